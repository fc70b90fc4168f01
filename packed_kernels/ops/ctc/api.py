"""``packed_ctc_loss``: the public function, its argument checks and its operators.

The loss is one :class:`~packed_kernels.dispatch.Operator`, ``packed_kernels::ctc_loss``:
the forward kernels and the batch reduction (``zero_infinity`` and ``reduction`` are
arguments of the operator), with a gradient formula that is one launch of the gradient
kernel, ``packed_kernels::ctc_loss_backward``, which applies the reduction's weights
itself. Eager calls run both as ``autograd.Function``s; traced calls (``torch.compile``,
CUDA-graph capture, fake tensors) as the custom ops, with the same formula. Tensors the
kernels do not take (CPU tensors on a machine whose kernels are compiled for a GPU) go
through the padded PyTorch stage instead, with the same conventions.

The values of ``cu_seqlens``, ``target_lengths`` and ``targets`` are checked on the
device, by the label sort of the forward (:func:`~.triton_kernels.ctc_label_groups_kernel`,
no extra launch), and reported as :mod:`packed_kernels.validation` says. Each forward
operator reports as the public function that calls it (:func:`_value_checks`), traced
calls included; the padded stage checks its CPU tensors on the host, with the same
:class:`~packed_kernels.validation.ValueCheck` s.

Every CTC function takes its batch the same way (:func:`_batch_description`):
``target_lengths`` a tensor or a list of ints, and ``targets`` padded ``(B, U)`` or
concatenated ``(sum(target_lengths),)`` as ``F.ctc_loss`` takes them. Concatenated targets
are padded on the device by one kernel, ``packed_kernels::ctc_padded_targets``, to the
width ``U = max(target_lengths)`` where the lengths are host data (a list, or the CPU
tensors of the padded stage) and otherwise ``U = targets.shape[0]``, the one bound known
without reading the lengths from the device.
"""
from __future__ import annotations

from operator import index as operator_index
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ... import runtime, validation
from ...dispatch import is_traced, operator
from .padded_torch import ctc_loss_padded
from .triton_kernels import (
    CHECK_NAMES,
    compute_dtype,
    ctc_backward_triton,
    ctc_forward_config,
    ctc_forward_triton,
    ctc_gradient_config,
    ctc_padded_targets_triton,
)

__all__ = ["packed_ctc_loss"]

_REDUCTIONS = ("none", "sum", "mean")


# ---------------------------------------------------------------------------------------
# the value checks


class _ValueChecks(NamedTuple):
    """The value checks of one public function, in the order of
    :data:`~.triton_kernels.CHECK_NAMES` (the order the launchers take their codes)."""

    cu_seqlens_start: validation.ValueCheck
    cu_seqlens_order: validation.ValueCheck
    cu_seqlens_end: validation.ValueCheck
    target_lengths: validation.ValueCheck
    targets: validation.ValueCheck

    @property
    def codes(self) -> Tuple[int, ...]:
        return tuple(check.code for check in self)


assert _ValueChecks._fields == CHECK_NAMES


def _value_checks(function: str, rows: str) -> _ValueChecks:
    """The value checks of ``function``, whose argument ``rows`` has the ``T_total`` rows.
    ``cu_seqlens`` is checked per entry (its index), the targets per utterance."""
    check = validation.value_check
    return _ValueChecks(
        check(function, "cu_seqlens", "must start at 0", "entry"),
        check(function, "cu_seqlens", "must be non-decreasing", "entry"),
        check(function, "cu_seqlens", f"must end at T_total = {rows}.shape[0]", "entry"),
        check(function, "target_lengths", "must lie in [0, U = targets.shape[1]]", "utterance"),
        check(function, "targets", "must lie in [0, C) within each target length", "utterance"),
    )


#: What ``packed_kernels::ctc_loss`` checks, and reports as.
_CHECKS = _value_checks("packed_ctc_loss", "log_probs")


