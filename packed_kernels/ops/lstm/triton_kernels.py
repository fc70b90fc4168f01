"""The Triton stage: one persistent launch runs a layer's whole recurrence.

For one layer, both directions, the work splits in two:

1. The input projection of every frame, ``X W_ih^T + b_ih + b_hh``, has no
   dependency between frames: it is one matrix product for the whole layer (both
   directions side by side in its columns), done by cuBLAS through ``torch`` or, for
   wide inputs, by :func:`input_projection` on tensor cores.
2. The recurrence ``z_t = xw_t + W_hh h_{t-1}`` is sequential. Launching a kernel
   per step costs more than the step's work (a ``(B, H) x (H, 4H)`` product), so
   :func:`_lstm_recurrence_kernel` is launched once and loops over time itself.

The grid is ``(K, batch tiles, directions)``. The ``K`` programs of one (direction,
batch tile) cooperate on one recurrence: program ``k`` owns hidden units
``[k U, (k + 1) U)`` with ``U = BLOCK_H / K`` and the matching rows of the four
gates of ``W_hh``, a ``4U x H`` slice loaded on chip once (into registers; into
shared memory for the tensor-core product) and used at every step. Each step a
program reads the whole ``h_{t-1}`` of its batch tile from a small exchange buffer
in global memory (it stays in L2), computes its ``U`` units of ``h_t`` and ``c_t``
(``c`` never leaves the program), writes its slice of ``h_t`` back and waits until
the other ``K - 1`` programs have written theirs.

The wait (``sync`` 2 and 3) is carried by the data itself: every entry of the
exchange buffer is one 64-bit word, the step number in its high half and the float32
bits of ``h`` in its low half, written by one store that no reader can see half-done.
A program polls its tile's ``h`` (volatile loads from L2) until every word carries the
step it waits for; it then has the values too. One round trip through L2 per step
when the data is ready, where a separate flag needs the writer's fence and counter
update and the reader's counter loads before the data load (``sync`` 1, kept as an
option: after a CTA barrier one release ``atomic_add`` per program, acquire loads of
the counter until it reaches ``K (s + 1)``, then a ``.cg`` load of ``h``).

The poll's verdict must cover every copy of every word. Triton may lay a small tile
out with several threads holding the same element (a ``(1, 64)`` tile over 128
threads holds each twice), and a ``tl.sum`` treats such copies as one: it can pass
while another thread's copy is still a step old. So each thread votes on what it
loaded itself, through the CTA barrier-reduction ``bar.red.or`` (:func:`_any_stale`),
and the program leaves the loop only when no thread saw a stale word.

``sync`` 3 (the default for hidden sizes up to 128) is the same wait with the poll
loop written in PTX (:func:`_wait_tiles_words`): the ``bar.red.or`` result is the
same in every thread, so the loop branches on it directly. In Triton a ``while``
needs a scalar condition, and turning the per-thread vote into one is a reduction of
its own (three more CTA barriers and two trips through shared memory per poll).

The exchange buffer is double buffered by step parity, so a fast program never
overwrites values a slow one still reads: it can only write step ``s + 2`` into a
slot after reading every program's step ``s + 1``, which each wrote after reading
step ``s``.

The wait needs every cooperating program resident at once (a program waiting for one
that never gets an SM would wait forever): the wrapper keeps each launch within the
SM count, one program per SM, and runs a batch too large for that as several
launches. Other work running at the same time only delays the start of some
programs (the others wait for them); two cooperative launches on different streams
could each hold SMs the other needs, so run recurrences from one stream.

``K = 1`` (``SYNC = 0``) has no cross-program wait at all: one program per
(direction, tile) computes all units, reading ``W_hh`` from memory each step. This
is the configuration Triton's interpreter runs on the CPU, where the programs of a
grid run one after another and a spin-wait would never end (and the GPU's, for
hidden sizes of 32 or less at batches larger than one cooperative launch holds).

There is no backward kernel: this is an inference path, and the module falls back
to the differentiable padded PyTorch stage when a gradient is needed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import runtime
from ...device_functions.fast_math import exp as _exp
from ...device_functions.fast_math import reciprocal as _reciprocal

__all__ = ["MAX_HIDDEN", "RecurrenceConfig", "choose_config", "input_projection", "lstm_recurrence"]

#: The largest hidden size whose recurrent weights the kernels keep on chip.
MAX_HIDDEN = 512


@triton.jit
def _sigmoid(z, FAST: tl.constexpr):
    # 1 / (1 + e^{-z}): exact limits 0 and 1 when e^{-z} overflows or underflows.
    return _reciprocal(1.0 + _exp(-z, FAST), FAST)


@triton.jit
def _tanh(z, FAST: tl.constexpr):
    # 1 - 2 / (e^{2z} + 1): exact limits +-1 when e^{2z} overflows or underflows.
    return 1.0 - 2.0 * _reciprocal(_exp(2.0 * z, FAST) + 1.0, FAST)


@triton.jit
def _any_stale(stale, VOTE_PACK: tl.constexpr):
    """Whether any thread of the program holds a nonzero entry of ``stale`` (0/1 int8).

    ``bar.red.or.pred`` is a CTA barrier that ORs one predicate over all threads. Each
    thread votes once per ``VOTE_PACK`` of its entries (1, or 4 bytes of one register),
    so entries that several threads hold are voted on by every holder; the max then
    covers the votes. ``VOTE_PACK`` 4 needs a multiple of 4 entries per thread.
    GPU only (inline PTX).
    """
    if VOTE_PACK == 4:
        votes = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.b32 p, $1, 0; bar.red.or.pred q, 0, p; selp.b32 $0, 0x01010101, 0, q; }",
            "=r,r", [stale], dtype=tl.int8, is_pure=False, pack=4)
    else:
        votes = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r", [stale.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    return tl.max(votes)


@triton.jit
def _gate_matvec(h, w, MATVEC: tl.constexpr):
    """``h W^T`` for one gate: ``h`` is ``(BLOCK_B, BLOCK_H)``; the result ``(BLOCK_B, U)``.

    ``MATVEC`` picks how (the layout of ``w`` follows, see :func:`_load_gate_weight`):

    * 0: ``w`` is ``(U, BLOCK_H)``; a broadcast multiply summed over its contiguous
      last axis (Triton spreads that axis over the lanes of a warp: many shuffles).
    * 1: ``w`` is ``(BLOCK_H, U)``; ``tl.dot`` on CUDA cores in IEEE float32.
    * 2: ``w`` is ``(BLOCK_H, U)``, read from a transposed copy so that the units are
      contiguous; a broadcast multiply summed over axis 1, which Triton keeps mostly
      inside each thread. Only for ``BLOCK_B < 16``: from 16 rows on, Triton rewrites
      this pattern into a dot with TF32 inputs.
    * 3: as 1, on tensor cores with three TF32 products per product
      (``tf32x3``: the high and low parts of both factors), float32 accuracy.

    (``MATVEC`` 4, the four gates as one product, is written out in :func:`_cell`.)
    """
    if MATVEC == 3:
        return tl.dot(h, w, input_precision="tf32x3")
    elif MATVEC == 1:
        return tl.dot(h, w, input_precision="ieee")
    elif MATVEC == 2:
        return tl.sum(h[:, :, None] * w[None, :, :], axis=1)
    else:
        return tl.sum(h[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _load_gate_weight(w_hh_ptr, d, gate, H, units, cols, mask_units, mask_cols, MATVEC: tl.constexpr):
    rows = (d * 4 + gate) * H + units  # rows of W_hh for direction d, this gate, these units
    if MATVEC == 2:
        # w_hh_ptr holds W_hh transposed per gate, (D, 4, H, H) indexed [d, gate, col, unit].
        ptrs = w_hh_ptr + ((d * 4 + gate) * H + cols[:, None]).to(tl.int64) * H + units[None, :]
        return tl.load(ptrs, mask=mask_units[None, :] & mask_cols[:, None], other=0.0)
    elif MATVEC == 0:
        ptrs = w_hh_ptr + rows[:, None].to(tl.int64) * H + cols[None, :]
        return tl.load(ptrs, mask=mask_units[:, None] & mask_cols[None, :], other=0.0)
    else:
        ptrs = w_hh_ptr + rows[None, :].to(tl.int64) * H + cols[:, None]
        return tl.load(ptrs, mask=mask_units[None, :] & mask_cols[:, None], other=0.0)


@triton.jit
def _frame_row(row_start, lengths, s, d, row_step):
    """The row (in ``xw`` and ``out``) of step ``s``'s frame for each sequence of a tile.

    Step ``s`` of the forward direction is frame ``s``; of the reverse direction frame
    ``length - 1 - s``, so each sequence runs backwards from its own last frame.
    """
    t = tl.where(d == 0, s, lengths - 1 - s)
    return row_start + t.to(tl.int64) * row_step


@triton.jit
def _load_gate_weights(w_hh_ptr, d, H, units, cols, mask_units, mask_cols, MATVEC: tl.constexpr):
    """This program's ``4 x UNITS`` rows of ``W_hh``, one tensor per gate (``i, f, g, o``)."""
    return (_load_gate_weight(w_hh_ptr, d, 0, H, units, cols, mask_units, mask_cols, MATVEC),
            _load_gate_weight(w_hh_ptr, d, 1, H, units, cols, mask_units, mask_cols, MATVEC),
            _load_gate_weight(w_hh_ptr, d, 2, H, units, cols, mask_units, mask_cols, MATVEC),
            _load_gate_weight(w_hh_ptr, d, 3, H, units, cols, mask_units, mask_cols, MATVEC))


