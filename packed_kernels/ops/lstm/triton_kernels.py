"""The Triton stage: one persistent launch runs a layer's whole recurrence.

For one layer, both directions, the work splits in two:

1. The input projection of every frame, ``xw = X W_ih^T + b_ih + b_hh``, has no
   dependency between frames: one matrix product for the whole layer (both directions
   side by side in its columns), by cuBLAS through ``torch`` or, for wide inputs, by
   :func:`input_projection_triton` on tensor cores.
2. The recurrence ``z_t = xw_t + W_hh h_{t-1}`` is sequential, and a launch per step
   costs more than the step's ``(B, H) x (H, 4H)`` product, so
   :func:`_lstm_recurrence_kernel` is launched once and loops over time itself.

The grid is ``(K, batch tiles, directions)``. The ``K`` programs of one (direction,
batch tile) cooperate on one recurrence: program ``k`` owns hidden units ``[k U, (k + 1)
U)``, ``U = BLOCK_H / K``, and loads the matching ``4U x H`` rows of ``W_hh`` on chip
once. Each step it reads the whole ``h_{t-1}`` of its tile from an exchange buffer in
global memory (it stays in L2), computes its units of ``h_t`` and ``c_t`` (``c`` never
leaves the program), writes its slice of ``h_t`` back and waits for the other ``K - 1``
programs (:class:`StepWait`).

Such a wait needs every program of a launch resident at once (a program waiting for
one that never gets an SM waits forever): a launch holds at most one program per SM,
and a larger batch runs as several launches. Two cooperative launches on different
streams could each hold SMs the other needs, so run recurrences from one stream.
Triton's interpreter runs the programs of a grid one after another, so there ``K = 1``:
no cross-program wait.

Float16 and bfloat16 layers run the same kernels with ``W_hh`` held on chip and ``h``
exchanged in that dtype, the gates accumulated and ``c`` kept in float32.

There is no backward kernel: this is an inference path.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import runtime, validation
from ...device_functions.fast_math import exp as _exp
from ...device_functions.fast_math import reciprocal as _reciprocal

__all__ = [
    "MAX_HIDDEN", "RecurrenceConfig", "RecurrentProduct", "StepWait", "choose_config", "input_projection_triton",
    "lstm_recurrence_triton",
]

#: The largest hidden size whose recurrent weights the kernels keep on chip.
MAX_HIDDEN = 512


class RecurrentProduct(enum.IntEnum):
    """How a program computes ``W_hh h`` for its units each step (:func:`_products`)."""

    #: Per gate, ``w`` ``(U, BLOCK_H)``: a broadcast multiply summed along each weight row.
    ROW_SUMS = 0
    #: Per gate, ``tl.dot`` on tensor cores with three TF32 products per product
    #: (``tf32x3``: the high and low parts of both factors), float32 accuracy.
    TENSOR_CORES = 1
    #: The four gates as one ``(BLOCK_H, U, 4)`` slice of the transposed weights: one
    #: broadcast multiply summed over the columns, mostly inside each thread, and one
    #: reduction instead of four. Only for ``rows_per_tile < 16``: from 16 rows on,
    #: Triton rewrites this pattern into a dot with TF32 inputs.
    FOUR_GATES = 2


class StepWait(enum.IntEnum):
    """How the ``K`` programs of a tile wait, each step, for the ``h`` the others wrote.

    The exchange buffer has two slots, used by step parity: a program writes step
    ``s + 2`` into a slot only after reading every program's step ``s + 1``, which each
    wrote after reading step ``s``, so no value is overwritten while still being read.
    """

    #: ``K = 1``: one program per tile, a CTA barrier between steps and nothing to wait for.
    CTA_BARRIER = 0
    #: After a CTA barrier, one release ``atomic_add`` per program on its tile's counter,
    #: acquire loads until it reaches ``K (s + 1)``, then a ``.cg`` load of ``h`` (from L2).
    STEP_COUNTER = 1
    #: Each exchange entry is one 64-bit word, the step in its high half and the float32
    #: bits of ``h`` in its low half, written by one store: a program polls its tiles'
    #: words until all carry the step it waits for, and then holds the values too (one
    #: trip through L2, where a counter needs the writer's fence and update and the
    #: reader's counter loads first). Triton may give several threads copies of one word,
    #: which a ``tl.sum`` over the tile counts once, so every thread votes on what it
    #: loaded itself (:func:`_any_stale`).
    TAGGED_WORDS = 2
    #: The same with the poll loop in inline PTX (:func:`_wait_tiles_words`), which
    #: branches on the ``bar.red.or`` vote directly, where a Triton ``while`` first needs
    #: it reduced to a scalar (more CTA barriers per poll). At most
    #: :data:`MAX_WAIT_TILES` tiles per program.
    TAGGED_WORDS_PTX = 3


# The modes as the kernels compare them (a jit function reads only constexpr globals).
ROW_SUMS = tl.constexpr(RecurrentProduct.ROW_SUMS.value)
TENSOR_CORES = tl.constexpr(RecurrentProduct.TENSOR_CORES.value)
FOUR_GATES = tl.constexpr(RecurrentProduct.FOUR_GATES.value)
CTA_BARRIER = tl.constexpr(StepWait.CTA_BARRIER.value)
STEP_COUNTER = tl.constexpr(StepWait.STEP_COUNTER.value)
TAGGED_WORDS = tl.constexpr(StepWait.TAGGED_WORDS.value)
TAGGED_WORDS_PTX = tl.constexpr(StepWait.TAGGED_WORDS_PTX.value)

#: The most tiles per program the PTX poll loop (:data:`StepWait.TAGGED_WORDS_PTX`) is tested with.
MAX_WAIT_TILES = 3


@triton.jit
def _sigmoid(z, FAST: tl.constexpr):
    # 1 / (1 + e^{-z}): exact limits 0 and 1 when e^{-z} overflows or underflows.
    return _reciprocal(1.0 + _exp(-z, FAST), FAST)


@triton.jit
def _tanh(z, FAST: tl.constexpr):
    # 1 - 2 / (e^{2z} + 1): exact limits +-1 when e^{2z} overflows or underflows.
    return 1.0 - 2.0 * _reciprocal(_exp(2.0 * z, FAST) + 1.0, FAST)


@triton.jit
def _widen(w, PTX: tl.constexpr):
    """``w`` (float32, float16 or bfloat16) as float32, for a product accumulated in float32.

    Weights held across steps in float16 or bfloat16 stay in their dtype, two to a
    32-bit register, and are widened at each use inside the loop. A plain conversion
    of a value that does not change in the loop would be moved out of it, leaving
    float32 copies in registers (what the narrow dtype is meant to save), so on the GPU
    (``PTX``) it is an inline-PTX block that the compilers keep where it is: per
    register, two ``cvt.f32.f16``, or for bfloat16 (the high half of a float32) a shift
    and a mask. Called on the operand of the product as broadcast (``w[None]``), so that
    any change of layout is made once, on the held weights, before the loop.
    """
    if w.dtype == tl.float32:
        return w
    elif PTX:
        if w.dtype == tl.float16:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                "=r,=r,r", [w], dtype=tl.float32, is_pure=False, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }",
                "=r,=r,r", [w], dtype=tl.float32, is_pure=False, pack=2)
    else:
        return w.to(tl.float32)


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
def _gate_product(h, w, PRODUCT: tl.constexpr, PTX: tl.constexpr):
    """``h W^T`` for one gate: ``h`` is ``(BLOCK_B, BLOCK_H)``; the result ``(BLOCK_B, U)``,
    float32.

    With ``ROW_SUMS`` ``w`` is ``(U, BLOCK_H)``, summed over its contiguous last axis;
    with ``TENSOR_CORES`` it is ``(BLOCK_H, U)``, a ``tf32x3`` dot for float32 (see
    :class:`RecurrentProduct`; ``FOUR_GATES`` is written out in :func:`_products`), one
    float16 or bfloat16 product with a float32 accumulator for ``h`` and ``w`` in those.
    """
    if PRODUCT == TENSOR_CORES:
        if w.dtype == tl.float32:
            return tl.dot(h, w, input_precision="tf32x3")
        else:
            return tl.dot(h, w, out_dtype=tl.float32)
    else:
        return tl.sum(h.to(tl.float32)[:, None, :] * _widen(w[None, :, :], PTX), axis=2)


@triton.jit
def _load_gate_weight(w_hh_ptr, d, gate, H, units, cols, mask_units, mask_cols, PRODUCT: tl.constexpr):
    rows = (d * 4 + gate) * H + units  # rows of W_hh for direction d, this gate, these units
    if PRODUCT == ROW_SUMS:
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
def _load_gate_weights(w_hh_ptr, d, H, units, cols, mask_units, mask_cols, PRODUCT: tl.constexpr):
    """This program's ``4 x UNITS`` rows of ``W_hh``, one tensor per gate (``i, f, g, o``)."""
    return (_load_gate_weight(w_hh_ptr, d, 0, H, units, cols, mask_units, mask_cols, PRODUCT),
            _load_gate_weight(w_hh_ptr, d, 1, H, units, cols, mask_units, mask_cols, PRODUCT),
            _load_gate_weight(w_hh_ptr, d, 2, H, units, cols, mask_units, mask_cols, PRODUCT),
            _load_gate_weight(w_hh_ptr, d, 3, H, units, cols, mask_units, mask_cols, PRODUCT))


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
    x_i = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x_f = tl.load(base + H, mask=mask, other=0.0).to(tl.float32)
    x_g = tl.load(base + 2 * H, mask=mask, other=0.0).to(tl.float32)
    x_o = tl.load(base + 3 * H, mask=mask, other=0.0).to(tl.float32)
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
    """The tiles' words once every one carries step ``s``, the poll loop in PTX (``TAGGED_WORDS_PTX``).

    A first load of the words in Triton, then one inline-PTX loop over all tiles
    (:func:`_wait_asm`). GPU only.
    """
    words_t = _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES)
    step = mask_full_t[0].to(tl.int32) * 0 + s  # s in the words' layout
    # Inside a loop that runs once: Triton does not recompute a loop's results, where it
    # would redo the loads and the poll in each consumer's layout (for a one-row tile, once
    # per element of the broadcast h).
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
def _products(h, weights, BLOCK_B: tl.constexpr, UNITS: tl.constexpr, PRODUCT: tl.constexpr,
              PTX: tl.constexpr):
    """``W_hh h`` of a tile's ``(BLOCK_B, UNITS)`` units, one float32 tensor per gate
    (``i, f, g, o``).

    ``weights``: ``(w4,)``, the four gates' ``(BLOCK_H, UNITS, 4)`` slice, with
    ``FOUR_GATES``, else one tensor per gate (float16 or bfloat16 ones: :func:`_widen`).
    """
    if PRODUCT == FOUR_GATES:
        # One product for the four gates; (BLOCK_B, UNITS, 4) -> four (BLOCK_B, UNITS).
        z = tl.sum(h.to(tl.float32)[:, :, None, None] * _widen(weights[0][None, :, :, :], PTX), axis=1)
        z_ig, z_fo = tl.split(tl.reshape(z, (BLOCK_B, UNITS, 2, 2)))  # gate 2a + b at [a, b]
        z_i, z_g = tl.split(z_ig)
        z_f, z_o = tl.split(z_fo)
        return z_i, z_f, z_g, z_o
    else:
        w_i, w_f, w_g, w_o = weights
        return (_gate_product(h, w_i, PRODUCT, PTX), _gate_product(h, w_f, PRODUCT, PTX),
                _gate_product(h, w_g, PRODUCT, PTX), _gate_product(h, w_o, PRODUCT, PTX))


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
    BLOCK_H: tl.constexpr, UNITS: tl.constexpr, PRODUCT: tl.constexpr, WAIT: tl.constexpr,
    PREFETCH: tl.constexpr, VOTE_PACK: tl.constexpr, L2_AHEAD: tl.constexpr, FAST: tl.constexpr,
    SUB_TILES: tl.constexpr, PTX: tl.constexpr,
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

    Float16 and bfloat16 (``xw``, ``W_hh``, the states and ``out`` all in one of them):
    ``W_hh`` is held in that dtype and ``h`` exchanged and stored in it; the products
    accumulate in float32 (:func:`_widen`, or a tensor-core product with a float32
    accumulator), and ``c`` stays float32 until it is stored in ``cn``.

    Layouts (contiguous): ``xw`` ``(N, D * 4H)``, ``W_hh`` ``(D, 4H, H)``,
    ``out`` ``(N, D * H)``, ``h0``/``c0``/``hn``/``cn`` ``(D, B, H)``; frame ``t`` of
    sequence ``b`` is row ``row_start[b] + t * row_step``. ``exchange`` is ``(2, D, B,
    H)``, slot 0 holding ``h0``: in the dtype of ``h``, or with the ``TAGGED_WORDS`` waits
    int64 words tagged with their step in the high half, the bits of ``h`` in the low 32
    (float32) or 16 (float16, bfloat16) bits (``h0`` step 0, slot 1 step -1); ``counter``, read with
    ``STEP_COUNTER`` only, ``(D, n_tiles)`` int32 zeros: the step counter of each
    direction and tile. Program
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
    if PRODUCT == FOUR_GATES:
        # All four gates in one (BLOCK_H, UNITS, 4) tensor, from the transposed copy:
        # w4[col, u, gate] = W_hh[d, gate H + units[u], col]. Held for every step.
        gates = tl.arange(0, 4)
        w4 = tl.load(w_hh_ptr + ((d * 4 + gates[None, None, :]) * H + cols[:, None, None]).to(tl.int64) * H
                     + units[None, :, None], mask=mask_cols[:, None, None] & mask_units[None, :, None], other=0.0)
        weights = (w4,)
    elif K > 1:
        # Held in registers for every step: this program's 4 x UNITS rows of W_hh.
        weights = _load_gate_weights(w_hh_ptr, d, H, units, cols, mask_units, mask_cols, PRODUCT)

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
        h_own_t = h_own_t + (tl.load(h0_ptr + own, mask=mask_own, other=0.0).to(tl.float32),)
        c_t = c_t + (tl.load(c0_ptr + own, mask=mask_own, other=0.0).to(tl.float32),)
    slot_size = NUM_DIRECTIONS * B * H
    counter = counter_ptr + d * n_tiles + tile
    STATE = hn_ptr.dtype.element_ty  # the dtype h is exchanged in: the parameters'

    x_t = _load_tiles_inputs(xw_ptr, starts_t, lengths_t, 0, d, H, units, mask_units, row_step,
                             NUM_DIRECTIONS, SUB_TILES)
    if PREFETCH == 2:
        y_t = _load_tiles_inputs(xw_ptr, starts_t, lengths_t, 1, d, H, units, mask_units, row_step,
                                 NUM_DIRECTIONS, SUB_TILES)
    for s in range(0, n_steps):
        # h_{s-1} of the whole tile, as written by all K programs: slot s % 2.
        read_slot = exchange_ptr + (s % 2) * slot_size
        if WAIT == TAGGED_WORDS:
            # Each entry is (step << 32) | float bits, one 64-bit word: a reader sees the
            # value and its step together. Poll until every entry of the tiles is step s.
            packed_t = _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES)
            while _any_stale(_stale_words(packed_t, mask_full_t, s, SUB_TILES), VOTE_PACK) > 0:
                packed_t = _load_tiles_words(read_slot, full_t, mask_full_t, SUB_TILES)
        elif WAIT == TAGGED_WORDS_PTX:
            packed_t = _wait_tiles_words(read_slot, full_t, mask_full_t, s, SUB_TILES)  # the same, in PTX
        if K == 1 and PRODUCT != FOUR_GATES:
            # Nothing is held across steps: the whole W_hh is re-read (from cache) each step.
            weights = _load_gate_weights(w_hh_ptr, d, H, units, cols, mask_units, mask_cols, PRODUCT)

        # The products of every tile first, then the cells: the gates of one tile and the
        # products of the next are then not separated by the CTA barriers of a product.
        z_t = ()
        for r in tl.static_range(SUB_TILES):
            if WAIT >= TAGGED_WORDS:  # either tagged-word wait
                if STATE == tl.float32:
                    h = packed_t[r].to(tl.int32).to(tl.float32, bitcast=True)  # the low 32 bits
                else:
                    h = packed_t[r].to(tl.int16).to(STATE, bitcast=True)  # the low 16 bits
            else:
                # .cg reads L2, never a stale L1 line from an earlier step.
                h = tl.load(read_slot + full_t[r], mask=mask_full_t[r], other=0.0, cache_modifier=".cg")
            z_t = z_t + (_products(h, weights, BLOCK_B, UNITS, PRODUCT, PTX),)
        new_h_t = ()
        new_c_t = ()
        for r in tl.static_range(SUB_TILES):
            c_new, h_new = _cell(z_t[r], x_t[r], c_t[r], FAST)
            active = s < lengths_t[r]
            h_own = tl.where(active[:, None], h_new, h_own_t[r])
            new_c_t = new_c_t + (tl.where(active[:, None], c_new, c_t[r]),)
            new_h_t = new_h_t + (h_own,)
            # The exchange first: the other programs wait for it, nothing waits for the output.
            if WAIT >= TAGGED_WORDS:
                if STATE == tl.float32:
                    bits = h_own.to(tl.uint32, bitcast=True).to(tl.int64)
                else:
                    bits = h_own.to(STATE).to(tl.uint16, bitcast=True).to(tl.int64)
                shared = bits | ((tl.zeros((), tl.int64) + s + 1) << 32)
            else:
                shared = h_own.to(STATE)
            tl.store(exchange_ptr + ((s + 1) % 2) * slot_size + own_t[r], shared, mask=mask_own_t[r])
            out_row = _frame_row(starts_t[r], lengths_t[r], s, d, row_step)
            tl.store(out_ptr + out_row[:, None] * (NUM_DIRECTIONS * H) + d * H + units[None, :], h_new.to(STATE),
                     mask=active[:, None] & mask_units[None, :])
        h_own_t = new_h_t
        c_t = new_c_t
        # Later steps' inputs do not depend on h: their loads overlap the wait for the other
        # programs' h (below, or at the top of the next step with tagged words). Loads that miss
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
        if WAIT == STEP_COUNTER:
            # Every thread's store must be done before this program signals (CTA barrier),
            # and the release makes them visible to the programs that acquire the count.
            tl.debug_barrier()
            tl.atomic_add(counter, 1, sem="release", scope="gpu")
            arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            while arrived < K * (s + 1):
                arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        elif WAIT == CTA_BARRIER:
            tl.debug_barrier()  # the next step reads values other threads of this program wrote

    for r in tl.static_range(SUB_TILES):
        tl.store(hn_ptr + own_t[r], h_own_t[r].to(STATE), mask=mask_own_t[r])
        tl.store(cn_ptr + own_t[r], c_t[r].to(STATE), mask=mask_own_t[r])


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
def input_projection_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W^T + bias`` in float32 accuracy on tensor cores: ``x`` ``(M, K)`` with unit
    column stride, ``w`` ``(N, K)`` and ``bias`` ``(N,)`` (or ``None``) contiguous.

    The input projection of every frame of a layer: cuBLAS's float32 product (TF32 off)
    runs on CUDA cores, three TF32 products on tensor cores are as accurate.
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


