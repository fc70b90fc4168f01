"""The public functions ``sinkhorn`` and ``sinkhorn_backward``: validation and autograd wiring.

The forward and the two backwards are operators of :mod:`packed_kernels.dispatch`
(``packed_kernels::sinkhorn_forward``, ``::sinkhorn_implicit_backward``,
``::sinkhorn_unrolled_backward``): eager calls run their ``autograd.Function``, traced
ones (``torch.compile``, export, fake tensors, CUDA-graph capture) the custom ops. The
forward's autograd formula calls the backward of the chosen kind.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ... import validation
from ...dispatch import operator
from . import padded_torch
from .triton_kernels import (
    MAX_KERNEL_N,
    MAX_UNROLLED_ITERS,
    forward_config,
    implicit_backward_config,
    sinkhorn_forward_triton,
    sinkhorn_implicit_backward_triton,
    sinkhorn_unrolled_backward_triton,
    unrolled_backward_config,
)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_BACKWARDS = ("implicit", "unrolled")
_DIRECT_SOLVE = -1  # custom-op schemas take ints, not Optional: -1 selects the direct solve


def _cg_or_none(cg_iters: int):
    return None if cg_iters == _DIRECT_SOLVE else cg_iters


@operator("sinkhorn_forward")
def _forward_op(logits: Tensor, iters: int, unrolled: bool, cg_iters: int) -> Tensor:
    """``(T, n, n)`` logits -> ``R``; ``unrolled`` and ``cg_iters`` choose the backward."""
    return sinkhorn_forward_triton(logits, iters, forward_config(logits.shape[-1], logits.dtype))


@_forward_op.register_fake
def _(logits, iters, unrolled, cg_iters):
    return torch.empty_like(logits)


@operator("sinkhorn_implicit_backward")
def _implicit_backward_op(R: Tensor, grad_R: Tensor, cg_iters: int) -> Tensor:
    cg = _cg_or_none(cg_iters)
    config = implicit_backward_config(R.shape[-1], R.dtype, cg is not None)
    return sinkhorn_implicit_backward_triton(R, grad_R.contiguous(), cg, config)


@_implicit_backward_op.register_fake
def _(R, grad_R, cg_iters):
    return torch.empty_like(R)


@operator("sinkhorn_unrolled_backward")
def _unrolled_backward_op(logits: Tensor, grad_R: Tensor, iters: int) -> Tensor:
    config = unrolled_backward_config(logits.shape[-1], logits.dtype, iters)
    return sinkhorn_unrolled_backward_triton(logits, grad_R.contiguous(), iters, config)


@_unrolled_backward_op.register_fake
def _(logits, grad_R, iters):
    return torch.empty_like(logits)


def _forward_setup(ctx, inputs, output):
    logits, iters, unrolled, cg_iters = inputs
    ctx.iters, ctx.unrolled, ctx.cg_iters = iters, unrolled, cg_iters
    # the unrolled backward recomputes the iterates from the logits; the implicit one needs only R
    ctx.save_for_backward(logits if unrolled else output)


def _forward_backward(ctx, grad_R):
    (saved,) = ctx.saved_tensors
    grad_R = grad_R.to(saved.dtype)
    if ctx.unrolled:
        grad = _unrolled_backward_op.within(ctx)(saved, grad_R, ctx.iters)
    else:
        grad = _implicit_backward_op.within(ctx)(saved, grad_R, ctx.cg_iters)
    return grad, None, None, None


_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


class _PaddedImplicit(torch.autograd.Function):
    """Fallback beyond the kernels' ``n``: padded PyTorch forward, CG implicit backward."""

    @staticmethod
    def forward(ctx, logits, iters, cg_iters):
        with torch.no_grad():
            R = padded_torch.sinkhorn_padded(logits, iters)
        ctx.save_for_backward(R)
        ctx.cg_iters = cg_iters
        return R

    @staticmethod
    def backward(ctx, grad_R):
        (R,) = ctx.saved_tensors
        return padded_torch.implicit_backward_padded(R, grad_R, ctx.cg_iters), None, None


def _check_matrices(name: str, x) -> int:
    """``x`` a float tensor of shape ``(..., n, n)``, ``n >= 1``; returns ``n``."""
    validation.check_float_tensor(name, x, dtypes=_FLOAT_DTYPES)
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"{name} must have shape (..., n, n) with at least 2 dims; got shape {tuple(x.shape)}")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} must have n >= 1; got shape {tuple(x.shape)}")
    return x.shape[-1]


def _check_cg_iters(cg_iters) -> int:
    if cg_iters is None:
        return _DIRECT_SOLVE
    cg_iters = validation.integer_argument("cg_iters", cg_iters, "None or an int")
    if cg_iters < 1:
        raise ValueError(f"cg_iters must be >= 1 (or None for the direct solve); got {cg_iters}")
    return cg_iters


