"""``packed_ctc_loss``: the public function, its argument checks and its autograd wiring.

The Triton kernels of :mod:`.triton_kernels` are launched by two plain functions, the
forward and the gradient launcher. In eager mode (and inside a captured CUDA graph)
they run under one ``torch.autograd.Function``, which costs the host little: the
kernels are short, so the time the host spends per call matters. Under
``torch.compile`` the same launchers run as two ``torch.library`` custom ops with fake
implementations and an autograd formula, so the loss traces without graph breaks.
The batch reduction and ``zero_infinity`` are ordinary PyTorch ops on the ``(B,)``
losses; the gradient kernel applies the reduction's weights itself.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import numpy as np
import torch

from ... import runtime, validation
from ...dispatch import is_traced
from ...validation import integer_argument
from .triton_kernels import (
    ctc_alpha_beta_kernel,
    ctc_alpha_beta_pairs_kernel,
    ctc_gradient_kernel,
    ctc_label_groups_kernel,
)

__all__ = ["packed_ctc_loss"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_REDUCTIONS = ("none", "sum", "mean")

#: How the recursion shifts its state by one and two lanes (see ``ctc_alpha_beta_kernel``):
#: ``"gather"`` (two ``tl.gather`` in registers), ``"gather-joined"`` (one), or ``"memory"``
#: (through the state buffer).
SHIFT = "gather"
#: Which recursion kernel runs: ``"pairs"`` (:func:`ctc_alpha_beta_pairs_kernel`, one
#: lane per blank-and-label pair) or ``"states"`` (:func:`ctc_alpha_beta_kernel`, one
#: lane per state, shifted as ``SHIFT`` says).
RECURSION = "pairs"
_SHIFT_CODES = {"memory": 0, "gather": 1, "gather-joined": 2}


def _kernel_numerics():
    """Under the interpreter, numpy would warn about ``log(0) = -inf`` and ``-inf - -inf``,
    which the kernels produce on purpose for unreachable states (and then mask)."""
    if runtime.INTERPRETED:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore")
    return contextlib.nullcontext()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _alpha_beta_num_warps(block: int, per_thread: int = 1) -> int:
    # The recursion is bound by each step's latency, not by throughput: spreading a
    # step over more threads shortens it. On an H200, one (blank, label) pair per
    # thread ran the pairs kernel 1.2-1.5x faster than two per thread; the
    # one-lane-per-state kernel is given two states per thread.
    return max(1, min(16, block // (32 * per_thread)))


# ---------------------------------------------------------------------------------------
# the launchers: plain functions, shared by the eager path and the custom ops


@runtime.on_inputs_device
def _launch_forward(log_probs, cu_seqlens, targets, target_lengths, blank: int):
    """Per-utterance losses ``nll`` (B,), the ``(2, T_total, 2U + 1)`` alpha/beta state and
    the sorted label slots ``(labels, slots, run_starts)``, each int32 ``(B, U + 1)``."""
    T_total, C = log_probs.shape
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    dtype = _compute_dtype(log_probs.dtype)
    device = log_probs.device
    nll = torch.empty(B, dtype=dtype, device=device)
    # state[0] holds alpha, state[1] beta, one row per packed frame
    state = torch.empty((2, T_total, 2 * U + 1), dtype=dtype, device=device)
    # each utterance's label slots sorted by class (see ctc_label_groups_kernel)
    labels, slots, run_starts = (torch.empty((B, U + 1), dtype=torch.int32, device=device) for _ in range(3))
    if B == 0:
        return nll, state, labels, slots, run_starts
    block_k = max(16, runtime.next_power_of_2(U + 1))
    block_s = max(16, runtime.next_power_of_2(2 * U + 1))
    block_j = max(1, min(16, 4096 // block_k))
    with _kernel_numerics():
        ctc_label_groups_kernel[(B,)](
            targets, targets.stride(0), targets.stride(1),
            target_lengths,
            labels, slots, run_starts, labels.stride(0),
            C, U, blank,
            BLOCK_K=block_k,
            BLOCK_J=block_j,
            num_warps=4,
        )
        if RECURSION == "pairs":
            ctc_alpha_beta_pairs_kernel[(B, 2)](
                log_probs, log_probs.stride(0), log_probs.stride(1),
                cu_seqlens,
                targets, targets.stride(0), targets.stride(1),
                target_lengths,
                state, state.stride(0), state.stride(1),
                nll,
                T_total, C, U, blank,
                BLOCK_U=block_k,
                num_warps=_alpha_beta_num_warps(block_k),
            )
        else:
            ctc_alpha_beta_kernel[(B, 2)](
                log_probs, log_probs.stride(0), log_probs.stride(1),
                cu_seqlens,
                targets, targets.stride(0), targets.stride(1),
                target_lengths,
                state, state.stride(0), state.stride(1),
                nll,
                T_total, C, U, blank,
                BLOCK_S=block_s,
                SHIFT=_SHIFT_CODES[SHIFT],
                num_warps=_alpha_beta_num_warps(block_s, per_thread=2),
            )
    return nll, state, labels, slots, run_starts


def _gradient_rows(block_width: int) -> int:
    # Several packed rows per program when rows are short (a small vocabulary, few
    # labels), so that each program's tiles hold about 2048 elements; under the
    # interpreter, as many as possible, since its cost is per program and per
    # operation, not per element.
    if runtime.INTERPRETED:
        return 64
    return max(1, min(32, 2048 // block_width))


def _gradient_num_warps(rows: int, block_width: int) -> int:
    # 8 warps for a 4096-element tile: 16 elements of each live tensor per thread.
    return max(1, min(8, rows * block_width // 512))


_REDUCTION_CODES = {"none": 0, "sum": 1, "mean": 2}


@runtime.on_inputs_device
def _launch_backward(grad_loss, log_probs, cu_seqlens, targets, target_lengths, nll, state, labels, slots,
                     run_starts, blank: int, zero_infinity: bool, reduction: str):
    """``d loss / d log_probs`` (T_total, C) in log_probs' dtype, from the gradient of the loss.

    ``grad_loss`` is the gradient of the *reduced* loss: ``(B,)`` for ``"none"``, a scalar
    for ``"sum"`` and ``"mean"``; the kernel derives each utterance's share itself.
    """
    T_total, C = log_probs.shape
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    grad = torch.empty((T_total, C), dtype=log_probs.dtype, device=log_probs.device)
    if B == 0 or T_total == 0:
        return grad.zero_()
    if grad_loss.dtype != nll.dtype:
        grad_loss = grad_loss.to(nll.dtype)
    grad_stride = grad_loss.stride(0) if grad_loss.dim() == 1 else 0
    block_c = min(1024, max(16, runtime.next_power_of_2(C)))
    block_k = max(16, runtime.next_power_of_2(U + 1))
    rows = _gradient_rows(max(block_c, block_k))
    with _kernel_numerics():
        ctc_gradient_kernel[(runtime.cdiv(T_total, rows),)](
            log_probs, log_probs.stride(0), log_probs.stride(1),
            grad, grad.stride(0),
            cu_seqlens, target_lengths,
            nll, grad_loss, grad_stride,
            state[0], state[1], state.stride(1),
            labels, slots, run_starts, labels.stride(0),
            B, T_total, C, U, blank,
            ZERO_INFINITY=bool(zero_infinity),
            REDUCTION=_REDUCTION_CODES[reduction],
            ROWS=rows,
            BLOCK_B=max(16, min(runtime.next_power_of_2(B), 4096 // rows)),
            BLOCK_K=block_k,
            BLOCK_C=block_c,
            num_warps=_gradient_num_warps(rows, max(block_c, block_k)),
        )
    return grad


def _reduce(nll, target_lengths, reduction: str, zero_infinity: bool):
    loss = nll
    if zero_infinity:
        loss = torch.where(torch.isinf(loss), torch.zeros_like(loss), loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return (loss / target_lengths.clamp(min=1)).mean()


# ---------------------------------------------------------------------------------------
# eager mode: one autograd Function, which launches the kernels directly


class _PackedCTCLoss(torch.autograd.Function):
    """The loss with its reduction, and a backward that is one kernel launch."""

    @staticmethod
    def forward(ctx, log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity):
        nll, *saved = _launch_forward(log_probs, cu_seqlens, targets, target_lengths, blank)
        ctx.save_for_backward(log_probs, cu_seqlens, targets, target_lengths, nll, *saved)
        ctx.options = (blank, zero_infinity, reduction)
        return _reduce(nll, target_lengths, reduction, zero_infinity)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad = _launch_backward(grad_loss, *ctx.saved_tensors, *ctx.options)
        return grad, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------
# torch.compile: the same launchers as torch.library custom ops with fake implementations


@torch.library.custom_op("packed_kernels::ctc_forward", mutates_args=())
def _ctc_forward(
    log_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    targets: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    zero_infinity: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_forward(log_probs, cu_seqlens, targets, target_lengths, blank)


@_ctc_forward.register_fake
def _(log_probs, cu_seqlens, targets, target_lengths, blank, zero_infinity):
    dtype = _compute_dtype(log_probs.dtype)
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    nll = log_probs.new_empty((B,), dtype=dtype)
    state = log_probs.new_empty((2, log_probs.shape[0], 2 * U + 1), dtype=dtype)
    groups = [log_probs.new_empty((B, U + 1), dtype=torch.int32) for _ in range(3)]
    return (nll, state, *groups)


@torch.library.custom_op("packed_kernels::ctc_backward", mutates_args=())
def _ctc_backward(
    grad_nll: torch.Tensor,
    log_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    targets: torch.Tensor,
    target_lengths: torch.Tensor,
    nll: torch.Tensor,
    state: torch.Tensor,
    labels: torch.Tensor,
    slots: torch.Tensor,
    run_starts: torch.Tensor,
    blank: int,
    zero_infinity: bool,
) -> torch.Tensor:
    # grad_nll is per utterance: the reduction is applied outside the op, by autograd
    return _launch_backward(grad_nll, log_probs, cu_seqlens, targets, target_lengths, nll, state, labels,
                            slots, run_starts, blank, zero_infinity, "none")


@_ctc_backward.register_fake
def _(grad_nll, log_probs, cu_seqlens, targets, target_lengths, nll, state, labels, slots, run_starts, blank,
      zero_infinity):
    return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    log_probs, cu_seqlens, targets, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, cu_seqlens, targets, target_lengths, *output)
    # Only nll is differentiable; without this, autograd would hand the backward a
    # zero-filled gradient as large as the alpha/beta state.
    ctx.set_materialize_grads(False)
    ctx.blank = blank
    ctx.zero_infinity = zero_infinity


def _backward(ctx, grad_nll, *unused_grads):
    grad = _ctc_backward(grad_nll, *ctx.saved_tensors, ctx.blank, ctx.zero_infinity)
    return grad, None, None, None, None, None


_ctc_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# the public function


def _check_tensor(name: str, value, dims: int, integer: bool) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if integer and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise TypeError(f"{name} must have an integer dtype (int32 or int64), got {value.dtype}")
    if value.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(value.shape)}")


class _HostCopies:
    """Copies of the small index tensors on the host, started now and waited for later.

    On a GPU the copies go into pinned memory on a side stream that first waits for the
    work already queued (whatever produced the tensors). The caller can then launch
    the kernels, whose every index is clamped so that any values are safe, and wait
    for the copies while the GPU computes: the value checks cost no kernels and do not
    leave the GPU idle. On the CPU the tensors are read directly.
    """

    def __init__(self, *tensors: torch.Tensor):
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
        if self.done is None:
            return [t.numpy() for t in self.tensors]
        self.done.synchronize()
        return [h.numpy() for h in self.hosts]


_SIDE_STREAMS = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _check_arguments(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity) -> int:
    """The checks that need no tensor values; returns ``blank`` as a Python int."""
    if not isinstance(log_probs, torch.Tensor):
        raise TypeError(f"log_probs must be a torch.Tensor, got {type(log_probs).__name__}")
    if log_probs.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"log_probs must be float16, bfloat16, float32 or float64, got {log_probs.dtype}")
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be 2-D (T_total, C), got shape {tuple(log_probs.shape)}")
    _check_tensor("cu_seqlens", cu_seqlens, 1, integer=True)
    _check_tensor("targets", targets, 2, integer=True)
    _check_tensor("target_lengths", target_lengths, 1, integer=True)
    T_total, C = log_probs.shape
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have B + 1 >= 1 entries, got an empty tensor")
    B = cu_seqlens.shape[0] - 1
    if targets.shape[0] != B:
        raise ValueError(f"targets must have shape (B={B}, U) to match cu_seqlens, got {tuple(targets.shape)}")
    if target_lengths.shape[0] != B:
        raise ValueError(f"target_lengths must have shape (B={B},) to match cu_seqlens, "
                         f"got {tuple(target_lengths.shape)}")
    if C < 1:
        raise ValueError(f"log_probs must have at least one class, got shape {tuple(log_probs.shape)}")
    blank = integer_argument("blank", blank)
    if not 0 <= blank < C:
        raise ValueError(f"blank must lie in [0, C={C}), got {blank}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not isinstance(zero_infinity, bool):
        raise TypeError(f"zero_infinity must be a bool, got {type(zero_infinity).__name__}")
    validation.check_same_device(log_probs=log_probs, cu_seqlens=cu_seqlens, targets=targets,
                              target_lengths=target_lengths)
    validation.check_kernel_device("log_probs", log_probs)
    return blank


def _check_values(copies: _HostCopies, T_total: int, C: int, U: int) -> None:
    """The checks that read tensor values: ``cu_seqlens``, ``target_lengths``, ``targets``."""
    cu, lengths, ids = copies.wait()
    B = len(lengths)
    in_target = np.arange(U)[None, :] < lengths[:, None]
    first, last, decreasing = int(cu[0]), int(cu[-1]), int((cu[1:] < cu[:-1]).sum())
    shortest, longest = (int(lengths.min()), int(lengths.max())) if B else (0, 0)
    negative_ids, large_ids = int(((ids < 0) & in_target).sum()), int(((ids >= C) & in_target).sum())
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {first}")
    if decreasing:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {decreasing} decreasing step(s)")
    if last != T_total:
        raise ValueError(f"cu_seqlens must end at T_total = log_probs.shape[0] = {T_total}, "
                         f"got cu_seqlens[-1] = {last}")
    if shortest < 0:
        raise ValueError(f"target_lengths must be >= 0, got a length of {shortest}")
    if longest > U:
        raise ValueError(f"target_lengths must be <= U = targets.shape[1] = {U}, got a length of {longest}")
    if negative_ids or large_ids:
        raise ValueError(f"targets must lie in [0, C={C}) within each target length, got "
                         f"{negative_ids + large_ids} id(s) outside that range")


def packed_ctc_loss(
    log_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    targets: torch.Tensor,
    target_lengths: torch.Tensor,
    *,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """CTC loss of a packed batch, with the semantics of ``torch.nn.functional.ctc_loss``.

    Args:
        log_probs: ``(T_total, C)`` log-softmax outputs of all utterances concatenated
            along time; utterance ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
            float16, bfloat16, float32 (computed in float32) or float64 (computed in
            float64). Any strides.
        cu_seqlens: int32 or int64 ``(B + 1,)``, starting at 0, non-decreasing, ending at
            ``T_total``. Utterances with no frames are allowed.
        targets: integer ``(B, U)`` padded target ids in ``[0, C)``; entries at or beyond
            each target length are ignored.
        target_lengths: integer ``(B,)``, each in ``[0, U]``.
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
    ``torch.compile`` traces or a CUDA graph is captured. The kernels clamp every index
    they read from these tensors, so no value can make them read or write out of bounds.
    """
    blank = _check_arguments(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity)
    # the kernels read the offsets and lengths as dense arrays (a strided view is copied once)
    cu_seqlens, target_lengths = cu_seqlens.contiguous(), target_lengths.contiguous()
    copies = None if is_traced() else _HostCopies(cu_seqlens, target_lengths, targets)
    if copies is not None and copies.done is None:
        _check_values(copies, *log_probs.shape, targets.shape[1])  # on the CPU: before any kernel
    if torch.compiler.is_compiling():
        nll = torch.ops.packed_kernels.ctc_forward(log_probs, cu_seqlens, targets, target_lengths,
                                                   blank, zero_infinity)[0]
        return _reduce(nll, target_lengths, reduction, zero_infinity)
    loss = _PackedCTCLoss.apply(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, zero_infinity)
    if copies is not None and copies.done is not None:
        # on the GPU: while the forward kernels run (they clamp every index, so bad values
        # cannot make them read or write out of bounds; their result is then discarded)
        _check_values(copies, *log_probs.shape, targets.shape[1])
    return loss