def _power_of_two(name: str, value) -> int:
    value = validation.integer_argument(name, value)
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two; got {value}")
    return value


def _at_least(name: str, value, low: int) -> int:
    value = validation.integer_argument(name, value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class RecurrenceConfig:
    """How :func:`lstm_recurrence_triton` runs a layer's recurrence (:func:`choose_config`
    picks it for a shape and device).

    Attributes:
        programs_per_tile: ``K``, the programs that cooperate on one (direction, batch
            tile); each holds ``4 H / K`` rows of ``W_hh``. ``1``: no cross-program wait
            (the interpreter's configuration).
        rows_per_tile: batch rows per tile (a power of two).
        product: how the recurrent product is computed (:class:`RecurrentProduct`).
        wait: how the programs of a tile wait for each other's ``h`` (:class:`StepWait`):
            ``CTA_BARRIER`` exactly when ``programs_per_tile`` is 1.
        num_warps: warps per program.
        prefetch_steps: how many steps ahead the projected inputs are loaded (1 or 2).
        l2_prefetch_steps: how many steps ahead the projected inputs are first brought
            from DRAM into L2 (0: not at all; GPU only).
        fast_math: the gates' exponentials and reciprocals as single approximate
            instructions (``ex2.approx.ftz``, ``rcp.approx.ftz``, about 1 ulp; GPU only),
            where ``tl.exp`` and ``/`` add range tests around the same instructions.
        tiles_per_program: how many tiles of ``rows_per_tile`` rows one program runs in
            each step (the products of all of them, then their cells): more rows per
            program for the registers of one tile.
    """

    programs_per_tile: int
    rows_per_tile: int
    product: RecurrentProduct
    wait: StepWait
    num_warps: int = 4
    prefetch_steps: int = 1
    l2_prefetch_steps: int = 0
    fast_math: bool = False
    tiles_per_program: int = 1

    def __post_init__(self):
        programs = _at_least("programs_per_tile", self.programs_per_tile, 1)
        rows = _power_of_two("rows_per_tile", self.rows_per_tile)
        _power_of_two("num_warps", self.num_warps)
        for name, kind in (("product", RecurrentProduct), ("wait", StepWait)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}; got {getattr(self, name)!r}")
        validation.check_choice("prefetch_steps", validation.integer_argument("prefetch_steps", self.prefetch_steps),
                                (1, 2))
        _at_least("l2_prefetch_steps", self.l2_prefetch_steps, 0)
        validation.check_bool("fast_math", self.fast_math)
        tiles = _at_least("tiles_per_program", self.tiles_per_program, 1)
        if (programs == 1) != (self.wait == StepWait.CTA_BARRIER):
            needed = "CTA_BARRIER" if programs == 1 else "STEP_COUNTER, TAGGED_WORDS or TAGGED_WORDS_PTX"
            raise ValueError(f"programs_per_tile={programs} needs wait {needed}; got {self.wait.name}")
        if self.wait == StepWait.TAGGED_WORDS_PTX and tiles > MAX_WAIT_TILES:
            raise ValueError(f"wait TAGGED_WORDS_PTX takes at most {MAX_WAIT_TILES} tiles_per_program; got {tiles}")
        if self.product == RecurrentProduct.FOUR_GATES and rows >= 16:
            raise ValueError(f"product FOUR_GATES needs rows_per_tile < 16 (Triton turns larger ones into a TF32 "
                             f"dot); got {rows}")


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).L2_cache_size


