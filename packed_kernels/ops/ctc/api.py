"""``packed_ctc_loss``: the public function, its argument checks and its operators.

The loss is one :class:`~packed_kernels.dispatch.Operator`, ``packed_kernels::ctc_loss``:
the forward kernels and the batch reduction (``zero_infinity`` and ``reduction`` are
arguments of the operator), with a gradient formula that is one launch of the gradient
kernel, ``packed_kernels::ctc_loss_backward``, which applies the reduction's weights
itself. Eager calls run both as ``autograd.Function``s; traced calls (``torch.compile``,
CUDA-graph capture, fake tensors) as the custom ops, with the same formula. Tensors the
kernels do not take (CPU tensors on a machine whose kernels are compiled for a GPU) go
through the padded PyTorch stage instead, with the same conventions.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
from torch import Tensor

from ... import runtime, validation
from ...dispatch import is_traced, operator
from .padded_torch import ctc_loss_padded
from .triton_kernels import (
    compute_dtype,
    ctc_backward_triton,
    ctc_forward_config,
    ctc_forward_triton,
    ctc_gradient_config,
)

__all__ = ["packed_ctc_loss"]

_REDUCTIONS = ("none", "sum", "mean")


# ---------------------------------------------------------------------------------------
# the operators


def _loss_is_nll(reduction: str, zero_infinity: bool) -> bool:
    """Whether the loss is the per-utterance losses themselves (then returned once: the
    outputs of a custom op may not alias each other)."""
    return reduction == "none" and not zero_infinity


def _reduce(nll: Tensor, target_lengths: Tensor, reduction: str, zero_infinity: bool, U: int) -> Tensor:
    """The reduced loss; the mean divides by each target length as the kernels read it
    (clamped to ``[1, U]``), so that the gradient is that of the returned loss."""
    loss = nll
    if zero_infinity:
        loss = torch.where(torch.isinf(loss), torch.zeros_like(loss), loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return (loss / target_lengths.clamp(1, max(U, 1))).mean()


@operator("ctc_loss")
def _ctc_loss(
    log_probs: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, nll, state, labels, slots, run_starts)``: the reduced loss, then what its
    gradient needs (``nll`` is empty where the loss is the ``(B,)`` losses themselves)."""
    nll, *saved = ctc_forward_triton(log_probs, cu_seqlens, targets, target_lengths, blank,
                                     ctc_forward_config(targets.shape[1]))
    loss = _reduce(nll, target_lengths, reduction, zero_infinity, targets.shape[1])
    return (loss, nll.new_empty(0) if _loss_is_nll(reduction, zero_infinity) else nll, *saved)


@_ctc_loss.register_fake
def _(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity):
    dtype = compute_dtype(log_probs.dtype)
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    loss = log_probs.new_empty((B,) if reduction == "none" else (), dtype=dtype)
    nll = log_probs.new_empty((0,) if _loss_is_nll(reduction, zero_infinity) else (B,), dtype=dtype)
    state = log_probs.new_empty((2, log_probs.shape[0], 2 * U + 1), dtype=dtype)
    groups = [log_probs.new_empty((B, U + 1), dtype=torch.int32) for _ in range(3)]
    return (loss, nll, state, *groups)


@operator("ctc_loss_backward")
def _ctc_loss_backward(
    grad_loss: Tensor,
    log_probs: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    nll: Tensor,
    state: Tensor,
    labels: Tensor,
    slots: Tensor,
    run_starts: Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
) -> Tensor:
    config = ctc_gradient_config(cu_seqlens.shape[0] - 1, log_probs.shape[1], targets.shape[1])
    return ctc_backward_triton(grad_loss, log_probs, cu_seqlens, targets, target_lengths, nll, state, labels,
                               slots, run_starts, blank, reduction, zero_infinity, config)


@_ctc_loss_backward.register_fake
def _(grad_loss, log_probs, *unused):
    return log_probs.new_empty(log_probs.shape)


def _setup_context(ctx, inputs, output):
    log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity = inputs
    loss, nll, *saved = output
    if _loss_is_nll(reduction, zero_infinity):
        nll = loss
    # Only the loss is differentiable; without this, autograd would hand the backward a
    # zero-filled gradient as large as the alpha/beta state.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(log_probs, cu_seqlens, targets, target_lengths, nll, *saved)
    ctx.options = (blank, reduction, zero_infinity)