def _concatenated_lengths_check(function: str) -> validation.ValueCheck:
    """The check of ``target_lengths`` beside 1-D concatenated targets, per utterance."""
    return validation.value_check(function, "target_lengths",
                                  "must be non-negative and sum to targets.shape[0] (1-D targets)", "utterance")


def _check_values_on_host(checks: _ValueChecks, cu_seqlens: Tensor, targets: Tensor, target_lengths: Tensor,
                          T_total: int, C: int) -> None:
    """The device's value checks, made by PyTorch ops on CPU tensors that no kernel reads
    (the padded stage's) and raised at once: the first check of ``checks`` that fails, at
    its first failing position. (Where several values are broken, the kernels report one
    of them; where one is, the same as here.)"""
    U = targets.shape[1]
    # (under a torch.func transform, reading plain tensors' values needs the transforms
    # switched off for the read)
    with torch._C._DisableFuncTorch():
        B = cu_seqlens.shape[0] - 1
        validation.raise_flags(checks.cu_seqlens_start, cu_seqlens[:1] != 0)
        validation.raise_flags(checks.cu_seqlens_order, cu_seqlens[1:] < cu_seqlens[:-1], offset=1)
        validation.raise_flags(checks.cu_seqlens_end, cu_seqlens[B:] != T_total, offset=B)
        validation.raise_flags(checks.target_lengths, (target_lengths < 0) | (target_lengths > U))
        in_target = torch.arange(U)[None, :] < target_lengths.clamp(0, U)[:, None]
        validation.raise_flags(checks.targets, (((targets < 0) | (targets >= C)) & in_target).any(1))


def _padded_length(checks: _ValueChecks, traced: bool, shape: Tuple[int, int], cu_seqlens: Tensor,
                   targets: Tensor, target_lengths: Tensor) -> int:
    """The frames the padded stage pads each utterance to, for its CPU tensors (whose
    ``shape`` is ``(T_total, C)``): eager, their values are checked on the host first
    (:func:`_check_values_on_host`) and the length is the longest utterance's; traced
    (no value may be read), ``T_total``."""
    T_total, C = shape
    if traced:
        return T_total
    _check_values_on_host(checks, cu_seqlens, targets, target_lengths, T_total, C)
    with torch._C._DisableFuncTorch():
        return int(cu_seqlens.diff().max()) if cu_seqlens.shape[0] > 1 else 0


# ---------------------------------------------------------------------------------------
# the batch description: lengths as lists, targets concatenated


def _lengths_argument(target_lengths, device: torch.device) -> Tuple[object, Optional[Tuple[int, ...]]]:
    """``(target_lengths, values)``: a list or tuple of ints, or an integer CPU tensor for
    inputs on a GPU, becomes an int64 tensor on ``device`` (``values`` keeps the ints, host
    data that needs no read); anything else is returned as it came (``values`` is
    ``None``), for :func:`_check_batch` to check."""
    if isinstance(target_lengths, torch.Tensor) and target_lengths.device.type == "cpu" and device.type == "cuda" \
            and not torch.compiler.is_compiling():
        # lengths kept on the host for GPU inputs: reading them costs nothing, and they go
        # over as a list does
        validation.check_index_tensor("target_lengths", target_lengths, 1, layout="(B,)")
        target_lengths = target_lengths.tolist()
    if not isinstance(target_lengths, (list, tuple)):
        if not isinstance(target_lengths, torch.Tensor):
            raise TypeError(f"target_lengths must be a torch.Tensor or a list of ints; "
                            f"got {type(target_lengths).__name__}")
        return target_lengths, None
    for i, value in enumerate(target_lengths):
        if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
            raise TypeError(f"target_lengths must be a torch.Tensor or a list of ints; "
                            f"got {type(value).__name__} at index {i}")
    values = tuple(operator_index(value) for value in target_lengths)
    if device.type == "cuda" and not torch.compiler.is_compiling():
        # from pinned memory, the copy is queued on the stream and the host goes on at once
        tensor = torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    else:
        tensor = torch.tensor(values, dtype=torch.int64, device=device)
    return tensor, values