def choose_config(batch: int, hidden: int, num_directions: int, device: torch.device, *,
                  frames: int, dtype: torch.dtype = torch.float32) -> RecurrenceConfig:
    """The configuration of a layer of this shape on ``device``; ``frames`` is the number
    of rows of its projected inputs (every frame of every sequence), ``dtype`` theirs and
    the parameters' (float32, float16 or bfloat16).

    On the GPU each launch is filled up to the SM count: ``K`` programs per (direction,
    batch tile), as many tiles as fit, over slices of 16, 32 or 64 units. Per-program
    work is ``rows x units x H`` multiply-adds per gate and step; beyond 64 per thread
    (cooperating programs, hidden sizes up to 128) or 128 the sums no longer stay in
    registers, so a batch that needs more rows per program runs as several launches.
    Among the splits: the fewest launches, then the least work per thread, then fewer
    programs per exchange for H <= 128 and the smaller weight slice for larger H. The
    CUDA-core splits compute the four gates as one product and wait on tagged words.
    At hidden sizes up to 128, a batch that needs two or three launches of them runs as
    one launch of programs with that many tiles each, and one that needs more (or the
    full 128 multiply-adds a thread) as one launch of 16-row tensor-core programs, which
    wait on the step counter (a thread holds 16 words of ``h``: too many to vote on).
    """
    batch = max(batch, 1)  # an empty batch launches nothing: the configuration of one row will do
    if runtime.INTERPRETED or device.type != "cuda":
        # The interpreter runs programs one after another: no cross-program waits.
        return RecurrenceConfig(programs_per_tile=1, rows_per_tile=min(runtime.next_power_of_2(batch), 16),
                                product=RecurrentProduct.ROW_SUMS, wait=StepWait.CTA_BARRIER, num_warps=4)
    # The L2 prefetch pays off when most projected inputs would come from DRAM (they
    # fill more than half of L2).
    element_size = torch.empty((), dtype=dtype).element_size()
    inputs_spill_l2 = frames * num_directions * 4 * hidden * element_size > _l2_bytes(device) // 2
    # Dynamo traces the function itself (and warns when it meets a cached one).
    choose = _gpu_config.__wrapped__ if torch.compiler.is_compiling() else _gpu_config
    return choose(batch, hidden, num_directions, runtime.sm_count(device), inputs_spill_l2, dtype != torch.float32)