@triton.jit
def _load_step_inputs(xw_ptr, row_start, lengths, s, d, H, units, mask_units, row_step,
                      NUM_DIRECTIONS: tl.constexpr):
    """The projected inputs of step ``s`` for each row of the tile, four ``(BLOCK_B, U)``
    gates (see :func:`_frame_row`). Rows whose sequence has ended (``s >= length``) read
    nothing.
    """
    active = s < lengths
    row = _frame_row(row_start, lengths, s, d, row_step)
    base = xw_ptr + row[:, None] * (NUM_DIRECTIONS * 4 * H) + d * 4 * H + units[None, :]
    mask = active[:, None] & mask_units[None, :]
    x_i = tl.load(base, mask=mask, other=0.0)
    x_f = tl.load(base + H, mask=mask, other=0.0)
    x_g = tl.load(base + 2 * H, mask=mask, other=0.0)
    x_o = tl.load(base + 3 * H, mask=mask, other=0.0)
    return x_i, x_f, x_g, x_o


@triton.jit
def _prefetch_step_inputs(xw_ptr, row_start, lengths, s, d, H, k, row_step,
                          NUM_DIRECTIONS: tl.constexpr, UNITS: tl.constexpr):
    """Ask L2 for the projected inputs of step ``s`` (``prefetch.global.L2``, no registers).

    One request per 128-byte line: lanes ``u`` of the four gates' ``UNITS`` entries with
    ``u % 32 == 0``. GPU only (inline PTX).
    """
    lane = tl.arange(0, 4 * UNITS)
    unit = k * UNITS + lane % UNITS
    row = _frame_row(row_start, lengths, s, d, row_step)
    ptrs = xw_ptr + row[:, None] * (NUM_DIRECTIONS * 4 * H) + d * 4 * H + (lane // UNITS * H + unit)[None, :]
    wanted = (s < lengths)[:, None] & ((unit < H) & (lane % 32 == 0))[None, :]
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, wanted.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_tiles_inputs(xw_ptr, starts_t, lengths_t, s, d, H, units, mask_units, row_step,
                       NUM_DIRECTIONS: tl.constexpr, SUB_TILES: tl.constexpr):
    """:func:`_load_step_inputs` of each tile: a tuple of ``(x_i, x_f, x_g, x_o)``."""
    x_t = ()
    for r in tl.static_range(SUB_TILES):
        x_t = x_t + (_load_step_inputs(xw_ptr, starts_t[r], lengths_t[r], s, d, H, units, mask_units,
                                       row_step, NUM_DIRECTIONS),)
    return x_t


@triton.jit
def _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES: tl.constexpr):
    """The exchange words of each tile, by volatile loads (served by L2)."""
    packed_t = ()
    for r in tl.static_range(SUB_TILES):
        packed_t = packed_t + (tl.load(read_slot + full_t[r], mask=mask_full_t[r], other=0, volatile=True),)
    return packed_t


