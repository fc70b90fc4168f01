"""Split a ``[ROWS, COLS]`` register tile into its columns, and join them back.

A kernel that gives each thread whole rows (a token's ``n x n`` matrix, a lane's
consecutive rows) loads the rows as one wide, coalesced tile and then wants each
column as its own ``[ROWS]`` vector, so that the per-row work is plain arithmetic
inside one thread. These helpers do that with a tree of ``tl.split`` /
``tl.join`` on the last axis (``COLS = 2 ** BITS``): values move between
registers, nothing goes through memory once each thread holds whole rows.

Triton loads such a tile with its threads spread along the rows (coalesced), so
giving each thread whole rows costs a trip through shared memory before the split.
:func:`load_lane_rows` skips it on the GPU: every thread reads its own consecutive
elements with 16-byte vector loads straight into its registers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import runtime  # noqa: F401  (decides interpret vs compile before @triton.jit)


@triton.constexpr_function
def bit_reversed(index, bits):
    index, bits = int(index), int(bits)
    return int(format(index, f"0{bits}b")[::-1], 2) if bits else 0


@triton.jit
def split_columns(x, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """``[ROWS, COLS]`` -> tuple of the ``COLS`` columns, ``[ROWS]`` each, in natural order.

    Each level splits off the lowest bit of the column index, so the leaves come out
    in bit-reversed order and are put back in order at the end.
    """
    parts = (x,)
    for level in tl.static_range(BITS):
        new = ()
        for p in tl.static_range(1 << level):
            a, b = tl.split(tl.reshape(parts[p], (ROWS, COLS >> (level + 1), 2)))
            new = new + (a, b)
        parts = new
    columns = ()
    for c in tl.static_range(COLS):
        columns = columns + (tl.reshape(parts[bit_reversed(c, BITS)], (ROWS,)),)
    return columns


@triton.jit
def join_columns(columns, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """Inverse of :func:`split_columns`: tuple of ``COLS`` vectors (natural order) -> ``[ROWS, COLS]``."""
    parts = ()
    for c in tl.static_range(COLS):
        parts = parts + (columns[bit_reversed(c, BITS)],)
    if BITS == 0:
        # (one return statement: the compiler types every return of a function alike)
        joined = tl.reshape(parts[0], (ROWS, 1))
    else:
        for level in tl.static_range(BITS):
            new = ()
            for p in tl.static_range(1 << (BITS - 1 - level)):
                new = new + (tl.reshape(tl.join(parts[2 * p], parts[2 * p + 1]), (ROWS, 2 << level)),)
            parts = new
        joined = parts[0]
    return joined


@triton.jit
def _load_group_of_4(ptr, first, n, other):
    """``ptr[first + k]`` for ``k < 4`` (``other`` from index ``n`` on), as four int32/float32
    vectors: one 16-byte load when all four are in range, else up to four scalar loads."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred full, p0, p1, p2;
        .reg .s32 i;
        mov.b32 $0, $7;
        mov.b32 $1, $7;
        mov.b32 $2, $7;
        mov.b32 $3, $7;
        add.s32 i, $5, 3;
        setp.lt.s32 full, i, $6;
        setp.lt.s32 p0, $5, $6;
        add.s32 i, $5, 1;
        setp.lt.s32 p1, i, $6;
        add.s32 i, $5, 2;
        setp.lt.s32 p2, i, $6;
        and.pred p0, p0, !full;
        and.pred p1, p1, !full;
        and.pred p2, p2, !full;
        @full ld.global.v4.b32 {$0, $1, $2, $3}, [$4];
        @p0 ld.global.b32 $0, [$4];
        @p1 ld.global.b32 $1, [$4 + 4];
        @p2 ld.global.b32 $2, [$4 + 8];
        }""",
        "=r,=r,=r,=r,l,r,r,r",
        [(ptr + first).to(tl.int64), first, n, other],
        dtype=(other.dtype, other.dtype, other.dtype, other.dtype), is_pure=True, pack=1)


@triton.jit
def load_lane_rows(ptr, base, n, other, ROWS: tl.constexpr, LANES: tl.constexpr, BITS: tl.constexpr,
                   VECTOR: tl.constexpr):
    """Tuple of ``ROWS`` vectors of ``LANES``: entry ``r`` holds ``ptr[base[t] + r]`` in lane ``t``,
    ``other`` from index ``n`` on; ``ptr`` points to 32-bit elements.

    ``VECTOR`` (compiled code only; ``ROWS`` a multiple of 4, ``ptr + base`` 16-byte
    aligned, ``base`` a multiple of 4): each lane reads its rows with 16-byte loads, no
    shared memory. Otherwise one ``[LANES, ROWS]`` tile load, split in registers.
    """
    if VECTOR:
        other = tl.zeros((LANES,), dtype=ptr.dtype.element_ty) + other
        rows = ()
        for g in tl.static_range(ROWS // 4):
            a, b, c, d = _load_group_of_4(ptr, base + 4 * g, n, other)
            rows = rows + (a, b, c, d)
        return rows
    else:
        offsets = base[:, None] + tl.arange(0, ROWS)[None, :]
        tile = tl.load(ptr + offsets.to(tl.int64), mask=offsets < n, other=other)
        return split_columns(tile, LANES, ROWS, BITS)
