"""A teaching kernel: the segmented sum, one program per segment.

For rows ``x`` of shape ``(N, D)`` and a sorted ``idx`` of length ``N``,

.. math::

    \\mathrm{out}[s, c] = \\sum_{i:\\, \\mathrm{idx}[i] = s} x[i, c],
    \\qquad s = 0, \\dots, S - 1.

Because ``idx`` is sorted, the rows of segment ``s`` are one contiguous range
``offsets[s] <= i < offsets[s + 1]``, where ``offsets`` (the ``cu_seqlens`` of the
segments, ``S + 1`` entries starting at 0) counts the rows with a smaller id:
``offsets[s] = #{i : idx[i] < s}``. The launcher finds these boundaries with a binary
search (``torch.searchsorted``); the kernel then gives each segment one program, which
walks its range a block of rows at a time and adds the block's columns. An empty segment
has an empty range and writes 0.

This is the algorithm at its simplest, for reading: it trusts ``idx`` (sorted, in
``[0, S)``) and has no gradient. Its one-program-per-segment layout is also its
weakness: a segment of ten rows leaves most of a block idle, and one segment of ten
million rows runs on one program while the others finish. The production kernels of
:mod:`.triton_kernels` give each program a fixed chunk of rows instead.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import runtime  # noqa: F401  (sets TRITON_INTERPRET when there is no GPU)


@triton.jit
def segment_sum_teaching_kernel(x_ptr, offsets_ptr, out_ptr, n_cols,
                                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """``out[s, c] = sum of x[i, c] for offsets[s] <= i < offsets[s + 1]``.

    Grid ``(S, cdiv(D, BLOCK_COLS))``: program ``(s, b)`` sums columns ``b * BLOCK_COLS``
    onwards of segment ``s``. ``out`` has the accumulation dtype (float32, or float64
    for float64 rows)."""
    segment = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    # The segment's rows are one contiguous range, because idx is sorted.
    start = tl.load(offsets_ptr + segment)
    end = tl.load(offsets_ptr + segment + 1)
    total = tl.zeros((BLOCK_COLS,), dtype=out_ptr.dtype.element_ty)
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        # Rows past the segment's end are masked: they belong to the next segment.
        ok = (rows < end)[:, None] & col_ok[None, :]
        # 64-bit offsets: N * D may pass 2**31 elements.
        block = tl.load(x_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :],
                        mask=ok, other=0.0)
        total += tl.sum(block.to(total.dtype), axis=0)
    out_row = segment.to(tl.int64) * n_cols
    tl.store(out_ptr + out_row + cols, total, mask=col_ok)


def segment_offsets(idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The ``(S + 1,)`` int32 row offsets of the segments of a sorted ``idx``: segment
    ``s`` is rows ``offsets[s]`` to ``offsets[s + 1] - 1``. One binary search per
    boundary, on the device, without reading ``idx`` on the host."""
    boundaries = torch.arange(num_segments + 1, device=idx.device, dtype=idx.dtype)
    return torch.searchsorted(idx, boundaries).to(torch.int32)


def segmented_sum_teaching(x: torch.Tensor, idx: torch.Tensor, num_segments: int,
                           block_rows: int = 32) -> torch.Tensor:
    """``segmented_sum`` by :func:`segment_sum_teaching_kernel`: ``x`` ``(N,)`` or
    ``(N, D)``, ``idx`` sorted int32 or int64 ``(N,)`` in ``[0, num_segments)``
    (not checked); returns ``(S,)`` or ``(S, D)`` in ``x``'s dtype. Sums in float32
    (float64 for float64 rows); no gradient."""
    n_cols = math.prod(x.shape[1:])
    rows = x.reshape(x.shape[0], n_cols).contiguous()
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.empty((num_segments, n_cols), dtype=accumulate, device=x.device)
    if num_segments == 0:
        return out.to(x.dtype).reshape((0,) + x.shape[1:])
    offsets = segment_offsets(idx, num_segments)
    block_cols = min(triton.next_power_of_2(n_cols), 128)
    grid = (num_segments, triton.cdiv(n_cols, block_cols))
    segment_sum_teaching_kernel[grid](rows, offsets, out, n_cols,
                                      BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
    return out.to(x.dtype).reshape((num_segments,) + x.shape[1:])