@triton.constexpr_function
def _wait_asm(tiles):
    """PTX of the poll loop of :func:`_wait_tiles_words` over one word of each of ``tiles`` tiles.

    Operands: ``$0 .. $(n-1)`` the words returned; then per tile the word first
    loaded, its address and its mask (0: no load, never stale); last the step
    waited for. Each pass ORs every thread's "some word of mine is stale" through
    ``bar.red.or`` (a CTA barrier: every thread runs the same passes) and, while any
    thread saw one, reloads this thread's words (volatile, served by L2).
    """
    n = int(tiles)
    lines = ["{", ".reg .pred p, t, q;", ".reg .b32 lo, tag;"]
    for i in range(n):
        lines += [f".reg .pred w{i};", f".reg .b64 v{i};",
                  f"setp.ne.b32 w{i}, ${3 * n + i}, 0;", f"mov.b64 v{i}, ${n + i};"]
    lines += ["POLL_${:uid}:"]
    for i in range(n):
        lines += [f"mov.b64 {{lo, tag}}, v{i};", f"setp.ne.and.s32 {'t' if i else 'p'}, tag, ${4 * n}, w{i};"]
        lines += ["or.pred p, p, t;"] if i else []
    lines += ["bar.red.or.pred q, 0, p;", "@!q bra DONE_${:uid};"]
    lines += [f"@w{i} ld.volatile.global.b64 v{i}, [${2 * n + i}];" for i in range(n)]
    lines += ["bra.uni POLL_${:uid};", "DONE_${:uid}:"]
    lines += [f"mov.b64 ${i}, v{i};" for i in range(n)]
    return "\n".join(lines + ["}"])


@triton.constexpr_function
def _wait_constraints(tiles):
    n = int(tiles)
    return ",".join(["=l"] * n + ["l"] * (2 * n) + ["r"] * (n + 1))


@triton.constexpr_function
def _words_dtypes(tiles):
    return (tl.int64,) * int(tiles)  # a tuple even for one tile: the asm returns a tuple


#: most tiles per program the PTX poll loop (``sync`` 3) was measured and tested with
MAX_WAIT_TILES = 3


@triton.jit
def _poll_asm(words_t, read_slot, full_t, mask_full_t, step, SUB_TILES: tl.constexpr):
    """One instance of :func:`_wait_asm`'s loop per word a thread holds of each tile."""
    ptrs_t = ()
    masks_t = ()
    for r in tl.static_range(SUB_TILES):
        ptrs_t = ptrs_t + (read_slot + full_t[r],)
        masks_t = masks_t + (mask_full_t[r].to(tl.int32),)
    return tl.inline_asm_elementwise(_wait_asm(SUB_TILES), _wait_constraints(SUB_TILES),
                                     words_t + ptrs_t + masks_t + (step,), dtype=_words_dtypes(SUB_TILES),
                                     is_pure=False, pack=1)


@triton.jit
def _wait_tiles_words(read_slot, full_t, mask_full_t, s, SUB_TILES: tl.constexpr):
    """``sync`` 3: the tiles' words once every one carries step ``s``; the poll loop in PTX.

    A first load of the words in Triton, then one inline-PTX loop over all tiles
    (:func:`_wait_asm`). GPU only.
    """
    words_t = _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES)
    step = mask_full_t[0].to(tl.int32) * 0 + s  # s in the words' layout
    # Inside a loop that runs once: Triton then does not recompute the loads and the
    # poll in each consumer's layout (measured: for a one-row tile it reran them once
    # per element of the broadcast h, 128 polls a thread, and the kernel spilled).
    once = 0
    while once < 1:
        words_t = _poll_asm(words_t, read_slot, full_t, mask_full_t, step, SUB_TILES)
        once += 1
    return words_t


@triton.jit
def _stale_words(packed_t, mask_full_t, s, SUB_TILES: tl.constexpr):
    """1 (int8) where some tile's word held by this thread is not tagged with step ``s``."""
    stale = mask_full_t[0] & ((packed_t[0] >> 32).to(tl.int32) != s)
    for r in tl.static_range(1, SUB_TILES):
        stale = stale | (mask_full_t[r] & ((packed_t[r] >> 32).to(tl.int32) != s))
    return stale.to(tl.int8)


@triton.jit
def _products(h, weights, BLOCK_B: tl.constexpr, UNITS: tl.constexpr, MATVEC: tl.constexpr):
    """``W_hh h`` of a tile's ``(BLOCK_B, UNITS)`` units, one tensor per gate (``i, f, g, o``).

    ``weights``: ``(w4,)``, the four gates' ``(BLOCK_H, UNITS, 4)`` slice, with ``MATVEC``
    4, else one tensor per gate.
    """
    if MATVEC == 4:
        # One product for the four gates; (BLOCK_B, UNITS, 4) -> four (BLOCK_B, UNITS).
        z = tl.sum(h[:, :, None, None] * weights[0][None, :, :, :], axis=1)
        z_ig, z_fo = tl.split(tl.reshape(z, (BLOCK_B, UNITS, 2, 2)))  # gate 2a + b at [a, b]
        z_i, z_g = tl.split(z_ig)
        z_f, z_o = tl.split(z_fo)
        return z_i, z_f, z_g, z_o
    else:
        w_i, w_f, w_g, w_o = weights
        return (_gate_matvec(h, w_i, MATVEC), _gate_matvec(h, w_f, MATVEC), _gate_matvec(h, w_g, MATVEC),
                _gate_matvec(h, w_o, MATVEC))


