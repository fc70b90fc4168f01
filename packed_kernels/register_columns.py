"""Split a ``[ROWS, COLS]`` register tile into its columns, and join them back.

A kernel that gives each thread whole rows (a token's ``n x n`` matrix, a lane's
consecutive rows) loads the rows as one wide, coalesced tile and then wants each
column as its own ``[ROWS]`` vector, so that the per-row work is plain arithmetic
inside one thread. These helpers do that with a tree of ``tl.split`` /
``tl.join`` on the last axis (``COLS = 2 ** BITS``): values move between
registers, nothing goes through memory once each thread holds whole rows.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import runtime  # noqa: F401  (decides interpret vs compile before @triton.jit)


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
        return tl.reshape(parts[0], (ROWS, 1))
    for level in tl.static_range(BITS):
        new = ()
        for p in tl.static_range(1 << (BITS - 1 - level)):
            new = new + (tl.reshape(tl.join(parts[2 * p], parts[2 * p + 1]), (ROWS, 2 << level)),)
        parts = new
    return parts[0]
