"""Stage 3: Triton kernels for Sinkhorn normalisation over ``(T, n, n)`` contiguous tokens.

Every token's matrix is independent, so a program takes a tile of ``BLOCK`` tokens
(``BLOCK * n * n`` contiguous elements: one wide, coalesced load) and keeps the whole
tile in registers. Each kernel reads its inputs once and writes its output once: all
iterations happen on chip. Three layouts (:class:`Layout`):

* tile kernels (any ``n`` up to :data:`MAX_KERNEL_N`): the tile as ``[BLOCK, N, N]``,
  padded to ``N`` the next power of two of ``n``; padded rows and columns hold exact
  zeros and never enter a sum;
* one-token-per-thread kernels (``n`` in 2, 4, 8): the tile split in registers into
  ``n * n`` vectors of ``BLOCK`` tokens, so that a thread owns whole matrices (see the
  section below);
* column groups (the forward for ``n`` from 9 to 32, the direct implicit backward
  from 9 to 16): each matrix across ``N / 4`` lanes of one warp, four whole columns a
  lane (see their section).

Range. Every kernel starts from the balanced matrix of :func:`_balanced_exp`,
``K = exp(X - c_j - rho_i)`` (``c_j`` the column maxima, ``rho_i`` the row maxima of
``X - c``), and the scaling vector ``u0 = exp(rho)``: ``diag(u0) K = exp(X - colmax X)``,
so the iterates are exactly those of the plain matrix, but every row and every column
of ``K`` holds an exact 1, and no sum the kernels take falls below the normal range.
(A row far below its column maxima would otherwise have a row sum below ``2^-126``,
whose reciprocal overflows.) The tile unrolled backward iterates on the matrix, whose
sums then stay in ``[1/n, n]``, and carries its gradient in logarithmic form; the
kernels on the scaling vectors absorb them into the matrix every
:func:`absorb_period` iterations, which bounds them for any logits and any number of
iterations.

Launchers (``*_triton``) take contiguous ``(T, n, n)`` tensors of float32, bfloat16,
float16 (computed in float32) or float64 (computed in float64) and a configuration
(:func:`forward_config`, :func:`implicit_backward_config`,
:func:`unrolled_backward_config`), and return a new tensor of the input's dtype.
Validation happens in :mod:`.api`.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import runtime  # (imported first: decides interpret vs compile before @triton.jit)
from ...device_functions.fast_math import reciprocal as _reciprocal
from ...device_functions.register_columns import join_columns, split_columns

#: Largest n the kernels take; :mod:`.api` uses the padded PyTorch stage beyond it.
MAX_KERNEL_N = 32
#: Most iterations the unrolled-backward kernels recompute on chip (their checkpoints
#: live in registers); :mod:`.api` uses the padded PyTorch stage beyond it.
MAX_UNROLLED_ITERS = 128
#: Most iterations :func:`~.api.sinkhorn` takes (it refuses more): a guard against
#: runaway calls. No bound of the kernels depends on it (:func:`absorb_period`).
MAX_ITERS = 1 << 20
#: ``n^t`` at most this, for ``t`` iterations between absorptions (:func:`absorb_period`)
_SCALING_RANGE = 2.0 ** 40


def absorb_period(n: int) -> int:
    """Iterations between absorptions of the scaling vectors into the matrix, for ``n x n``.

    The kernels on the scaling vectors hold each iterate as ``E = diag(u) K diag(v)``
    and every so many iterations absorb the vectors: ``K = E``, ``u = 1``. A block of
    iterations starts from the balanced matrix of :func:`_balanced_exp` with ``u = u0``
    or from an absorbed iterate with ``u = 1``; either way every column and row sum of
    the block's iterates lies in ``[1/n, n]``. (Entries are at most 1; the first column
    sums are those of ``exp(X - colmax X)``, with a 1 in every column; the balanced
    matrix has a 1 in every row; and a matrix whose rows, or columns, sum to 1 keeps
    sums of at least ``1/n`` once divided by sums of at most ``n`` along the other
    axis.) Each step divides ``v`` by the column sums and ``u`` by the row sums of
    iterates, so after ``t`` iterations of a block ``u``, ``v`` and the sums
    ``K^T u``, ``K v`` whose reciprocals the kernels take lie in ``[n^-t, n^t]``. With
    ``n^t <= 2^40`` a product of two of them (two sums sharing one reciprocal, a
    ``u_i v_j`` of the unrolled backward) lies within ``2^+-80``: inside float32's
    normal range, with room for the gradient's own scale, for any logits and any
    number of iterations. (``u0`` itself may underflow: it only weights the first
    column sums.) Without absorptions ``u`` and ``v`` keep spreading towards the
    scaling of the limit, which can need ratios up to that of the largest to the
    smallest entry: past ``2^64`` within a few dozen iterations on some logits spread
    over ``+-100``. Returns the largest such ``t`` (64 at most; at ``n = 1`` nothing
    moves).
    """
    t = 0
    while t < 64 and float(n) ** (t + 1) <= _SCALING_RANGE:
        t += 1
    return t


@triton.jit
def _tile(tile_start, num_tokens, n: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets ``[BLOCK, N, N]`` of a tile of tokens and the mask of real entries."""
    tok = tile_start + tl.arange(0, BLOCK)
    rows = tl.arange(0, N)
    cols = tl.arange(0, N)
    offsets = tok[:, None, None] * (n * n) + rows[None, :, None] * n + cols[None, None, :]
    mask = (tok[:, None, None] < num_tokens) & (rows[None, :, None] < n) & (cols[None, None, :] < n)
    return offsets, mask


@triton.jit
def _load_tile(ptr, offsets, mask, tile_start, num_tokens, n: tl.constexpr, N: tl.constexpr,
               BLOCK: tl.constexpr, FLAT: tl.constexpr, COMPUTE: tl.constexpr):
    """The ``[BLOCK, N, N]`` tile, 0 outside ``mask``, converted to ``COMPUTE``.

    ``FLAT`` (``n == N``, a power of two): load the tile as one ``[BLOCK, n*n]``
    contiguous block and reshape it in registers, instead of three-dimensional offsets.
    """
    if FLAT:
        flat = (tile_start + tl.arange(0, BLOCK))[:, None] * (n * n) + tl.arange(0, N * N)[None, :]
        x = tl.load(ptr + flat, mask=flat < num_tokens * (n * n), other=0.0)
        return tl.reshape(x, (BLOCK, N, N)).to(COMPUTE)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(COMPUTE)


@triton.jit
def _store_tile(ptr, value, offsets, mask, tile_start, num_tokens, n: tl.constexpr, N: tl.constexpr,
                BLOCK: tl.constexpr, FLAT: tl.constexpr):
    value = value.to(ptr.dtype.element_ty)
    if FLAT:
        flat = (tile_start + tl.arange(0, BLOCK))[:, None] * (n * n) + tl.arange(0, N * N)[None, :]
        tl.store(ptr + flat, tl.reshape(value, (BLOCK, N * N)), mask=flat < num_tokens * (n * n))
    else:
        tl.store(ptr + offsets, value, mask=mask)


@triton.jit
def _balanced_exp(x, mask):
    """``(K, u0)``: ``K = exp(X - c_j - rho_i)``, exact zeros outside ``mask``, and ``u0 = exp(rho)``.

    ``c_j = max_i X_ij`` and ``rho_i = max_j (X_ij - c_j) <= 0``: every entry of ``K`` is
    at most 1, every row holds an exact 1 (at its maximum) and so does every column (a
    row holding a column's maximum has ``rho_i = 0``). ``diag(u0) K = exp(X - colmax X)``.
    ``x`` holds 0 outside ``mask`` (so padded lanes compute ``0 - (-inf)``, never
    ``-inf - (-inf)``); padded rows get ``rho = 0``. A NaN or ``+inf`` logit still gives
    NaN in its matrix.
    """
    col_max = tl.max(tl.where(mask, x, float("-inf")), axis=1)
    shifted = tl.where(mask, x - col_max[:, None, :], float("-inf"))
    row_max = tl.max(shifted, axis=2)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    return tl.exp(shifted - row_max[:, :, None]), tl.exp(row_max)


@triton.jit
def _sinkhorn_step(E, first_col_sum, first, pad, FAST: tl.constexpr):
    """One iteration on the matrix: divide by column sums, then by row sums (by reciprocals).

    Returns the new matrix and the two sums. ``first``: the column sums are
    ``first_col_sum``, those of ``diag(u0) E`` (the first step on the balanced matrix of
    :func:`_balanced_exp`). Padded rows and columns (``pad``) have zero sums, replaced by
    1 so that no ``0 * inf`` appears; a real zero sum still gives NaN, as in the
    reference.
    """
    col_sum = tl.where(first, first_col_sum, tl.where(pad, 1.0, tl.sum(E, axis=1)))
    E = E * _reciprocal(col_sum, FAST)[:, None, :]
    row_sum = tl.where(pad, 1.0, tl.sum(E, axis=2))
    E = E * _reciprocal(row_sum, FAST)[:, :, None]
    return E, col_sum, row_sum


