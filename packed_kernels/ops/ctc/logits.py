"""The CTC loss from logits, and from the input of the linear layer that makes them.

A CTC head is ``hidden -> logits = hidden @ weight.T + bias -> log_softmax -> CTC``. Run
as three PyTorch steps it holds ``(T_total, C)`` tensors at every step: the logits, the
log-probabilities (saved for the backward), their gradient and the logits' gradient.
The loss needs far less. Per frame ``t`` it reads the ``U + 1`` log-probabilities of its
utterance's label columns, ``lp[t, c] = z[t, c] - lse[t]`` with ``lse[t] = log sum_c
exp(z[t, c])``, and its gradient with respect to the logits is::

    dlogits[t, c] = g_b (softmax(z)[t, c] - o_t(c))

with ``g_b`` the gradient of the loss with respect to utterance ``b``'s ``nll`` and
``o_t(c)`` the posterior probability that the alignment emits class ``c`` at frame
``t``, non-zero only on the blank and the target's classes. So:

* :func:`packed_ctc_loss_from_logits` reads the logits once for ``lse`` and the gathered
  label log-probabilities, runs the CTC recursion over those ``U + 1`` columns, and keeps
  for the backward only the logits (its input), ``lse`` and the alpha/beta state; the
  backward writes ``dlogits`` in one pass over the rows. Operators
  ``packed_kernels::ctc_loss_from_logits`` and ``packed_kernels::ctc_loss_from_logits_backward``.
* :func:`linear_packed_ctc_loss` never holds the logits of all frames: chunks of frames
  are projected, reduced to their ``lse`` and label log-probabilities, and dropped; the
  backward projects each chunk again, turns it into its ``dlogits`` in place and
  multiplies it out into the gradients of ``hidden``, ``weight`` and ``bias``. Operators
  ``packed_kernels::ctc_linear_loss`` and ``packed_kernels::ctc_linear_loss_backward``.

Both share :func:`~packed_kernels.packed_ctc_loss`'s conventions, checks and fallbacks
(tensors the kernels do not take go through the padded PyTorch stage). Each forward
operator checks the values of ``cu_seqlens``, ``target_lengths`` and ``targets`` on the
device, in its label sort, and reports a violation as its public function.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import runtime, validation
from ...dispatch import is_traced, operator
from .api import (
    _batch_description,
    _check_arguments,
    _check_batch,
    _lengths_argument,
    _loss_is_nll,
    _padded_length,
    _padded_stage_loss,
    _reduce,
    _value_checks,
)
from .triton_kernels import (
    compute_dtype,
    ctc_forward_config,
    ctc_gradient_config,
    ctc_linear_backward_triton,
    ctc_linear_forward_triton,
    ctc_logits_backward_triton,
    ctc_logits_forward_triton,
    linear_chunk_frames,
)

__all__ = ["linear_packed_ctc_loss", "packed_ctc_loss_from_logits"]

#: What each forward operator checks, and reports as (its public function).
_LOGITS_CHECKS = _value_checks("packed_ctc_loss_from_logits", "logits")
_LINEAR_CHECKS = _value_checks("linear_packed_ctc_loss", "hidden")


def _configs(B: int, C: int, U: int):
    return ctc_forward_config(U), ctc_gradient_config(B, C, U)


def _fake_forward(rows: Tensor, dtype: torch.dtype, B: int, U: int, reduction: str, zero_infinity: bool):
    """The shapes of the forward operators' outputs: loss, nll, lse, state and the groups."""
    T_total = rows.shape[0]
    loss = rows.new_empty((B,) if reduction == "none" else (), dtype=dtype)
    nll = rows.new_empty((0,) if _loss_is_nll(reduction, zero_infinity) else (B,), dtype=dtype)
    lse = rows.new_empty((T_total,), dtype=dtype)
    state = rows.new_empty((2, T_total, 2 * U + 1), dtype=dtype)
    groups = [rows.new_empty((B, U + 1), dtype=torch.int32) for _ in range(3)]
    return (loss, nll, lse, state, *groups)


def _loss_outputs(nll, saved, target_lengths, reduction, zero_infinity, U):
    loss = _reduce(nll, target_lengths, reduction, zero_infinity, U)
    return (loss, nll.new_empty(0) if _loss_is_nll(reduction, zero_infinity) else nll, *saved)


