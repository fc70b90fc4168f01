"""Stage 2: batched Sinkhorn in plain PyTorch over ``(..., n, n)``.

* :func:`sinkhorn_padded`: the iterations as tensor operations; autograd through the
  loop gives the exact gradient of the ``iters``-step map (the reference of the
  unrolled Triton backward). Every iteration reads and writes the whole tensor
  (several times), and autograd keeps every iterate for the backward.
* :func:`column_laplacian`: the well-conditioned form of the implicit system (see
  below), shared with the conjugate-gradient backward.
* :func:`implicit_backward_padded`: the implicit gradient by batched conjugate
  gradient on that system (``cg_iters`` steps, default ``2n``).
* :func:`implicit_backward_eps_cg_padded`: the approach of published kernels, kept as
  a comparison point: plain conjugate gradient on the ``2n x 2n`` system
  ``[[I, R], [R^T, I]]`` with an epsilon added to its denominators.

The well-conditioned form. Writing ``dlogits = R * (dR - alpha[:, None] - beta[None, :])``,
the implicit gradient is the one whose rows and columns all sum to zero. With
``a = rowsum(R*dR)``, ``b = colsum(R*dR)``, ``r = rowsum(R)``, ``c = colsum(R)``:

    diag(r) alpha + R beta = a,        R^T alpha + diag(c) beta = b.

(For a doubly stochastic ``R``, ``r = c = 1`` and this is exactly the system
``[[I, R], [R^T, I]]``.) Eliminating ``alpha = (a - R beta) / r`` leaves
``L beta = h`` with ``h = b - R^T (a / r)`` and ``L = diag(c) - R^T diag(1/r) R``:
the Laplacian of the graph on the columns with edge weights
``W[j, k] = sum_i R[i, j] R[i, k] / r[i]``. Its diagonal ``c[j] - W[j, j]`` equals
``sum_{k != j} W[j, k]`` exactly, and computing it that way avoids the cancellation
``1 - (nearly 1)`` that ruins float32 near a permutation. ``L`` has the null vector
``1`` for *any* positive ``R`` and ``sum(h) = 0`` always, so the system is consistent
even when ``R`` is not exactly doubly stochastic (after finitely many iterations,
or rounded to bfloat16).
"""
from __future__ import annotations

from typing import Optional

import torch