def sinkhorn(logits: torch.Tensor, iters: int = 20, *, backward: str = "implicit",
             cg_iters: Optional[int] = None) -> torch.Tensor:
    """Project each ``n x n`` matrix of ``logits`` towards the doubly stochastic matrices.

    Args:
        logits: ``(..., n, n)``, float32, bfloat16, float16 (computed in float32) or
            float64 (computed in float64); any leading dims, any strides
            (non-contiguous input is copied to a contiguous one first).
        iters: number of iterations, ``>= 1``. Each divides by the column sums
            (dim -2), then by the row sums (dim -1), after ``exp(logits - column max)``.
        backward: ``"implicit"``: gradient of the converged projection (implicit
            function theorem; see :func:`sinkhorn_backward`), or ``"unrolled"``: the
            exact gradient of the ``iters``-step map, by reverse mode with the
            forward recomputed on chip.
        cg_iters: implicit backward only. ``None`` (default): direct solve of the
            gauge-fixed system per matrix (elimination without cancellation; see
            :func:`sinkhorn_backward`). An int: that many conjugate-gradient steps on
            the same system, shifted by one rounding unit (``2n`` steps reach the
            direct answer up to rounding).

    Returns:
        ``R`` of the shape and dtype of ``logits``: rows sum to 1 exactly (up to
        rounding) and columns approach 1 as ``iters`` grows.

    ``n`` from 1 to 32 runs the Triton kernels (``n`` = 2, 4, 8 with one matrix per
    thread); larger ``n`` runs the padded PyTorch stage (same results, no fused
    kernel; its implicit backward is conjugate gradient with ``cg_iters`` or ``2n``
    steps). ``backward="unrolled"`` with more than 128 iterations also runs the
    padded PyTorch stage (autograd through the loop, which stores every iterate):
    the kernels keep their recomputation checkpoints in registers. A NaN or ``+inf``
    logit makes its own matrix NaN (forward and gradient) and leaves the others
    untouched; ``-inf`` logits are exact zeros as long as every row and column keeps a
    finite entry.
    """
    n = _check_matrices("logits", logits)
    iters = validation.integer_argument("iters", iters)
    if iters < 1:
        raise ValueError(f"iters must be >= 1; got {iters}")
    validation.check_choice("backward", backward, _BACKWARDS)
    cg = _check_cg_iters(cg_iters)
    if cg != _DIRECT_SOLVE and backward != "implicit":
        raise ValueError("cg_iters applies to backward='implicit' only; got backward='unrolled' with cg_iters set")
    if backward == "unrolled" and iters > MAX_UNROLLED_ITERS:
        return padded_torch.sinkhorn_padded(logits, iters)
    if n > MAX_KERNEL_N:
        if backward == "unrolled":
            return padded_torch.sinkhorn_padded(logits, iters)
        return _PaddedImplicit.apply(logits, iters, _cg_or_none(cg))
    validation.check_kernel_device("logits", logits)
    flat = logits.contiguous().view(-1, n, n)
    return _forward_op(flat, iters, backward == "unrolled", cg).view(logits.shape)


def sinkhorn_backward(R: torch.Tensor, grad_R: torch.Tensor, cg_iters: Optional[int] = None) -> torch.Tensor:
    """Implicit gradient ``dL/dlogits`` of the converged Sinkhorn projection at ``R``.

    Args:
        R: ``(..., n, n)`` doubly stochastic matrices (a forward output), float32,
            bfloat16, float16 or float64.
        grad_R: ``dL/dR``, the same shape as ``R`` (cast to ``R``'s dtype).
        cg_iters: ``None`` for the direct solve (default), or a number of
            conjugate-gradient steps.

    Returns:
        ``dlogits = R * (grad_R - alpha[:, None] - beta[None, :])`` with ``alpha, beta``
        making every row and column of ``dlogits`` sum to zero: the solution of
        ``[[I, R], [R^T, I]] [alpha; beta] = [rowsum(R*dR); colsum(R*dR)]`` when ``R``
        is exactly doubly stochastic, and of its consistent weighted form
        (``diag(rowsum R)``, ``diag(colsum R)`` in place of ``I``) otherwise. Same shape
        and dtype as ``R``. Not differentiable itself.
    """
    n = _check_matrices("R", R)
    validation.check_tensor("grad_R", grad_R)
    if grad_R.shape != R.shape:
        raise ValueError(f"grad_R must have the shape of R {tuple(R.shape)}; got {tuple(grad_R.shape)}")
    if not grad_R.is_floating_point():
        raise TypeError(f"grad_R must be a floating-point tensor; got {grad_R.dtype}")
    validation.check_same_device(R=R, grad_R=grad_R)
    cg = _check_cg_iters(cg_iters)
    if n > MAX_KERNEL_N:
        return padded_torch.implicit_backward_padded(R, grad_R.to(R.dtype), _cg_or_none(cg))
    validation.check_kernel_device("R", R)
    flat_R = R.detach().contiguous().view(-1, n, n)
    flat_grad = grad_R.detach().to(R.dtype).contiguous().view(-1, n, n)
    return _implicit_backward_op(flat_R, flat_grad, cg).view(R.shape)