@triton.jit
def _pads(tile_start, num_tokens, n: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    tok = tile_start + tl.arange(0, BLOCK)
    idx = tl.arange(0, N)
    pad = (tok[:, None] >= num_tokens) | (idx[None, :] >= n)
    return pad  # [BLOCK, N]: the same mask serves rows and columns


@runtime.CachedLaunch
@triton.jit
def sinkhorn_forward_kernel(logits_ptr, out_ptr, num_tokens, iters,
                            n: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, ABSORB: tl.constexpr,
                            FLAT: tl.constexpr, FAST: tl.constexpr, COMPUTE: tl.constexpr):
    """Forward: ``R = S^iters(exp(X - colmax X))`` per token, ``S`` = column then row normalisation.

    ``S(E) = D_r^{-1} (E D_c^{-1})`` with ``D_c = diag(colsum E)`` and
    ``D_r = diag(rowsum(E D_c^{-1}))``. Every iterate is ``diag(u) K diag(v)``, so the
    kernel iterates on the scaling vectors: ``v = 1 / (K^T u)`` (column step),
    ``u = 1 / (K v)`` (row step), one multiply-add per entry and half-step instead of
    a sum and a rescaling of the matrix. It starts from the balanced ``K`` and
    ``u = u0`` of :func:`_balanced_exp` (``diag(u0) K = exp(X - colmax X)``), and every
    ``ABSORB`` iterations (:func:`absorb_period`) absorbs the scaling vectors,
    ``K = diag(u) K diag(v)``, ``u = 1``, which keeps them in range; the last
    absorption is ``R``. Reads ``X`` once, writes ``R`` once.
    """
    tile_start = tl.program_id(0) * BLOCK
    offsets, mask = _tile(tile_start, num_tokens, n, N, BLOCK)
    pad = _pads(tile_start, num_tokens, n, N, BLOCK)
    x = _load_tile(logits_ptr, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT, COMPUTE)
    K, u = _balanced_exp(x, mask)
    v = u
    for start in range(0, iters, ABSORB):
        for _ in range(start, tl.minimum(start + ABSORB, iters)):
            # padded rows and columns: sum 0, replaced by 1 (their K entries are 0 anyway)
            v = _reciprocal(tl.where(pad, 1.0, tl.sum(K * u[:, :, None], axis=1)), FAST)
            u = _reciprocal(tl.where(pad, 1.0, tl.sum(K * v[:, None, :], axis=2)), FAST)
        K = K * u[:, :, None] * v[:, None, :]
        u = tl.full((BLOCK, N), 1.0, COMPUTE)
    _store_tile(out_ptr, K, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT)


@runtime.CachedLaunch
@triton.jit
def sinkhorn_unrolled_backward_kernel(logits_ptr, grad_ptr, out_ptr, num_tokens, iters, seg_len, num_segs,
                                      n: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
                                      SEGS: tl.constexpr, SEG: tl.constexpr, FLAT: tl.constexpr,
                                      FAST: tl.constexpr, COMPUTE: tl.constexpr):
    """Exact reverse mode through the ``iters``-step map, forward recomputed on chip.

    The gradient is carried in logarithmic form, ``G = dL/dE * E`` (the gradient with
    respect to ``log E``), which never divides by a sum: a half-step ``Y = X / s``
    (``s`` the sums of ``X`` along one axis) has ``G_X = G_Y - Y * sum(G_Y)`` along that
    axis. A step is a column half-step then a row half-step; ``G`` starts as
    ``dR * R`` and ends as ``dlogits`` (the column-max shift has zero gradient: the
    last ``G`` has zero column sums). The iterations start from the balanced matrix
    (:func:`_balanced_exp`), whose first column sums are taken with the weights
    ``u0``; the row scaling ``u0`` cancels in the first row step, and the reverse
    multiplies it back into the first row sums so that ``C_1`` is the true first
    column-normalised iterate.

    Reverse mode needs the iterates in reverse order without storing them in memory.
    Checkpoints: iterations are cut into ``num_segs`` segments of ``seg_len``; a first
    forward sweep keeps the matrix at each segment start (``[BLOCK, SEGS, N, N]`` in
    registers); then, last segment first, the segment is recomputed from its
    checkpoint keeping only its column and row sums (``[BLOCK, SEG, N]`` each), and
    walked backwards: ``C_t = E_t * r_t``, ``E_{t-1} = C_t * c_t``. About ``2 iters``
    forward steps plus ``iters`` reverse steps; memory traffic: read ``X`` and ``dR``,
    write ``dX``.
    """
    tile_start = tl.program_id(0) * BLOCK
    offsets, mask = _tile(tile_start, num_tokens, n, N, BLOCK)
    pad = _pads(tile_start, num_tokens, n, N, BLOCK)
    x = _load_tile(logits_ptr, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT, COMPUTE)
    G = _load_tile(grad_ptr, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT, COMPUTE)
    E, u0 = _balanced_exp(x, mask)
    first_col_sum = tl.where(pad, 1.0, tl.sum(E * u0[:, :, None], axis=1))

    seg_ids = tl.arange(0, SEGS)[None, :, None, None]
    checkpoints = tl.zeros((BLOCK, SEGS, N, N), dtype=COMPUTE)
    for s in range(num_segs):
        checkpoints = tl.where(seg_ids == s, E[:, None, :, :], checkpoints)
        for t in range(s * seg_len, tl.minimum(s * seg_len + seg_len, iters)):
            E, _, _ = _sinkhorn_step(E, first_col_sum, t == 0, pad, FAST)
    G = G * E

    step_ids = tl.arange(0, SEG)[None, :, None]
    for s_back in range(num_segs):
        s = num_segs - 1 - s_back
        count = tl.minimum(seg_len, iters - s * seg_len)
        E = tl.sum(tl.where(seg_ids == s, checkpoints, 0.0), axis=1)
        col_sums = tl.zeros((BLOCK, SEG, N), dtype=COMPUTE)
        row_sums = tl.zeros((BLOCK, SEG, N), dtype=COMPUTE)
        for k in range(count):
            first = s * seg_len + k == 0
            E, col_sum, row_sum = _sinkhorn_step(E, first_col_sum, first, pad, FAST)
            row_sum = tl.where(first, row_sum * u0, row_sum)
            col_sums = tl.where(step_ids == k, col_sum[:, None, :], col_sums)
            row_sums = tl.where(step_ids == k, row_sum[:, None, :], row_sums)
        for k_back in range(count):
            k = count - 1 - k_back
            col_sum = tl.sum(tl.where(step_ids == k, col_sums, 0.0), axis=1)
            row_sum = tl.sum(tl.where(step_ids == k, row_sums, 0.0), axis=1)
            # row half-step: E = C / row_sum
            G = G - E * tl.sum(G, axis=2)[:, :, None]
            C = E * row_sum[:, :, None]
            # column half-step: C = E_prev / col_sum
            G = G - C * tl.sum(G, axis=1)[:, None, :]
            E = C * col_sum[:, None, :]
    _store_tile(out_ptr, G, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT)


@triton.jit
def _inverse_or_zero(x):
    """``1 / x`` where ``x > 0``, else 0 (an empty row, or a cut pivot)."""
    return tl.where(x > 0, 1.0 / tl.where(x > 0, x, 1.0), 0.0)


@triton.jit
def _row_of(M, i, N: tl.constexpr):
    """Row ``i`` of each ``[N, N]`` matrix in ``M`` (``[BLOCK, N, N]`` -> ``[BLOCK, N]``)."""
    rows = tl.arange(0, N)[None, :, None]
    return tl.sum(tl.where(rows == i, M, 0.0), axis=1)


@triton.jit
def _entry_of(v, i, N: tl.constexpr):
    """Entry ``i`` of each vector in ``v`` (``[BLOCK, N]`` -> ``[BLOCK]``)."""
    return tl.sum(tl.where(tl.arange(0, N)[None, :] == i, v, 0.0), axis=1)


@runtime.CachedLaunch
@triton.jit
def sinkhorn_implicit_backward_kernel(R_ptr, grad_ptr, out_ptr, num_tokens, cg_iters, rounding_floor, cut,
                                      n: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
                                      USE_CG: tl.constexpr, FLAT: tl.constexpr, COMPUTE: tl.constexpr):
    """Implicit gradient of the converged projection: ``dX = R * (dR - alpha_i - beta_j)``.

    ``alpha, beta`` make every row and column of ``dX`` sum to zero:
    ``diag(r) alpha + R beta = a`` and ``R^T alpha + diag(c) beta = b`` with
    ``a, b`` the row and column sums of ``R * dR`` and ``r, c`` those of ``R`` (for a
    doubly stochastic ``R`` this is ``[[I, R], [R^T, I]] [alpha; beta] = [a; b]``).
    With ``alpha = (a - R beta) / r``: ``L beta = h``, ``h = b - R^T (a / r)``, where
    ``L`` is the Laplacian of the column graph ``W = R^T diag(1/r) R`` (off-diagonal).
    ``L`` is singular (null vector ``1``; the null direction ``(1, -1)`` of the full
    system) and the system is consistent for any ``R``.

    Direct solve (default): ground ``beta_0 = 0`` and eliminate columns ``n-1 .. 1``
    (Kron reduction, the Grassmann-Taksar-Heyman order): each pivot is the sum of
    the remaining edge weights and each update ``W[j,q] += W[j,p] W[p,q] / d_p`` adds
    non-negative numbers, so no cancellation occurs however close ``R`` is to a
    permutation. A pivot at or below ``cut * colsum_p`` (``cut`` = the unit roundoff
    of the compute dtype) marks a block of columns linked to the rest only through
    entries of ``R`` below rounding level: that link is cut and the block's offset
    set by ``beta_p = 0``. Solving through such a link would divide the block's
    rounding noise in ``h`` by the tiny pivot, giving a huge common offset to the
    block's ``alpha, beta`` whose cancellation in ``alpha_i + beta_j`` would wipe out
    the in-block gradient; cutting it changes only the gradient of the sub-rounding
    entries, by about ``cut`` times the gradient's scale.
    ``USE_CG``: ``cg_iters`` conjugate-gradient steps on ``(L + cut diag(c)) beta = h``
    instead: the shift plays the part of the cut, damping the modes of ``L`` below
    rounding level rather than dividing rounding noise by them.
    """
    tile_start = tl.program_id(0) * BLOCK
    offsets, mask = _tile(tile_start, num_tokens, n, N, BLOCK)
    R = _load_tile(R_ptr, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT, COMPUTE)
    dR = _load_tile(grad_ptr, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT, COMPUTE)
    idx = tl.arange(0, N)[None, :]
    rows3 = tl.arange(0, N)[None, :, None]
    cols3 = tl.arange(0, N)[None, None, :]

    G = R * dR
    a = tl.sum(G, axis=2)
    b = tl.sum(G, axis=1)
    r = tl.sum(R, axis=2)
    inv_r = _inverse_or_zero(r)
    W = tl.zeros((BLOCK, N, N), dtype=COMPUTE)
    for i in range(n):
        R_i = _row_of(R, i, N)
        W += (R_i * _entry_of(inv_r, i, N)[:, None])[:, :, None] * R_i[:, None, :]
    h = b - tl.sum(R * (inv_r * a)[:, :, None], axis=1)

    if USE_CG:
        W = tl.where(rows3 == cols3, 0.0, W)
        # shifted by cut * column mass: damps the modes below rounding level (see padded_torch)
        degree = tl.sum(W, axis=2) + cut * tl.sum(R, axis=1)
        h = h - (tl.sum(h, axis=1) / n)[:, None]
        h = tl.where(idx < n, h, 0.0)
        beta = tl.zeros((BLOCK, N), dtype=COMPUTE)
        residual = h
        direction = h
        rs = tl.sum(h * h, axis=1)
        # a matrix stops once its residual is at rounding level (see padded_torch)
        floor = rs * rounding_floor
        for _ in range(cg_iters):
            Ld = degree * direction - tl.sum(W * direction[:, None, :], axis=2)
            dLd = tl.sum(direction * Ld, axis=1)
            live = (dLd > 0) & (rs > floor)
            step = tl.where(live, rs / tl.where(live, dLd, 1.0), 0.0)
            beta += step[:, None] * direction
            residual -= step[:, None] * Ld
            rs_new = tl.sum(residual * residual, axis=1)
            ratio = tl.where(rs > 0, rs_new / tl.where(rs > 0, rs, 1.0), 0.0)
            direction = residual + ratio[:, None] * direction
            rs = rs_new
    else:
        col_mass = tl.sum(R, axis=1)
        pivots = tl.zeros((BLOCK, N), dtype=COMPUTE)
        for k in range(n - 1):
            p = n - 1 - k
            w_p = tl.where(idx < p, _row_of(W, p, N), 0.0)
            pivot = tl.sum(w_p, axis=1)
            # Links weaker than rounding level are cut (see the docstring).
            linked = pivot > cut * _entry_of(col_mass, p, N)
            pivot = tl.where(linked, pivot, 0.0)
            scaled = tl.where(linked[:, None], w_p / tl.where(linked, pivot, 1.0)[:, None], 0.0)
            W += scaled[:, :, None] * w_p[:, None, :]
            h += scaled * _entry_of(h, p, N)[:, None]
            pivots = tl.where(idx == p, pivot[:, None], pivots)
        # Eliminating p only touched entries below p, so row p of W and h[p] still
        # hold their values at p's elimination.
        beta = tl.zeros((BLOCK, N), dtype=COMPUTE)
        for p in range(1, n):
            w_p = tl.where(idx < p, _row_of(W, p, N), 0.0)
            pivot = _entry_of(pivots, p, N)
            linked = pivot > 0
            beta_p = (_entry_of(h, p, N) + tl.sum(w_p * beta, axis=1)) / tl.where(linked, pivot, 1.0)
            beta = tl.where(idx == p, tl.where(linked, beta_p, 0.0)[:, None], beta)

    alpha = inv_r * (a - tl.sum(R * beta[:, None, :], axis=2))
    dX = R * (dR - alpha[:, :, None] - beta[:, None, :])
    _store_tile(out_ptr, dX, offsets, mask, tile_start, num_tokens, n, N, BLOCK, FLAT)


# ---------------------------------------------------------------------------------------
# One token per thread, for n = 2, 4, 8.
#
# The kernels above spread a token's matrix over several threads (Triton lays a
# [BLOCK, N, N] tile out for wide loads), so every column sum is a cross-thread
# shuffle and every reciprocal is computed by several threads. For small n the
# arithmetic, not the memory, then sets the time. Here the tile is loaded as one
# coalesced [BLOCK, n*n] block and split in registers into n*n vectors of BLOCK
# tokens (a tuple), so that a thread owns whole matrices and all sums are plain
# additions. The forward also iterates on the scaling vectors instead of the matrix.


@triton.jit
def _ones(n: tl.constexpr, ROWS: tl.constexpr, COMPUTE: tl.constexpr):
    """The scaling vector ``u = 1`` after an absorption: ``n`` vectors of ``ROWS``."""
    u = ()
    for i in tl.static_range(n):
        u = u + (tl.full((ROWS,), 1.0, COMPUTE),)
    return u


@triton.jit
def _iterate_staggered(KA, KB, u_a, u_b, iters, n: tl.constexpr, HALF: tl.constexpr, ABSORB: tl.constexpr,
                       FAST: tl.constexpr, PAIRS: tl.constexpr):
    """``iters`` iterations on the scaling vectors of two tokens per thread, token B half
    an iteration behind token A, from ``u_a``, ``u_b``: the two final iterates.

    Each half-step is ``n`` dependent sums (multiply-adds) followed by ``n`` reciprocals
    (special-function unit). With B's sums computed in the same stretch of code as A's
    reciprocals and the other way round, both units have independent work at every
    point of the loop; with the two tokens in step, each warp waits for one unit while
    the other idles. Every ``ABSORB`` iterations both absorb their scaling vectors
    (``K = diag(u) K diag(v)``, ``u = 1``), which keeps every sum within
    :func:`absorb_period`'s bound, so ``PAIRS`` pairs of sums may always share one
    reciprocal.
    """
    v_a = u_a
    v_b = u_b
    for start in range(0, iters, ABSORB):
        p_b = _column_sums(KB, u_b, n)
        for _ in range(start, tl.minimum(start + ABSORB, iters)):
            p_a = _column_sums(KA, u_a, n)
            v_b = _reciprocals(p_b, n, FAST, PAIRS)
            v_a = _reciprocals(p_a, n, FAST, PAIRS)
            q_b = _row_sums(KB, v_b, n)
            q_a = _row_sums(KA, v_a, n)
            u_b = _reciprocals(q_b, n, FAST, PAIRS)
            u_a = _reciprocals(q_a, n, FAST, PAIRS)
            p_b = _column_sums(KB, u_b, n)  # (wasted after the block's last iteration)
        KA = _scaled_entries(u_a, KA, v_a, n)
        KB = _scaled_entries(u_b, KB, v_b, n)
        u_a = _ones(n, HALF, KA[0].dtype)
        u_b = u_a
    return KA, KB


@triton.jit
def _iterate(K, u, iters, n: tl.constexpr, ROWS: tl.constexpr, ABSORB: tl.constexpr, FAST: tl.constexpr):
    """``iters`` iterations on the scaling vectors of one token per thread, from ``u``,
    absorbing them every ``ABSORB`` iterations: the final iterate."""
    v = u
    for start in range(0, iters, ABSORB):
        for _ in range(start, tl.minimum(start + ABSORB, iters)):
            v = _column_step(K, u, n, FAST)
            u = _row_step(K, v, n, FAST)
        K = _scaled_entries(u, K, v, n)
        u = _ones(n, ROWS, K[0].dtype)
    return K


@triton.jit
def _scaled_entries(u, K, v, n: tl.constexpr):
    """``R = diag(u) K diag(v)`` entry by entry (natural order)."""
    R = ()
    for k in tl.static_range(n * n):
        R = R + (u[k // n] * K[k] * v[k % n],)
    return R


@triton.jit
def _matrices(ptr, first, num_tokens, NN: tl.constexpr, ROWS: tl.constexpr):
    """Pointers and mask of ``ROWS`` matrices from token ``first`` on, one per thread.

    The tile's start is a 64-bit scalar and the offsets inside it 32-bit: 64-bit
    offsets per element would hold registers that the iterations need.
    """
    rows = tl.arange(0, ROWS)
    ptrs = ptr + first.to(tl.int64) * NN + (rows[:, None] * NN + tl.arange(0, NN)[None, :])
    return ptrs, (first + rows)[:, None] < num_tokens


@triton.jit
def _load_matrices(ptr, first, num_tokens, NN: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                   COMPUTE: tl.constexpr):
    """Entries (natural order) of ``ROWS`` matrices from token ``first`` on, one per thread."""
    ptrs, mask = _matrices(ptr, first, num_tokens, NN, ROWS)
    return split_columns(tl.load(ptrs, mask=mask, other=0.0).to(COMPUTE), ROWS, NN, BITS)


@triton.jit
def _store_matrices(ptr, entries, first, num_tokens, NN: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr):
    """Inverse of :func:`_load_matrices`."""
    ptrs, mask = _matrices(ptr, first, num_tokens, NN, ROWS)
    tl.store(ptrs, join_columns(entries, ROWS, NN, BITS).to(ptr.dtype.element_ty), mask=mask)


@runtime.CachedLaunch
@triton.jit
def sinkhorn_forward_small_kernel(logits_ptr, out_ptr, num_tokens, iters,
                                  n: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                                  ABSORB: tl.constexpr, FAST: tl.constexpr, COMPUTE: tl.constexpr,
                                  STAGGER: tl.constexpr, PAIRS: tl.constexpr):
    """Forward for ``n`` in 2, 4, 8, whole matrices in one thread, on the scaling vectors.

    Every iterate is ``diag(u) K diag(v)``: the column step sets ``v = 1 / (K^T u)``, the
    row step ``u = 1 / (K v)``, from the balanced ``K`` and ``u = u0`` of
    :func:`_shifted_exp_entries`, and every ``ABSORB`` iterations the scaling vectors
    are absorbed, ``K = diag(u) K diag(v)``, ``u = 1`` (:func:`absorb_period`); the
    last absorption is ``R``. The same map as the matrix iterations, in ``2 n^2``
    multiply-adds and ``2n`` reciprocals per iteration.

    ``STAGGER``: each thread takes two tokens, the second half an iteration behind
    (:func:`_iterate_staggered`), ``BLOCK // 2`` threads a program. ``PAIRS`` (with
    ``STAGGER``): that many pairs of sums per half-step share one reciprocal,
    ``r = 1 / (ab)``, ``1/a = b r``, ``1/b = a r``: between absorptions every sum lies
    in ``[2^-40, 2^40]``, so the products stay far inside the normal range.
    """
    NN: tl.constexpr = n * n
    ROWS: tl.constexpr = BLOCK // 2 if STAGGER else BLOCK  # tokens per load: each half (A, B) with STAGGER
    first = tl.program_id(0) * BLOCK
    u_a, K_a = _shifted_exp_entries(_load_matrices(logits_ptr, first, num_tokens, NN, ROWS, BITS, COMPUTE), n)
    if STAGGER:
        u_b, K_b = _shifted_exp_entries(_load_matrices(logits_ptr, first + ROWS, num_tokens, NN, ROWS, BITS, COMPUTE),
                                        n)
        R_a, R_b = _iterate_staggered(K_a, K_b, u_a, u_b, iters, n, ROWS, ABSORB, FAST, PAIRS)
        _store_matrices(out_ptr, R_b, first + ROWS, num_tokens, NN, ROWS, BITS)
    else:
        R_a = _iterate(K_a, u_a, iters, n, ROWS, ABSORB, FAST)
    _store_matrices(out_ptr, R_a, first, num_tokens, NN, ROWS, BITS)


# ---------------------------------------------------------------------------------------
# A token across a group of lanes, for n from 9 to 32 (the forward) and 9 to 16 (the
# direct implicit backward).
#
# A whole matrix of n >= 16 does not fit one thread's registers, and the tile layout
# spreads it so that both sums of every half-step cross threads. Here the padded
# ``N x N`` matrix is spread over ``N / 4`` lanes of one warp, each lane holding four
# whole columns (``n`` row vectors of four entries each): a column sum is plain
# arithmetic inside a lane, and a row sum adds four entries in a lane and then
# ``log2(N / 4)`` butterfly shuffles across the group. Each lane reads its part of a
# row as one 16-byte load, the group a whole row, so the loads stay coalesced.

#: columns of a matrix each lane of a column group holds
_GROUP_COLUMNS = 4  # (written as 4 inside the kernels)


@triton.jit
def _column_group_offsets(first, i, num_tokens, n: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr):
    """Offsets ``[ROWS, 4 LANES]`` of row ``i`` of ``ROWS`` tokens from ``first`` on, and the
    mask of real entries. (Two-dimensional, so that Triton lays a row's contiguous
    entries along the lanes: four to a lane, the row across ``LANES`` lanes.)"""
    tok = first + tl.arange(0, ROWS)
    col = tl.arange(0, LANES * 4)[None, :]
    return tok[:, None] * (n * n) + i * n + col, (tok[:, None] < num_tokens) & (col < n)


@triton.jit
def _load_group_row(ptr, first, i, num_tokens, n: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                    COMPUTE: tl.constexpr):
    """Row ``i`` as four ``[ROWS, LANES]`` columns (lane ``l``, column ``c``: entry ``4 l + c``),
    0 outside the matrices."""
    offsets, mask = _column_group_offsets(first, i, num_tokens, n, ROWS, LANES)
    row = tl.load(ptr + offsets, mask=mask, other=0.0).to(COMPUTE)
    even, odd = tl.split(tl.reshape(row, (ROWS, LANES, 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _store_group_row(ptr, entries, first, i, num_tokens, n: tl.constexpr, ROWS: tl.constexpr,
                     LANES: tl.constexpr):
    """Inverse of :func:`_load_group_row`: the four columns ``entries`` as row ``i``."""
    offsets, mask = _column_group_offsets(first, i, num_tokens, n, ROWS, LANES)
    even = tl.join(entries[0], entries[2])
    odd = tl.join(entries[1], entries[3])
    row = tl.reshape(tl.join(even, odd), (ROWS, LANES * 4))
    tl.store(ptr + offsets, row.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_column_group(ptr, first, num_tokens, n: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                       COMPUTE: tl.constexpr):
    """Entries ``x[4 i + c]``, ``[ROWS, LANES]`` each (lane ``l``: column ``4 l + c`` of row
    ``i``), 0 outside the matrices, of ``ROWS`` tokens from ``first`` on."""
    x = ()
    for i in tl.static_range(n):
        x = x + _load_group_row(ptr, first, i, num_tokens, n, ROWS, LANES, COMPUTE)
    return x


@triton.jit
def _store_column_group(ptr, entries, first, num_tokens, n: tl.constexpr, ROWS: tl.constexpr,
                        LANES: tl.constexpr):
    """Inverse of :func:`_load_column_group`."""
    for i in tl.static_range(n):
        _store_group_row(ptr, (entries[4 * i], entries[4 * i + 1], entries[4 * i + 2], entries[4 * i + 3]),
                         first, i, num_tokens, n, ROWS, LANES)


@triton.jit
def _group_columns_real(n: tl.constexpr, LANES: tl.constexpr):
    """The four ``[1, LANES]`` masks of the columns ``4 l + c < n`` a lane holds."""
    base = tl.arange(0, LANES)[None, :] * 4
    return base < n, base + 1 < n, base + 2 < n, base + 3 < n


@triton.jit
def _group_balanced_exp(x, real, n: tl.constexpr):
    """``(u0, K)`` of :func:`_balanced_exp` for column-group entries ``x``: ``K`` as
    ``4 n`` entries ``[ROWS, LANES]``, ``u0`` as ``n`` entries ``[ROWS, 1]`` (the same in
    every lane of a group); padded columns (``real`` false) get ``K = 0``."""
    col_max = ()
    for c in tl.static_range(4):
        m = x[c]
        for i in tl.static_range(1, n):
            m = tl.maximum(m, x[4 * i + c])
        col_max = col_max + (m,)
    K = ()
    u0 = ()
    for i in tl.static_range(n):
        shifted = ()
        for c in tl.static_range(4):
            shifted = shifted + (tl.where(real[c], x[4 * i + c] - col_max[c], float("-inf")),)
        rho = tl.max(tl.maximum(tl.maximum(shifted[0], shifted[1]), tl.maximum(shifted[2], shifted[3])), axis=1,
                     keep_dims=True)
        for c in tl.static_range(4):
            K = K + (tl.exp(shifted[c] - rho),)
        u0 = u0 + (tl.exp(rho),)
    return u0, K


@triton.jit
def _group_ones(n: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr, COMPUTE: tl.constexpr):
    """The scaling vector ``u = 1`` after an absorption: ``n`` entries ``[ROWS, WIDTH]``."""
    u = ()
    for i in tl.static_range(n):
        u = u + (tl.full((ROWS, WIDTH), 1.0, COMPUTE),)
    return u


@triton.jit
def _group_column_step(K, u, real, n: tl.constexpr, FAST: tl.constexpr):
    """``v = 1 / (K^T u)`` for a lane's four columns (column-group entries); a padded column
    sums to 0 and gets ``v = 0``, so that ``K v`` meets no ``0 * inf``."""
    v = ()
    for c in tl.static_range(4):
        s = K[c] * u[0]
        for i in tl.static_range(1, n):
            s += K[4 * i + c] * u[i]
        v = v + (tl.where(real[c], _reciprocal(tl.where(real[c], s, 1.0), FAST), 0.0),)
    return v


@triton.jit
def _group_row_parts(K, v, n: tl.constexpr):
    """A lane's four-column part of every row sum of ``K v``."""
    part = ()
    for i in tl.static_range(n):
        p = K[4 * i] * v[0]
        for c in tl.static_range(1, 4):
            p += K[4 * i + c] * v[c]
        part = part + (p,)
    return part


@triton.jit
def _group_row_step(K, v, n: tl.constexpr, FAST: tl.constexpr):
    """``u = 1 / (K v)``: each lane adds its four columns, the group adds the lanes' parts
    (a butterfly: every lane ends with every sum, and takes every reciprocal)."""
    part = _group_row_parts(K, v, n)
    u = ()
    for i in tl.static_range(n):
        u = u + (_reciprocal(tl.sum(part[i], axis=1, keep_dims=True), FAST),)
    return u


@triton.jit
def _lane_partner(x, M: tl.constexpr):
    """``x`` (``[ROWS, LANES]``) as lane ``l ^ M`` of each group holds it: the other
    element of every pair ``(l, l ^ M)``, exactly. Each element's bits are xored with the
    pair's xor; compiled, that is one butterfly shuffle (the two xors cancel)."""
    ROWS: tl.constexpr = x.shape[0]
    LANES: tl.constexpr = x.shape[1]
    if x.dtype == tl.float64:
        bits = x.to(tl.int64, bitcast=True)
    else:
        bits = x.to(tl.int32, bitcast=True)
    pairs = tl.reshape(bits, (ROWS, LANES // (2 * M), 2, M))
    pairs = pairs ^ tl.xor_sum(pairs, axis=2, keep_dims=True)
    return tl.reshape(pairs, (ROWS, LANES)).to(x.dtype, bitcast=True)


@triton.jit
def _lane_row_order(x, n: tl.constexpr, WIDTH: tl.constexpr, LANES: tl.constexpr):
    """Column-group entries (``WIDTH`` a row, ``n = 4 LANES`` rows) rearranged so that
    row slot ``s`` of lane ``l`` holds row ``s ^ 4 l``. It is its own inverse."""
    lane = tl.arange(0, LANES)[None, :]
    for j in tl.static_range(3):
        if (1 << j) < LANES:
            flip = ((lane >> j) & 1) == 1
            y = ()
            for s in tl.static_range(n):
                for c in tl.static_range(WIDTH):
                    y = y + (tl.where(flip, x[WIDTH * (s ^ (4 << j)) + c], x[WIDTH * s + c]),)
            x = y
    return x


@triton.jit
def _group_row_step_scattered(K, v, n: tl.constexpr, LANES: tl.constexpr, FAST: tl.constexpr):
    """``u = 1 / (K v)`` for entries in :func:`_lane_row_order` (``n = 4 LANES``).

    The lanes' parts are reduce-scattered: each exchange with lane ``l ^ M`` adds the
    partner's upper half of the slots to one's own lower half (the partner holds the same
    rows there), so that after ``log2 LANES`` exchanges each lane holds four whole sums
    (its rows ``4 l`` to ``4 l + 3``) and takes four reciprocals; ``log2 LANES`` more
    exchanges gather the rest. Against the butterfly of :func:`_group_row_step`: ``2 (n -
    4)`` exchanges, ``n - 4`` additions and 4 reciprocals a lane instead of ``n log2
    LANES``, ``n log2 LANES`` and ``n``.
    """
    part = _group_row_parts(K, v, n)
    for j in tl.static_range(3):
        if (2 << j) <= LANES:
            kept = ()
            for s in tl.static_range(n >> (j + 1)):
                kept = kept + (part[s] + _lane_partner(part[s + (n >> (j + 1))], LANES >> (j + 1)),)
            part = kept
    u = ()
    for s in tl.static_range(4):
        u = u + (_reciprocal(part[s], FAST),)
    for j in tl.static_range(3):
        if (1 << j) < LANES:
            gathered = ()
            for s in tl.static_range(4 << j):
                gathered = gathered + (_lane_partner(u[s], 1 << j),)
            u = u + gathered
    return u


@triton.jit
def _group_scaled_entries(u, K, v, n: tl.constexpr):
    """``diag(u) K diag(v)`` on column-group entries."""
    R = ()
    for k in tl.static_range(4 * n):
        R = R + (K[k] * u[k // 4] * v[k % 4],)
    return R


@runtime.CachedLaunch
@triton.jit
def sinkhorn_forward_group_kernel(logits_ptr, out_ptr, num_tokens, iters,
                                  n: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
                                  ABSORB: tl.constexpr, FAST: tl.constexpr, COMPUTE: tl.constexpr):
    """Forward for ``n`` from 9 to 32, each token across ``LANES = N / 4`` lanes.

    The map of :func:`sinkhorn_forward_small_kernel` on the scaling vectors: a lane
    computes ``v = 1 / (K^T u)`` for its four columns, then its four-column part of
    ``K v`` for every row, which the group adds up into ``u = 1 / (K v)`` (each lane
    then holds all of ``u``); every ``ABSORB`` iterations ``K = diag(u) K diag(v)``,
    ``u = 1`` (:func:`absorb_period`). Padded columns (``n`` not a multiple of 4 or
    ``N < 4 LANES``) hold ``K = 0`` and ``v = 0``; rows beyond ``n`` do not exist.
    Where the rows fill the group (``n = 4 LANES``: 16 and 32) each lane holds the rows
    in its own order (:func:`_lane_row_order`) and the group reduce-scatters the row
    sums (:func:`_group_row_step_scattered`).
    """
    SCATTER: tl.constexpr = n == 4 * LANES
    WIDTH: tl.constexpr = LANES if SCATTER else 1  # of each entry of u
    first = tl.program_id(0) * BLOCK
    real = _group_columns_real(n, LANES)
    x = _load_column_group(logits_ptr, first, num_tokens, n, BLOCK, LANES, COMPUTE)
    u, K = _group_balanced_exp(x, real, n)
    if SCATTER:
        K = _lane_row_order(K, n, 4, LANES)
        u = _lane_row_order(u, n, 1, LANES)
    v = (K[0], K[1], K[2], K[3])
    for start in range(0, iters, ABSORB):
        for _ in range(start, tl.minimum(start + ABSORB, iters)):
            v = _group_column_step(K, u, real, n, FAST)
            if SCATTER:
                u = _group_row_step_scattered(K, v, n, LANES, FAST)
            else:
                u = _group_row_step(K, v, n, FAST)
        K = _group_scaled_entries(u, K, v, n)
        u = _group_ones(n, BLOCK, WIDTH, COMPUTE)
    if SCATTER:
        K = _lane_row_order(K, n, 4, LANES)
    _store_column_group(out_ptr, K, first, num_tokens, n, BLOCK, LANES)


@triton.jit
def _group_entry(x, lane, src: tl.constexpr):
    """What lane ``src`` of each group holds in ``x`` (``[ROWS, LANES]``), in every lane (``[ROWS]``)."""
    return tl.sum(tl.where(lane == src, x, 0.0), axis=1)


@triton.jit
def _group_row_sum(x0, x1, x2, x3):
    """The sum over a row's entries, four columns a lane: ``[ROWS]``, in every lane."""
    return tl.sum((x0 + x1) + (x2 + x3), axis=1)


@triton.jit
def _group_row_loads(R_ptr, grad_ptr, first, i, num_tokens, n: tl.constexpr, ROWS: tl.constexpr,
                     LANES: tl.constexpr, COMPUTE: tl.constexpr):
    """Row ``i`` of ``R`` and of ``dR``, four columns each."""
    return (_load_group_row(R_ptr, first, i, num_tokens, n, ROWS, LANES, COMPUTE),
            _load_group_row(grad_ptr, first, i, num_tokens, n, ROWS, LANES, COMPUTE))


@triton.jit
def _group_row_terms(R_i, dR_i):
    """``1 / r_i`` and ``a_i``, the row sums of ``R`` and ``R * dR`` (``[ROWS, 1]`` in every lane)."""
    inv_r = _inverse_or_zero(_group_row_sum(R_i[0], R_i[1], R_i[2], R_i[3]))[:, None]
    a_i = _group_row_sum(R_i[0] * dR_i[0], R_i[1] * dR_i[1], R_i[2] * dR_i[2], R_i[3] * dR_i[3])[:, None]
    return inv_r, a_i


@triton.jit
def _with_column(columns, C: tl.constexpr, value):
    """The four columns ``columns`` with column ``C`` replaced by ``value``."""
    out = ()
    for c in tl.static_range(4):
        if c == C:
            out = out + (value,)
        else:
            out = out + (columns[c],)
    return out


@runtime.CachedLaunch
@triton.jit
def sinkhorn_implicit_backward_group_kernel(R_ptr, grad_ptr, out_ptr, num_tokens, cut,
                                            n: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
                                            COMPUTE: tl.constexpr):
    """The direct implicit backward of :func:`sinkhorn_implicit_backward_kernel` for ``n``
    from 9 to 16, each token across ``LANES = 4`` lanes, four columns a lane.

    Same equations and elimination (Kron reduction onto column 0, links below
    ``cut * colsum`` cut). A lane holds its four columns of the edge weights
    ``W = R^T diag(1/r) R`` (every row ``j``) and of ``h``, ``c``, ``beta``:

    * one pass over the rows of ``R`` and ``dR`` builds ``h``, ``c`` and ``W``, each row's
      entries handed to every lane of the group by a reduction over the lanes;
    * eliminating column ``p`` takes its pivot, ``h_p`` and ``W[j, p]`` (``j < p``) from
      the lane holding ``p``; the row ``W[p, :]`` every lane needs is its own (``W`` is
      symmetric). Columns at or beyond ``p`` are updated too, saving a mask: those
      entries are never read again, and the back substitution masks them;
    * back substitution adds each lane's ``W[p, q] beta_q`` (``q < p``) over the group;
      the lane holding ``p`` keeps ``beta_p``;
    * a second pass over the rows (from cache) forms ``alpha`` and ``dX``.
    """
    first = tl.program_id(0) * BLOCK
    lane = tl.arange(0, LANES)[None, :]
    zero = tl.zeros((BLOCK, LANES), dtype=COMPUTE)
    h = (zero, zero, zero, zero)
    mass = (zero, zero, zero, zero)
    W = ()
    for k in tl.static_range(4 * n):
        W = W + (zero,)
    # Each pass over the rows loads row i + 1 before working on row i, so that a load's
    # latency hides behind a row's arithmetic (the last load, of row 0 again, is cached).
    R_next, dR_next = _group_row_loads(R_ptr, grad_ptr, first, 0, num_tokens, n, BLOCK, LANES, COMPUTE)
    for i in range(n):
        R_i, dR_i = R_next, dR_next
        R_next, dR_next = _group_row_loads(R_ptr, grad_ptr, first, (i + 1) % n, num_tokens, n, BLOCK, LANES,
                                           COMPUTE)
        inv_r, a_i = _group_row_terms(R_i, dR_i)
        s_i = a_i * inv_r
        h = (h[0] + R_i[0] * (dR_i[0] - s_i), h[1] + R_i[1] * (dR_i[1] - s_i),
             h[2] + R_i[2] * (dR_i[2] - s_i), h[3] + R_i[3] * (dR_i[3] - s_i))
        mass = (mass[0] + R_i[0], mass[1] + R_i[1], mass[2] + R_i[2], mass[3] + R_i[3])
        scaled = (R_i[0] * inv_r, R_i[1] * inv_r, R_i[2] * inv_r, R_i[3] * inv_r)
        new_W = ()
        for j in tl.static_range(n):
            R_ij = _group_entry(R_i[j % 4], lane, j // 4)[:, None]
            for c in tl.static_range(4):
                new_W = new_W + (W[4 * j + c] + R_ij * scaled[c],)
        W = new_W

    inv_pivot = (zero, zero, zero, zero)  # of the lane's columns: 1 / pivot, 0 where cut
    for p in tl.static_range(n - 1, 0, -1):
        part = W[p % 4]
        for q in tl.static_range(1, p):
            part += W[4 * q + p % 4]
        # Links weaker than rounding level are cut (see sinkhorn_implicit_backward_kernel).
        holder = lane == p // 4
        pivot = tl.sum(tl.where(holder & (part > cut * mass[p % 4]), part, 0.0), axis=1)
        inv = _inverse_or_zero(pivot)[:, None]
        h_p = _group_entry(h[p % 4], lane, p // 4)[:, None]
        row_p = (W[4 * p] * inv, W[4 * p + 1] * inv, W[4 * p + 2] * inv, W[4 * p + 3] * inv)
        new_h = ()
        for c in tl.static_range(4):
            new_h = new_h + (tl.where(4 * lane + c < p, h[c] + row_p[c] * h_p, h[c]),)
        h = new_h
        inv_pivot = _with_column(inv_pivot, p % 4, tl.where(holder, inv, inv_pivot[p % 4]))
        new_W = ()
        for j in tl.static_range(n):
            if j < p:
                w_jp = _group_entry(W[4 * j + p % 4], lane, p // 4)[:, None]
                for c in tl.static_range(4):
                    new_W = new_W + (W[4 * j + c] + w_jp * row_p[c],)
            else:
                for c in tl.static_range(4):
                    new_W = new_W + (W[4 * j + c],)
        W = new_W

    beta = (zero, zero, zero, zero)  # beta_0 = 0 grounds the solution
    for p in tl.static_range(1, n):
        part = tl.where(4 * lane < p, W[4 * p] * beta[0], 0.0)
        for c in tl.static_range(1, 4):
            part += tl.where(4 * lane + c < p, W[4 * p + c] * beta[c], 0.0)
        beta_p = (h[p % 4] + tl.sum(part, axis=1)[:, None]) * inv_pivot[p % 4]
        beta = _with_column(beta, p % 4, tl.where(lane == p // 4, beta_p, beta[p % 4]))

    R_next, dR_next = _group_row_loads(R_ptr, grad_ptr, first, 0, num_tokens, n, BLOCK, LANES, COMPUTE)
    for i in range(n):
        R_i, dR_i = R_next, dR_next
        R_next, dR_next = _group_row_loads(R_ptr, grad_ptr, first, (i + 1) % n, num_tokens, n, BLOCK, LANES,
                                           COMPUTE)
        inv_r, a_i = _group_row_terms(R_i, dR_i)
        s_i = _group_row_sum(R_i[0] * beta[0], R_i[1] * beta[1], R_i[2] * beta[2], R_i[3] * beta[3])
        alpha = inv_r * (a_i - s_i[:, None])
        dX = (R_i[0] * (dR_i[0] - alpha - beta[0]), R_i[1] * (dR_i[1] - alpha - beta[1]),
              R_i[2] * (dR_i[2] - alpha - beta[2]), R_i[3] * (dR_i[3] - alpha - beta[3]))
        _store_group_row(out_ptr, dX, first, i, num_tokens, n, BLOCK, LANES)


@runtime.CachedLaunch
@triton.jit
def sinkhorn_implicit_backward_small_kernel(R_ptr, grad_ptr, out_ptr, num_tokens, cut,
                                            n: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                                            COMPUTE: tl.constexpr):
    """The direct implicit backward of :func:`sinkhorn_implicit_backward_kernel`, one token per thread.

    Same equations and the same elimination (Kron reduction onto column 0, links
    below ``cut * colsum`` cut), written out entry by entry for ``n`` in 2, 4, 8.
    """
    NN: tl.constexpr = n * n
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offsets = tok[:, None] * NN + tl.arange(0, NN)[None, :]
    mask = tok[:, None] < num_tokens
    R = split_columns(tl.load(R_ptr + offsets, mask=mask, other=0.0).to(COMPUTE), BLOCK, NN, BITS)
    dR = split_columns(tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(COMPUTE), BLOCK, NN, BITS)
    zero = tl.zeros((BLOCK,), dtype=COMPUTE)
    a = ()
    inv_r = ()
    for i in tl.static_range(n):
        a_i = R[i * n] * dR[i * n]
        r_i = R[i * n]
        for j in tl.static_range(1, n):
            a_i += R[i * n + j] * dR[i * n + j]
            r_i += R[i * n + j]
        a = a + (a_i,)
        inv_r = inv_r + (_inverse_or_zero(r_i),)
    h = ()
    col_mass = ()
    for j in tl.static_range(n):
        h_j = R[j] * (dR[j] - inv_r[0] * a[0])
        c_j = R[j]
        for i in tl.static_range(1, n):
            h_j += R[i * n + j] * (dR[i * n + j] - inv_r[i] * a[i])
            c_j += R[i * n + j]
        h = h + (h_j,)
        col_mass = col_mass + (c_j,)
    # edge weights W[j * n + k] = sum_i R[i, j] R[i, k] / r_i (diagonal unused)
    W = ()
    for j in tl.static_range(n):
        for k in tl.static_range(n):
            w = zero
            if j != k:
                for i in tl.static_range(n):
                    w += R[i * n + j] * inv_r[i] * R[i * n + k]
            W = W + (w,)
    inv_pivots = ()  # inv_pivots[n - 1 - p]: 1 / pivot of column p (0 where cut)
    for p in tl.static_range(n - 1, 0, -1):
        pivot = W[p * n]
        for q in tl.static_range(1, p):
            pivot += W[p * n + q]
        linked = pivot > cut * col_mass[p]
        inv = tl.where(linked, 1.0 / tl.where(linked, pivot, 1.0), 0.0)
        new_W = ()
        for j in tl.static_range(n):
            for k in tl.static_range(n):
                if j < p and k < p and j != k:
                    new_W = new_W + (W[j * n + k] + W[p * n + j] * inv * W[p * n + k],)
                else:
                    new_W = new_W + (W[j * n + k],)
        new_h = ()
        for j in tl.static_range(n):
            if j < p:
                new_h = new_h + (h[j] + W[p * n + j] * inv * h[p],)
            else:
                new_h = new_h + (h[j],)
        W = new_W
        h = new_h
        inv_pivots = inv_pivots + (inv,)
    beta = (zero,)
    for p in tl.static_range(1, n):
        acc = h[p]
        for q in tl.static_range(p):
            acc += W[p * n + q] * beta[q]
        beta = beta + (acc * inv_pivots[n - 1 - p],)
    out = ()
    for i in tl.static_range(n):
        s_i = R[i * n] * beta[0]
        for j in tl.static_range(1, n):
            s_i += R[i * n + j] * beta[j]
        alpha_i = inv_r[i] * (a[i] - s_i)
        for j in tl.static_range(n):
            out = out + (R[i * n + j] * (dR[i * n + j] - alpha_i - beta[j]),)
    dX = join_columns(out, BLOCK, NN, BITS)
    tl.store(out_ptr + offsets, dX.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shifted_exp_entries(x, n: tl.constexpr):
    """``(u0, K)`` of :func:`_balanced_exp` for one-token-per-thread entries ``x`` (natural
    order ``i n + j``): ``K = exp(X - c_j - rho_i)``, ``u0 = exp(rho)``."""
    col_max = ()
    for j in tl.static_range(n):
        m = x[j]
        for i in tl.static_range(1, n):
            m = tl.maximum(m, x[i * n + j])
        col_max = col_max + (m,)
    shifted = ()
    for k in tl.static_range(n * n):
        shifted = shifted + (x[k] - col_max[k % n],)
    K = ()
    u0 = ()
    for i in tl.static_range(n):
        rho = shifted[i * n]
        for j in tl.static_range(1, n):
            rho = tl.maximum(rho, shifted[i * n + j])
        for j in tl.static_range(n):
            K = K + (tl.exp(shifted[i * n + j] - rho),)
        u0 = u0 + (tl.exp(rho),)
    return u0, K


@triton.jit
def _column_sums(K, u, n: tl.constexpr):
    """``K^T u`` (``K`` in natural order, one token per thread)."""
    p = ()
    for j in tl.static_range(n):
        col_sum = K[j] * u[0]
        for i in tl.static_range(1, n):
            col_sum += K[i * n + j] * u[i]
        p = p + (col_sum,)
    return p


@triton.jit
def _row_sums(K, v, n: tl.constexpr):
    """``K v`` (``K`` in natural order, one token per thread)."""
    q = ()
    for i in tl.static_range(n):
        row_sum = K[i * n] * v[0]
        for j in tl.static_range(1, n):
            row_sum += K[i * n + j] * v[j]
        q = q + (row_sum,)
    return q


@triton.jit
def _reciprocals(s, n: tl.constexpr, FAST: tl.constexpr, PAIRS: tl.constexpr):
    """``1 / s`` entry by entry; the first ``PAIRS`` pairs ``(s_0, s_1), (s_2, s_3), ...``
    share one reciprocal (safe for any logits: :func:`absorb_period` bounds every sum)."""
    r = ()
    for p in tl.static_range(n // 2):
        if p < PAIRS:
            shared = _reciprocal(s[2 * p] * s[2 * p + 1], FAST)
            r = r + (shared * s[2 * p + 1], shared * s[2 * p])
        else:
            r = r + (_reciprocal(s[2 * p], FAST), _reciprocal(s[2 * p + 1], FAST))
    return r


@triton.jit
def _column_step(K, u, n: tl.constexpr, FAST: tl.constexpr):
    """``v = 1 / (K^T u)`` (``K`` in natural order, one token per thread)."""
    return _reciprocals(_column_sums(K, u, n), n, FAST, 0)


@triton.jit
def _row_step(K, v, n: tl.constexpr, FAST: tl.constexpr):
    """``u = 1 / (K v)`` (``K`` in natural order, one token per thread)."""
    return _reciprocals(_row_sums(K, v, n), n, FAST, 0)


@triton.jit
def _reverse_start(G, R, n: tl.constexpr):
    """Reverse mode through ``R = diag(u_T) K diag(v_T)`` (a block's absorption), in
    logarithmic form: ``(Gbar, da_T, db_T)`` with ``Gbar = dR * R`` the gradient with
    respect to ``log K`` of its direct use, and ``da_T, db_T`` (its row and column sums)
    those with respect to ``log u_T``, ``log v_T``."""
    Gbar = ()
    for k in tl.static_range(n * n):
        Gbar = Gbar + (G[k] * R[k],)
    da, db = _log_gradient_sums(Gbar, n)
    return Gbar, da, db


@triton.jit
def _log_gradient_sums(Gbar, n: tl.constexpr):
    """Row and column sums of ``Gbar`` (natural order): the gradients with respect to
    ``log u``, ``log v`` of ``E = diag(u) K diag(v)`` given ``Gbar = dL/dE * E``."""
    da = ()
    for i in tl.static_range(n):
        acc = Gbar[i * n]
        for j in tl.static_range(1, n):
            acc += Gbar[i * n + j]
        da = da + (acc,)
    db = ()
    for j in tl.static_range(n):
        acc = Gbar[j]
        for i in tl.static_range(1, n):
            acc += Gbar[i * n + j]
        db = db + (acc,)
    return da, db


@triton.jit
def _reverse_step(K, A, da, u_t, u_prev, v_t, db_out, n: tl.constexpr, LAST: tl.constexpr):
    """Reverse mode through iteration ``t`` of a block: ``(A, da_{t-1})`` from ``da_t``.

    ``da`` is the gradient with respect to ``log u_t`` (the scaling vectors' gradients
    in logarithmic form, ``du * u``, stay of the order of the gradient of ``R``); ``A``
    accumulates ``dL/dK`` of the iterations (``dX`` is ``A * K`` plus the direct term).
    ``LAST``: ``t`` is the block's last iteration, whose ``v_t`` also has the gradient
    ``db_out`` (logarithmic) from the absorption.
    """
    NN: tl.constexpr = n * n
    dq = ()  # dL/dq of u = 1 / q: -du u^2 = -da u
    for i in tl.static_range(n):
        dq = dq + (-da[i] * u_t[i],)
    dp = ()  # dL/dp of v = 1 / p, through db = v * (K^T dq) (+ db_out)
    for j in tl.static_range(n):
        acc = K[j] * dq[0]
        for i in tl.static_range(1, n):
            acc += K[i * n + j] * dq[i]
        db = acc * v_t[j]
        if LAST:
            db += db_out[j]
        dp = dp + (-db * v_t[j],)
    w = _row_sums(K, dp, n)
    da_prev = ()
    for i in tl.static_range(n):
        da_prev = da_prev + (w[i] * u_prev[i],)
    new_A = ()
    for k in tl.static_range(NN):
        if LAST:  # the block's first step back: A starts here
            new_A = new_A + (dq[k // n] * v_t[k % n] + u_prev[k // n] * dp[k % n],)
        else:
            new_A = new_A + (A[k] + dq[k // n] * v_t[k % n] + u_prev[k // n] * dp[k % n],)
    return new_A, da_prev


@triton.jit
def _block_log_gradient(Gbar, A, K, n: tl.constexpr):
    """The gradient with respect to ``log K`` of a block's matrix: ``Gbar + A * K``."""
    out = ()
    for k in tl.static_range(n * n):
        out = out + (Gbar[k] + A[k] * K[k],)
    return out


@triton.jit
def _zeros(NN: tl.constexpr, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    z = ()
    for k in tl.static_range(NN):
        z = z + (tl.zeros((BLOCK,), dtype=COMPUTE),)
    return z


@runtime.CachedLaunch
@triton.jit
def sinkhorn_unrolled_backward_small_kernel(logits_ptr, grad_ptr, out_ptr, num_tokens,
                                            n: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr,
                                            BLOCK: tl.constexpr, ABSORB: tl.constexpr, FAST: tl.constexpr,
                                            COMPUTE: tl.constexpr):
    """Unrolled backward, one token per thread, for ``n`` = 2, 4 and as many iterations as registers hold.

    Reverse mode on the scaling-vector form of the forward (see
    :func:`sinkhorn_forward_small_kernel`). Within a block of at most ``ABSORB``
    iterations on the matrix ``K`` (the balanced matrix, then each block's last
    iterate), from ``u_0`` (``u0``, then 1): ``p_t = K^T u_{t-1}``, ``v_t = 1/p_t``,
    ``q_t = K v_t``, ``u_t = 1/q_t``, and the block ends with ``K' = diag(u_T) K diag(v_T)``
    (the next block's matrix, or ``R``). Gradients are carried in logarithmic form,
    ``Gbar = dL/dK' * K'`` and ``da = dL/du * u``, which stay of the order of ``dR * R``
    however small entries of ``K`` are:

    * ``da_T = rowsum(Gbar)``, ``db_T = colsum(Gbar)``;
    * for ``t = T .. 1``: ``dq = -da_t u_t``; ``db_t = v_t (K^T dq)`` (``+ db_T`` at
      ``t = T``); ``dp = -db_t v_t``; ``da_{t-1} = u_{t-1} (K dp)``;
      ``A += dq v_t^T + u_{t-1} dp^T``;
    * the block's matrix gets ``Gbar + A * K``, the next ``Gbar`` down; the balanced
      matrix's is ``dX`` (its shifts have zero gradient; ``u0`` cancels).

    Within a block every ``u_i v_j`` is at most ``2^80`` (:func:`absorb_period`), so no
    term overflows. All scaling vectors (``2n`` numbers per iteration) and the block
    matrices stay in registers: the iterations are unrolled at compile time
    (``ITERS`` is a compile-time constant), so nothing but ``X``, ``dR`` and ``dX``
    touches memory.
    """
    NN: tl.constexpr = n * n
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offsets = tok[:, None] * NN + tl.arange(0, NN)[None, :]
    mask = tok[:, None] < num_tokens
    x = split_columns(tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(COMPUTE), BLOCK, NN, BITS)
    u, K = _shifted_exp_entries(x, n)
    ones = _ones(n, BLOCK, COMPUTE)
    Ks = (K,)  # Ks[b]: the matrix of block b
    us = (u,)  # us[t] = u_t (us[0] = u0)
    vs = ()  # vs[t - 1] = v_t
    v = u
    for t in tl.static_range(ITERS):
        if t > 0 and t % ABSORB == 0:
            K = _scaled_entries(u, K, v, n)
            Ks = Ks + (K,)
            u = ones
        v = _column_step(K, u, n, FAST)
        u = _row_step(K, v, n, FAST)
        us = us + (u,)
        vs = vs + (v,)
    G = split_columns(tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(COMPUTE), BLOCK, NN, BITS)
    Gbar, da, db_out = _reverse_start(G, _scaled_entries(u, K, v, n), n)
    # Iteration t belongs to block (t - 1) // ABSORB; indices are expressions of the loop
    # variable, since a name assigned inside static_range is not a compile-time constant.
    A = _zeros(NN, BLOCK, COMPUTE)
    for t in tl.static_range(ITERS, 0, -1):
        if (t - 1) % ABSORB == 0 and t > 1:
            u_prev = ones
        else:
            u_prev = us[t - 1]
        A, da = _reverse_step(Ks[(t - 1) // ABSORB], A, da, us[t], u_prev, vs[t - 1], db_out, n,
                              t == ITERS or t % ABSORB == 0)
        if (t - 1) % ABSORB == 0:  # the block's first iteration: on to the block below
            Gbar = _block_log_gradient(Gbar, A, Ks[(t - 1) // ABSORB], n)
            if t > 1:
                da, db_out = _log_gradient_sums(Gbar, n)
                A = _zeros(NN, BLOCK, COMPUTE)
    tl.store(out_ptr + offsets, join_columns(Gbar, BLOCK, NN, BITS).to(out_ptr.dtype.element_ty), mask=mask)


@runtime.CachedLaunch
@triton.jit
def sinkhorn_unrolled_backward_scratch_kernel(logits_ptr, grad_ptr, out_ptr, scratch_ptr, checkpoint_ptr,
                                              num_tokens, iters, num_tiles, n: tl.constexpr, BITS: tl.constexpr,
                                              BLOCK: tl.constexpr, ABSORB: tl.constexpr, FAST: tl.constexpr,
                                              COMPUTE: tl.constexpr, PTX: tl.constexpr):
    """The unrolled backward of :func:`sinkhorn_unrolled_backward_small_kernel` for any
    number of iterations, one token per thread, ``u_t`` kept in a scratch buffer.

    Where the scaling vectors of every iteration do not fit in registers (``n`` = 8, or
    many iterations), the forward loop (a run-time loop: no unrolling) stores each
    ``u_t`` in this program's slice of ``scratch``, ``(iters + 1, n, BLOCK)`` per
    program, and the matrix of every block in its slice of ``checkpoints``
    (``(blocks, n * n, BLOCK)``: no matrix stays in registers across the two loops);
    the reverse loop reads them back from the newest, recomputing
    ``v_t = 1 / (K^T u_{t-1})`` (the same operations in the same order, so the same
    bits). Programs loop over tiles of ``BLOCK`` tokens, so the scratch is a few MB
    whatever the number of tokens, and stays in L2. ``PTX`` (compiled code only): the
    scratch and checkpoint accesses as inline PTX (:func:`_scratch_load`).
    """
    NN: tl.constexpr = n * n
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    cols = tl.arange(0, NN)
    slot_size = n * BLOCK
    matrix_size = NN * BLOCK
    num_blocks = (iters + ABSORB - 1) // ABSORB
    base = scratch_ptr + pid.to(tl.int64) * (iters + 1) * slot_size + lanes
    matrices = checkpoint_ptr + pid.to(tl.int64) * num_blocks * matrix_size + lanes
    ones = _ones(n, BLOCK, COMPUTE)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        tok = tile * BLOCK + lanes
        offsets = tok[:, None].to(tl.int64) * NN + cols[None, :]
        mask = tok[:, None] < num_tokens
        # X, dR and dX pass through once: marked to leave L2 first, so that the scratch stays
        x = split_columns(tl.load(logits_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
                          .to(COMPUTE), BLOCK, NN, BITS)
        u, K = _shifted_exp_entries(x, n)
        _store_vector(base, u, n, BLOCK, PTX)
        v = u
        for b in range(num_blocks):
            _store_vector(matrices + b * matrix_size, K, NN, BLOCK, PTX)
            for t in range(b * ABSORB, tl.minimum(b * ABSORB + ABSORB, iters)):
                v = _column_step(K, u, n, FAST)
                u = _row_step(K, v, n, FAST)
                _store_vector(base + (t + 1) * slot_size, u, n, BLOCK, PTX)
            K = _scaled_entries(u, K, v, n)
            u = ones
        tl.debug_barrier()  # the reverse loop may read what other threads of the program wrote
        G = split_columns(tl.load(grad_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
                          .to(COMPUTE), BLOCK, NN, BITS)
        Gbar, da, db_out = _reverse_start(G, K, n)
        for b_back in range(num_blocks):
            b = num_blocks - 1 - b_back
            K = _load_vector(matrices + b * matrix_size, NN, BLOCK, PTX)
            start = b * ABSORB
            count = tl.minimum(ABSORB, iters - start)
            if b_back > 0:
                da, db_out = _log_gradient_sums(Gbar, n)
            # Gbar waits in the block's checkpoint until the block's end (its registers are
            # needed meanwhile); the barriers: layouts may give a lane to another thread
            tl.debug_barrier()
            _store_vector(matrices + b * matrix_size, Gbar, NN, BLOCK, PTX)
            u_t = _load_vector(base + (start + count) * slot_size, n, BLOCK, PTX)
            # the u entering a block's first iteration: u0 (slot 0), or 1 after an absorption
            u_prev = _load_scaling(base + (start + count - 1) * slot_size, (count == 1) & (b > 0), n, BLOCK, PTX)
            # one iteration ahead, so that the load's latency hides behind a reverse step
            u_next = _load_scaling(base + tl.maximum(start + count - 2, 0) * slot_size, (count == 2) & (b > 0),
                                   n, BLOCK, PTX)
            A, da = _reverse_step(K, K, da, u_t, u_prev, _column_step(K, u_prev, n, FAST), db_out, n, True)
            for back in range(1, count):
                u_t = u_prev
                u_prev = u_next
                t = start + count - back  # the iteration whose input u_prev is
                u_next = _load_scaling(base + tl.maximum(t - 2, 0) * slot_size, (t - 2 == start) & (b > 0),
                                       n, BLOCK, PTX)
                A, da = _reverse_step(K, A, da, u_t, u_prev, _column_step(K, u_prev, n, FAST), db_out, n, False)
            tl.debug_barrier()
            Gbar = _block_log_gradient(_load_pinned(matrices + b * matrix_size, NN, BLOCK, PTX), A, K, n)
        tl.store(out_ptr + offsets, join_columns(Gbar, BLOCK, NN, BITS).to(out_ptr.dtype.element_ty), mask=mask,
                 cache_modifier=".cs")
        tl.debug_barrier()  # the next tile overwrites the scratch


@triton.jit
def _scratch_load(ptrs, PTX: tl.constexpr):
    """``*ptrs``, a ``[BLOCK]`` vector of the scratch or checkpoint buffers (32- or 64-bit floats).

    With ``PTX`` (compiled code only: the interpreter runs no PTX) one ``ld.global`` in
    inline PTX, which the compiler's coalescing pass does not see. That pass relates
    every ``tl.load`` and ``tl.store`` to every other operation in its data flow, at a
    cost that grows with the number of accesses times (more than) the kernel's size: at
    ``n = 8`` the kernel's few hundred vector accesses (every entry of a matrix is one)
    would spend minutes there. Lane ``t`` reads token ``t``'s entry, so the access is
    coalesced as written. Not pure: it stays in order with the stores.
    """
    if PTX:
        if ptrs.dtype.element_ty == tl.float64:
            return tl.inline_asm_elementwise("ld.global.b64 $0, [$1];", "=l,l", [ptrs.to(tl.int64)],
                                             dtype=tl.float64, is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ptrs.to(tl.int64)],
                                             dtype=tl.float32, is_pure=False, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _scratch_store(ptrs, value, PTX: tl.constexpr):
    """``*ptrs = value`` (see :func:`_scratch_load`; the asm's output is a placeholder)."""
    if PTX:
        if ptrs.dtype.element_ty == tl.float64:
            tl.inline_asm_elementwise("st.global.b64 [$1], $2; mov.b32 $0, 0;", "=r,l,l", [ptrs.to(tl.int64), value],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("st.global.b32 [$1], $2; mov.b32 $0, 0;", "=r,l,r", [ptrs.to(tl.int64), value],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, value)


@triton.jit
def _store_vector(ptrs, vec, n: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr):
    for i in tl.static_range(n):
        _scratch_store(ptrs + i * BLOCK, vec[i], PTX)


@triton.jit
def _load_vector(ptrs, n: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr):
    vec = ()
    for i in tl.static_range(n):
        vec = vec + (_scratch_load(ptrs + i * BLOCK, PTX),)
    return vec


@triton.jit
def _load_pinned(ptrs, n: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr):
    """:func:`_load_vector` with its first entry read by ``tl.load``, for the values that
    the output's :func:`join_columns` takes.

    The layout pass moves the output store's layout conversion up through every
    operation it can recompute in the store's layout; with only inline-PTX loads
    upstream it moves it into the tree of joins, one shared-memory round trip per piece
    instead of one for the whole tile. A ``tl.load`` is not recomputed, which keeps the
    conversion at the store.
    """
    return (tl.load(ptrs),) + _load_vector(ptrs + BLOCK, n - 1, BLOCK, PTX)


@triton.jit
def _load_scaling(ptrs, reset, n: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr):
    """:func:`_load_vector`, or ``u = 1`` where the scalar ``reset`` holds (after an absorption)."""
    vec = ()
    for i in tl.static_range(n):
        vec = vec + (tl.where(reset, 1.0, _scratch_load(ptrs + i * BLOCK, PTX)),)
    return vec


# ---------------------------------------------------------------------------------------
# configurations and launchers


class Layout(enum.Enum):
    """How a program holds its tokens."""

    #: a ``[BLOCK, N, N]`` tile spread over the program's threads, ``n`` padded to ``N = 2^k``
    TILE = "tile"
    #: whole matrices in one thread's registers (``n`` in 2, 4, 8)
    TOKEN_PER_THREAD = "token per thread"
    #: a matrix across ``N / 4`` lanes of a warp, four columns a lane (the forward for ``n``
    #: from 9 to 32, the direct implicit backward from 9 to 16)
    COLUMN_GROUP = "column group"


#: ``n`` the one-token-per-thread kernels are written for
_TOKEN_PER_THREAD_N = (2, 4, 8)
#: ``n`` the column-group forward takes (at least two lanes of four columns)
_COLUMN_GROUP_N = range(9, MAX_KERNEL_N + 1)
#: ``n`` the column-group implicit backward takes: four lanes. With eight, a lane's
#: share of ``W`` (128 entries) leaves room for two programs an SM, and the one-warp
#: tile kernel is faster.
_COLUMN_GROUP_IMPLICIT_N = range(9, 17)
_NO_COLUMN_GROUP = range(0)
#: most elements one launch touches per tensor: the kernels index within a launch with
#: 32-bit offsets, so the launchers run bigger inputs in slices of whole tokens
_MAX_LAUNCH_ELEMENTS = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What the configuration of every kernel family holds."""

    layout: Layout
    #: tokens per program
    block: int
    num_warps: int
    #: most elements of a tensor one launch takes (beyond: slices of whole tokens)
    max_launch_elements: int = _MAX_LAUNCH_ELEMENTS
    #: registers per thread the compiler may use (``None``: its own choice)
    max_registers: Optional[int] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig(LaunchConfig):
    """How :func:`sinkhorn_forward_triton` runs (chosen by :func:`forward_config`)."""

    #: ``TOKEN_PER_THREAD``: two tokens a thread, the second half an iteration behind
    staggered: bool
    #: ``staggered``: pairs of sums per half-step that share one reciprocal
    reciprocal_pairs: int
    #: iterations between absorptions of the scaling vectors into the matrix (:func:`absorb_period`)
    absorb_every: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImplicitBackwardConfig(LaunchConfig):
    """How :func:`sinkhorn_implicit_backward_triton` runs (chosen by :func:`implicit_backward_config`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnrolledBackwardConfig(LaunchConfig):
    """How :func:`sinkhorn_unrolled_backward_triton` runs (chosen by :func:`unrolled_backward_config`)."""

    #: ``TOKEN_PER_THREAD``: the ``u_t`` of every iteration in a per-program scratch buffer
    #: (run-time loops) instead of registers (iterations unrolled at compile time)
    scratch: bool
    #: ``scratch`` on a GPU: programs per SM, each looping over tiles
    scratch_programs_per_sm: int
    #: ``TOKEN_PER_THREAD``: iterations between absorptions of the scaling vectors into the
    #: matrix (:func:`absorb_period`); the tile kernel iterates on the matrix itself
    absorb_every: int


def _layout(n: int, layout: Optional[Layout], token_per_thread_possible: bool = True,
            column_group_n: range = _NO_COLUMN_GROUP) -> Layout:
    """``layout``, or the default for ``n``: one token per thread, else a column group
    (for ``n`` in ``column_group_n``), wherever its kernel exists, else tiles."""
    possible = token_per_thread_possible and n in _TOKEN_PER_THREAD_N
    group = n in column_group_n
    if layout is None:
        return Layout.TOKEN_PER_THREAD if possible else Layout.COLUMN_GROUP if group else Layout.TILE
    if layout is Layout.COLUMN_GROUP and not group:
        which = (f"n from {column_group_n.start} to {column_group_n.stop - 1}" if column_group_n
                 else "the forward and the direct implicit backward only")
        raise ValueError(f"layout Layout.COLUMN_GROUP takes {which}; got n = {n}")
    if layout is Layout.TOKEN_PER_THREAD and not possible:
        solve = "" if token_per_thread_possible else " and solve directly (cg_iters None)"
        raise ValueError(f"layout must be Layout.TILE: the one-token-per-thread kernels take n in "
                         f"{_TOKEN_PER_THREAD_N}{solve}; got n = {n}")
    return layout


def _tile_block(N: int, elements_per_program: int) -> int:
    return max(1, elements_per_program // (N * N))


def _tile_warps(block: int, N: int) -> int:
    return 4 if block * N * N <= 2048 else 8


def _backward_tile_shape(N: int, elements_per_program: int):
    """``(block, num_warps)`` of a backward's tile. From ``N = 16`` on a program is one
    warp holding one matrix: the solve and the reverse sweep reduce along both axes
    many times a matrix, which inside a warp are shuffles, and across warps shared
    memory and a barrier each."""
    if N >= 16:
        return 1, 1
    block = _tile_block(N, elements_per_program)
    return block, _tile_warps(block, N)


def _token_per_thread_block(n: int, dtype: torch.dtype) -> int:
    # one token per thread (block // 32 warps); fewer tokens where a token needs many registers
    return 128 if n <= 4 and dtype != torch.float64 else 64


def _group_lanes(n: int) -> int:
    """Lanes a column-group kernel spreads one ``n x n`` matrix over."""
    return runtime.next_power_of_2(n) // _GROUP_COLUMNS


def _column_group_shape(n: int):
    """``(block, num_warps)`` of a column-group program: four warps, each covering
    ``32 / lanes`` tokens."""
    return 128 // _group_lanes(n), 4


@functools.lru_cache(maxsize=None)
def forward_config(n: int, dtype: torch.dtype, *, layout: Optional[Layout] = None) -> ForwardConfig:
    """The forward's configuration for ``n x n`` matrices of ``dtype`` (``layout``: force one)."""
    layout = _layout(n, layout, column_group_n=_COLUMN_GROUP_N)
    if layout is Layout.COLUMN_GROUP:
        if _group_lanes(n) == 8 and dtype == torch.float32:
            # About 186 registers a thread leave room for 10 warps an SM (8 in programs of
            # four warps); capped at 168, a few values spill to cache and 12 one-warp
            # programs of 32 / 8 tokens fit.
            block, num_warps, max_registers = 4, 1, 168
        else:
            (block, num_warps), max_registers = _column_group_shape(n), None
        return ForwardConfig(layout=layout, block=block, num_warps=num_warps, staggered=False, reciprocal_pairs=0,
                             absorb_every=absorb_period(n), max_registers=max_registers)
    if layout is Layout.TILE:
        N = runtime.next_power_of_2(n)
        block = _tile_block(N, 2048)
        return ForwardConfig(layout=layout, block=block, num_warps=_tile_warps(block, N), staggered=False,
                             reciprocal_pairs=0, absorb_every=absorb_period(n))
    # at n = 8 a thread's registers hold one token only
    staggered = n in (2, 4)
    block = _token_per_thread_block(n, dtype)
    threads = block // 2 if staggered else block
    # shared reciprocals in float32 only, where one replaces a special-function instruction
    pairs = 1 if staggered and dtype != torch.float64 else 0
    return ForwardConfig(layout=layout, block=block, num_warps=max(1, threads // 32), staggered=staggered,
                         reciprocal_pairs=pairs, absorb_every=absorb_period(n))


@functools.lru_cache(maxsize=None)
def implicit_backward_config(n: int, dtype: torch.dtype, conjugate_gradient: bool, *,
                             layout: Optional[Layout] = None) -> ImplicitBackwardConfig:
    """The implicit backward's configuration (the one-token-per-thread kernel solves directly only)."""
    layout = _layout(n, layout, token_per_thread_possible=not conjugate_gradient,
                     column_group_n=_NO_COLUMN_GROUP if conjugate_gradient else _COLUMN_GROUP_IMPLICIT_N)
    if layout is Layout.COLUMN_GROUP:
        block, num_warps = _column_group_shape(n)
        return ImplicitBackwardConfig(layout=layout, block=block, num_warps=num_warps)
    if layout is Layout.TILE:
        block, num_warps = _backward_tile_shape(runtime.next_power_of_2(n), 1024)
        return ImplicitBackwardConfig(layout=layout, block=block, num_warps=num_warps)
    block = _token_per_thread_block(n, dtype)
    return ImplicitBackwardConfig(layout=layout, block=block, num_warps=max(1, block // 32))


@functools.lru_cache(maxsize=None)
def unrolled_backward_config(n: int, dtype: torch.dtype, iters: int, *,
                             layout: Optional[Layout] = None) -> UnrolledBackwardConfig:
    """The unrolled backward's configuration for ``iters`` iterations."""
    layout = _layout(n, layout)
    if layout is Layout.TILE:
        block, num_warps = _backward_tile_shape(runtime.next_power_of_2(n), 512)
        return UnrolledBackwardConfig(layout=layout, block=block, num_warps=num_warps, scratch=False,
                                      max_registers=None, scratch_programs_per_sm=0, absorb_every=absorb_period(n))
    # most iterations whose scaling vectors the registers hold, per n
    scratch = iters > {2: 32, 4: 24, 8: 0}[n]
    block = _token_per_thread_block(n, dtype)
    if n == 4 and scratch:
        # the programs loop over tiles, so all of them should be resident at once: in
        # float32 eight programs of 64 tokens fit an SM's registers; of 128 tokens seven
        # would, and the eighth would run its share of the tiles alone afterwards
        block = 64
    max_registers = None
    if n == 4 and not scratch and dtype != torch.float64:
        # a register cap trades a few spills (which stay in cache) for more warps per SM
        block, max_registers = 64, 168
    return UnrolledBackwardConfig(layout=layout, block=block, num_warps=max(1, block // 32), scratch=scratch,
                                  max_registers=max_registers, scratch_programs_per_sm=8 if scratch else 0,
                                  absorb_every=absorb_period(n))


def _compute_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _fast(dtype: torch.dtype) -> bool:
    return dtype != torch.float64 and not runtime.INTERPRETED


def _token_slices(T: int, n: int, max_launch_elements: int):
    """Slices of at most ``max_launch_elements`` elements, starting at multiples of
    128 tokens: the kernels' tiles then fall where one launch would put them, and every
    slice keeps 16-byte alignment."""
    per = max(128, max_launch_elements // (n * n) // 128 * 128)
    return [slice(start, min(T, start + per)) for start in range(0, T, per)]


def _launch_in_slices(launch, tensors, *arguments) -> torch.Tensor:
    """A new output like ``tensors[0]``, written by ``launch(out, *tensors, *arguments)`` on
    each of :func:`_token_slices` (none for no tokens); the last argument is the configuration."""
    T, n, _ = tensors[0].shape
    out = torch.empty_like(tensors[0])
    parts = _token_slices(T, n, arguments[-1].max_launch_elements)
    if len(parts) == 1:  # the common case, without the views (a few microseconds of host time each)
        launch(out, *tensors, *arguments)
        return out
    for part in parts:
        launch(out[part], *(t[part] for t in tensors), *arguments)
    return out


def _bits(n: int) -> int:
    """``log2`` of the ``N * N`` register columns a one-token-per-thread kernel splits a tile into."""
    return 2 * (runtime.next_power_of_2(n).bit_length() - 1)


@runtime.on_inputs_device
def sinkhorn_forward_triton(logits: torch.Tensor, iters: int, config: ForwardConfig) -> torch.Tensor:
    """``(T, n, n)`` contiguous logits -> ``(T, n, n)`` doubly stochastic (approximately) ``R``."""
    return _launch_in_slices(_launch_forward, (logits,), iters, config)


def _launch_forward(out, logits, iters, config: ForwardConfig):
    T, n, _ = logits.shape
    grid = (runtime.cdiv(T, config.block),)
    if config.layout is Layout.TOKEN_PER_THREAD:
        sinkhorn_forward_small_kernel[grid](logits, out, T, iters, n=n, BITS=_bits(n),
                                            BLOCK=config.block, ABSORB=config.absorb_every,
                                            FAST=_fast(logits.dtype),
                                            COMPUTE=_compute_dtype(logits.dtype), STAGGER=config.staggered,
                                            PAIRS=config.reciprocal_pairs, num_warps=config.num_warps)
        return
    if config.layout is Layout.COLUMN_GROUP:
        sinkhorn_forward_group_kernel[grid](logits, out, T, iters, n=n, LANES=_group_lanes(n), BLOCK=config.block,
                                            ABSORB=config.absorb_every, FAST=_fast(logits.dtype),
                                            COMPUTE=_compute_dtype(logits.dtype), num_warps=config.num_warps,
                                            **runtime.register_cap(config.max_registers))
        return
    N = runtime.next_power_of_2(n)
    sinkhorn_forward_kernel[grid](logits, out, T, iters, n=n, N=N, BLOCK=config.block,
                                  ABSORB=config.absorb_every, FLAT=n == N,
                                  FAST=_fast(logits.dtype),
                                  COMPUTE=_compute_dtype(logits.dtype),
                                  num_warps=config.num_warps)


def checkpoint_segments(iters: int):
    """``(seg_len, num_segs, SEG, SEGS)``: checkpoint segments minimising registers per token."""
    best = None
    seg_len = 1
    while True:
        num_segs = math.ceil(iters / seg_len)
        cost = runtime.next_power_of_2(num_segs) * 4 + 2 * seg_len  # checkpoint matrices weigh more than sums
        if best is None or cost < best[0]:
            best = (cost, seg_len, num_segs)
        if seg_len >= iters:
            break
        seg_len *= 2
    _, seg_len, num_segs = best
    return seg_len, num_segs, seg_len, runtime.next_power_of_2(num_segs)


#: programs of the scratch variant under the interpreter, which runs them one after another
_INTERPRETED_SCRATCH_PROGRAMS = 4


@runtime.on_inputs_device
def sinkhorn_unrolled_backward_triton(logits: torch.Tensor, grad_R: torch.Tensor, iters: int,
                                      config: UnrolledBackwardConfig) -> torch.Tensor:
    """``(T, n, n)`` logits and ``dL/dR`` -> ``dL/dlogits`` of the ``iters``-step map."""
    return _launch_in_slices(_launch_unrolled_backward, (logits, grad_R), iters, config)


def _launch_unrolled_backward(out, logits, grad_R, iters, config: UnrolledBackwardConfig):
    T, n, _ = logits.shape
    if config.layout is Layout.TOKEN_PER_THREAD and config.scratch:
        _launch_unrolled_backward_scratch(out, logits, grad_R, iters, config)
        return
    grid = (runtime.cdiv(T, config.block),)
    if config.layout is Layout.TOKEN_PER_THREAD:
        sinkhorn_unrolled_backward_small_kernel[grid](logits, grad_R, out, T, n=n, BITS=_bits(n),
                                                      ITERS=iters, BLOCK=config.block,
                                                      ABSORB=config.absorb_every, FAST=_fast(logits.dtype),
                                                      COMPUTE=_compute_dtype(logits.dtype),
                                                      num_warps=config.num_warps,
                                                      **runtime.register_cap(config.max_registers))
        return
    N = runtime.next_power_of_2(n)
    seg_len, num_segs, SEG, SEGS = checkpoint_segments(iters)
    sinkhorn_unrolled_backward_kernel[grid](logits, grad_R, out, T, iters, seg_len, num_segs,
                                            n=n, N=N, BLOCK=config.block, SEGS=SEGS, SEG=SEG, FLAT=n == N,
                                            FAST=_fast(logits.dtype),
                                            COMPUTE=_compute_dtype(logits.dtype),
                                            num_warps=config.num_warps)


def _launch_unrolled_backward_scratch(out, logits, grad_R, iters, config: UnrolledBackwardConfig):
    T, n, _ = logits.shape
    BLOCK = config.block
    num_tiles = runtime.cdiv(T, BLOCK)
    if runtime.INTERPRETED or logits.device.type != "cuda":
        programs = min(num_tiles, _INTERPRETED_SCRATCH_PROGRAMS)
    else:
        programs = min(num_tiles, runtime.sm_count(logits.device) * config.scratch_programs_per_sm)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scratch = torch.empty((programs, iters + 1, n, BLOCK), dtype=compute, device=logits.device)
    # the matrix of every block of absorb_every iterations
    blocks = runtime.cdiv(iters, config.absorb_every)
    checkpoints = torch.empty((programs, blocks, n * n, BLOCK), dtype=compute, device=logits.device)
    sinkhorn_unrolled_backward_scratch_kernel[(programs,)](
        logits, grad_R, out, scratch, checkpoints, T, iters, num_tiles, n=n, BITS=_bits(n),
        BLOCK=BLOCK, ABSORB=config.absorb_every, FAST=_fast(logits.dtype), COMPUTE=_compute_dtype(logits.dtype),
        PTX=not runtime.INTERPRETED, num_warps=config.num_warps)


@runtime.on_inputs_device
def sinkhorn_implicit_backward_triton(R: torch.Tensor, grad_R: torch.Tensor, cg_iters: Optional[int],
                                      config: ImplicitBackwardConfig) -> torch.Tensor:
    """``(T, n, n)`` ``R`` and ``dL/dR`` -> implicit ``dL/dlogits`` (direct solve, or CG if ``cg_iters``)."""
    if config.layout is not Layout.TILE and cg_iters is not None:
        raise ValueError(f"the implicit backward in {config.layout} solves directly: cg_iters must be None")
    return _launch_in_slices(_launch_implicit_backward, (R, grad_R), cg_iters, config)


def _launch_implicit_backward(out, R, grad_R, cg_iters, config: ImplicitBackwardConfig):
    T, n, _ = R.shape
    eps = torch.finfo(torch.float64 if R.dtype == torch.float64 else torch.float32).eps
    grid = (runtime.cdiv(T, config.block),)
    if config.layout is Layout.TOKEN_PER_THREAD:
        sinkhorn_implicit_backward_small_kernel[grid](R, grad_R, out, T, eps, n=n, BITS=_bits(n),
                                                      BLOCK=config.block, COMPUTE=_compute_dtype(R.dtype),
                                                      num_warps=config.num_warps)
        return
    if config.layout is Layout.COLUMN_GROUP:
        sinkhorn_implicit_backward_group_kernel[grid](R, grad_R, out, T, eps, n=n, LANES=_group_lanes(n),
                                                      BLOCK=config.block, COMPUTE=_compute_dtype(R.dtype),
                                                      num_warps=config.num_warps)
        return
    N = runtime.next_power_of_2(n)
    sinkhorn_implicit_backward_kernel[grid](R, grad_R, out, T, 0 if cg_iters is None else int(cg_iters),
                                            (n * eps) ** 2, eps,
                                            n=n, N=N, BLOCK=config.block, USE_CG=cg_iters is not None,
                                            FLAT=n == N,
                                            COMPUTE=_compute_dtype(R.dtype),
                                            num_warps=config.num_warps)