@functools.lru_cache(maxsize=1024)
def _gpu_config(batch: int, hidden: int, num_directions: int, sms: int, inputs_spill_l2: bool,
                narrow: bool = False) -> RecurrenceConfig:
    """:func:`choose_config` on a GPU of ``sms`` SMs; ``narrow``: float16 or bfloat16."""
    block_h = max(runtime.next_power_of_2(hidden), 16)
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
        # rows per program: the most that keeps the work per thread within the limit. Weights
        # held in float16 or bfloat16 are widened each step next to the packed ones they
        # come from: at 128 weights a thread that leaves registers for half the work.
        weights_per_thread = 4 * units * block_h // threads
        limit = 64 if (block_h <= 128 and k > 1) or (narrow and weights_per_thread >= 128) else 128
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
            best = (key, RecurrenceConfig(
                programs_per_tile=k, rows_per_tile=block_b, product=RecurrentProduct.FOUR_GATES,
                wait=StepWait.TAGGED_WORDS if k > 1 else StepWait.CTA_BARRIER, num_warps=num_warps,
                prefetch_steps=2 if block_b == 1 else 1))  # two steps ahead for one-row tiles
    if best is None:
        if hidden > MAX_HIDDEN:
            raise ValueError(f"hidden_size={hidden} is too large for the persistent kernels (at most {MAX_HIDDEN})")
        raise ValueError(f"hidden_size={hidden} with {num_directions} direction(s) needs more SMs than the GPU's "
                         f"{sms}: the persistent kernels split W_hh over programs resident at once")
    launches, work = best[0][:2]
    config = _ptx_poll(best[1], block_h)
    if block_h <= 128 and best[1].programs_per_tile > 1 and 1 < launches <= 3 and not narrow:
        # Two or three launches' worth of rows: one launch whose programs each run that
        # many tiles one after another.
        config = _ptx_poll(replace(best[1], tiles_per_program=launches), block_h)
    elif block_h <= 128 and (launches > 3 or work >= 128 or (narrow and launches > 1)):
        # Many rows (for float16 and bfloat16: more than one launch of them): 16 rows per
        # program on the tensor cores (tf32x3 for float32), in one launch,
        # instead of four or more tiles per program of the CUDA-core sums, or of
        # programs that each run a whole recurrence alone with 128 multiply-adds a
        # thread; at hidden 256 the weight slice outgrows shared memory.
        k = max(block_h // 32, 1)
        tiles = sms // (num_directions * k)
        if tiles >= 1 and runtime.cdiv(batch, tiles * 16) <= launches:
            config = RecurrenceConfig(programs_per_tile=k, rows_per_tile=16, product=RecurrentProduct.TENSOR_CORES,
                                      wait=StepWait.STEP_COUNTER if k > 1 else StepWait.CTA_BARRIER, num_warps=4)
    # The tensor-core programs gain neither from the L2 prefetch nor from the
    # approximate gate arithmetic.
    cuda_cores = config.product != RecurrentProduct.TENSOR_CORES
    return replace(config, l2_prefetch_steps=8 if inputs_spill_l2 and cuda_cores else 0, fast_math=cuda_cores)


def _ptx_poll(config: RecurrenceConfig, block_h: int) -> RecurrenceConfig:
    """``config`` with the poll loop in PTX where each thread holds at most one word of a
    tile (it runs once per word a thread holds; at hidden sizes above 128 the Triton loop
    stays)."""
    one_word = config.rows_per_tile * block_h <= 32 * config.num_warps
    if config.wait == StepWait.TAGGED_WORDS and block_h <= 128 and one_word \
            and config.tiles_per_program <= MAX_WAIT_TILES:
        return replace(config, wait=StepWait.TAGGED_WORDS_PTX)
    return config


@runtime.on_inputs_device
def lstm_recurrence_triton(
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
    config: RecurrenceConfig,
    w_hh_t: Optional[torch.Tensor] = None,
) -> None:
    """Run one layer's recurrence, every direction, in one launch (writes ``out``, ``h_n``, ``c_n``).

    A batch larger than one launch can keep resident (``SMs / (D K)`` tiles) runs as
    several launches of consecutive rows.

    Args (contiguous, on the kernel device; the floating ones all float32, all float16 or
    all bfloat16, the dtype the kernel holds ``W_hh`` and exchanges ``h`` in; it keeps
    ``c`` and accumulates the gates in float32 whatever the dtype):
        xw: ``(N, D * 4H)`` projected inputs, ``x W_ih^T + b_ih + b_hh`` per direction.
        w_hh: ``(D, 4H, H)`` recurrent weights.
        h0, c0: ``(D, B, H)`` initial states.
        row_start: int64 ``(B,)``, the row of frame 0 of each sequence in ``xw``/``out``.
        lengths: int32 ``(B,)``, frames per sequence (frame ``t`` is row
            ``row_start[b] + t * row_step``).
        out: ``(N, D * H)``; only the rows of frames ``t < lengths[b]`` are written.
        h_n, c_n: ``(D, B, H)`` final states.
        config: see :class:`RecurrenceConfig` (:func:`choose_config`).
        w_hh_t: ``(D, 4, H, H)``, each gate's ``W_hh`` block transposed; only read with
            ``FOUR_GATES`` (made here when not given).

    The caller guarantees the shapes and that every row index is in range.
    """
    num_directions, _, hidden = w_hh.shape
    batch = lengths.numel()
    if batch == 0:
        return
    block_h = max(runtime.next_power_of_2(hidden), 16)
    k = config.programs_per_tile
    if block_h % k:
        raise ValueError(f"programs_per_tile={k} must divide the padded hidden size {block_h}")
    if k > 1 and runtime.INTERPRETED:
        raise ValueError("Triton's interpreter runs programs one at a time: programs_per_tile must be 1")
    if config.product == RecurrentProduct.FOUR_GATES:
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
        rows_per_launch = max_tiles * config.rows_per_tile * config.tiles_per_program
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
    n_tiles = runtime.cdiv(batch, config.rows_per_tile * config.tiles_per_program)
    grid = (k, n_tiles, num_directions)
    tagged = config.wait >= StepWait.TAGGED_WORDS  # either tagged-word wait
    if tagged:
        # slot 0: h0 tagged step 0 (its bits in the low half); slot 1: tagged -1, never a
        # step a reader waits for
        exchange = torch.empty((2, num_directions, batch, hidden), dtype=torch.int64, device=xw.device)
        if h0.dtype == torch.float32:
            exchange[0] = h0.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        else:
            exchange[0] = h0.view(torch.int16).to(torch.int64) & 0xFFFF
        exchange[1] = -1 << 32
    else:
        exchange = torch.empty((2, num_directions, batch, hidden), dtype=h0.dtype, device=xw.device)
        exchange[0] = h0
    if config.wait == StepWait.STEP_COUNTER:
        counter = torch.zeros((num_directions, n_tiles), dtype=torch.int32, device=xw.device)
    else:
        counter = exchange  # not read: any pointer will do
    gpu = not runtime.INTERPRETED  # the interpreter runs no inline PTX
    _lstm_recurrence_kernel[grid](
        xw, w_hh, out, exchange, h0, c0, h_n, c_n, row_start, lengths, counter,
        batch, hidden, row_step, n_tiles,
        NUM_DIRECTIONS=num_directions, K=k, BLOCK_B=config.rows_per_tile, BLOCK_H=block_h,
        UNITS=block_h // k, PRODUCT=int(config.product), WAIT=int(config.wait), PREFETCH=config.prefetch_steps,
        # one vote per register of four entries where every thread holds a multiple of four
        VOTE_PACK=4 if config.rows_per_tile * block_h >= 4 * 32 * config.num_warps else 1,
        L2_AHEAD=config.l2_prefetch_steps if gpu else 0, FAST=config.fast_math and gpu,
        SUB_TILES=config.tiles_per_program, PTX=gpu, num_warps=config.num_warps,
    )