def _backward(ctx, grad_loss, *unused_grads):
    grad = None
    if grad_loss is not None:
        grad = _ctc_loss_backward.within(ctx)(grad_loss, *ctx.saved_tensors, *ctx.options)
    return grad, None, None, None, None, None, None


_ctc_loss.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# the public function


class _HostCopies:
    """Copies of the small index tensors on the host, started now and waited for later.

    On a GPU the copies go into pinned memory on a side stream that first waits for the
    work already queued (whatever produced the tensors). The caller can then launch
    the kernels, whose every index is clamped so that any values are safe, and wait
    for the copies while the GPU computes: the value checks cost no kernels and do not
    leave the GPU idle. On the CPU the tensors are read directly.
    """

    def __init__(self, *tensors: Tensor):
        self.tensors = tensors
        self.done = None
        if tensors[0].device.type == "cpu":
            return
        current = torch.cuda.current_stream(tensors[0].device)
        side = _side_stream(tensors[0].device)
        side.wait_stream(current)
        self.hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        with torch.cuda.stream(side):
            for host, t in zip(self.hosts, tensors):
                host.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(side)

    def wait(self):
        if self.done is not None:
            self.done.synchronize()
        # (under a torch.func transform, reading plain tensors' values needs the
        # transforms switched off for the read)
        with torch._C._DisableFuncTorch():
            return [t.numpy() for t in (self.tensors if self.done is None else self.hosts)]


_SIDE_STREAMS = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _check_arguments(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity,
                     name: str = "log_probs") -> int:
    """The checks that need no tensor values; returns ``blank`` as a Python int. ``name``
    is the argument ``log_probs`` stands for (``"logits"`` for the loss from logits)."""
    validation.check_float_tensor(name, log_probs, 2, layout="(T_total, C)")
    return _check_batch(cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity,
                        classes=(name, log_probs.shape, log_probs.shape[1]), tensors={name: log_probs})


def _check_batch(cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity, *,
                 classes: Tuple[str, torch.Size, int], tensors: dict) -> int:
    """The value-free checks of the batch description and the options. ``classes`` is
    ``(name, shape, C)``: the argument that gives the number of classes, its shape and
    ``C``; ``tensors`` are the arguments (by name) that must share the first one's device."""
    validation.check_index_tensor("cu_seqlens", cu_seqlens, 1, layout="(B + 1,)")
    validation.check_index_tensor("targets", targets, 2, layout="(B, U)")
    validation.check_index_tensor("target_lengths", target_lengths, 1, layout="(B,)")
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have B + 1 >= 1 entries; got an empty tensor")
    B = cu_seqlens.shape[0] - 1
    if targets.shape[0] != B:
        raise ValueError(f"targets must have shape (B={B}, U) to match cu_seqlens; got {tuple(targets.shape)}")
    if target_lengths.shape[0] != B:
        raise ValueError(f"target_lengths must have shape (B={B},) to match cu_seqlens; "
                         f"got {tuple(target_lengths.shape)}")
    name, shape, C = classes
    if C < 1:
        raise ValueError(f"{name} must have at least one class; got shape {tuple(shape)}")
    blank = validation.integer_argument("blank", blank)
    if not 0 <= blank < C:
        raise ValueError(f"blank must lie in [0, C={C}); got {blank}")
    validation.check_choice("reduction", reduction, _REDUCTIONS)
    validation.check_bool("zero_infinity", zero_infinity)
    validation.check_same_device(**tensors, cu_seqlens=cu_seqlens, targets=targets, target_lengths=target_lengths)
    return blank