# ---------------------------------------------------------------------------------------
# the operators: from logits


@operator("ctc_loss_from_logits")
def _ctc_loss_from_logits(
    logits: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, nll, lse, state, labels, slots, run_starts)``: the reduced loss, then what its
    gradient needs (``nll`` is empty where the loss is the ``(B,)`` losses themselves).
    Values are checked as ``packed_ctc_loss_from_logits``'s (:data:`_LOGITS_CHECKS`)."""
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    nll, *saved = ctc_logits_forward_triton(logits, cu_seqlens, targets, target_lengths, blank,
                                            *_configs(B, logits.shape[1], U), _LOGITS_CHECKS.codes)
    return _loss_outputs(nll, saved, target_lengths, reduction, zero_infinity, U)


@_ctc_loss_from_logits.register_fake
def _(logits, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity):
    return _fake_forward(logits, compute_dtype(logits.dtype), cu_seqlens.shape[0] - 1, targets.shape[1],
                         reduction, zero_infinity)


@operator("ctc_loss_from_logits_backward")
def _ctc_loss_from_logits_backward(
    grad_loss: Tensor,
    logits: Tensor,
    cu_seqlens: Tensor,
    target_lengths: Tensor,
    nll: Tensor,
    lse: Tensor,
    state: Tensor,
    labels: Tensor,
    slots: Tensor,
    run_starts: Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
) -> Tensor:
    config = ctc_gradient_config(cu_seqlens.shape[0] - 1, logits.shape[1], labels.shape[1] - 1)
    return ctc_logits_backward_triton(grad_loss, logits, cu_seqlens, target_lengths, nll, lse, state, labels,
                                      slots, run_starts, blank, reduction, zero_infinity, config)


@_ctc_loss_from_logits_backward.register_fake
def _(grad_loss, logits, *unused):
    return logits.new_empty(logits.shape)


def _mark_outputs(ctx, output, reduction, zero_infinity):
    """``nll`` as the gradient formula needs it; only the loss is differentiable (else
    autograd would hand the backward zero-filled gradients as large as the state)."""
    loss, nll, *saved = output
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    return (loss if _loss_is_nll(reduction, zero_infinity) else nll), saved


def _setup_from_logits(ctx, inputs, output):
    logits, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity = inputs
    nll, saved = _mark_outputs(ctx, output, reduction, zero_infinity)
    ctx.save_for_backward(logits, cu_seqlens, target_lengths, nll, *saved)
    ctx.options = (blank, reduction, zero_infinity)


def _backward_from_logits(ctx, grad_loss, *unused_grads):
    grad = None
    if grad_loss is not None and ctx.needs_input_grad[0]:
        grad = _ctc_loss_from_logits_backward.within(ctx)(grad_loss, *ctx.saved_tensors, *ctx.options)
    return grad, None, None, None, None, None, None


_ctc_loss_from_logits.register_autograd(_backward_from_logits, setup_context=_setup_from_logits)


# ---------------------------------------------------------------------------------------
# the operators: from a linear layer's input


@operator("ctc_linear_loss")
def _ctc_linear_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
    chunk_frames: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, nll, lse, state, labels, slots, run_starts)``, as ``ctc_loss_from_logits``
    of ``hidden @ weight.T + bias``, ``chunk_frames`` frames of logits at a time. Values
    are checked as ``linear_packed_ctc_loss``'s (:data:`_LINEAR_CHECKS`)."""
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    nll, *saved = ctc_linear_forward_triton(hidden, weight, bias, cu_seqlens, targets, target_lengths, blank,
                                            chunk_frames, *_configs(B, weight.shape[0], U), _LINEAR_CHECKS.codes)
    return _loss_outputs(nll, saved, target_lengths, reduction, zero_infinity, U)


@_ctc_linear_loss.register_fake
def _(hidden, weight, bias, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity, chunk_frames):
    return _fake_forward(hidden, compute_dtype(hidden.dtype), cu_seqlens.shape[0] - 1, targets.shape[1],
                         reduction, zero_infinity)