@triton.jit
def _cell(z, x, c, FAST: tl.constexpr):
    """One step of the cell: ``(c_t, h_t)`` from the products ``z`` (:func:`_products`),
    the projected inputs ``x`` and ``c_{t-1}``, each four gates ``i, f, g, o``."""
    z_i, z_f, z_g, z_o = z
    x_i, x_f, x_g, x_o = x
    gate_i = _sigmoid(x_i + z_i, FAST)
    gate_f = _sigmoid(x_f + z_f, FAST)
    gate_g = _tanh(x_g + z_g, FAST)
    gate_o = _sigmoid(x_o + z_o, FAST)
    c_new = gate_f * c + gate_i * gate_g
    return c_new, gate_o * _tanh(c_new, FAST)


@triton.jit
def _lstm_recurrence_kernel(
    xw_ptr, w_hh_ptr, out_ptr, exchange_ptr, h0_ptr, c0_ptr, hn_ptr, cn_ptr,
    row_start_ptr, lengths_ptr, counter_ptr,
    B, H, row_step, n_tiles,
    NUM_DIRECTIONS: tl.constexpr, K: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr, UNITS: tl.constexpr, MATVEC: tl.constexpr, SYNC: tl.constexpr,
    PREFETCH: tl.constexpr, VOTE_PACK: tl.constexpr, L2_AHEAD: tl.constexpr, FAST: tl.constexpr,
    SUB_TILES: tl.constexpr,
):
    """The recurrence of one LSTM layer, all directions, in one launch.

    For each sequence ``b`` and step ``s < length_b`` (frame ``t = s`` forward,
    ``t = length_b - 1 - s`` in reverse), with ``xw`` the projected input row of
    frame ``t`` (biases included)::

        z = xw[t] + W_hh h                                 (4H,)
        i, f, g, o = sigmoid(z_i), sigmoid(z_f), tanh(z_g), sigmoid(z_o)
        c = f * c + i * g;   h = o * tanh(c);   out[t] = h

    A sequence's ``h`` and ``c`` stop changing after its last frame, so the state
    left at the end is its final state ``(h_n, c_n)``. Forward only (no gradient).

    Layouts (float32, contiguous): ``xw`` ``(N, D * 4H)``, ``W_hh`` ``(D, 4H, H)``,
    ``out`` ``(N, D * H)``, ``h0``/``c0``/``hn``/``cn`` ``(D, B, H)``; frame ``t`` of
    sequence ``b`` is row ``row_start[b] + t * row_step``. ``exchange`` is ``(2, D, B,
    H)``, slot 0 holding ``h0``: float32, or with ``SYNC`` 2 or 3 int64 words tagged with
    their step (``h0`` step 0, slot 1 step -1); ``counter``, read with ``SYNC`` 1 only,
    ``(D, n_tiles)`` int32 zeros: the step counter of each direction and tile. Program
    ``(k, tile, d)`` owns units ``[k UNITS, (k + 1) UNITS)`` of rows ``[tile R, (tile +
    1) R)``, ``R = BLOCK_B SUB_TILES``, in direction ``d``: ``SUB_TILES`` tiles of
    ``BLOCK_B`` rows, each step computing the products of all of them, then their cells.
    """
    k = tl.program_id(0)
    tile = tl.program_id(1)
    d = tl.program_id(2)

    units = k * UNITS + tl.arange(0, UNITS)
    mask_units = units < H
    cols = tl.arange(0, BLOCK_H)
    mask_cols = cols < H
    if MATVEC == 4:
        # All four gates in one (BLOCK_H, UNITS, 4) tensor, from the transposed copy:
        # w4[col, u, gate] = W_hh[d, gate H + units[u], col]. Held for every step.
        gates = tl.arange(0, 4)
        w4 = tl.load(w_hh_ptr + ((d * 4 + gates[None, None, :]) * H + cols[:, None, None]).to(tl.int64) * H
                     + units[None, :, None], mask=mask_cols[:, None, None] & mask_units[None, :, None], other=0.0)
        weights = (w4,)
    elif K > 1:
        # Held in registers for every step: this program's 4 x UNITS rows of W_hh.
        weights = _load_gate_weights(w_hh_ptr, d, H, units, cols, mask_units, mask_cols, MATVEC)

    # The program's SUB_TILES tiles of BLOCK_B rows, each its own tuple entry: a step
    # computes their products one after another, so registers hold the broadcast h of
    # one tile at a time.
    lengths_t = ()
    starts_t = ()
    own_t = ()  # (BLOCK_B, UNITS) offsets in (D, B, H)
    full_t = ()  # (BLOCK_B, BLOCK_H) offsets in (D, B, H)
    mask_own_t = ()
    mask_full_t = ()
    h_own_t = ()
    c_t = ()
    n_steps = 0  # the program runs until its longest sequence ends
    for r in tl.static_range(SUB_TILES):
        rows = (tile * SUB_TILES + r) * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_rows = rows < B
        lengths = tl.load(lengths_ptr + rows, mask=mask_rows, other=0)
        n_steps = tl.maximum(n_steps, tl.max(lengths, axis=0))
        own = (d * B + rows)[:, None].to(tl.int64) * H + units[None, :]
        mask_own = mask_rows[:, None] & mask_units[None, :]
        lengths_t = lengths_t + (lengths,)
        starts_t = starts_t + (tl.load(row_start_ptr + rows, mask=mask_rows, other=0).to(tl.int64),)
        own_t = own_t + (own,)
        mask_own_t = mask_own_t + (mask_own,)
        full_t = full_t + ((d * B + rows)[:, None].to(tl.int64) * H + cols[None, :],)
        mask_full_t = mask_full_t + (mask_rows[:, None] & mask_cols[None, :],)
        h_own_t = h_own_t + (tl.load(h0_ptr + own, mask=mask_own, other=0.0),)
        c_t = c_t + (tl.load(c0_ptr + own, mask=mask_own, other=0.0),)
    slot_size = NUM_DIRECTIONS * B * H
    counter = counter_ptr + d * n_tiles + tile

    x_t = _load_tiles_inputs(xw_ptr, starts_t, lengths_t, 0, d, H, units, mask_units, row_step,
                             NUM_DIRECTIONS, SUB_TILES)
    if PREFETCH == 2:
        y_t = _load_tiles_inputs(xw_ptr, starts_t, lengths_t, 1, d, H, units, mask_units, row_step,
                                 NUM_DIRECTIONS, SUB_TILES)
    for s in range(0, n_steps):
        # h_{s-1} of the whole tile, as written by all K programs: slot s % 2.
        read_slot = exchange_ptr + (s % 2) * slot_size
        if SYNC == 2:
            # Each entry is (step << 32) | float bits, one 64-bit word: a reader sees the
            # value and its step together. Poll until every entry of the tiles is step s.
            packed_t = _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES)
            while _any_stale(_stale_words(packed_t, mask_full_t, s, SUB_TILES), VOTE_PACK) > 0:
                packed_t = _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES)
        elif SYNC == 3:
            packed_t = _wait_tiles_words(read_slot, full_t, mask_full_t, s, SUB_TILES)  # the same, in PTX
        if K == 1 and MATVEC != 4:
            # Nothing is held across steps: the whole W_hh is re-read (from cache) each step.
            weights = _load_gate_weights(w_hh_ptr, d, H, units, cols, mask_units, mask_cols, MATVEC)

        # The products of every tile first, then the cells: the gates of one tile and the
        # products of the next are not separated by the CTA barriers of a product (H200,
        # hidden 128: batch 128 7.67 -> 7.44 ms, batch 192 10.93 -> 10.75).
        z_t = ()
        for r in tl.static_range(SUB_TILES):
            if SYNC >= 2:
                h = packed_t[r].to(tl.int32).to(tl.float32, bitcast=True)  # the low 32 bits
            else:
                # .cg reads L2, never a stale L1 line from an earlier step.
                h = tl.load(read_slot + full_t[r], mask=mask_full_t[r], other=0.0, cache_modifier=".cg")
            z_t = z_t + (_products(h, weights, BLOCK_B, UNITS, MATVEC),)
        new_h_t = ()
        new_c_t = ()
        for r in tl.static_range(SUB_TILES):
            c_new, h_new = _cell(z_t[r], x_t[r], c_t[r], FAST)
            active = s < lengths_t[r]
            h_own = tl.where(active[:, None], h_new, h_own_t[r])
            new_c_t = new_c_t + (tl.where(active[:, None], c_new, c_t[r]),)
            new_h_t = new_h_t + (h_own,)
            # The exchange first: the other programs wait for it, nothing waits for the output.
            if SYNC >= 2:
                shared = h_own.to(tl.uint32, bitcast=True).to(tl.int64) | ((tl.zeros((), tl.int64) + s + 1) << 32)
            else:
                shared = h_own
            tl.store(exchange_ptr + ((s + 1) % 2) * slot_size + own_t[r], shared, mask=mask_own_t[r])
            out_row = _frame_row(starts_t[r], lengths_t[r], s, d, row_step)
            tl.store(out_ptr + out_row[:, None] * (NUM_DIRECTIONS * H) + d * H + units[None, :], h_new,
                     mask=active[:, None] & mask_units[None, :])
        h_own_t = new_h_t
        c_t = new_c_t
        # Later steps' inputs do not depend on h: their loads overlap the wait for the other
        # programs' h (below, or at the top of the next step with SYNC 2 or 3). Loads that miss
        # L2 still slow the steps that wait on them, so with L2_AHEAD the inputs of step
        # s + L2_AHEAD are first brought from DRAM into L2.
        if L2_AHEAD > 0:
            for r in tl.static_range(SUB_TILES):
                _prefetch_step_inputs(xw_ptr, starts_t[r], lengths_t[r], s + L2_AHEAD, d, H, k, row_step,
                                      NUM_DIRECTIONS, UNITS)
        if PREFETCH == 2:
            x_t = y_t
            y_t = _load_tiles_inputs(xw_ptr, starts_t, lengths_t, s + 2, d, H, units, mask_units, row_step,
                                     NUM_DIRECTIONS, SUB_TILES)
        else:
            x_t = _load_tiles_inputs(xw_ptr, starts_t, lengths_t, s + 1, d, H, units, mask_units, row_step,
                                     NUM_DIRECTIONS, SUB_TILES)
        if SYNC == 1:
            # Every thread's store must be done before this program signals (CTA barrier),
            # and the release makes them visible to the programs that acquire the count.
            tl.debug_barrier()
            tl.atomic_add(counter, 1, sem="release", scope="gpu")
            arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            while arrived < K * (s + 1):
                arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        elif SYNC == 0:
            tl.debug_barrier()  # the next step reads values other threads of this program wrote

    for r in tl.static_range(SUB_TILES):
        tl.store(hn_ptr + own_t[r], h_own_t[r], mask=mask_own_t[r])
        tl.store(cn_ptr + own_t[r], c_t[r], mask=mask_own_t[r])