def _first_concatenation_error(values: Sequence[int], N: int) -> Optional[int]:
    """The utterance where lengths ``values`` stop being non-negative and summing to ``N``
    (as :func:`~.triton_kernels.ctc_concatenated_targets_kernel` finds it), or ``None``."""
    end = 0
    for b, length in enumerate(values):
        end += max(length, 0)
        if length < 0 or end > N or (b == len(values) - 1 and end != N):
            return b
    return None


@operator("ctc_padded_targets")
def _ctc_padded_targets(targets: Tensor, target_lengths: Tensor, U: int, function: str) -> Tuple[Tensor, Tensor]:
    """``(padded, lengths)``: 1-D ``targets`` as ``(B, U)`` padded ones and the lengths
    clamped to ``[0, U]``, checked as ``function``'s."""
    return ctc_padded_targets_triton(targets, target_lengths, U, _concatenated_lengths_check(function).code)


@_ctc_padded_targets.register_fake
def _(targets, target_lengths, U, function):
    return targets.new_empty((target_lengths.shape[0], U)), target_lengths.new_empty(target_lengths.shape)


def _padded_targets_on_host(check: validation.ValueCheck, targets: Tensor, target_lengths: Tensor):
    """``(padded, lengths)`` of 1-D CPU ``targets`` for the padded stage, the lengths checked
    at once; padded to ``U = max(target_lengths)``, which costs nothing to read here."""
    N = targets.shape[0]
    with torch._C._DisableFuncTorch():
        values = target_lengths.tolist()
    bad = _first_concatenation_error(values, N)
    if bad is not None:
        raise check.error(bad)
    positions = torch.arange(max(values, default=0))
    starts = torch.cumsum(target_lengths, 0) - target_lengths
    source = (starts[:, None] + positions[None, :]).clamp(0, max(N - 1, 0))
    inside = positions[None, :] < target_lengths[:, None]
    return torch.where(inside, targets[source], 0).to(targets.dtype), target_lengths


class _Batch(NamedTuple):
    """The targets as every stage takes them."""

    targets: Tensor  # (B, U), padded
    target_lengths: Tensor  # (B,)
    #: rows of the aligner's spans: room for each utterance's U tokens, or the N of 1-D targets
    span_rows: int


