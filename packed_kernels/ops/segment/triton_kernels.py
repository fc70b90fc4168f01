"""Triton stage: the kernels behind the segment operations, and their launchers.

Every tensor here is 2-D and contiguous: rows ``(N, C)`` indexed by a sorted int32
``idx`` of length ``N``, or per-segment rows ``(S, C)``. The public functions of
:mod:`packed_kernels.ops.segment` reshape ``(N,)`` and ``(N, D)`` inputs to that form.

Two kinds of kernel cover the six operations and all of their derivatives:

* **Segmented reductions** (``sum``, ``mean``, ``dot``, ``rms_norm``, the gradient of
  ``mul``'s ``y`` and of ``matvec``'s ``m``): ``out[s] = epilogue(sum_{i: idx[i]=s} f(row i))``.
  One design serves segments of length 1 and of length ten million alike: each
  program takes a fixed chunk of *rows*, not a segment, so no long segment
  serialises on one program and no short one wastes one. Inside the chunk a
  segmented inclusive scan (``tl.associative_scan`` on ``(starts-a-run, value)``
  pairs) gives the total of every run of equal ``idx`` at the run's last row. Runs
  that lie wholly inside the chunk are written straight to the output. The
  chunk's first run and last run may continue in the neighbouring chunks: they are
  written as two partial rows to a small buffer, and a second pass adds up the
  partials of each segment in a fixed order. No atomics: the result is bitwise
  reproducible. ``sum`` and ``mean`` of narrow rows (up to
  :attr:`SegmentConfig.rows_in_order_max_cols` columns) use a cheaper first pass
  with the same partials: each lane walks its own consecutive rows in order, and the
  scan runs over lanes instead of rows (:func:`segment_sum_rows_kernel`).
* **Row-wise maps** (the gradients of the reductions, ``mul`` and ``matvec``):
  ``out[i] = g(row i, segment row idx[i])``; one program per block of rows, no
  reduction at all.

Accumulation is in float64 for float64 inputs and in float32 otherwise (float16 and
bfloat16 inputs are read, computed in float32 and written back in their own dtype).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import runtime
from ...device_functions.fast_math import reciprocal as _reciprocal
from ...device_functions.register_columns import load_lane_rows
from ...validation import error_word, report_violation

# The modes of the kernels, compared by name inside them; the launchers take these
# objects and pass their ``.value``.

# Prologues of the segmented reduction (``PROLOGUE``): what each row contributes.
ROW_VALUE = tl.constexpr(0)  # x[i, c]
ROW_PRODUCT = tl.constexpr(1)  # x[i, c] * y[i, c]
ROW_DOT = tl.constexpr(2)  # sum_c x[i, c] * y[i, c] (one output column)
ROW_SQUARED_NORM = tl.constexpr(3)  # sum_c x[i, c]^2 (one output column)
ROW_OUTER = tl.constexpr(4)  # x[i, j] * y[i, k] at column j * K + k

# Epilogues (``EPILOGUE``): what is done to a segment's total before it is stored. An
# empty segment stays 0 in each.
TOTAL = tl.constexpr(0)  # the total
DIVIDE_BY_COUNT = tl.constexpr(1)  # the total over the row count (mean)
SQRT_OF_MEAN = tl.constexpr(2)  # the square root of that (rms)

# Row-wise maps (``MODE``), with s = idx[i].
GATHER = tl.constexpr(0)  # out[i, c] = b[s, c]
GATHER_OVER_COUNT = tl.constexpr(1)  # out[i, c] = b[s, c] / count[s]
SCALE_ROWS = tl.constexpr(2)  # out[i, c] = a[i, c] * b[s, c or 0]
RMS_BACKWARD = tl.constexpr(3)  # out[i, c] = a[i, c] * b[s] / (count[s] * r[s]), 0 where r[s] = 0


@triton.jit
def _segmented_add(start_a, value_a, start_b, value_b):
    """Combine of the segmented scan: a run start on the right cuts the sum off."""
    return start_a | start_b, tl.where(start_b != 0, value_b, value_a + value_b)


@triton.jit
def _segmented_add_counted(start_a, value_a, count_a, start_b, value_b, count_b):
    """``_segmented_add`` that also counts the rows of the run."""
    cut = start_b != 0
    return start_a | start_b, tl.where(cut, value_b, value_a + value_b), tl.where(cut, count_b, count_a + count_b)


@triton.jit
def _zero_rows(out_ptr, counts_ptr, fill, fill_ok, cols, col_ok, n_cols, counts_block, WRITE_COUNTS: tl.constexpr):
    """Zero the output rows ``fill`` (where ``fill_ok``) at columns ``cols``, and their counts
    in the program of column block ``counts_block == 0`` only."""
    fill64 = fill.to(tl.int64)
    tl.store(out_ptr + fill64[:, None] * n_cols + cols[None, :],
             tl.zeros((fill.shape[0], cols.shape[0]), dtype=out_ptr.dtype.element_ty),
             mask=fill_ok[:, None] & col_ok[None, :])
    if WRITE_COUNTS:
        # (a vector test: the interpreter's store rejects a scalar-and-vector mask)
        tl.store(counts_ptr + fill64, tl.zeros((fill.shape[0],), dtype=tl.int32),
                 mask=fill_ok & ((fill * 0 + counts_block) == 0))


@triton.jit
def _zero_empty_segments(out_ptr, counts_ptr, first, end, cols, col_ok, n_cols, counts_block,
                         BLOCK: tl.constexpr, WRITE_COUNTS: tl.constexpr):
    """Zero the output rows (and counts) of segments ``first .. end - 1``, ``BLOCK`` at a time.

    Empty segments must read 0, and no total is ever stored for them. A chunk's share
    is the segments after its first one up to the next chunk's first one (exclusive;
    up to its own last one, inclusive, for the last chunk). These ranges are disjoint
    and cover every segment from ``idx[0]`` to ``idx[N - 1]`` but the chunks' first
    ones, which the combine pass always writes; the segments before ``idx[0]`` and
    after ``idx[N - 1]`` are spread over all programs (:func:`_zero_outer_segments`).
    """
    fill_rows = tl.arange(0, BLOCK)
    for start in range(first, end, BLOCK):
        fill = start + fill_rows
        _zero_rows(out_ptr, counts_ptr, fill, fill < end, cols, col_ok, n_cols, counts_block, WRITE_COUNTS)


@triton.jit
def _zero_outer_segments(out_ptr, counts_ptr, idx_ptr, N, num_segments, cols, col_ok, n_cols, counts_block,
                         BLOCK: tl.constexpr, WRITE_COUNTS: tl.constexpr):
    """Zero the segments before ``idx[0]`` and after ``idx[N - 1]``, shared by all programs.

    The ``E = idx[0] + (num_segments - 1 - idx[N - 1])`` empty segments at the two ends
    are numbered ``e = 0 .. E - 1`` (segment ``e`` for ``e < idx[0]``, else
    ``e + idx[N - 1] + 1 - idx[0]``) and cut into blocks of ``BLOCK``; program ``p`` of
    ``P`` zeroes blocks ``p, p + P, p + 2P, ...``. So ``num_segments`` far beyond the last
    index costs one pass of zero stores over many programs (the launcher gives the grid
    enough programs), and nothing but two loads when there are no such segments.
    """
    first_segment = tl.load(idx_ptr)
    last_segment = tl.load(idx_ptr + N - 1)
    n_empty = first_segment + (num_segments - 1 - last_segment)
    skip = last_segment + 1 - first_segment
    fill_rows = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n_empty, tl.num_programs(0) * BLOCK):
        e = start + fill_rows
        fill = tl.where(e < first_segment, e, e + skip)
        _zero_rows(out_ptr, counts_ptr, fill, e < n_empty, cols, col_ok, n_cols, counts_block, WRITE_COUNTS)


@triton.jit
def _partial_rows(partials_ptr, n_parts, n_cols):
    """The partial rows' three arrays in their one buffer: ``n_parts * n_cols`` values,
    then ``n_parts`` segment ids and ``n_parts`` row counts (int32, right after the
    values; one allocation where three would each cost the host a call)."""
    segment_ptr = (partials_ptr + n_parts.to(tl.int64) * n_cols).to(tl.pointer_type(tl.int32), bitcast=True)
    return partials_ptr, segment_ptr, segment_ptr + n_parts


@runtime.CachedLaunch
@triton.jit
def segment_reduce_chunks_kernel(
    x_ptr, y_ptr, idx_ptr, out_ptr, counts_ptr, partials_ptr,
    N, D, K, n_cols, num_segments,
    PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, WRITE_COUNTS: tl.constexpr, NEED_COUNTS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """First pass of the segmented reduction: one chunk of ``BLOCK_ROWS`` rows per program.

    Forward maths, for the segment ``s`` and output column ``c``::

        total[s, c] = sum_{i : idx[i] = s} f(i, c)
        out[s, c]   = total[s, c]                       (TOTAL)
                    = total[s, c] / n_s                  (DIVIDE_BY_COUNT, n_s rows in s)
                    = sqrt(total[s, 0] / n_s)            (SQRT_OF_MEAN)

    with ``f`` the prologue: ``x[i, c]``, ``x[i, c] y[i, c]``, ``sum_d x[i, d] y[i, d]``,
    ``sum_d x[i, d]^2`` or ``x[i, j] y[i, k]`` (``c = j K + k``). Gradients are not
    computed here: the adjoint of a segmented sum is a gather (a row-wise map) and
    the adjoint of a gather is again a segmented sum (see the operators in ``api``).

    Runs of equal ``idx`` inside the chunk are summed by one segmented inclusive scan
    over ``(is_run_start, value)``. A run that is neither the chunk's first nor its
    last lies wholly inside the chunk: its output row is written here. The first
    and the last run go to the partial buffer, rows ``2 * pid`` and ``2 * pid + 1``
    (the last one is an empty 0 when the chunk holds a single run), with their
    segment ids and row counts; ``segment_reduce_combine_kernel`` finishes them.
    The program also zeroes its share of the empty segments (``_zero_empty_segments``,
    ``_zero_outer_segments``); programs past the last chunk do only the latter. Program
    axis 1 walks blocks of output columns.
    """
    pid = tl.program_id(0)
    col_block = tl.program_id(1)
    cols = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    _zero_outer_segments(out_ptr, counts_ptr, idx_ptr, N, num_segments, cols, col_ok, n_cols, col_block,
                         BLOCK_ROWS, WRITE_COUNTS)
    row0 = pid * BLOCK_ROWS
    if row0 >= N:
        return  # a program only for the empty segments at the ends
    part_value_ptr, part_segment_ptr, part_count_ptr = _partial_rows(partials_ptr, 2 * tl.cdiv(N, BLOCK_ROWS),
                                                                      n_cols)
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    in_range = rows < N
    rows64 = rows.to(tl.int64)
    # Rows past N get a segment id of -2, so they never join a real run.
    segment = tl.load(idx_ptr + rows, mask=in_range, other=-2)
    previous = tl.load(idx_ptr + rows - 1, mask=in_range & (rows > row0), other=-1)
    following = tl.load(idx_ptr + rows + 1, mask=(rows + 1 < N) & (rows + 1 < row0 + BLOCK_ROWS), other=-1)
    starts = (segment != previous).to(tl.int32)
    ends = (segment != following) & in_range

    if PROLOGUE == ROW_VALUE:
        value = tl.load(x_ptr + rows64[:, None] * D + cols[None, :],
                        mask=in_range[:, None] & col_ok[None, :], other=0.0).to(ACC_DTYPE)
    elif PROLOGUE == ROW_PRODUCT:
        offsets = rows64[:, None] * D + cols[None, :]
        both = in_range[:, None] & col_ok[None, :]
        value = (tl.load(x_ptr + offsets, mask=both, other=0.0).to(ACC_DTYPE)
                 * tl.load(y_ptr + offsets, mask=both, other=0.0).to(ACC_DTYPE))
    elif PROLOGUE == ROW_OUTER:
        j = cols // K
        k = cols % K
        both = in_range[:, None] & col_ok[None, :]
        value = (tl.load(x_ptr + rows64[:, None] * D + j[None, :], mask=both, other=0.0).to(ACC_DTYPE)
                 * tl.load(y_ptr + rows64[:, None] * K + k[None, :], mask=both, other=0.0).to(ACC_DTYPE))
    else:  # ROW_DOT, ROW_SQUARED_NORM: one output column
        # One column at a time into a 1-D row total: a 2-D tile reduced over its columns
        # would leave the total replicated across the threads that held those columns,
        # and the segmented scan below must see each row once.
        row_total = tl.zeros((BLOCK_ROWS,), dtype=ACC_DTYPE)
        for d in range(0, D):
            a = tl.load(x_ptr + rows64 * D + d, mask=in_range, other=0.0).to(ACC_DTYPE)
            if PROLOGUE == ROW_DOT:
                b = tl.load(y_ptr + rows64 * D + d, mask=in_range, other=0.0).to(ACC_DTYPE)
            else:
                b = a
            row_total += a * b
        value = row_total[:, None] + tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=ACC_DTYPE)

    flags = starts[:, None] + tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.int32)
    if NEED_COUNTS:
        # Rows per run counted in the same scan, in the values' layout (no conversion).
        _, total, count_2d = tl.associative_scan((flags, value, flags * 0 + 1), 0, _segmented_add_counted)
        count = tl.max(count_2d, axis=1)
    else:
        _, total = tl.associative_scan((flags, value), 0, _segmented_add)
        count = tl.full((BLOCK_ROWS,), 1, tl.int32)

    head_segment = tl.load(idx_ptr + row0)
    tail_segment = tl.load(idx_ptr + tl.minimum(row0 + BLOCK_ROWS, N) - 1)
    inside = ends & (segment != head_segment) & (segment != tail_segment)

    # This chunk's share of the empty segments; the barrier orders the zeros before
    # the totals stored below (some land on the same rows).
    next_row = row0 + BLOCK_ROWS
    next_head = tl.load(idx_ptr + next_row, mask=next_row < N, other=tail_segment + 1)
    _zero_empty_segments(out_ptr, counts_ptr, head_segment + 1, next_head,
                         cols, col_ok, n_cols, col_block, BLOCK_ROWS, WRITE_COUNTS)
    tl.debug_barrier()

    if EPILOGUE == TOTAL:
        finished = total
    elif EPILOGUE == DIVIDE_BY_COUNT:
        finished = total / tl.maximum(count, 1).to(ACC_DTYPE)[:, None]
    else:  # SQRT_OF_MEAN
        finished = tl.sqrt(total / tl.maximum(count, 1).to(ACC_DTYPE)[:, None])
    segment64 = segment.to(tl.int64)
    tl.store(out_ptr + segment64[:, None] * n_cols + cols[None, :],
             finished.to(out_ptr.dtype.element_ty), mask=inside[:, None] & col_ok[None, :])
    if WRITE_COUNTS:
        if col_block == 0:
            tl.store(counts_ptr + segment64, count, mask=inside)

    is_head = ends & (segment == head_segment)
    is_tail = ends & (segment == tail_segment) & (segment != head_segment)
    head_value = tl.sum(tl.where(is_head[:, None], total, 0.0), axis=0)
    tail_value = tl.sum(tl.where(is_tail[:, None], total, 0.0), axis=0)
    part = 2 * pid.to(tl.int64)
    tl.store(part_value_ptr + part * n_cols + cols, head_value, mask=col_ok)
    tl.store(part_value_ptr + (part + 1) * n_cols + cols, tail_value, mask=col_ok)
    if col_block == 0:
        tl.store(part_segment_ptr + part, head_segment)
        tl.store(part_segment_ptr + part + 1, tail_segment)
        tl.store(part_count_ptr + part, tl.sum(tl.where(is_head, count, 0), axis=0))
        tl.store(part_count_ptr + part + 1, tl.sum(tl.where(is_tail, count, 0), axis=0))


@triton.jit
def _lane_rows(x_ptr, base, N, COLS: tl.constexpr, ROWS_PER_THREAD: tl.constexpr, THREADS: tl.constexpr,
               BITS: tl.constexpr, VECTOR: tl.constexpr):
    """The ``ROWS_PER_THREAD`` rows of ``COLS`` columns from row ``base[t]`` of each lane, flat.

    A lane's rows are ``ROWS_PER_THREAD * COLS`` consecutive elements of ``x``: they
    come as ``COLS`` contiguous tiles of ``ROWS_PER_THREAD`` elements per lane. Entry
    ``r * COLS + c`` of the tuple is row ``base + r``, column ``c`` (0 past row ``N``).
    """
    flat = ()
    for j in tl.static_range(COLS):
        flat = flat + load_lane_rows(x_ptr, base * COLS + j * ROWS_PER_THREAD, N * COLS, 0.0,
                                     ROWS_PER_THREAD, THREADS, BITS, VECTOR)
    return flat


@runtime.CachedLaunch
@triton.jit
def segment_sum_rows_kernel(
    x_ptr, idx_ptr, out_ptr, counts_ptr, partials_ptr,
    N, num_segments,
    EPILOGUE: tl.constexpr, WRITE_COUNTS: tl.constexpr, NEED_COUNTS: tl.constexpr,
    COLS: tl.constexpr, COLS_POW2: tl.constexpr, ROWS_PER_THREAD: tl.constexpr, BITS: tl.constexpr,
    THREADS: tl.constexpr, VECTOR_IDX: tl.constexpr, VECTOR_X: tl.constexpr, ACC_DTYPE: tl.constexpr,
    FAST_DIVIDE: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    """First pass of ``sum`` and ``mean`` of narrow rows, each lane walking its rows in order.

    Same maths, same output and the same partial rows as
    :func:`segment_reduce_chunks_kernel` (``TOTAL`` or ``DIVIDE_BY_COUNT``), for a
    chunk of ``THREADS * ROWS_PER_THREAD`` rows of all ``COLS`` columns per program,
    with less work per row: lane ``t`` owns the ``ROWS_PER_THREAD`` consecutive rows
    from ``row0 + t ROWS_PER_THREAD`` and walks them one after another with a running
    sum per column that restarts where ``idx`` changes, so a row costs one compare and
    an add per column instead of the steps of a scan over the chunk. A run that starts
    and ends inside a lane is stored by that lane as soon as it ends. What crosses
    lanes is settled by one segmented scan over the ``THREADS`` lanes (not over the
    rows): lane ``t``'s last run continues in lane ``t + 1`` unless that lane starts
    a new segment. Then, per lane:

    * its first run, if it ends inside the lane: the previous lanes' share (the scan
      at ``t - 1``) plus the lane's own rows of it;
    * its last run, if it ends at the lane's last row: the scan at ``t``.

    Rows past ``N`` continue the chunk's last run with zeros (and are not counted),
    so they never start a run. The chunk's first and last runs go to the partial
    buffer for :func:`segment_reduce_combine_kernel`, exactly as in the scan kernel.
    Every sum is taken in the rows' order: deterministic, no atomics. Empty segments
    are zeroed as in the scan kernel (programs past the last chunk only zero).
    """
    chunk = tl.program_id(0)
    CHUNK: tl.constexpr = THREADS * ROWS_PER_THREAD
    columns = tl.arange(0, COLS_POW2)
    _zero_outer_segments(out_ptr, counts_ptr, idx_ptr, N, num_segments, columns, columns < COLS, COLS, 0,
                         FILL_BLOCK, WRITE_COUNTS)
    row0 = chunk * CHUNK
    if row0 >= N:
        return  # a program only for the empty segments at the ends
    part_value_ptr, part_segment_ptr, part_count_ptr = _partial_rows(partials_ptr, 2 * tl.cdiv(N, CHUNK), COLS)
    lane = tl.arange(0, THREADS)
    base = row0 + lane * ROWS_PER_THREAD
    chunk_end = tl.minimum(row0 + CHUNK, N)
    head_segment = tl.load(idx_ptr + row0)
    tail_segment = tl.load(idx_ptr + chunk_end - 1)
    # This chunk's share of the empty segments, before the totals stored below.
    next_head = tl.load(idx_ptr + row0 + CHUNK, mask=row0 + CHUNK < N, other=tail_segment + 1)
    _zero_empty_segments(out_ptr, counts_ptr, head_segment + 1, next_head,
                         columns, columns < COLS, COLS, 0, THREADS, WRITE_COUNTS)
    tl.debug_barrier()
    # Rows past N take the chunk's last segment: they join its last run (with zeros).
    # A chunk that starts and ends in one segment lies wholly inside it (idx is sorted):
    # its ids are not read at all, which halves the bytes of long segments of scalars.
    read_end = tl.where(head_segment == tail_segment, 0, N)
    segments = load_lane_rows(idx_ptr, base, read_end, tail_segment, ROWS_PER_THREAD, THREADS, BITS, VECTOR_IDX)
    values = _lane_rows(x_ptr, base, N, COLS, ROWS_PER_THREAD, THREADS, BITS, VECTOR_X)
    first = segments[0]
    last = segments[ROWS_PER_THREAD - 1]  # the segment of each lane's last run
    # The segment of the row before each lane's first row (-1 for lane 0: nothing
    # before) and after its last row, from the neighbouring lanes' registers.
    before = tl.where(lane == 0, -1, tl.gather(last, tl.maximum(lane - 1, 0), 0))
    following = tl.gather(first, tl.minimum(lane + 1, THREADS - 1), 0)
    starts_at_lane = first != before
    running = ()
    first_run = ()
    for c in tl.static_range(COLS):
        running = running + (values[c].to(ACC_DTYPE),)
        first_run = first_run + (tl.zeros((THREADS,), dtype=ACC_DTYPE),)
    # A run's row count comes from where it began: the rows it spans up to its end.
    # (Rows past N never start a run, so only the lane's last run can reach past N.)
    run_start = base
    first_count = tl.zeros((THREADS,), dtype=tl.int32)
    ended = tl.zeros((THREADS,), dtype=tl.int1)  # a run has ended inside the lane
    for r in tl.static_range(1, ROWS_PER_THREAD):
        previous = segments[r - 1]
        new_run = segments[r] != previous
        # The run of `previous` ended at the row before: store it if it began in this
        # lane and is not one of the chunk's edge runs; keep it if it is the lane's first.
        store = new_run & ended & (previous != head_segment) & (previous != tail_segment)
        keep = new_run & ~ended
        count = base + r - run_start
        if EPILOGUE != TOTAL:
            # One reciprocal per row, shared by its columns.
            inverse = _reciprocal(count.to(ACC_DTYPE), FAST_DIVIDE)
        row_out = previous.to(tl.int64) * COLS
        next_running = ()
        next_first_run = ()
        for c in tl.static_range(COLS):
            if EPILOGUE == TOTAL:
                finished = running[c]
            else:
                finished = running[c] * inverse
            tl.store(out_ptr + row_out + c, finished.to(out_ptr.dtype.element_ty), mask=store)
            next_first_run = next_first_run + (tl.where(keep, running[c], first_run[c]),)
            value = values[r * COLS + c].to(ACC_DTYPE)
            next_running = next_running + (tl.where(new_run, value, running[c] + value),)
        if WRITE_COUNTS:
            tl.store(counts_ptr + previous, count, mask=store)
        running = next_running
        first_run = next_first_run
        first_count = tl.where(keep, count, first_count)
        ended = ended | new_run
        run_start = tl.where(new_run, base + r, run_start)
    count = tl.maximum(tl.minimum(base + ROWS_PER_THREAD, N) - run_start, 0)

    # Across lanes: lane t's last run holds nothing from lane t - 1 when a run began in t.
    fresh = (ended | starts_at_lane).to(tl.int32)
    shift = tl.maximum(lane - 1, 0)
    if NEED_COUNTS:
        _, carried_count = tl.associative_scan((fresh, count), 0, _segmented_add)
        first_count = tl.where(starts_at_lane, 0, tl.gather(carried_count, shift, 0)) + first_count
    else:
        carried_count = count
    last_ends = (following != last) | (lane == THREADS - 1)
    first_store = ended & (first != head_segment) & (first != tail_segment)
    last_store = last_ends & (last != head_segment) & (last != tail_segment)
    # The chunk's first run ends in exactly one lane: inside it (first_total) or at its
    # last row (carried); that lane stores the first partial. The last lane stores the
    # second (0 when the chunk holds a single run).
    head_in_lane = ended & (first == head_segment)
    head_end = head_in_lane | (last_ends & (last == head_segment))
    at_last_lane = lane == THREADS - 1
    is_tail = at_last_lane & (tail_segment != head_segment)
    part = 2 * chunk.to(tl.int64)
    head_part = part * COLS + lane * 0
    tail_part = (part + 1) * COLS + lane * 0
    for c in tl.static_range(COLS):
        _, carried = tl.associative_scan((fresh, running[c]), 0, _segmented_add)
        first_total = tl.where(starts_at_lane, 0.0, tl.gather(carried, shift, 0)) + first_run[c]
        if EPILOGUE == TOTAL:
            first_finished = first_total
            last_finished = carried
        else:
            first_finished = first_total * _reciprocal(tl.maximum(first_count, 1).to(ACC_DTYPE), FAST_DIVIDE)
            last_finished = carried * _reciprocal(tl.maximum(carried_count, 1).to(ACC_DTYPE), FAST_DIVIDE)
        tl.store(out_ptr + first.to(tl.int64) * COLS + c, first_finished.to(out_ptr.dtype.element_ty),
                 mask=first_store)
        tl.store(out_ptr + last.to(tl.int64) * COLS + c, last_finished.to(out_ptr.dtype.element_ty),
                 mask=last_store)
        tl.store(part_value_ptr + head_part + c, tl.where(head_in_lane, first_total, carried), mask=head_end)
        tl.store(part_value_ptr + tail_part + c, tl.where(is_tail, carried, 0.0), mask=at_last_lane)
    if WRITE_COUNTS:
        tl.store(counts_ptr + first, first_count, mask=first_store)
        tl.store(counts_ptr + last, carried_count, mask=last_store)
    tl.store(part_segment_ptr + part, head_segment)
    tl.store(part_segment_ptr + part + 1, tail_segment)
    tl.store(part_count_ptr + part + lane * 0, tl.where(head_in_lane, first_count, carried_count), mask=head_end)
    tl.store(part_count_ptr + part + 1 + lane * 0, tl.where(is_tail, carried_count, 0), mask=at_last_lane)


@runtime.CachedLaunch
@triton.jit
def segment_reduce_combine_kernel(
    partials_ptr, out_ptr, counts_ptr,
    n_parts, n_cols,
    EPILOGUE: tl.constexpr, WRITE_COUNTS: tl.constexpr,
    BLOCK_PARTS: tl.constexpr, BACK_PARTS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """Second pass: add up the partial rows of each segment that touches a chunk edge.

    The partial rows are ordered by segment (chunk ``p``'s first run, then its last
    run, then chunk ``p + 1``'s), so the partials of a segment are consecutive: the
    second pass is a segmented sum of its own, over ``2 * chunks`` rows. Each program
    takes a block of ``BLOCK_PARTS`` partials and runs one segmented scan over it; the
    last partial of each segment writes ``out[s]``. Only the block's first segment
    can have partials in earlier blocks: the program adds those, walking back
    ``BACK_PARTS`` partials at a time until the segment's first partial (one step
    for a segment of fewer than ``BACK_PARTS`` partials; a segment of ten million
    rows in chunks of 2048 rows has about 10,000 partials: ten steps of 1024). Sums
    run in a fixed order: deterministic.
    """
    part_value_ptr, part_segment_ptr, part_count_ptr = _partial_rows(partials_ptr, n_parts, n_cols)
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    first_part = block * BLOCK_PARTS
    parts = first_part + tl.arange(0, BLOCK_PARTS)
    parts_ok = parts < n_parts
    segment = tl.load(part_segment_ptr + parts, mask=parts_ok, other=-1)
    previous = tl.load(part_segment_ptr + parts - 1, mask=parts_ok & (parts > first_part), other=-1)
    following = tl.load(part_segment_ptr + parts + 1, mask=parts + 1 < n_parts, other=-1)
    cols = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    parts64 = parts.to(tl.int64)
    values = tl.load(part_value_ptr + parts64[:, None] * n_cols + cols[None, :],
                     mask=parts_ok[:, None] & col_ok[None, :], other=0.0).to(ACC_DTYPE)
    count = tl.load(part_count_ptr + parts, mask=parts_ok, other=0)
    starts = (segment != previous).to(tl.int32)
    flags = starts[:, None] + tl.zeros((BLOCK_PARTS, BLOCK_COLS), dtype=tl.int32)
    _, total = tl.associative_scan((flags, values), 0, _segmented_add)
    _, count = tl.associative_scan((starts, count), 0, _segmented_add)

    # The block's first segment: its partials in earlier blocks, newest block first.
    head = tl.load(part_segment_ptr + first_part)
    earlier = tl.zeros((BLOCK_COLS,), dtype=ACC_DTYPE)
    earlier_count = tl.sum(tl.zeros((BLOCK_PARTS,), dtype=tl.int32), axis=0)
    start = first_part - BACK_PARTS
    more = first_part > 0
    while more:
        back = start + tl.arange(0, BACK_PARTS)
        match = (back >= 0) & (tl.load(part_segment_ptr + back, mask=back >= 0, other=-1) == head)
        back64 = back.to(tl.int64)
        found = tl.load(part_value_ptr + back64[:, None] * n_cols + cols[None, :],
                        mask=match[:, None] & col_ok[None, :], other=0.0).to(ACC_DTYPE)
        earlier += tl.sum(found, axis=0)
        earlier_count += tl.sum(tl.load(part_count_ptr + back, mask=match, other=0), axis=0)
        more = (tl.sum(match.to(tl.int32), axis=0) == BACK_PARTS) & (start > 0)
        start -= BACK_PARTS
    in_head = segment == head
    total = total + tl.where(in_head[:, None], earlier[None, :], 0.0)
    count = count + tl.where(in_head, earlier_count, 0)

    if EPILOGUE == DIVIDE_BY_COUNT:
        total = total / tl.maximum(count, 1).to(ACC_DTYPE)[:, None]
    elif EPILOGUE == SQRT_OF_MEAN:
        total = tl.sqrt(total / tl.maximum(count, 1).to(ACC_DTYPE)[:, None])
    last = parts_ok & (segment != following)
    segment64 = segment.to(tl.int64)
    tl.store(out_ptr + segment64[:, None] * n_cols + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=last[:, None] & col_ok[None, :])
    if WRITE_COUNTS:
        if col_block == 0:
            tl.store(counts_ptr + segment64, count, mask=last)


@runtime.CachedLaunch
@triton.jit
def segment_rowwise_kernel(
    a_ptr, b_ptr, counts_ptr, r_ptr, idx_ptr, out_ptr,
    N, n_cols,
    MODE: tl.constexpr, BROADCAST_B: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """Row-wise map ``out[i, c] = g(i, s = idx[i])``: the gradients of the reductions, and ``mul``.

    * ``GATHER``:            ``out[i, c] = b[s, c]``  (the adjoint of a segmented sum)
    * ``GATHER_OVER_COUNT``: ``out[i, c] = b[s, c] / n_s``  (the adjoint of a segmented mean)
    * ``SCALE_ROWS``:        ``out[i, c] = a[i, c] b[s, c]``, or ``a[i, c] b[s, 0]`` when ``b``
      has one column (``mul``; the gradients of ``dot``)
    * ``RMS_BACKWARD``:      ``out[i, c] = a[i, c] b[s] / (n_s r_s)``, 0 where ``r_s = 0``: the
      gradient of ``r_s = sqrt(sum_i |x_i|^2 / n_s)`` is ``dr_s/dx_i = x_i / (n_s r_s)``.
    """
    pid = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = rows < N
    rows64 = rows.to(tl.int64)
    if MODE == GATHER or MODE == GATHER_OVER_COUNT:
        # The gathers (adjoints of reductions, whose idx is sorted): a block of rows that
        # starts and ends in one segment lies wholly inside it, and its ids are not read.
        # (mul reads every id: while traced its idx may be unsorted, and it stays exact.)
        first = tl.load(idx_ptr + pid * BLOCK_ROWS)
        last = tl.load(idx_ptr + tl.minimum(pid * BLOCK_ROWS + BLOCK_ROWS, N) - 1)
        read_end = tl.where(first == last, 0, N)
        segment = tl.load(idx_ptr + rows, mask=rows < read_end, other=first).to(tl.int64)
    else:
        segment = tl.load(idx_ptr + rows, mask=in_range, other=0).to(tl.int64)
    cols = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    both = in_range[:, None] & (cols < n_cols)[None, :]
    if MODE == GATHER:
        result = tl.load(b_ptr + segment[:, None] * n_cols + cols[None, :], mask=both, other=0.0).to(ACC_DTYPE)
    elif MODE == GATHER_OVER_COUNT:
        n = tl.load(counts_ptr + segment, mask=in_range, other=1).to(ACC_DTYPE)
        result = tl.load(b_ptr + segment[:, None] * n_cols + cols[None, :], mask=both, other=0.0).to(ACC_DTYPE)
        result = result / n[:, None]
    elif MODE == SCALE_ROWS:
        a = tl.load(a_ptr + rows64[:, None] * n_cols + cols[None, :], mask=both, other=0.0).to(ACC_DTYPE)
        if BROADCAST_B:
            b = tl.load(b_ptr + segment, mask=in_range, other=0.0).to(ACC_DTYPE)[:, None]
        else:
            b = tl.load(b_ptr + segment[:, None] * n_cols + cols[None, :], mask=both, other=0.0).to(ACC_DTYPE)
        result = a * b
    else:  # RMS_BACKWARD
        a = tl.load(a_ptr + rows64[:, None] * n_cols + cols[None, :], mask=both, other=0.0).to(ACC_DTYPE)
        g = tl.load(b_ptr + segment, mask=in_range, other=0.0).to(ACC_DTYPE)
        n = tl.load(counts_ptr + segment, mask=in_range, other=1).to(ACC_DTYPE)
        r = tl.load(r_ptr + segment, mask=in_range, other=0.0).to(ACC_DTYPE)
        weight = tl.where(r > 0, g / (n * tl.where(r > 0, r, 1.0)), 0.0)
        result = a * weight[:, None]
    tl.store(out_ptr + rows64[:, None] * n_cols + cols[None, :], result.to(out_ptr.dtype.element_ty), mask=both)


@runtime.CachedLaunch
@triton.jit
def segment_matvec_kernel(
    v_ptr, m_ptr, idx_ptr, out_ptr, N, D, K,
    TRANSPOSE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_OUT: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """Per-row small matrix-vector product with the row's segment matrix ``m[s]`` of shape ``(D, K)``.

    * ``TRANSPOSE=False``: ``out[i, k] = sum_j m[s, j, k] v[i, j]``  (``out_i = m_s^T v_i``; v ``(N, D)``)
    * ``TRANSPOSE=True``:  ``out[i, j] = sum_k m[s, j, k] v[i, k]``  (``out_i = m_s v_i``; v ``(N, K)``)

    Gradients of ``out_i = m_s^T v_i`` with upstream ``g_i``: ``dv_i = m_s g_i`` (this kernel
    with ``TRANSPOSE=True``) and ``dm_s = sum_{i in s} v_i g_i^T`` (a segmented reduction with
    the outer-product prologue). The inner dimension is small (3 in the anchor case),
    so it is a loop of rank-1 updates.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = rows < N
    rows64 = rows.to(tl.int64)
    segment = tl.load(idx_ptr + rows, mask=in_range, other=0).to(tl.int64)
    outs = tl.arange(0, BLOCK_OUT)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=ACC_DTYPE)
    if TRANSPOSE:
        out_ok = outs < D
        both = in_range[:, None] & out_ok[None, :]
        for k in range(0, K):
            vk = tl.load(v_ptr + rows64 * K + k, mask=in_range, other=0.0).to(ACC_DTYPE)
            mk = tl.load(m_ptr + segment[:, None] * (D * K) + outs[None, :] * K + k, mask=both, other=0.0)
            acc += vk[:, None] * mk.to(ACC_DTYPE)
        tl.store(out_ptr + rows64[:, None] * D + outs[None, :], acc.to(out_ptr.dtype.element_ty), mask=both)
    else:
        out_ok = outs < K
        both = in_range[:, None] & out_ok[None, :]
        for j in range(0, D):
            vj = tl.load(v_ptr + rows64 * D + j, mask=in_range, other=0.0).to(ACC_DTYPE)
            mj = tl.load(m_ptr + segment[:, None] * (D * K) + j * K + outs[None, :], mask=both, other=0.0)
            acc += vj[:, None] * mj.to(ACC_DTYPE)
        tl.store(out_ptr + rows64[:, None] * K + outs[None, :], acc.to(out_ptr.dtype.element_ty), mask=both)