@triton.jit
def _projection_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """``out = x W^T (+ bias)`` for one ``(BLOCK_M, BLOCK_N)`` tile, float32 in and out.

    ``x`` is ``(M, K)`` with row stride ``stride_x``, ``W`` ``(N, K)`` and ``out`` ``(M, N)``
    contiguous. The products run on tensor cores as ``tf32x3``: each factor split into
    its TF32 part and the TF32 rounding of the remainder, three products summed, which
    keeps float32 accuracy (a plain TF32 product would lose about three digits).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_rows = rows < M
    mask_cols = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=mask_rows[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + ks[:, None],
                    mask=mask_cols[None, :] & mask_k[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask_cols, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc,
             mask=mask_rows[:, None] & mask_cols[None, :])


@runtime.on_inputs_device
def input_projection(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + bias`` in float32 accuracy on tensor cores: ``x`` ``(M, K)`` with unit
    column stride, ``w`` ``(N, K)`` and ``bias`` ``(N,)`` (or ``None``) contiguous.

    The input projection of every frame of a layer. cuBLAS's float32 product (TF32
    off) runs on CUDA cores; three TF32 products on tensor cores are faster and as
    accurate (H200, 18,848 frames x 256 inputs x 1,024 outputs: see the chapter).
    """
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N)) if bias is not None else out.zero_()
    block_m, block_n = 128, 128
    grid = (runtime.cdiv(M, block_m), runtime.cdiv(N, block_n))
    _projection_kernel[grid](
        x, w, bias if bias is not None else w, out, M, N, K, x.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
        num_warps=8, num_stages=3,
    )
    return out