@operator("ctc_linear_loss_backward")
def _ctc_linear_loss_backward(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    cu_seqlens: Tensor,
    target_lengths: Tensor,
    nll: Tensor,
    lse: Tensor,
    state: Tensor,
    labels: Tensor,
    slots: Tensor,
    run_starts: Tensor,
    blank: int,
    reduction: str,
    zero_infinity: bool,
    chunk_frames: int,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(grad_hidden, grad_weight, grad_bias)``; an empty tensor stands for a gradient not
    asked for (or the bias's, without a bias)."""
    config = ctc_gradient_config(cu_seqlens.shape[0] - 1, weight.shape[0], labels.shape[1] - 1)
    grads = ctc_linear_backward_triton(grad_loss, hidden, weight, bias, cu_seqlens, target_lengths, nll, lse, state,
                                       labels, slots, run_starts, blank, reduction, zero_infinity, chunk_frames,
                                       (needs_hidden, needs_weight, needs_bias), config)
    return tuple(hidden.new_empty(0) if grad is None else grad for grad in grads)


@_ctc_linear_loss_backward.register_fake
def _(grad_loss, hidden, weight, bias, *rest):
    needs_hidden, needs_weight, needs_bias = rest[-3:]
    return (hidden.new_empty(hidden.shape if needs_hidden else (0,)),
            weight.new_empty(weight.shape if needs_weight else (0,)),
            hidden.new_empty(bias.shape if needs_bias and bias is not None else (0,)))


def _setup_linear(ctx, inputs, output):
    hidden, weight, bias, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity, chunk_frames = inputs
    nll, saved = _mark_outputs(ctx, output, reduction, zero_infinity)
    ctx.save_for_backward(hidden, weight, bias, cu_seqlens, target_lengths, nll, *saved)
    ctx.options = (blank, reduction, zero_infinity, chunk_frames)


def _backward_linear(ctx, grad_loss, *unused_grads):
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
    grads = (None, None, None)
    if grad_loss is not None and any(needs):
        computed = _ctc_linear_loss_backward.within(ctx)(grad_loss, *ctx.saved_tensors, *ctx.options, *needs)
        grads = tuple(grad if need else None for grad, need in zip(computed, needs))
    return (*grads, None, None, None, None, None, None, None)


_ctc_linear_loss.register_autograd(_backward_linear, setup_context=_setup_linear)


# ---------------------------------------------------------------------------------------
# the public functions


def packed_ctc_loss_from_logits(
    logits: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> Tensor:
    """CTC loss of ``logits.log_softmax(-1)``, the normaliser computed inside.

    The same loss as ``packed_ctc_loss(logits.log_softmax(-1), ...)``, with the same
    arguments, conventions and checks (see :func:`packed_ctc_loss`: the values of
    ``cu_seqlens``, ``target_lengths`` and ``targets`` are checked on the device, and a
    violation is raised within the call for CPU tensors and in strict mode, otherwise by a
    later call into the package or :func:`~packed_kernels.check_errors`), but no
    ``(T_total, C)`` log-probabilities are formed or kept: the forward reads each row of
    logits once, for its log-sum-exp ``lse[t]`` and its ``U + 1`` label columns, and the
    backward writes the gradient of the logits in one pass over the rows::

        d loss / d logits[t, c] = g_b (exp(logits[t, c] - lse[t]) - o_t(c))

    ``g_b``: the gradient with respect to utterance ``b``'s loss (the reduction's weight
    times the upstream gradient); ``o_t(c)``: the posterior probability that the alignment
    emits class ``c`` at frame ``t`` (non-zero on the blank and the target's classes,
    repeats summed). Saved for the backward: ``logits`` itself, ``lse`` (``T_total``
    numbers), the ``(2, T_total, 2U + 1)`` alpha/beta state and the ``(B, U + 1)`` label groups.

    Args:
        logits: ``(T_total, C)`` unnormalised scores, packed as in :func:`packed_ctc_loss`.
            float16, bfloat16, float32 (computed in float32) or float64. Any strides.
        cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity: as in
            :func:`packed_ctc_loss`.

    Returns:
        The loss: ``(B,)`` for ``"none"``, else a scalar; float64 for float64 logits,
        float32 otherwise. Its gradient has the dtype of ``logits``. An impossible
        utterance has NaN gradient rows (as through ``log_softmax`` and ``F.ctc_loss``), or
        zero rows under ``zero_infinity``. A logit of ``-inf`` (a masked class) gets a zero
        gradient, where the composition with ``log_softmax`` gives NaN.

    Tensors the kernels do not take (CPU tensors on a machine whose kernels are compiled
    for a GPU) go through ``log_softmax`` and the padded PyTorch stage, with the same loss
    and gradient.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> logits = torch.zeros(5, 3, requires_grad=True)  # 3 + 2 frames, 3 classes
        >>> cu_seqlens, targets = pk.cu_seqlens_from_lengths([3, 2]), torch.tensor([[1, 2], [1, 0]])
        >>> loss = pk.packed_ctc_loss_from_logits(logits, cu_seqlens, targets, [2, 1], reduction="none")
        >>> loss.detach().round(decimals=4)  # the loss of logits.log_softmax(-1), uniform here
        tensor([1.6864, 1.0986])
        >>> loss.sum().backward()
        >>> logits.grad.shape
        torch.Size([5, 3])
    """
    validation.raise_reported()
    blank, target_lengths, values = _check_arguments(logits, cu_seqlens, targets, target_lengths, blank,
                                                     reduction, zero_infinity, name="logits")
    cu_seqlens, target_lengths = cu_seqlens.contiguous(), target_lengths.contiguous()
    traced = is_traced(logits, cu_seqlens, targets, target_lengths)
    kernels = runtime.on_kernel_device(logits)
    targets, target_lengths, _ = _batch_description("packed_ctc_loss_from_logits", _LOGITS_CHECKS, targets,
                                                    target_lengths, values, kernels)
    if not kernels:
        longest = _padded_length(_LOGITS_CHECKS, traced, logits.shape, cu_seqlens, targets, target_lengths)
        log_probs = logits.to(compute_dtype(logits.dtype)).log_softmax(-1)
        return _padded_stage_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction,
                                  zero_infinity, longest)
    loss = _ctc_loss_from_logits(logits, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity)[0]
    if not traced:
        validation.values_checked(logits.device)
    return loss


def _check_linear(hidden, weight, bias) -> None:
    validation.check_float_tensor("hidden", hidden, 2, layout="(T_total, D)")
    validation.check_float_tensor("weight", weight, 2, layout="(C, D)")
    D, C = hidden.shape[1], weight.shape[0]
    if weight.shape[1] != D:
        raise ValueError(f"weight must have shape (C, D={D}) to match hidden; got {tuple(weight.shape)}")
    if bias is not None:
        validation.check_float_tensor("bias", bias, 1, layout="(C,)")
        if bias.shape[0] != C:
            raise ValueError(f"bias must have shape (C={C},) to match weight; got {tuple(bias.shape)}")


def _linear_inputs(hidden, weight, bias):
    """The three inputs in the one dtype the products run in: under autocast, the autocast
    dtype (float64 stays, as ``F.linear`` does); then the promotion of the three."""
    inputs = [hidden, weight, bias]
    device_type = hidden.device.type
    if runtime.autocast_enabled(device_type):
        low = torch.get_autocast_dtype(device_type)
        inputs = [t if t is None or t.dtype == torch.float64 else t.to(low) for t in inputs]
    dtype = inputs[0].dtype
    for t in inputs[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return [t if t is None else t.to(dtype) for t in inputs]


def linear_packed_ctc_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
    chunk_frames: Optional[int] = None,
) -> Tensor:
    """CTC loss of ``(hidden @ weight.T + bias).log_softmax(-1)`` without holding its logits.

    The same loss as ``packed_ctc_loss_from_logits(F.linear(hidden, weight, bias), ...)``
    and the gradients of ``hidden``, ``weight`` and ``bias``, but the ``(T_total, C)``
    logits are never held at once. The forward projects ``chunk_frames`` frames at a time
    (``torch.matmul``), reduces each chunk to its per-frame log-sum-exp and its label
    columns' log-probabilities, and drops it; the recursion then runs over the gathered
    columns. The backward projects each chunk again, turns it into ``dlogits`` in place
    (see :func:`packed_ctc_loss_from_logits`) and accumulates::

        grad_hidden[chunk] = dlogits @ weight,   grad_weight += dlogits.T @ hidden[chunk],
        grad_bias += dlogits.sum(0)

    Memory beyond the inputs and the gradients: one chunk of logits, ``T_total`` numbers
    of ``lse``, the ``(2, T_total, 2U + 1)`` alpha/beta state (and, for float16 and
    bfloat16 over several chunks, ``grad_weight`` and ``grad_bias`` summed in float32).
    A chunk may end inside an utterance. The price is a second projection of every
    frame in the backward.

    Args:
        hidden: ``(T_total, D)`` inputs of the output layer, packed as in
            :func:`packed_ctc_loss`. float16, bfloat16, float32 or float64.
        weight: ``(C, D)``, as ``torch.nn.Linear.weight``.
        bias: ``(C,)`` or ``None``.
        cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity: as in
            :func:`packed_ctc_loss`, with ``C = weight.shape[0]``.
        chunk_frames: frames projected at a time, a positive int; ``None`` takes
            :func:`~packed_kernels.ops.ctc.triton_kernels.linear_chunk_frames`: as many
            as keep a chunk's logits within ``2**25`` elements.

    Returns:
        The loss, as :func:`packed_ctc_loss_from_logits`. Inputs of different dtypes are
        promoted to one (the gradients come back in each input's dtype). Under
        ``torch.autocast`` the inputs are cast as ``F.linear`` casts them, and the loss
        is computed in float32.

    Values are checked as :func:`packed_ctc_loss` checks them (on the device; a violation
    raised within the call for CPU tensors and in strict mode, otherwise by a later call
    into the package or :func:`~packed_kernels.check_errors`). Tensors the kernels do not
    take (CPU tensors on a machine whose kernels are compiled for a GPU) are computed as
    ``F.linear``, ``log_softmax`` and the padded PyTorch stage: the same loss and
    gradients, with the logits held.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> hidden = torch.ones(5, 4, requires_grad=True)  # 3 + 2 frames, D = 4 features
        >>> weight = torch.zeros(3, 4, requires_grad=True)  # C = 3 classes; uniform logits here
        >>> loss = pk.linear_packed_ctc_loss(hidden, weight, None, pk.cu_seqlens_from_lengths([3, 2]),
        ...                                  torch.tensor([[1, 2], [1, 0]]), [2, 1], reduction="none")
        >>> loss.detach().round(decimals=4)
        tensor([1.6864, 1.0986])
        >>> loss.sum().backward()
        >>> hidden.grad.shape, weight.grad.shape
        (torch.Size([5, 4]), torch.Size([3, 4]))
    """
    validation.raise_reported()
    _check_linear(hidden, weight, bias)
    target_lengths, values = _lengths_argument(target_lengths, hidden.device)
    tensors = dict(hidden=hidden, weight=weight) if bias is None else dict(hidden=hidden, weight=weight, bias=bias)
    blank = _check_batch(cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity,
                         classes=("weight", weight.shape, weight.shape[0]), tensors=tensors)
    if chunk_frames is not None:
        chunk_frames = validation.integer_argument("chunk_frames", chunk_frames, "a positive int or None")
        if chunk_frames < 1:
            raise ValueError(f"chunk_frames must be >= 1; got {chunk_frames}")
    hidden, weight, bias = _linear_inputs(hidden, weight, bias)
    cu_seqlens, target_lengths = cu_seqlens.contiguous(), target_lengths.contiguous()
    traced = is_traced(hidden, weight, bias, cu_seqlens, targets, target_lengths)
    T_total, C = hidden.shape[0], weight.shape[0]
    kernels = runtime.on_kernel_device(hidden)
    targets, target_lengths, _ = _batch_description("linear_packed_ctc_loss", _LINEAR_CHECKS, targets,
                                                    target_lengths, values, kernels)
    if not kernels:
        longest = _padded_length(_LINEAR_CHECKS, traced, (T_total, C), cu_seqlens, targets, target_lengths)
        with torch.autocast(hidden.device.type, enabled=False):
            log_probs = F.linear(hidden, weight, bias).to(compute_dtype(hidden.dtype)).log_softmax(-1)
        return _padded_stage_loss(log_probs, cu_seqlens, targets, target_lengths, blank, reduction,
                                  zero_infinity, longest)
    if chunk_frames is None:
        chunk_frames = linear_chunk_frames(C)
    loss = _ctc_linear_loss(hidden, weight, bias, cu_seqlens, targets, target_lengths, blank, reduction,
                            zero_infinity, chunk_frames)[0]
    if not traced:
        validation.values_checked(hidden.device)
    return loss