def _batch_description(function: str, checks: _ValueChecks, targets: Tensor, target_lengths: Tensor,
                       values: Optional[Tuple[int, ...]], kernels: bool) -> _Batch:
    """The padded targets of a call to ``function`` whose arguments passed
    :func:`_check_batch`; ``values`` are the target lengths where they came as a list
    (checked here, at once: they are host data), ``kernels`` whether the kernels take the
    tensors (else the padded stage does, on the host)."""
    B = target_lengths.shape[0]
    if targets.dim() == 2:
        U = targets.shape[1]
        if values is not None:
            outside = [b for b, length in enumerate(values) if not 0 <= length <= U]
            if outside:
                raise checks.target_lengths.error(outside[0])
        return _Batch(targets, target_lengths, B * U)
    N = targets.shape[0]
    check = _concatenated_lengths_check(function)
    if values is not None:
        bad = _first_concatenation_error(values, N)
        if bad is not None:
            raise check.error(bad)
    if not kernels:
        return _Batch(*_padded_targets_on_host(check, targets, target_lengths), N)
    U = max(values, default=0) if values is not None else N
    padded, lengths = _ctc_padded_targets(targets, target_lengths, U, function)
    return _Batch(padded, lengths, N)


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
    gradient needs (``nll`` is empty where the loss is the ``(B,)`` losses themselves).
    The label sort checks the values of ``cu_seqlens``, ``target_lengths`` and ``targets``
    and reports a violation as ``packed_ctc_loss`` (:data:`_CHECKS`)."""
    nll, *saved = ctc_forward_triton(log_probs, cu_seqlens, targets, target_lengths, blank,
                                     ctc_forward_config(targets.shape[1]), _CHECKS.codes)
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


def _check_arguments(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity,
                     name: str = "log_probs"):
    """The checks that need no tensor values: ``(blank, target_lengths, values)``, ``blank``
    as a Python int and the lengths as :func:`_lengths_argument` gives them. ``name`` is
    the argument ``log_probs`` stands for (``"logits"`` for the loss from logits)."""
    validation.check_float_tensor(name, log_probs, 2, layout="(T_total, C)")
    target_lengths, values = _lengths_argument(target_lengths, log_probs.device)
    blank = _check_batch(cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity,
                         classes=(name, log_probs.shape, log_probs.shape[1]), tensors={name: log_probs})
    return blank, target_lengths, values


def _check_batch(cu_seqlens, targets, target_lengths, blank, reduction=None, zero_infinity=None, *,
                 classes: Tuple[str, torch.Size, int], tensors: dict) -> int:
    """The value-free checks of the batch description and the options (``reduction`` and
    ``zero_infinity`` unless ``None``: the aligner has neither). ``classes`` is
    ``(name, shape, C)``: the argument that gives the number of classes, its shape and
    ``C``; ``tensors`` are the arguments (by name) that must share the first one's device.
    ``targets`` may be 2-D padded or 1-D concatenated."""
    validation.check_index_tensor("cu_seqlens", cu_seqlens, 1, layout="(B + 1,)")
    validation.check_index_tensor("targets", targets)
    if targets.dim() not in (1, 2):
        raise ValueError(f"targets must be 2-D (B, U) padded or 1-D (sum(target_lengths),) concatenated; "
                         f"got shape {tuple(targets.shape)}")
    validation.check_index_tensor("target_lengths", target_lengths, 1, layout="(B,)")
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have B + 1 >= 1 entries; got an empty tensor")
    B = cu_seqlens.shape[0] - 1
    if targets.dim() == 2 and targets.shape[0] != B:
        raise ValueError(f"targets must have shape (B={B}, U) to match cu_seqlens; got {tuple(targets.shape)}")
    if target_lengths.shape[0] != B:
        raise ValueError(f"target_lengths must have shape (B={B},) to match cu_seqlens; "
                         f"got {tuple(target_lengths.shape)}")
    if targets.dim() == 1 and B == 0 and targets.shape[0] != 0:
        raise ValueError(f"targets must be empty for B = 0 utterances (1-D, sum(target_lengths) ids); "
                         f"got shape {tuple(targets.shape)}")
    name, shape, C = classes
    if C < 1:
        raise ValueError(f"{name} must have at least one class; got shape {tuple(shape)}")
    blank = validation.integer_argument("blank", blank)
    if not 0 <= blank < C:
        raise ValueError(f"blank must lie in [0, C={C}); got {blank}")
    if reduction is not None or zero_infinity is not None:
        validation.check_choice("reduction", reduction, _REDUCTIONS)
        validation.check_bool("zero_infinity", zero_infinity)
    validation.check_same_device(**tensors, cu_seqlens=cu_seqlens, targets=targets, target_lengths=target_lengths)
    return blank


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
            beyond each target length are ignored. Or, as ``F.ctc_loss`` takes them, 1-D
            ``(sum(target_lengths),)``: the targets concatenated (then the lengths must be
            non-negative and sum to ``targets.shape[0]``). These are padded on the device,
            to ``U = max(target_lengths)`` where the lengths are a list, else to
            ``U = targets.shape[0]`` (the widest bound known without a read from the
            device: the alpha/beta state then grows with the batch's whole label count,
            so give long batches padded targets or a list of lengths).
        target_lengths: int32 or int64 ``(B,)``, each in ``[0, U]``; or a list or tuple
            of ints, or a CPU tensor beside GPU ``log_probs``, copied to ``log_probs``'
            device without waiting for it (checked at once, being host data).
        blank: the blank class, in ``[0, C)``.
        reduction: ``"none"`` (the ``(B,)`` losses), ``"sum"``, or ``"mean"`` (each loss
            divided by its target length clamped to 1, then averaged over the batch).
        zero_infinity: replace infinite losses (impossible alignments) by 0 and their
            gradients by 0.

    Returns:
        The loss: ``(B,)`` for ``"none"``, else a scalar; float64 for float64 input,
        float32 otherwise. Its gradient with respect to ``log_probs`` has the dtype of
        ``log_probs`` and follows PyTorch's convention (see the chapter "CTC loss over
        packed sequences" of the packed-kernels book, ``book/ctc.ipynb``): it equals the
        gradient of the logits once passed through the ``log_softmax``'s backward.

    The padded ``(B, T, C)`` log-probabilities or gradient are never formed. Shapes,
    dtypes and devices are checked on the host, before any kernel runs. The values of
    ``cu_seqlens``, ``target_lengths`` and ``targets`` are checked on the device, by the
    forward's first kernel, without stopping the host; a violation is raised as a
    ``ValueError`` naming the function, the argument and the entry or utterance (see
    :mod:`packed_kernels.validation`): for CPU tensors and in strict mode
    (:func:`~packed_kernels.strict_checks`) before the call returns, otherwise by a later
    call into the package or by :func:`~packed_kernels.check_errors`. Calls that
    ``torch.compile`` traces or a CUDA graph captures run the same kernel, so the compiled
    call and each replay report too, never within the call: by a later eager call or by
    :func:`~packed_kernels.check_errors`. ``meta`` tensors and ``FakeTensorMode`` infer the
    shapes only and check nothing. The kernels clamp every index they read from these
    tensors, so no value can make them read or write out of bounds, and compute on.

    Tensors the kernels do not take (CPU tensors on a machine whose kernels are compiled
    for a GPU) are computed by the padded PyTorch stage,
    :func:`~packed_kernels.ops.ctc.padded_torch.ctc_loss_padded`, with the same loss,
    dtypes and gradient. Under ``torch.autocast`` for ``log_probs``' device type,
    ``log_probs`` of a lower precision is cast to float32 first, as ``F.ctc_loss`` does
    (the kernels compute in float32 either way). That stage checks the values of its CPU
    tensors on the host, with the same messages, and raises within the call.
    ``torch.func.grad`` works too.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> log_probs = torch.full((5, 3), 1 / 3).log().requires_grad_()  # 3 + 2 frames, 3 classes
        >>> cu_seqlens = pk.cu_seqlens_from_lengths([3, 2])
        >>> targets = torch.tensor([[1, 2], [1, 0]])  # padded, target lengths 2 and 1; blank 0
        >>> loss = pk.packed_ctc_loss(log_probs, cu_seqlens, targets, [2, 1], reduction="none")
        >>> loss.detach().round(decimals=4)  # uniform: exp(-loss) = 5 / 3**3 and 3 / 3**2 paths
        tensor([1.6864, 1.0986])
        >>> loss.sum().backward()
        >>> log_probs.grad.shape
        torch.Size([5, 3])
    """
    validation.raise_reported()
    blank, target_lengths, values = _check_arguments(log_probs, cu_seqlens, targets, target_lengths, blank,
                                                     reduction, zero_infinity)
    if log_probs.dtype in (torch.float16, torch.bfloat16) and runtime.autocast_enabled(log_probs.device.type):
        log_probs = log_probs.float()
    # the kernels read the offsets and lengths as dense arrays (a strided view is copied once)
    cu_seqlens, target_lengths = cu_seqlens.contiguous(), target_lengths.contiguous()
    traced = is_traced(log_probs, cu_seqlens, targets, target_lengths)
    kernels = runtime.on_kernel_device(log_probs)
    targets, target_lengths, _ = _batch_description("packed_ctc_loss", _CHECKS, targets, target_lengths, values,
                                                    kernels)
    if not kernels:
        longest = _padded_length(_CHECKS, traced, log_probs.shape, cu_seqlens, targets, target_lengths)
        return _padded_stage_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction,
                                  zero_infinity, longest)
    loss = _ctc_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity)[0]
    if not traced:
        validation.values_checked(log_probs.device)
    return loss