@dataclass(frozen=True)
class RecurrenceConfig:
    """How :func:`lstm_recurrence` splits the work.

    Attributes:
        programs_per_tile: ``K``, the programs that cooperate on one (direction,
            batch tile); each holds ``4 H / K`` rows of ``W_hh``. ``1`` means no
            cross-program waits (the interpreter's configuration).
        block_b: batch rows per tile (a power of two).
        matvec: how the recurrent product is computed (see :func:`_gate_matvec`):
            0 broadcast multiply and sum over a weight row, 1 ``tl.dot`` in IEEE
            float32, 2 broadcast multiply and sum over transposed weights (only
            with ``block_b < 16``), 3 ``tl.dot`` with three TF32 products per
            product (tensor cores, float32 accuracy), 4 as 2 with the four gates
            in one product (one reduction instead of four; ``block_b < 16``).
        sync: how programs wait for each other's ``h``: 2, step-tagged 64-bit
            words polled in place (GPU only); 3, the same with the poll loop in PTX
            (GPU only, ``sub_tiles`` up to 3); 1, a step counter; 0, a CTA barrier
            only. ``K > 1`` needs 1, 2 or 3, ``K = 1`` 0 or 1.
        num_warps: warps per program.
        prefetch: how many steps ahead the projected inputs are loaded (1 or 2).
        l2_prefetch: how many steps ahead the projected inputs are first brought from
            DRAM into L2 (0: not at all; GPU only). ``None``: 8 for the CUDA-core
            products when the layer's projected inputs fill more than half of L2 (so
            that most of them come from DRAM), else 0.
        sub_tiles: how many tiles of ``block_b`` rows one program runs in each step
            (the products of all of them, then their cells): more rows per program
            (fewer launches) for the registers of ``block_b`` rows.
        fast_math: the gates' exponentials and reciprocals as single approximate
            instructions (``ex2.approx.ftz``, ``rcp.approx.ftz``; GPU only), where
            ``tl.exp`` and ``/`` add range tests around the same instructions: about
            1 ulp, and outputs still equal ``nn.LSTM`` to 1e-5. ``None``: on for the
            CUDA-core products, off for the tensor-core one (measured slower there).
    """

    programs_per_tile: int
    block_b: int
    matvec: int
    sync: int
    num_warps: int = 4
    prefetch: int = 1
    l2_prefetch: Optional[int] = None
    fast_math: Optional[bool] = None
    sub_tiles: int = 1


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).L2_cache_size