def _check_values(copies: _HostCopies, T_total: int, C: int, U: int, rows: str = "log_probs") -> None:
    """The checks that read tensor values: ``cu_seqlens``, ``target_lengths``, ``targets``;
    ``rows`` names the argument whose first dimension is ``T_total``."""
    cu, lengths, ids = copies.wait()
    B = len(lengths)
    in_target = np.arange(U)[None, :] < lengths[:, None]
    first, last, decreasing = int(cu[0]), int(cu[-1]), int((cu[1:] < cu[:-1]).sum())
    shortest, longest = (int(lengths.min()), int(lengths.max())) if B else (0, 0)
    negative_ids, large_ids = int(((ids < 0) & in_target).sum()), int(((ids >= C) & in_target).sum())
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0] = {first}")
    if decreasing:
        raise ValueError(f"cu_seqlens must be non-decreasing; got {decreasing} decreasing step(s)")
    if last != T_total:
        raise ValueError(f"cu_seqlens must end at T_total = {rows}.shape[0] = {T_total}; "
                         f"got cu_seqlens[-1] = {last}")
    if shortest < 0:
        raise ValueError(f"target_lengths must be >= 0; got a length of {shortest}")
    if longest > U:
        raise ValueError(f"target_lengths must be <= U = targets.shape[1] = {U}; got a length of {longest}")
    if negative_ids or large_ids:
        raise ValueError(f"targets must lie in [0, C={C}) within each target length; got "
                         f"{negative_ids + large_ids} id(s) outside that range")


def _longest_utterance(copies, T_total: int) -> int:
    """The most frames of one utterance (the padded stage's padded length); ``T_total``
    when the values cannot be read (traced)."""
    if copies is None:
        return T_total
    cu = copies.wait()[0]
    return int(np.diff(cu).max()) if len(cu) > 1 else 0


class _PyTorchGradientConvention(torch.autograd.Function):
    """The per-utterance losses unchanged; their gradient with respect to ``log_probs``
    gains PyTorch's extra term, so that autograd through the padded stage (the true
    derivative, ``-g exp(gamma + nll - lp)``) gives what the kernels give::

        grad[t, c] += g_b exp(lp[t, c])      (t a frame of utterance b)

    and NaN where PyTorch's formula is ``exp(-inf + inf)``: every frame of an impossible
    utterance (unless ``zero_infinity`` zeroes it) and every ``lp = -inf``."""

    @staticmethod
    def forward(nll, log_probs, utterance_of_row, zero_infinity):
        return nll.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        nll, log_probs, utterance_of_row, zero_infinity = inputs
        ctx.save_for_backward(nll, log_probs, utterance_of_row)
        ctx.zero_infinity = zero_infinity

    @staticmethod
    def backward(ctx, grad_nll):
        nll, log_probs, utterance_of_row = ctx.saved_tensors
        extra = grad_nll[utterance_of_row, None] * log_probs.exp()
        impossible = torch.isinf(nll)[utterance_of_row, None]
        undefined = torch.isneginf(log_probs) | impossible
        if ctx.zero_infinity:
            undefined = undefined & ~impossible
        return grad_nll, torch.where(undefined, torch.full_like(extra, float("nan")), extra), None, None


def _padded_stage_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity,
                       longest: int) -> Tensor:
    """The loss through :func:`~.padded_torch.ctc_loss_padded`, for tensors the kernels do
    not take: the same value, dtypes and gradient as the kernels. The frames are padded to
    ``longest`` per utterance."""
    log_probs = log_probs.to(compute_dtype(log_probs.dtype))
    T_total, C = log_probs.shape
    B = cu_seqlens.shape[0] - 1
    rows = torch.arange(T_total, device=log_probs.device)
    utterance_of_row = torch.searchsorted(cu_seqlens[1:], rows, right=True).clamp(max=max(B - 1, 0))
    frame_of_row = (rows - cu_seqlens[utterance_of_row]).clamp(0, max(longest - 1, 0))
    padded = log_probs.new_zeros((B, longest, C)).index_put((utterance_of_row, frame_of_row), log_probs)
    nll = ctc_loss_padded(padded, cu_seqlens.diff(), targets, target_lengths, blank, "none", False)
    nll = _PyTorchGradientConvention.apply(nll, log_probs, utterance_of_row, zero_infinity)
    return _reduce(nll, target_lengths, reduction, zero_infinity, targets.shape[1])


