"""The public functions ``sinkhorn`` and ``sinkhorn_backward``: validation and autograd wiring.

The forward and the two backwards are operators of :mod:`packed_kernels.dispatch`
(``packed_kernels::sinkhorn_forward``, ``::sinkhorn_implicit_backward``,
``::sinkhorn_unrolled_backward``): eager calls run their ``autograd.Function``, traced
ones (``torch.compile``, export, fake tensors, CUDA-graph capture) the custom ops. The
forward's autograd formula calls the backward of the chosen kind. Inputs the kernels do
not take (``n`` above :data:`MAX_KERNEL_N`, a CPU tensor where the kernels are compiled
for the GPU, many unrolled iterations) run the padded PyTorch stage instead.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ... import runtime, validation
from ...dispatch import operator
from . import padded_torch
from .triton_kernels import (
    MAX_ITERS,
    MAX_KERNEL_N,
    MAX_UNROLLED_ITERS,
    forward_config,
    implicit_backward_config,
    sinkhorn_forward_triton,
    sinkhorn_implicit_backward_triton,
    sinkhorn_unrolled_backward_triton,
    unrolled_backward_config,
)

__all__ = ["MAX_ITERS", "sinkhorn", "sinkhorn_backward"]

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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 and bfloat16 are computed in float32, as the kernels compute them."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _PaddedImplicit(torch.autograd.Function):
    """The padded PyTorch forward with the implicit backward by conjugate gradient."""

    @staticmethod
    def forward(logits, iters, cg_iters):
        return padded_torch.sinkhorn_padded(logits, iters)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.cg_iters = inputs[2]

    @staticmethod
    def backward(ctx, grad_R):
        (R,) = ctx.saved_tensors
        with runtime.without_autocast(R.device.type):
            return padded_torch.implicit_backward_padded(R, grad_R, ctx.cg_iters), None, None


def _sinkhorn_padded_stage(logits: Tensor, iters: int, unrolled: bool, cg_iters: Optional[int]) -> Tensor:
    """:func:`sinkhorn` on inputs the kernels do not take: the same result and dtype,
    gradients of the same kind (autograd through the loop for ``unrolled``). The forward
    has no operation that autocast changes; the implicit backward turns it off."""
    x = logits.to(_compute_dtype(logits.dtype))
    R = padded_torch.sinkhorn_padded(x, iters) if unrolled else _PaddedImplicit.apply(x, iters, cg_iters)
    return R.to(logits.dtype)


def _implicit_backward_padded_stage(R: Tensor, grad_R: Tensor, cg_iters: Optional[int]) -> Tensor:
    """:func:`sinkhorn_backward` on inputs the kernels do not take (not differentiable, as the kernel)."""
    compute = _compute_dtype(R.dtype)
    with runtime.without_autocast(R.device.type), torch.no_grad():
        return padded_torch.implicit_backward_padded(R.to(compute), grad_R.to(compute), cg_iters).to(R.dtype)


def _check_matrices(name: str, x) -> int:
    """``x`` a float tensor of shape ``(..., n, n)``, ``n >= 1``; returns ``n``."""
    validation.check_float_tensor(name, x, dtypes=_FLOAT_DTYPES)
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"{name} must have shape (..., n, n) with at least 2 dims; got shape {tuple(x.shape)}")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} must have n >= 1; got shape {tuple(x.shape)}")
    return x.shape[-1]


def _check_iters(iters) -> int:
    iters = validation.integer_argument("iters", iters)
    if not 1 <= iters <= MAX_ITERS:
        raise ValueError(f"iters must be in [1, {MAX_ITERS}] (2**20); got {iters}")
    return iters


def _check_cg_iters(cg_iters, n: int) -> int:
    if cg_iters is None:
        return _DIRECT_SOLVE
    cg_iters = validation.integer_argument("cg_iters", cg_iters, "None or an int")
    # 2n: see sinkhorn_backward
    if not 1 <= cg_iters <= 2 * n:
        raise ValueError(f"cg_iters must be in [1, 2n] = [1, {2 * n}] for n = {n} "
                         f"(or None for the direct solve); got {cg_iters}")
    return cg_iters


def sinkhorn(logits: torch.Tensor, iters: int = 20, *, backward: str = "implicit",
             cg_iters: Optional[int] = None) -> torch.Tensor:
    """Project each ``n x n`` matrix of ``logits`` towards the doubly stochastic matrices.

    Args:
        logits: ``(..., n, n)``, float32, bfloat16, float16 (computed in float32) or
            float64 (computed in float64); any leading dims, any strides
            (non-contiguous input is copied to a contiguous one first).
        iters: number of iterations, from 1 to :data:`MAX_ITERS` (``2**20``). Each
            divides by the column sums (dim -2), then by the row sums (dim -1), after
            ``exp(logits - column max)``. The bound guards against runaway calls: on
            matrices with positive entries the iterations converge geometrically, so
            far fewer already reach rounding level (no bound inside the kernels
            depends on it).
        backward: ``"implicit"``: gradient of the converged projection (implicit
            function theorem; see :func:`sinkhorn_backward`), or ``"unrolled"``: the
            exact gradient of the ``iters``-step map, by reverse mode with the
            forward recomputed on chip. Choose ``"implicit"`` when ``R`` stands for the
            doubly stochastic limit (the iterations have converged: rows and columns
            both sum to 1 to rounding), where it is exact and costs one solve whatever
            ``iters`` is; choose ``"unrolled"`` to reproduce autograd through your own
            ``iters``-step loop, which differs from the implicit gradient while the
            iterations are far from converged (few iterations, peaked logits). The
            chapter "Sinkhorn normalisation and its two exact backwards" of the
            packed-kernels book (``book/sinkhorn.ipynb``) plots where the two differ.
        cg_iters: implicit backward only. ``None`` (default): direct solve of the
            gauge-fixed system per matrix (elimination without cancellation; see
            :func:`sinkhorn_backward`). An int from 1 to ``2n``: that many
            conjugate-gradient steps on the same system, shifted by one rounding unit
            (``2n`` steps reach the direct answer up to rounding; why no more, see
            :func:`sinkhorn_backward`).

    Returns:
        ``R`` of the shape and dtype of ``logits``: rows sum to 1 exactly (up to
        rounding) and columns approach 1 as ``iters`` grows.

    ``n`` from 1 to 32 runs the Triton kernels (``n`` = 2, 4, 8 with one matrix per
    thread) on tensors where the kernels run (CUDA tensors on a GPU machine, CPU
    tensors under the interpreter, ``meta`` tensors for shapes). Everything else runs
    the padded PyTorch stage with the same results and dtypes (float16 and bfloat16
    computed in float32) and a gradient of the same kind (autograd through the loop for
    ``"unrolled"``; conjugate gradient with ``cg_iters`` or ``2n`` steps for
    ``"implicit"``): larger ``n``, CPU tensors on a machine whose kernels are compiled
    for the GPU, and ``backward="unrolled"`` with more than 128 iterations (the kernels
    keep their recomputation checkpoints in registers; the loop stores every iterate).

    Autocast leaves it alone (no PyTorch op computes it, so none sets a precedent): the
    output keeps the dtype of ``logits``, computed as above. Works on ``meta`` tensors,
    under ``FakeTensorMode``, ``torch.compile(fullgraph=True)`` and ``torch.func.grad``
    (not under ``torch.func.vmap``: the leading dims already batch).
    Finite logits give finite results, forward and gradients, however widely spread
    (as long as their differences are finite in the compute dtype): before the first
    sum the kernels balance ``exp(logits)`` by its row and column maxima (a row far
    below its column maxima would otherwise have a row sum below the normal range,
    whose reciprocal overflows), and they absorb the scaling vectors they iterate on
    into the matrix every few iterations. In float32, entries of ``exp`` far below
    both their row and their column (by about 87 in the logits, or more) lose
    precision or vanish; over many iterations such entries can matter, and results
    then differ from float64's.
    A NaN or ``+inf`` logit makes its own matrix NaN (forward and gradient) and leaves
    the others untouched; ``-inf`` logits are exact zeros as long as every row and
    column keeps a finite entry.

    Example:
        >>> import torch
        >>> from packed_kernels import sinkhorn
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]], requires_grad=True)
        >>> R = sinkhorn(logits, iters=20)
        >>> R.detach()  # doubly stochastic; R00 R11 / (R01 R10) stays exp(2 + 1)
        tensor([[0.8176, 0.1824],
                [0.1824, 0.8176]])
        >>> R[0, 0].backward()  # implicit gradient: R00 (1 - R00) / 2, rows and columns summing to 0
        >>> logits.grad
        tensor([[ 0.0746, -0.0746],
                [-0.0746,  0.0746]])
    """
    validation.raise_reported()
    n = _check_matrices("logits", logits)
    iters = _check_iters(iters)
    validation.check_choice("backward", backward, _BACKWARDS)
    cg = _check_cg_iters(cg_iters, n)
    unrolled = backward == "unrolled"
    if cg != _DIRECT_SOLVE and unrolled:
        raise ValueError("cg_iters applies to backward='implicit' only; got backward='unrolled' with cg_iters set")
    if n > MAX_KERNEL_N or not runtime.on_kernel_device(logits) or (unrolled and iters > MAX_UNROLLED_ITERS):
        return _sinkhorn_padded_stage(logits, iters, unrolled, _cg_or_none(cg))
    flat = logits.contiguous().view(-1, n, n)
    return _forward_op(flat, iters, unrolled, cg).view(logits.shape)


def sinkhorn_backward(R: torch.Tensor, grad_R: torch.Tensor, cg_iters: Optional[int] = None) -> torch.Tensor:
    """Implicit gradient ``dL/dlogits`` of the converged Sinkhorn projection at ``R``.

    Args:
        R: ``(..., n, n)`` doubly stochastic matrices (a forward output), float32,
            bfloat16, float16 (computed in float32) or float64.
        grad_R: ``dL/dR``, the same shape and device as ``R``, any floating dtype: it is
            cast to ``R``'s dtype first, as autograd casts the gradient of an output
            to the output's dtype (so the result equals the gradient
            ``sinkhorn(logits).backward(grad_R)`` gives).
        cg_iters: ``None`` for the direct solve (default), or a number of
            conjugate-gradient steps from 1 to ``2n``. Eliminating ``alpha`` leaves the
            ``n``-dimensional system ``L beta = h`` below, on which conjugate gradient
            reaches the exact solution within ``n`` steps in exact arithmetic; ``2n``
            leaves as many again for the loss of conjugacy under rounding, and each
            matrix stops on its own once its residual is at rounding level, so more
            steps could only repeat that stop.

    Returns:
        ``dlogits = R * (grad_R - alpha[:, None] - beta[None, :])`` with ``alpha, beta``
        making every row and column of ``dlogits`` sum to zero: the solution of
        ``[[I, R], [R^T, I]] [alpha; beta] = [rowsum(R*dR); colsum(R*dR)]`` when ``R``
        is exactly doubly stochastic, and of its consistent weighted form
        (``diag(rowsum R)``, ``diag(colsum R)`` in place of ``I``) otherwise; with
        ``alpha = (rowsum(R*dR) - R beta) / rowsum(R)`` eliminated, ``L beta = h`` for
        the Laplacian ``L`` of the columns (see :mod:`.padded_torch`). Same shape and
        dtype as ``R``. Not differentiable itself.

    Where the kernels do not take ``R`` (``n`` above 32, a CPU tensor where the kernels
    are compiled for the GPU), the padded PyTorch stage computes it by conjugate
    gradient (``cg_iters`` or ``2n`` steps). Autocast leaves it alone, as
    :func:`sinkhorn`; works on ``meta`` tensors and under ``FakeTensorMode``.

    Example:
        >>> import torch
        >>> from packed_kernels import sinkhorn, sinkhorn_backward
        >>> R = sinkhorn(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), iters=20)
        >>> grad_R = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # dL/dR of L = R[0, 0]
        >>> sinkhorn_backward(R, grad_R)
        tensor([[ 0.0746, -0.0746],
                [-0.0746,  0.0746]])
    """
    validation.raise_reported()
    n = _check_matrices("R", R)
    validation.check_tensor("grad_R", grad_R)
    if grad_R.shape != R.shape:
        raise ValueError(f"grad_R must have the shape of R {tuple(R.shape)}; got {tuple(grad_R.shape)}")
    if not grad_R.is_floating_point():
        raise TypeError(f"grad_R must be a floating-point tensor; got {grad_R.dtype}")
    validation.check_same_device(R=R, grad_R=grad_R)
    cg = _check_cg_iters(cg_iters, n)
    grad_R = grad_R.to(R.dtype)
    if n > MAX_KERNEL_N or not runtime.on_kernel_device(R):
        return _implicit_backward_padded_stage(R, grad_R, _cg_or_none(cg))
    flat_R = R.detach().contiguous().view(-1, n, n)
    flat_grad = grad_R.detach().contiguous().view(-1, n, n)
    return _implicit_backward_op(flat_R, flat_grad, cg).view(R.shape)
