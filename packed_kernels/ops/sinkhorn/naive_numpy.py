"""Stage 1: Sinkhorn normalisation of one ``n x n`` matrix in float64 NumPy.

The reference every other stage is checked against. Three functions, each written
for one matrix and for reading rather than for speed:

* :func:`sinkhorn_numpy`: the iterations themselves;
* :func:`unrolled_backward_numpy`: reverse mode through those iterations, by hand;
* :func:`implicit_backward_numpy`: the gradient of the converged projection, by
  solving the singular ``2n x 2n`` linear system of the implicit function theorem
  directly, in the least-squares (minimum-norm) sense.
"""
from __future__ import annotations

import numpy as np


def sinkhorn_numpy(logits: np.ndarray, iters: int = 20) -> np.ndarray:
    """``R = exp(logits)``, then ``iters`` times: divide by column sums, then by row sums.

    Each column's maximum is subtracted first: the first step divides every column
    by its sum, so a per-column shift cancels exactly and only keeps ``exp`` finite.
    """
    x = np.asarray(logits, dtype=np.float64)
    E = np.exp(x - x.max(axis=0, keepdims=True))
    for _ in range(iters):
        E = E / E.sum(axis=0, keepdims=True)  # columns sum to 1
        E = E / E.sum(axis=1, keepdims=True)  # rows sum to 1
    return E


def unrolled_backward_numpy(logits: np.ndarray, grad_R: np.ndarray, iters: int = 20) -> np.ndarray:
    """Exact gradient of the ``iters``-step map, by reverse mode through every step.

    One normalisation ``Y = X / s`` with ``s`` the sums of ``X`` along an axis has the
    vector-Jacobian product ``dX = (dY - sum(dY * Y)) / s`` (same axis). The iterates
    are stored here (a list of ``2 * iters`` matrices); the Triton kernel recomputes
    them instead.
    """
    x = np.asarray(logits, dtype=np.float64)
    E = np.exp(x - x.max(axis=0, keepdims=True))
    E0 = E
    steps = []  # (normalised matrix, sums, axis) for every half-step
    for _ in range(iters):
        c = E.sum(axis=0, keepdims=True)
        E = E / c
        steps.append((E, c, 0))
        r = E.sum(axis=1, keepdims=True)
        E = E / r
        steps.append((E, r, 1))
    G = np.asarray(grad_R, dtype=np.float64)
    for Y, s, axis in reversed(steps):
        G = (G - (G * Y).sum(axis=axis, keepdims=True)) / s
    # d exp = exp; the column-max shift contributes nothing because the columns of
    # G * E0 already sum to zero (the first step normalised the columns).
    return G * E0


def implicit_system_numpy(R: np.ndarray, grad_R: np.ndarray):
    """The ``2n x 2n`` matrix ``[[I, R], [R^T, I]]`` and right-hand side ``[rowsum(R*dR); colsum(R*dR)]``."""
    R = np.asarray(R, dtype=np.float64)
    n = R.shape[0]
    G = R * np.asarray(grad_R, dtype=np.float64)
    A = np.block([[np.eye(n), R], [R.T, np.eye(n)]])
    rhs = np.concatenate([G.sum(axis=1), G.sum(axis=0)])
    return A, rhs


def implicit_backward_numpy(R: np.ndarray, grad_R: np.ndarray) -> np.ndarray:
    """Gradient of the converged (doubly stochastic) projection with respect to its logits.

    Solves ``[[I, R], [R^T, I]] [x1; x2] = [rowsum(R*dR); colsum(R*dR)]`` by least
    squares (the matrix is singular: ``(1, -1)`` is in its null space, and any
    multiple of it leaves ``x1[i] + x2[j]`` unchanged), then
    ``dlogits = (dR - x1[:, None] - x2[None, :]) * R``.
    """
    R = np.asarray(R, dtype=np.float64)
    n = R.shape[0]
    A, rhs = implicit_system_numpy(R, grad_R)
    x, *_ = np.linalg.lstsq(A, rhs, rcond=None)
    x1, x2 = x[:n], x[n:]
    return (np.asarray(grad_R, dtype=np.float64) - x1[:, None] - x2[None, :]) * R