def sinkhorn_padded(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """``(..., n, n)`` logits -> ``(..., n, n)`` matrices, computed in the input dtype.

    ``iters >= 1``. Differentiable by autograd (the gradient of the ``iters``-step map).
    The first iteration is taken in the log domain: its column step is a softmax over
    dim -2 (``logits - logsumexp``), its row step a softmax over dim -1 of that
    logarithm. Dividing ``exp(logits - colmax)`` by its sums instead fails where a whole
    row lies far below its column maxima (its entries and its sum underflow: ``0 / 0``).
    From then on the rows sum to 1 and every sum lies in ``[1/n, n]``.
    """
    E = torch.softmax(logits - torch.logsumexp(logits, dim=-2, keepdim=True), dim=-1)
    for _ in range(iters - 1):
        E = E / E.sum(dim=-2, keepdim=True)
        E = E / E.sum(dim=-1, keepdim=True)
    return E


def column_laplacian(R: torch.Tensor, grad_R: torch.Tensor):
    """The pieces of the well-conditioned implicit system for a batch ``(..., n, n)``.

    Returns ``(W, degree, h, a, inv_r)``: off-diagonal edge weights ``W`` (zero
    diagonal), the Laplacian diagonal ``degree = W.sum(-1)``, the right-hand side
    ``h`` (``L beta = h``), the row sums ``a`` of ``R*dR`` and ``1/rowsum(R)``
    (zero for an empty row).
    """
    G = R * grad_R
    a = G.sum(-1)
    b = G.sum(-2)
    r = R.sum(-1)
    inv_r = torch.where(r > 0, 1.0 / torch.where(r > 0, r, torch.ones_like(r)), torch.zeros_like(r))
    W = (R * inv_r[..., :, None]).transpose(-1, -2) @ R
    W = W - torch.diag_embed(torch.diagonal(W, dim1=-2, dim2=-1))
    degree = W.sum(-1)
    h = b - ((inv_r * a)[..., :, None] * R).sum(-2)
    return W, degree, h, a, inv_r


def _finish_implicit(R, grad_R, beta, a, inv_r):
    alpha = inv_r * (a - (R * beta[..., None, :]).sum(-1))
    return R * (grad_R - alpha[..., :, None] - beta[..., None, :])


def implicit_backward_padded(R: torch.Tensor, grad_R: torch.Tensor, cg_iters: Optional[int] = None) -> torch.Tensor:
    """Implicit gradient by batched conjugate gradient on the column Laplacian.

    ``R``, ``grad_R``: ``(..., n, n)``, computed in their dtype. ``cg_iters`` defaults to
    ``2n``. The Laplacian is shifted by one rounding unit times each column's mass
    (``L + eps diag(c)``), which damps the modes below rounding level (near a
    permutation, blocks of columns linked only by negligible entries) instead of
    amplifying the rounding noise of ``h`` along them; a matrix stops once its
    residual is at rounding level, and the divisions are guarded for exact
    convergence (a zero residual) instead of being padded with an epsilon.
    """
    n = R.shape[-1]
    iters = 2 * n if cg_iters is None else int(cg_iters)
    W, degree, h, a, inv_r = column_laplacian(R, grad_R)
    h = h - h.mean(-1, keepdim=True)  # exact consistency despite rounding
    # A shift of one rounding unit per column mass: modes of L below rounding level
    # (blocks of columns linked only through negligible entries of R) are damped
    # instead of solved, which would divide rounding noise by their tiny eigenvalue.
    degree = degree + torch.finfo(R.dtype).eps * R.sum(-2)

    def apply_laplacian(x):
        return degree * x - (W @ x[..., None])[..., 0]

    beta = torch.zeros_like(h)
    residual = h.clone()
    direction = residual.clone()
    rs = (residual * residual).sum(-1, keepdim=True)
    # Stop a matrix once its residual is at rounding level: further steps would only
    # divide rounding noise by the smallest curvatures.
    floor = rs * (n * torch.finfo(R.dtype).eps) ** 2
    zero = torch.zeros_like(rs)
    for _ in range(iters):
        Ld = apply_laplacian(direction)
        dLd = (direction * Ld).sum(-1, keepdim=True)
        live = (dLd > 0) & (rs > floor)
        step = torch.where(live, rs / torch.where(live, dLd, torch.ones_like(dLd)), zero)
        beta = beta + step * direction
        residual = residual - step * Ld
        rs_new = (residual * residual).sum(-1, keepdim=True)
        ratio = torch.where(rs > 0, rs_new / torch.where(rs > 0, rs, torch.ones_like(rs)), zero)
        direction = residual + ratio * direction
        rs = rs_new
    return _finish_implicit(R, grad_R, beta, a, inv_r)


def implicit_backward_eps_cg_padded(R: torch.Tensor, grad_R: torch.Tensor, cg_iters: Optional[int] = None,
                                    eps: float = 1e-6) -> torch.Tensor:
    """The published approach, as a comparison point: CG on ``[[I, R], [R^T, I]]`` with an epsilon.

    Conjugate gradient on the symmetric ``2n x 2n`` system (in the dtype of ``R``),
    ``x1, x2`` started at zero, ``eps`` added to both denominators, ``cg_iters``
    steps (default ``2n``); then ``dlogits = (dR - x1[:, None] - x2[None, :]) * R``.
    Near a permutation the matrix has many eigenvalues close to zero (the singular
    values of ``R`` all approach 1) and this loses accuracy that more iterations do
    not recover.
    """
    n = R.shape[-1]
    iters = 2 * n if cg_iters is None else int(cg_iters)
    G = R * grad_R
    rhs1, rhs2 = G.sum(-1), G.sum(-2)

    def apply(x1, x2):
        return x1 + (R @ x2[..., None])[..., 0], (R.transpose(-1, -2) @ x1[..., None])[..., 0] + x2

    x1, x2 = torch.zeros_like(rhs1), torch.zeros_like(rhs2)
    r1, r2 = rhs1.clone(), rhs2.clone()
    p1, p2 = r1.clone(), r2.clone()
    rs = (r1 * r1).sum(-1, keepdim=True) + (r2 * r2).sum(-1, keepdim=True)
    for _ in range(iters):
        q1, q2 = apply(p1, p2)
        step = rs / ((p1 * q1).sum(-1, keepdim=True) + (p2 * q2).sum(-1, keepdim=True) + eps)
        x1, x2 = x1 + step * p1, x2 + step * p2
        r1, r2 = r1 - step * q1, r2 - step * q2
        rs_new = (r1 * r1).sum(-1, keepdim=True) + (r2 * r2).sum(-1, keepdim=True)
        ratio = rs_new / (rs + eps)
        p1, p2 = r1 + ratio * p1, r2 + ratio * p2
        rs = rs_new
    return R * (grad_R - x1[..., :, None] - x2[..., None, :])