def choose_config(batch: int, hidden: int, num_directions: int, device: torch.device) -> RecurrenceConfig:
    """The configuration used by default for a layer of this shape on ``device``.

    On the GPU each launch is filled up to the SM count: ``K`` programs per
    (direction, batch tile), as many tiles as fit. Per-program work is ``block_b x
    units x H`` multiply-adds per gate and step; beyond 64 per thread (cooperating
    programs, hidden sizes up to 128) or 128 the sums no longer stay in registers and time climbs
    steeply, so a batch that needs more rows per program than that runs as several
    launches. Slices of 16, 32 or 64 units (64 with 8 warps, at hidden sizes up to
    128). Among the splits, the fewest launches, then the least work per thread, then
    (measured on an H200) fewer programs per exchange for H <= 128 and the smaller
    weight slice for larger H. The tensor-core product (``matvec`` 3, 16 rows per
    program) measured slower than these CUDA-core sums in one launch; at hidden sizes
    up to 128 a batch that needs two or three launches of them runs as one launch of
    programs with that many tiles each (``sub_tiles``), and one that needs more, or the
    full 128 multiply-adds per thread, as one launch of the tensor-core variant. The CUDA-core
    configurations compute the four gates as one product (``matvec`` 4: measured 4% to
    27% faster than gate by gate at 589 frames, for every shape tried) and wait on
    step-tagged words (``sync`` 2), polled by a loop in PTX (``sync`` 3) at hidden
    sizes up to 128 where each thread holds at most one word of a tile; the
    tensor-core one waits on the step counter (``sync`` 1), each the faster there.
    """
    block_h = max(runtime.next_power_of_2(hidden), 16)
    if runtime.INTERPRETED or device.type != "cuda":
        # The interpreter runs programs one after another: no cross-program waits.
        return RecurrenceConfig(1, min(runtime.next_power_of_2(max(batch, 1)), 16), 0, 0, 4)
    sms = runtime.sm_count(device)
    best = None
    for units in (16, 32, 64):
        units = min(units, block_h)
        # 8 warps for large hidden sizes and for 64-unit slices (128 registers of weights a thread)
        num_warps = 4 if block_h <= 128 and units <= 32 else 8
        threads = 32 * num_warps
        if 4 * units * block_h // threads > 128:
            continue
        k = block_h // units
        if num_directions * k > sms:
            continue
        # rows per program: the most that keeps the work per thread within the limit
        # (H200, hidden 128, batch 128: 4 rows of 64 units over 8 warps, 128 multiply-adds
        # a thread, took 122 ms; 2 rows in two launches 9.2 ms)
        limit = 64 if block_h <= 128 and k > 1 else 128
        largest = 8
        while largest > 1 and largest * units * block_h // threads > limit:
            largest //= 2
        if k == 1:
            tiles = runtime.cdiv(batch, largest)  # no waits: any number of tiles in one launch
        else:
            tiles = sms // (num_directions * k)
        block_b = min(runtime.next_power_of_2(max(math.ceil(batch / tiles), 1)), largest)
        launches = runtime.cdiv(batch, tiles * block_b)
        work = block_b * units * block_h // threads
        key = (launches, work, k if block_h <= 128 else -k)
        if best is None or key < best[0]:
            prefetch = 2 if block_b == 1 else 1  # measured a few percent faster at one row per program
            best = (key, RecurrenceConfig(k, block_b, 4, 2 if k > 1 else 0, num_warps, prefetch=prefetch))
    if best is None:
        raise ValueError(f"hidden_size={hidden} is too large for the persistent kernels (at most {MAX_HIDDEN})")
    launches, work = best[0][:2]
    config = best[1]
    if block_h <= 128 and config.programs_per_tile > 1 and 1 < launches <= 3:
        # Two or three launches' worth of rows: one launch whose programs each run that
        # many tiles one after another (H200, hidden 128: batch 128, 7.4 ms against 9.2
        # for two launches and 11.4 for the tensor cores; batch 192, 10.8 against 12.3
        # for the tensor cores). Four tiles per program lost to the tensor cores (batch
        # 256: 14.0 against 13.3 ms).
        return _ptx_poll(replace(config, sub_tiles=launches), block_h)
    if block_h <= 128 and (launches > 3 or work >= 128):
        # Many rows: 16 rows per program on the tensor cores (tf32x3), in one launch,
        # instead of four or more tiles per program of the CUDA-core sums, or of
        # programs that each run a whole recurrence alone with 128 multiply-adds a
        # thread; at hidden 256 the weight slice outgrows shared memory.
        # With 16 rows a thread holds 16 words of h: voting on them (``sync`` 2) cost
        # more than the step counter (14.6 against 13.0 ms at batch 128, 17.5 against
        # 15.9 at 256, measured before the CUDA-core sums took batch 128).
        k = max(block_h // 32, 1)
        tiles = sms // (num_directions * k)
        if tiles >= 1 and runtime.cdiv(batch, tiles * 16) <= launches:
            return RecurrenceConfig(k, 16, 3, 1 if k > 1 else 0, 4)
    return _ptx_poll(config, block_h)


def _ptx_poll(config: RecurrenceConfig, block_h: int) -> RecurrenceConfig:
    """``config`` with the PTX poll loop (``sync`` 3) where it measured faster.

    H200, pyannote stack (hidden 128): batch 1 2.50 -> 2.15 ms, batch 8 2.52 -> 2.15,
    batch 32 3.51 -> 3.43, batch 64 4.55 -> 3.97, batch 128 7.43 -> 6.81, batch 192
    10.70 -> 10.00. At hidden 256 (8 words a thread at batch 32) it was slower: 13.4 ->
    16.5 ms at batch 32, 4.40 -> 4.54 at batch 8.
    """
    one_word = config.block_b * block_h <= 32 * config.num_warps
    if config.sync == 2 and block_h <= 128 and one_word and config.sub_tiles <= MAX_WAIT_TILES:
        return replace(config, sync=3)
    return config


@runtime.on_inputs_device
def lstm_recurrence(
    xw: torch.Tensor,
    w_hh: torch.Tensor,
    h0: torch.Tensor,
    c0: torch.Tensor,
    row_start: torch.Tensor,
    lengths: torch.Tensor,
    row_step: int,
    out: torch.Tensor,
    h_n: torch.Tensor,
    c_n: torch.Tensor,
    config: Optional[RecurrenceConfig] = None,
    w_hh_t: Optional[torch.Tensor] = None,
) -> None:
    """Run one layer's recurrence, every direction, in one launch (writes ``out``, ``h_n``, ``c_n``).

    A batch larger than one launch can keep resident (``SMs / (D K)`` tiles) runs as
    several launches of consecutive rows.

    Args (float32 unless said, contiguous, on the kernel device):
        xw: ``(N, D * 4H)`` projected inputs, ``x W_ih^T + b_ih + b_hh`` per direction.
        w_hh: ``(D, 4H, H)`` recurrent weights.
        h0, c0: ``(D, B, H)`` initial states.
        row_start: int64 ``(B,)``, the row of frame 0 of each sequence in ``xw``/``out``.
        lengths: int32 ``(B,)``, frames per sequence (frame ``t`` is row
            ``row_start[b] + t * row_step``).
        out: ``(N, D * H)``; only the rows of frames ``t < lengths[b]`` are written.
        h_n, c_n: ``(D, B, H)`` final states.
        config: see :class:`RecurrenceConfig`; :func:`choose_config` when ``None``.
        w_hh_t: ``(D, 4, H, H)``, each gate's ``W_hh`` block transposed; only read
            with ``config.matvec`` 2 or 4 (made here when not given).

    The caller guarantees the shapes and that every row index is in range.
    """
    num_directions, _, hidden = w_hh.shape
    batch = lengths.numel()
    if batch == 0:
        return
    if config is None:
        config = choose_config(batch, hidden, num_directions, xw.device)
    block_h = max(runtime.next_power_of_2(hidden), 16)
    k = config.programs_per_tile
    if block_h % k:
        raise ValueError(f"programs_per_tile={k} must divide the padded hidden size {block_h}")
    allowed = (1, 2, 3) if k > 1 else (0, 1)
    if config.sync not in allowed:
        choices = f"{', '.join(map(str, allowed[:-1]))} or {allowed[-1]}"
        raise ValueError(f"programs_per_tile={k} needs sync {choices}, got {config.sync}")
    if not isinstance(config.sub_tiles, int) or config.sub_tiles < 1:
        raise ValueError(f"sub_tiles must be an int >= 1, got {config.sub_tiles!r}")
    if config.sync == 3 and config.sub_tiles > MAX_WAIT_TILES:
        raise ValueError(f"sync 3 takes at most {MAX_WAIT_TILES} sub_tiles, got {config.sub_tiles}")
    if config.l2_prefetch is not None and (not isinstance(config.l2_prefetch, int) or config.l2_prefetch < 0):
        raise ValueError(f"l2_prefetch must be None or a step count >= 0, got {config.l2_prefetch!r}")
    if config.matvec in (2, 4) and config.block_b >= 16:
        raise ValueError(f"matvec={config.matvec} needs block_b < 16 (Triton turns larger ones into a TF32 dot)")
    if k > 1 and runtime.INTERPRETED:
        raise ValueError("Triton's interpreter runs programs one at a time: programs_per_tile must be 1")
    if config.matvec in (2, 4):
        if w_hh_t is None:
            w_hh_t = w_hh.view(num_directions, 4, hidden, hidden).transpose(2, 3).contiguous()
        w_hh = w_hh_t
    if k > 1:
        sms = runtime.sm_count(xw.device)
        # Co-residency: every program of a launch may wait for any other of its tile, so
        # a launch holds at most one program per SM; larger batches take several launches.
        max_tiles = sms // (num_directions * k)
        if max_tiles < 1:
            raise ValueError(
                f"the cooperative configuration needs {num_directions * k} programs resident at once, "
                f"but the GPU has {sms} SMs; use fewer programs_per_tile"
            )
        rows_per_launch = max_tiles * config.block_b * config.sub_tiles
        if batch > rows_per_launch:
            for lo in range(0, batch, rows_per_launch):
                hi = min(lo + rows_per_launch, batch)
                h_part = torch.empty_like(h_n[:, lo:hi])
                c_part = torch.empty_like(c_n[:, lo:hi])
                _launch(xw, w_hh, h0[:, lo:hi].contiguous(), c0[:, lo:hi].contiguous(), row_start[lo:hi],
                        lengths[lo:hi], row_step, out, h_part, c_part, config, block_h)
                h_n[:, lo:hi] = h_part
                c_n[:, lo:hi] = c_part
            return
    _launch(xw, w_hh, h0, c0, row_start, lengths, row_step, out, h_n, c_n, config, block_h)


def _launch(xw, w_hh, h0, c0, row_start, lengths, row_step, out, h_n, c_n, config, block_h):
    num_directions, _, hidden = w_hh.shape[0], w_hh.shape[1], h0.shape[2]
    batch = lengths.numel()
    k = config.programs_per_tile
    n_tiles = runtime.cdiv(batch, config.block_b * config.sub_tiles)
    grid = (k, n_tiles, num_directions)
    if config.sync >= 2:
        # slot 0: h0 tagged step 0; slot 1: tagged -1, never a step a reader waits for
        exchange = torch.empty((2, num_directions, batch, hidden), dtype=torch.int64, device=xw.device)
        exchange[0] = h0.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        exchange[1] = -1 << 32
    else:
        exchange = torch.empty((2, num_directions, batch, hidden), dtype=torch.float32, device=xw.device)
        exchange[0] = h0
    l2_ahead = config.l2_prefetch
    if l2_ahead is None:
        # Measured on an H200 (50 MB of L2), pyannote stack: batch 16 (39 MB of projected
        # inputs per layer) 3.80 -> 3.55 ms, batch 32 4.05 -> 3.66, batch 64 5.29 -> 4.77;
        # batch 1 and 8 (inputs left in L2 by the projection) 2% slower, and the 16-row
        # tensor-core programs 1-2% slower: those keep it off.
        big = xw.numel() * xw.element_size() > _l2_bytes(xw.device) // 2
        l2_ahead = 8 if big and config.matvec != 3 else 0
    if runtime.INTERPRETED:
        l2_ahead = 0
    # H200, pyannote stack: batch 1 2.77 -> 2.53 ms, batch 32 3.69 -> 3.49, batch 64
    # 4.77 -> 4.58; the 16-row tensor-core programs at batch 128 11.3 -> 12.1 (kept off)
    fast = config.matvec != 3 if config.fast_math is None else bool(config.fast_math)
    if config.sync == 1:
        counter = torch.zeros((num_directions, n_tiles), dtype=torch.int32, device=xw.device)
    else:
        counter = exchange  # not read: any pointer will do
    _lstm_recurrence_kernel[grid](
        xw, w_hh, out, exchange, h0, c0, h_n, c_n, row_start, lengths, counter,
        batch, hidden, row_step, n_tiles,
        NUM_DIRECTIONS=num_directions, K=k, BLOCK_B=config.block_b, BLOCK_H=block_h,
        UNITS=block_h // k, MATVEC=config.matvec, SYNC=config.sync, PREFETCH=config.prefetch,
        # one vote per register of four entries where every thread holds a multiple of four
        VOTE_PACK=4 if config.block_b * block_h >= 4 * 32 * config.num_warps else 1,
        L2_AHEAD=l2_ahead, FAST=fast and not runtime.INTERPRETED, SUB_TILES=config.sub_tiles,
        num_warps=config.num_warps,
    )
