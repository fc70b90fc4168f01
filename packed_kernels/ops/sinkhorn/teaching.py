"""A teaching kernel: the Sinkhorn forward, one matrix per program, in log space.

For logits ``X`` of one ``n x n`` matrix, Sinkhorn alternates two normalisations,
columns first, then rows. Written on ``L = log E`` instead of ``E``, dividing by a sum
becomes subtracting a log-sum-exp::

    L <- L - logsumexp(L, axis=0)[None, :]     (every column of exp(L) sums to 1)
    L <- L - logsumexp(L, axis=1)[:, None]     (every row of exp(L) sums to 1)

starting from ``L = X`` and repeated ``iters`` times; the result is ``R = exp(L)``.
Each log-sum-exp subtracts its largest term before ``exp``
(``logsumexp(a) = m + log(sum(exp(a - m)))`` with ``m = max(a)``), so no ``exp``
overflows, whatever the logits. These are the iterations of
:func:`.naive_numpy.sinkhorn_numpy`, which divides by the sums themselves.

One program loads one whole matrix as an ``[n, n]`` block (``n`` a power of two,
Triton's block shapes), runs every iteration on it in registers and writes ``R`` once.
That is the core of the production kernels in :mod:`.triton_kernels`, which add tiles
of many matrices per program, any ``n``, the scaling-vector form of the iterations
(reciprocals instead of ``exp`` and ``log``), and the two backwards.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import runtime  # noqa: F401  (imported first: decides interpret vs compile)


@triton.jit
def sinkhorn_teaching_kernel(logits_ptr, out_ptr, iters, N: tl.constexpr):
    """``R = exp(L)`` after ``iters`` column-then-row log-space normalisations of one
    ``N x N`` matrix (``L = logits`` at the start); program ``t`` takes matrix ``t``."""
    matrix = tl.program_id(0).to(tl.int64)  # 64-bit: T * N * N may pass 2^31
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, N)[None, :]
    offsets = matrix * N * N + rows * N + cols  # the matrix is N * N contiguous floats
    L = tl.load(logits_ptr + offsets).to(tl.float32)
    for _ in range(iters):
        # columns: subtract each column's log-sum-exp (largest entry taken out first)
        top = tl.max(L, axis=0)
        L = L - (top + tl.log(tl.sum(tl.exp(L - top[None, :]), axis=0)))[None, :]
        # rows: the same along the other axis; the rows now sum to one
        top = tl.max(L, axis=1)
        L = L - (top + tl.log(tl.sum(tl.exp(L - top[:, None]), axis=1)))[:, None]
    tl.store(out_ptr + offsets, tl.exp(L))


def sinkhorn_teaching(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """``(T, n, n)`` logits (``n`` a power of two, ``iters >= 1``) -> ``(T, n, n)``
    float32 ``R``, computed in float32, one program per matrix."""
    if logits.dim() != 3 or logits.shape[1] != logits.shape[2]:
        raise ValueError(f"logits: expected shape (T, n, n), got {tuple(logits.shape)}")
    T, n, _ = logits.shape
    if n & (n - 1):
        raise ValueError(f"logits: n must be a power of two, got n = {n}")
    if iters < 1:
        raise ValueError(f"iters: expected at least 1, got {iters}")
    logits = logits.contiguous().float()
    out = torch.empty_like(logits)
    if T > 0:  # one matrix is a few registers a thread: one warp per program
        sinkhorn_teaching_kernel[(T,)](logits, out, iters, N=n, num_warps=1)
    return out