def packed_ctc_loss(
    log_probs: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> Tensor:
    """CTC loss of a packed batch, with the semantics of ``torch.nn.functional.ctc_loss``.

    Args:
        log_probs: ``(T_total, C)`` log-softmax outputs of all utterances concatenated
            along time; utterance ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
            float16, bfloat16, float32 (computed in float32) or float64 (computed in
            float64). Any strides.
        cu_seqlens: int32 or int64 ``(B + 1,)``, starting at 0, non-decreasing, ending at
            ``T_total``. Utterances with no frames are allowed.
        targets: int32 or int64 ``(B, U)`` padded target ids in ``[0, C)``; entries at or
            beyond each target length are ignored.
        target_lengths: int32 or int64 ``(B,)``, each in ``[0, U]``.
        blank: the blank class, in ``[0, C)``.
        reduction: ``"none"`` (the ``(B,)`` losses), ``"sum"``, or ``"mean"`` (each loss
            divided by its target length clamped to 1, then averaged over the batch).
        zero_infinity: replace infinite losses (impossible alignments) by 0 and their
            gradients by 0.

    Returns:
        The loss: ``(B,)`` for ``"none"``, else a scalar; float64 for float64 input,
        float32 otherwise. Its gradient with respect to ``log_probs`` has the dtype of
        ``log_probs`` and follows PyTorch's convention (see the chapter): it equals the
        gradient of the logits once passed through the ``log_softmax``'s backward.

    The padded ``(B, T, C)`` log-probabilities or gradient are never formed. The value
    checks copy ``cu_seqlens``, ``target_lengths`` and ``targets`` to the host once per
    call; on a GPU they run while the forward kernels compute. They are skipped while
    ``torch.compile`` traces or a CUDA graph is captured, and for ``meta`` tensors and under
    ``FakeTensorMode`` (which infer the shapes only). The kernels clamp every index they
    read from these tensors, so no value can make them read or write out of bounds.

    Tensors the kernels do not take (CPU tensors on a machine whose kernels are compiled
    for a GPU) are computed by the padded PyTorch stage,
    :func:`~packed_kernels.ops.ctc.padded_torch.ctc_loss_padded`, with the same loss,
    dtypes and gradient. Under ``torch.autocast`` for ``log_probs``' device type,
    ``log_probs`` of a lower precision is cast to float32 first, as ``F.ctc_loss`` does
    (the kernels compute in float32 either way). ``torch.func.grad`` works too.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> lengths = torch.tensor([5, 3])  # frames of two utterances
        >>> log_probs = torch.randn(8, 4).log_softmax(-1).requires_grad_()  # 8 frames, 4 classes
        >>> targets = torch.tensor([[1, 2], [3, 0]])  # padded; blank = 0
        >>> loss = pk.packed_ctc_loss(log_probs, pk.cu_seqlens_from_lengths(lengths), targets,
        ...                           target_lengths=torch.tensor([2, 1]))
        >>> loss.backward()
        >>> loss.shape, log_probs.grad.shape
        (torch.Size([]), torch.Size([8, 4]))
    """
    blank = _check_arguments(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity)
    if log_probs.dtype in (torch.float16, torch.bfloat16) and runtime.autocast_enabled(log_probs.device.type):
        log_probs = log_probs.float()
    # the kernels read the offsets and lengths as dense arrays (a strided view is copied once)
    cu_seqlens, target_lengths = cu_seqlens.contiguous(), target_lengths.contiguous()
    copies = None if is_traced(log_probs, cu_seqlens, targets, target_lengths) else _HostCopies(
        cu_seqlens, target_lengths, targets)
    if not runtime.on_kernel_device(log_probs):
        if copies is not None:
            _check_values(copies, *log_probs.shape, targets.shape[1])
        return _padded_stage_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction,
                                  zero_infinity, _longest_utterance(copies, log_probs.shape[0]))
    if copies is not None and copies.done is None:
        _check_values(copies, *log_probs.shape, targets.shape[1])  # on the CPU: before any kernel
    loss = _ctc_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity)[0]
    if copies is not None and copies.done is not None:
        # on the GPU: while the forward kernels run (they clamp every index, so bad values
        # cannot make them read or write out of bounds; their result is then discarded)
        _check_values(copies, *log_probs.shape, targets.shape[1])
    return loss