@runtime.CachedLaunch
@triton.jit
def rms_norm_double_backward_kernel(
    p_ptr, g_ptr, r_ptr, counts_ptr, grad_g_ptr, grad_r_ptr, S,
    BLOCK: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """Per-segment part of the double backward of ``rms_norm``.

    The first backward is ``dx_i = x_i g_s / (n_s r_s)``. Given the cotangent ``u_i`` of
    ``dx_i`` and ``p_s = sum_{i in s} u_i . x_i`` (a segmented dot), its derivatives are
    ``d/dg_s = p_s / (n_s r_s)`` and ``d/dr_s = -p_s g_s / (n_s r_s^2)`` (both 0 where
    ``r_s = 0``); the part through ``x`` directly, ``u_i g_s / (n_s r_s)``, is the first
    backward again, applied to ``u``.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < S
    p = tl.load(p_ptr + offsets, mask=ok, other=0.0).to(ACC_DTYPE)
    g = tl.load(g_ptr + offsets, mask=ok, other=0.0).to(ACC_DTYPE)
    r = tl.load(r_ptr + offsets, mask=ok, other=0.0).to(ACC_DTYPE)
    n = tl.load(counts_ptr + offsets, mask=ok, other=1).to(ACC_DTYPE)
    positive = r > 0
    safe_r = tl.where(positive, r, 1.0)
    grad_g = tl.where(positive, p / (n * safe_r), 0.0)
    grad_r = tl.where(positive, -p * g / (n * safe_r * safe_r), 0.0)
    tl.store(grad_g_ptr + offsets, grad_g.to(grad_g_ptr.dtype.element_ty), mask=ok)
    tl.store(grad_r_ptr + offsets, grad_r.to(grad_r_ptr.dtype.element_ty), mask=ok)


@runtime.CachedLaunch
@triton.jit
def idx_check_kernel(idx_ptr, out_ptr, word_ptr, N, num_segments, range_code, order_code, BLOCK: tl.constexpr):
    """Check ``idx`` on the device and write the int32 copy the other kernels read.

    ``out[i] = min(max(idx[i], 0), num_segments - 1)``: whatever the values, every kernel
    that indexes with ``out`` stays inside its tensors (a sorted ``out`` gives the result
    of the clamped ``idx``, an unsorted one an unspecified but memory-safe one). Where
    ``idx[i]`` lies outside ``[0, num_segments)`` the block reports ``range_code``, where
    ``idx[i] < idx[i - 1]`` ``order_code``, each at its smallest such ``i``
    (:func:`~packed_kernels.validation.report_violation`). One read of ``idx``, no atomics.
    """
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    has_previous = ok & (rows > 0)
    value = tl.load(idx_ptr + rows, mask=ok, other=0)
    previous = tl.load(idx_ptr + rows - 1, mask=has_previous, other=0)
    # (a program's later report overwrites its earlier one: a range violation wins)
    report_violation(word_ptr, order_code, has_previous & (value < previous), rows)
    report_violation(word_ptr, range_code, ok & ((value < 0) | (value >= num_segments)), rows)
    clamped = tl.minimum(tl.maximum(value, 0), num_segments - 1)
    tl.store(out_ptr + rows, clamped.to(tl.int32), mask=ok)


# ---------------------------------------------------------------------------------------
# Launchers. They take contiguous 2-D tensors on the kernel device; the public functions
# have validated everything already.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentConfig:
    """Launch choices of the segment kernels. The launchers take one (``None``: the
    default of :func:`segment_config`); a test passes a smaller one to drive many chunks,
    lanes and combine blocks through a small input."""

    #: Elements (rows times the columns of a column block) per chunk of the scan pass.
    chunk_elements: int
    #: Fewest rows per chunk of the scan pass (wide rows still get enough rows to
    #: amortise the scan).
    min_chunk_rows: int
    #: ``sum`` and ``mean`` of rows with at most this many columns take the in-order
    #: pass (:func:`segment_sum_rows_kernel`, all columns in one program); wider rows,
    #: and every row at 0, the scan pass.
    rows_in_order_max_cols: int
    #: Rows each lane of the in-order pass walks (a power of two), for scalar rows ...
    rows_per_thread: int
    #: ... and for rows of 2 to 4 columns.
    vector_rows_per_thread: int
    #: Most lanes (one per thread) per chunk of the in-order pass.
    rows_in_order_threads: int
    #: Register cap of the compiled in-order float32 ``mean`` of rows of 2 to 4 columns
    #: (None: the compiler's choice): ptxas schedules that pass better under the cap.
    mean_rows_maxnreg: Optional[int]
    #: Partials per program of the combine pass ...
    combine_parts: int
    #: ... per step of its walk back to a long segment's first partial ...
    combine_back_parts: int
    #: ... and its warps.
    combine_warps: int
    #: Elements per program of the row-wise maps and of ``matvec``.
    rowwise_elements: int
    #: Most empty segments before ``idx[0]`` and after ``idx[N - 1]`` each program of a
    #: first pass zeroes: the grid gets programs past the last chunk (that only zero) when
    #: ``num_segments`` would give its chunks more.
    empty_segments_per_program: int
    #: A test aid: start the outputs that the first pass fills completely (the empty
    #: segments included) at NaN, and the counts at -7, instead of uninitialised memory,
    #: so that a row no program writes shows up; and place them between
    #: :data:`GUARD_ROWS` poisoned rows on either side in one allocation, so that a
    #: write past either end shows up in the tensor's storage.
    poison_outputs: bool


@functools.lru_cache(maxsize=None)
def segment_config() -> SegmentConfig:
    """The launch choices of every segment kernel, compiled and interpreted alike."""
    return SegmentConfig(
        chunk_elements=4096,
        min_chunk_rows=64,
        rows_in_order_max_cols=4,
        rows_per_thread=16,
        vector_rows_per_thread=8,
        rows_in_order_threads=128,
        mean_rows_maxnreg=64,
        combine_parts=256,
        combine_back_parts=1024,
        combine_warps=4,
        rowwise_elements=4096,
        empty_segments_per_program=4096,
        poison_outputs=False,
    )


def _register_cap(epilogue: int, n_cols: int, dtype: torch.dtype, config: SegmentConfig) -> dict:
    """Launch option capping the in-order pass's registers (compiled code only)."""
    cap = (config.mean_rows_maxnreg if epilogue == DIVIDE_BY_COUNT.value and n_cols > 1 and dtype == torch.float32
           else None)
    return runtime.register_cap(cap)


def _vector_loads(t: torch.Tensor, rows_per_thread: int) -> bool:
    """Whether a lane's rows of ``t`` can come as 16-byte loads: compiled code, 32-bit
    elements, a 16-byte aligned start and whole groups of 4 rows per lane."""
    return (not runtime.INTERPRETED and t.element_size() == 4
            and t.data_ptr() % 16 == 0 and rows_per_thread % 4 == 0)


def _rows_in_order_lanes(N: int, rows_per_thread: int, config: SegmentConfig) -> int:
    """Lanes per chunk of :func:`segment_sum_rows_kernel` (one lane per thread)."""
    # no more lanes than the input needs (padding lanes still take the scan's steps)
    return min(config.rows_in_order_threads, max(2, runtime.next_power_of_2(runtime.cdiv(N, rows_per_thread))))


#: Poisoned rows before and after each output of a ``poison_outputs`` launch.
GUARD_ROWS = 2


def _uninitialised(shape, dtype, device, config: SegmentConfig) -> torch.Tensor:
    """An output that the kernels fill completely (poisoned, between guard rows, when
    ``config`` asks)."""
    if config.poison_outputs:
        guarded = (shape[0] + 2 * GUARD_ROWS,) + tuple(shape[1:])
        poison = -7 if dtype == torch.int32 else float("nan")
        return torch.full(guarded, poison, dtype=dtype, device=device)[GUARD_ROWS:GUARD_ROWS + shape[0]]
    return torch.empty(shape, dtype=dtype, device=device)


def _rows_and_columns(t: torch.Tensor):
    """``(rows, columns)`` of a ``(rows, columns)`` tensor, or of ``(rows,)`` as one column
    (the same memory, so a one-dimensional tensor needs no reshaped view)."""
    return (t.shape[0], 1) if t.dim() == 1 else tuple(t.shape)


def _warps_for(elements: int) -> int:
    # Small tiles (small inputs) get fewer threads: less replication of tiny tensors.
    return 8 if elements >= 2048 else (4 if elements >= 512 else 1)


def _accumulator(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _column_block(n_cols: int) -> int:
    return min(runtime.next_power_of_2(max(n_cols, 1)), 64)


def _chunk_rows(block_cols: int, config: SegmentConfig) -> int:
    return max(config.min_chunk_rows, config.chunk_elements // block_cols)


def _output_columns(prologue: int, D: int, K: int) -> int:
    """The columns of a segmented reduction's output (see :func:`segment_reduce_triton`)."""
    if prologue in (ROW_DOT.value, ROW_SQUARED_NORM.value):
        return 1
    return D * K if prologue == ROW_OUTER.value else D


@functools.lru_cache(maxsize=256)
def _reduce_plan(N: int, D: int, K: int, num_segments: int, prologue: int, epilogue: int, write_counts: bool,
                 dtype: torch.dtype, config: SegmentConfig, interpreted: bool) -> dict:
    """Every launch choice of :func:`segment_reduce_triton` that depends on the shapes,
    the modes, the dtype and the configuration alone (not on the tensors' addresses),
    worked out once per combination: grids, constexprs and launch options (for
    ``N``, ``num_segments`` and the output's columns all positive)."""
    n_cols = _output_columns(prologue, D, K)
    acc = _accumulator(dtype)
    block_cols = 1 if n_cols == 1 else _column_block(n_cols)
    block_rows = _chunk_rows(block_cols, config)
    # No chunk longer than the input, rounded up to a power of two: padding rows cost
    # scan steps (and the interpreter's scan steps are slow).
    block_rows = min(block_rows, max(16, runtime.next_power_of_2(N)))
    n_chunks = runtime.cdiv(N, block_rows)
    col_blocks = runtime.cdiv(n_cols, block_cols)
    rows_per_thread = config.rows_per_thread if n_cols == 1 else config.vector_rows_per_thread
    need_counts = write_counts or epilogue != TOTAL.value
    # (the in-order pass indexes the flat rows, up to one chunk past N, in int32)
    in_order = (prologue == ROW_VALUE.value and epilogue in (TOTAL.value, DIVIDE_BY_COUNT.value)
                and n_cols <= config.rows_in_order_max_cols
                and (N + rows_per_thread * config.rows_in_order_threads) * n_cols < 2 ** 31)
    if in_order:
        lanes = _rows_in_order_lanes(N, rows_per_thread, config)
        n_chunks = runtime.cdiv(N, rows_per_thread * lanes)
        first = dict(
            EPILOGUE=epilogue, WRITE_COUNTS=write_counts, NEED_COUNTS=need_counts,
            COLS=n_cols, COLS_POW2=runtime.next_power_of_2(n_cols), ROWS_PER_THREAD=rows_per_thread,
            BITS=rows_per_thread.bit_length() - 1, THREADS=lanes, ACC_DTYPE=acc,
            # compiled float32: the approximate reciprocal (1 ulp) instead of a division
            FAST_DIVIDE=not interpreted and acc == tl.float32, FILL_BLOCK=max(lanes, 64),
            num_warps=max(1, min(16, lanes // 32)), **_register_cap(epilogue, n_cols, dtype, config))
    else:
        first = dict(
            PROLOGUE=prologue, EPILOGUE=epilogue, WRITE_COUNTS=write_counts, NEED_COUNTS=need_counts,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, ACC_DTYPE=acc,
            num_warps=_warps_for(block_rows * block_cols))
    # the first pass's programs: its chunks, and more (that only zero) where the empty
    # segments at the ends would give each chunk more than its share
    programs = max(n_chunks, runtime.cdiv(num_segments, config.empty_segments_per_program))
    # the partial rows (two a chunk): their values, then int32 segment ids and row counts
    parts = 2 * n_chunks
    part_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    combine_parts = min(config.combine_parts, runtime.next_power_of_2(parts))
    combine = dict(
        EPILOGUE=epilogue, WRITE_COUNTS=write_counts,
        BLOCK_PARTS=combine_parts, BACK_PARTS=max(combine_parts, min(config.combine_back_parts, 4 * combine_parts)),
        BLOCK_COLS=block_cols, ACC_DTYPE=acc, num_warps=config.combine_warps)
    return dict(
        in_order=in_order, rows_per_thread=rows_per_thread,
        first_grid=(programs,) if in_order else (programs, col_blocks), first=first,
        combine_grid=(runtime.cdiv(parts, combine_parts), col_blocks), combine=combine, parts=parts,
        part_dtype=part_dtype, partial_elements=parts * n_cols + parts * 8 // part_dtype.itemsize)


@runtime.on_inputs_device
def segment_reduce_triton(x: torch.Tensor, y, idx: torch.Tensor, num_segments: int, prologue: tl.constexpr,
                          epilogue: tl.constexpr, write_counts: bool, K: int = 1,
                          config: Optional[SegmentConfig] = None):
    """Launch the two-pass segmented reduction; returns ``(out (S, C), counts)``: ``counts``
    the ``(S,)`` int32 row counts when ``write_counts``, else ``None``.

    ``prologue`` is one of the ``ROW_*`` modes and ``epilogue`` one of ``TOTAL``,
    ``DIVIDE_BY_COUNT``, ``SQRT_OF_MEAN``. ``x``: ``(N, D)``, or ``(N,)`` for ``D = 1``
    (``out`` is then ``(S,)``); ``y``: ``(N, D)`` (product, dot), ``(N, K)`` (outer) or
    ``None``. ``C`` is ``D`` (value, product), 1 (dot, squared norm) or ``D * K``
    (outer). ``out`` has ``x``'s dtype.
    """
    config = segment_config() if config is None else config
    N, D = _rows_and_columns(x)
    n_cols = _output_columns(prologue.value, D, K)
    out_shape = (num_segments,) if x.dim() == 1 else (num_segments, n_cols)
    if N == 0 or num_segments == 0 or n_cols == 0:
        out = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
        return out, torch.zeros((num_segments,), dtype=torch.int32, device=x.device) if write_counts else None
    plan = _reduce_plan(N, D, K, num_segments, prologue.value, epilogue.value, write_counts, x.dtype, config,
                        runtime.INTERPRETED)
    # The first pass zeroes the empty segments itself.
    out = _uninitialised(out_shape, x.dtype, x.device, config)
    partials = torch.empty((plan["partial_elements"],), dtype=plan["part_dtype"], device=x.device)
    # (without counts to write, the kernels never touch the counts pointer)
    counts = _uninitialised((num_segments,), torch.int32, x.device, config) if write_counts else None
    counts_arg = partials if counts is None else counts
    if plan["in_order"]:
        rows_per_thread = plan["rows_per_thread"]
        segment_sum_rows_kernel[plan["first_grid"]](
            x, idx, out, counts_arg, partials, N, num_segments,
            VECTOR_IDX=_vector_loads(idx, rows_per_thread), VECTOR_X=_vector_loads(x, rows_per_thread),
            **plan["first"])
    else:
        segment_reduce_chunks_kernel[plan["first_grid"]](
            x, x if y is None else y, idx, out, counts_arg, partials, N, D, K, n_cols, num_segments,
            **plan["first"])
    segment_reduce_combine_kernel[plan["combine_grid"]](
        partials, out, counts_arg, plan["parts"], n_cols, **plan["combine"])
    return out, counts


@runtime.on_inputs_device
def segment_rowwise_triton(mode: tl.constexpr, a, b: torch.Tensor, idx: torch.Tensor, counts=None, r=None,
                           n_cols: int = None, config: Optional[SegmentConfig] = None) -> torch.Tensor:
    """Launch the row-wise map ``mode`` (one of ``GATHER``, ``GATHER_OVER_COUNT``,
    ``SCALE_ROWS``, ``RMS_BACKWARD``: see ``segment_rowwise_kernel``); returns ``(N, n_cols)``,
    or ``(N,)`` where the operand that sets the columns (``a``, else ``b``) is one-dimensional."""
    config = segment_config() if config is None else config
    N = idx.shape[0]
    rows = a if a is not None else b
    if n_cols is None:
        n_cols = _rows_and_columns(rows)[1]
    out = torch.empty((N,) if rows.dim() == 1 else (N, n_cols), dtype=rows.dtype, device=idx.device)
    if N == 0 or n_cols == 0:
        return out
    block_cols = _column_block(n_cols)
    block_rows = max(16, config.rowwise_elements // block_cols)
    dummy = b
    segment_rowwise_kernel[(runtime.cdiv(N, block_rows), runtime.cdiv(n_cols, block_cols))](
        a if a is not None else dummy, b, counts if counts is not None else idx,
        r if r is not None else dummy, idx, out, N, n_cols,
        MODE=mode.value, BROADCAST_B=_rows_and_columns(b)[1] == 1 and n_cols != 1, BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols, ACC_DTYPE=_accumulator(rows.dtype),
        num_warps=4,
    )
    return out


@runtime.on_inputs_device
def segment_matvec_triton(v: torch.Tensor, m: torch.Tensor, idx: torch.Tensor, transpose: bool,
                          config: Optional[SegmentConfig] = None) -> torch.Tensor:
    """``m[idx]^T v`` (``transpose=False``; v ``(N, D)`` -> ``(N, K)``) or ``m[idx] v`` (``(N, K)`` -> ``(N, D)``)."""
    config = segment_config() if config is None else config
    N = v.shape[0]
    _, D, K = m.shape
    n_out = D if transpose else K
    out = torch.empty((N, n_out), dtype=v.dtype, device=v.device)
    if N == 0 or n_out == 0:
        return out
    block_out = runtime.next_power_of_2(n_out)
    block_rows = max(16, config.rowwise_elements // block_out)
    segment_matvec_kernel[(runtime.cdiv(N, block_rows),)](
        v, m, idx, out, N, D, K,
        TRANSPOSE=transpose, BLOCK_ROWS=block_rows, BLOCK_OUT=block_out, ACC_DTYPE=_accumulator(v.dtype),
        num_warps=4,
    )
    return out


@runtime.on_inputs_device
def rms_norm_double_backward_triton(p, g, r, counts):
    """Launch ``rms_norm_double_backward_kernel`` on ``(S, 1)`` tensors; returns ``(grad_g, grad_r)``."""
    S = p.shape[0]
    grad_g = torch.empty_like(g)
    grad_r = torch.empty_like(r)
    if S == 0:
        return grad_g, grad_r
    rms_norm_double_backward_kernel[(runtime.cdiv(S, 1024),)](
        p, g, r, counts, grad_g, grad_r, S, BLOCK=1024, ACC_DTYPE=_accumulator(g.dtype),
    )
    return grad_g, grad_r


@runtime.on_inputs_device
def idx_check_triton(idx: torch.Tensor, num_segments: int, range_code: int, order_code: int) -> torch.Tensor:
    """The checked int32 copy of a non-empty 1-D contiguous int32 or int64 ``idx``
    (:func:`idx_check_kernel`; ``num_segments >= 1``); violations go to the error word of
    ``idx``'s device."""
    N = idx.shape[0]
    out = torch.empty((N,), dtype=torch.int32, device=idx.device)
    block = min(4096, max(16, runtime.next_power_of_2(N)))
    idx_check_kernel[(runtime.cdiv(N, block),)](idx, out, error_word(idx.device), N, num_segments, range_code,
                                                 order_code, BLOCK=block, num_warps=_warps_for(block))
    return out


__all__ = [
    "SegmentConfig",
    "segment_config",
    "segment_reduce_triton",
    "segment_rowwise_triton",
    "segment_matvec_triton",
    "rms_norm_double_backward_triton",
    "idx_check_triton",
]
