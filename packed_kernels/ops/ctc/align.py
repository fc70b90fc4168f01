"""Forced alignment over packed sequences: the Viterbi path through the CTC trellis.

The loss sums the probability of every path through the trellis of extended labels
(blank, ``l_1``, blank, ..., ``l_L``, blank); the aligner keeps the best one. The same
recursion with the maximum in place of the log-sum-exp (max-product instead of
sum-product)::

    delta_t(s) = lp[t, l'_s] + max(delta_{t-1}(s), delta_{t-1}(s-1), delta_{t-1}(s-2) if l'_{s-2} != l'_s)

gives each state's best predecessor at every frame; walking those back from the best
final state (``2L`` or ``2L - 1``) gives the path: one state, so one label, per frame.

Two operators, ``packed_kernels::ctc_align`` (from log-probabilities) and
``packed_kernels::ctc_align_from_logits`` (the normaliser of the loss from logits, then
the same kernel over the label columns it gathers), each one launch of
:func:`~.triton_kernels.ctc_viterbi_kernel` (plus the normaliser's), without a gradient.
The values of ``cu_seqlens``, ``target_lengths`` and ``targets`` are checked on the device
by that kernel and reported as the public function; tensors the kernels do not take go
through :func:`~.padded_torch.ctc_align_padded`.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
from torch import Tensor

from ... import runtime, validation
from ...dispatch import is_traced, operator
from .api import _batch_description, _check_arguments, _padded_length, _value_checks
from .padded_torch import ctc_align_padded
from .triton_kernels import (
    compute_dtype,
    ctc_align_config,
    ctc_align_from_logits_triton,
    ctc_align_triton,
    ctc_gradient_config,
)

__all__ = ["CTCAlignment", "packed_ctc_align", "packed_ctc_align_from_logits"]

#: What each operator checks, and reports as (its public function).
_ALIGN_CHECKS = _value_checks("packed_ctc_align", "log_probs")
_ALIGN_LOGITS_CHECKS = _value_checks("packed_ctc_align_from_logits", "logits")


class CTCAlignment(NamedTuple):
    """The best CTC alignment of each utterance of a packed batch.

    Attributes:
        labels: int64 ``(T_total,)``, the class each packed frame emits on the best path:
            the blank, or the target id of the token it belongs to.
        tokens: int64 ``(T_total,)``, the position (0-based) in its utterance's target of
            the token each frame belongs to, -1 for a blank frame: repeated labels
            (``"l l"``) are told apart.
        scores: ``(T_total,)``, each frame's log-probability of its label,
            ``log_probs[t, labels[t]]``; float64 for float64 input, float32 otherwise.
        spans: int64 ``(S, 2)``, the first and the last frame of each token, counted from
            its utterance's first frame (0-based, inclusive); utterance ``b``'s tokens are
            rows ``span_offsets[b]`` to ``span_offsets[b + 1] - 1``. ``S`` is the number of
            ids of 1-D concatenated targets (``sum(target_lengths)``), and ``B U`` for
            padded ``(B, U)`` targets (room for every token without reading the lengths
            from the device), its rows from ``span_offsets[B]`` on set to -1.
        span_offsets: int64 ``(B + 1,)``, ``[0, L_0, L_0 + L_1, ...]``: the cumulative sum of
            the target lengths.
        log_likelihood: ``(B,)``, the best path's log-probability (the sum of its frames'
            ``scores``), the dtype of ``scores``: ``-inf`` where no alignment exists.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> log_probs = torch.zeros(4, 3).log_softmax(-1)  # uniform: tokens take the first frames
        >>> alignment = pk.packed_ctc_align(log_probs, pk.cu_seqlens_from_lengths([3, 1]),
        ...                                 torch.tensor([1, 2, 2]), [2, 1])  # targets 1 2 and 2
        >>> alignment.labels, alignment.tokens
        (tensor([1, 2, 0, 2]), tensor([ 0,  1, -1,  0]))
        >>> alignment.spans[alignment.span_offsets[0]:alignment.span_offsets[1]]  # utterance 0
        tensor([[0, 0],
                [1, 1]])
        >>> alignment.log_likelihood.round(decimals=4)  # 3 and 1 frames of log(1/3)
        tensor([-3.2958, -1.0986])
    """

    labels: Tensor
    tokens: Tensor
    scores: Tensor
    spans: Tensor
    span_offsets: Tensor
    log_likelihood: Tensor


# ---------------------------------------------------------------------------------------
# the operators


def _fake_alignment(rows: Tensor, dtype: torch.dtype, B: int, span_rows: int):
    T_total = rows.shape[0]
    index = [rows.new_empty((T_total,), dtype=torch.int64) for _ in range(2)]
    return (*index, rows.new_empty((T_total,), dtype=dtype), rows.new_empty((span_rows, 2), dtype=torch.int64),
            rows.new_empty((B + 1,), dtype=torch.int64), rows.new_empty((B,), dtype=dtype))


@operator("ctc_align")
def _ctc_align(
    log_probs: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    blank: int,
    span_rows: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fields of :class:`CTCAlignment`, in order. Values are checked as
    ``packed_ctc_align``'s (:data:`_ALIGN_CHECKS`)."""
    config = ctc_align_config(cu_seqlens.shape[0] - 1, targets.shape[1])
    return ctc_align_triton(log_probs, cu_seqlens, targets, target_lengths, blank, span_rows, config,
                            _ALIGN_CHECKS.codes)


@_ctc_align.register_fake
def _(log_probs, cu_seqlens, targets, target_lengths, blank, span_rows):
    return _fake_alignment(log_probs, compute_dtype(log_probs.dtype), cu_seqlens.shape[0] - 1, span_rows)


@operator("ctc_align_from_logits")
def _ctc_align_from_logits(
    logits: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    blank: int,
    span_rows: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As ``ctc_align``, of ``log_softmax(logits)``; values are checked as
    ``packed_ctc_align_from_logits``'s (:data:`_ALIGN_LOGITS_CHECKS`)."""
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    return ctc_align_from_logits_triton(logits, cu_seqlens, targets, target_lengths, blank, span_rows,
                                        ctc_align_config(B, U), ctc_gradient_config(B, logits.shape[1], U),
                                        _ALIGN_LOGITS_CHECKS.codes)


@_ctc_align_from_logits.register_fake
def _(logits, cu_seqlens, targets, target_lengths, blank, span_rows):
    return _fake_alignment(logits, compute_dtype(logits.dtype), cu_seqlens.shape[0] - 1, span_rows)


# ---------------------------------------------------------------------------------------
# the padded stage, for tensors the kernels do not take


def _padded_stage_alignment(log_probs, cu_seqlens, targets, target_lengths, blank: int, longest: int,
                            span_rows: int) -> CTCAlignment:
    """The alignment through :func:`~.padded_torch.ctc_align_padded`, the frames padded to
    ``longest`` per utterance, returned packed as the kernels return it."""
    log_probs = log_probs.to(compute_dtype(log_probs.dtype))
    T_total, C = log_probs.shape
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    device = log_probs.device
    cu = cu_seqlens.long()
    rows = torch.arange(T_total, device=device)
    utterance_of_row = torch.searchsorted(cu[1:], rows, right=True).clamp(max=max(B - 1, 0))
    frame_of_row = (rows - cu[utterance_of_row]).clamp(0, max(longest - 1, 0))
    padded = log_probs.new_zeros((B, longest, C)).index_put((utterance_of_row, frame_of_row), log_probs)
    result = ctc_align_padded(padded, cu.diff(), targets, target_lengths, blank)
    lengths = target_lengths.long().clamp(0, U)
    span_offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    positions = torch.arange(U, device=device)
    in_target = positions[None, :] < lengths[:, None]
    spans = torch.full((span_rows, 2), -1, dtype=torch.int64, device=device)
    spans[(span_offsets[:-1, None] + positions[None, :])[in_target]] = result.spans[in_target]
    at = (utterance_of_row, frame_of_row)
    return CTCAlignment(result.labels[at], result.tokens[at], result.scores[at], spans, span_offsets,
                        result.log_likelihood)


# ---------------------------------------------------------------------------------------
# the public functions


def _alignment_of(function: str, checks, op, rows: Tensor, rows_name: str, cu_seqlens, targets, target_lengths,
           blank, to_log_probs) -> CTCAlignment:
    validation.raise_reported()
    blank, target_lengths, values = _check_arguments(rows, cu_seqlens, targets, target_lengths, blank, None, None,
                                                     name=rows_name)
    rows = rows.detach()  # an alignment has no gradient
    cu_seqlens, target_lengths = cu_seqlens.contiguous(), target_lengths.contiguous()
    traced = is_traced(rows, cu_seqlens, targets, target_lengths)
    kernels = runtime.on_kernel_device(rows)
    targets, target_lengths, span_rows = _batch_description(function, checks, targets, target_lengths, values,
                                                            kernels)
    if not kernels:
        longest = _padded_length(checks, traced, rows.shape, cu_seqlens, targets, target_lengths)
        with torch.no_grad():
            return _padded_stage_alignment(to_log_probs(rows), cu_seqlens, targets, target_lengths, blank, longest,
                                           span_rows)
    alignment = CTCAlignment(*op(rows, cu_seqlens, targets, target_lengths, blank, span_rows))
    if not traced:
        validation.values_checked(rows.device)
    return alignment


def packed_ctc_align(
    log_probs: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    *,
    blank: int = 0,
) -> CTCAlignment:
    """Forced alignment of a packed batch: the single best CTC path of each utterance.

    The trellis of :func:`packed_ctc_loss` (the extended labels ``l'``: a blank between
    and around the target's labels, ``S = 2L + 1`` states), with the maximum in place of
    the log-sum-exp::

        delta_0(s) = lp[0, l'_s]                                         (s < 2)
        delta_t(s) = lp[t, l'_s] + max(delta_{t-1}(s), delta_{t-1}(s-1),
                                       delta_{t-1}(s-2) if s > 1 and l'_{s-2} != l'_s)
        log_likelihood = max(delta_{T-1}(2L), delta_{T-1}(2L-1))

    then the path walked back from the best final state. The best path's probability is
    at most the sum over all paths: ``log_likelihood <= -packed_ctc_loss(..., reduction="none")``,
    with equality where only one path exists.

    **Tie rule**, so that the result is bitwise reproducible: where predecessors score
    the same, the path stays in its state rather than coming from ``s - 1``, and comes from
    ``s - 1`` rather than ``s - 2`` (a predecessor is taken only if strictly better than
    those before it in that order); at the last frame it ends on the final blank ``2L``
    unless ``2L - 1`` is strictly better. Walking back, a tie keeps the later state, so
    the path takes its steps early: with uniform log-probabilities the tokens take the
    first frames (one each, a blank between repeats) and blanks the rest. Every stage (:func:`~packed_kernels.ops.ctc.naive_numpy.ctc_align_numpy`,
    :func:`~packed_kernels.ops.ctc.padded_torch.ctc_align_padded`, the kernel) follows it.

    Args:
        log_probs: ``(T_total, C)`` log-probabilities, packed as in :func:`packed_ctc_loss`;
            float16, bfloat16, float32 (computed in float32) or float64. Any strides. No
            gradient flows through the alignment.
        cu_seqlens, targets, target_lengths, blank: as in :func:`packed_ctc_loss` (padded
            or concatenated targets; lengths as a tensor or a list of ints).

    Returns:
        A :class:`CTCAlignment`: per frame ``labels``, ``tokens`` and ``scores``; per
        token ``spans`` (first and last frame within the utterance, with
        ``span_offsets``); per utterance ``log_likelihood``. An utterance without an
        alignment of finite score (too few frames for its target and its repeats, or
        ``-inf`` log-probabilities in the way) has ``log_likelihood = -inf``, and its
        frames get ``labels = blank``, ``tokens = -1`` and ``scores = -inf``, its spans
        ``(-1, -1)``. An utterance with no frames has ``log_likelihood`` 0 for an empty
        target, ``-inf`` otherwise.

    One program per utterance runs the recursion forward, keeping each frame's choices of
    predecessor as two bits per state: ``ceil((2U + 1) / 16)`` int32 words per packed
    frame, ``4 T_total ceil((2U + 1) / 16)`` bytes in all (32 times less than one float32
    copy of the trellis), freed on return; then it walks back through them and writes
    the outputs. One kernel launch, which also checks the values of ``cu_seqlens``,
    ``target_lengths`` and ``targets`` on the device, without stopping the host; a
    violation is raised as :func:`packed_ctc_loss` raises it, naming ``packed_ctc_align``.
    No host synchronisation: the outputs' sizes come from the shapes alone (hence the
    ``B U`` rows of ``spans`` for padded targets). Works under ``torch.no_grad``,
    inference mode and ``torch.compile`` (a custom op, ``packed_kernels::ctc_align``, with
    shapes for ``meta`` and fake tensors). Tensors the kernels do not take (CPU tensors on
    a machine whose kernels are compiled for a GPU) are aligned by the padded PyTorch
    stage, :func:`~packed_kernels.ops.ctc.padded_torch.ctc_align_padded`, with the same
    results.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> peaks = torch.tensor([1, 1, 0, 2, 0, 1])  # each frame's likeliest class: 4 + 2 frames
        >>> log_probs = (4.0 * torch.nn.functional.one_hot(peaks, 3)).log_softmax(-1)
        >>> alignment = pk.packed_ctc_align(log_probs, pk.cu_seqlens_from_lengths([4, 2]),
        ...                                 torch.tensor([1, 2, 1]), [2, 1])  # targets 1 2 and 1
        >>> alignment.labels, alignment.tokens
        (tensor([1, 1, 0, 2, 0, 1]), tensor([ 0,  0, -1,  1, -1,  0]))
        >>> alignment.spans.tolist()  # each token's first and last frame in its utterance
        [[0, 1], [3, 3], [1, 1]]
    """
    return _alignment_of("packed_ctc_align", _ALIGN_CHECKS, _ctc_align, log_probs, "log_probs", cu_seqlens, targets,
                         target_lengths, blank, lambda log_probs: log_probs)


def packed_ctc_align_from_logits(
    logits: Tensor,
    cu_seqlens: Tensor,
    targets: Tensor,
    target_lengths: Tensor,
    *,
    blank: int = 0,
) -> CTCAlignment:
    """Forced alignment of ``logits.log_softmax(-1)``, the normaliser computed inside.

    The same alignment as ``packed_ctc_align(logits.log_softmax(-1), ...)`` (see
    :func:`packed_ctc_align`: arguments, tie rule, outputs, checks), without forming the
    ``(T_total, C)`` log-probabilities: the normaliser kernel of
    :func:`packed_ctc_loss_from_logits` reads each row of logits once, for its log-sum-exp
    ``lse[t]`` and the ``U + 1`` log-probabilities ``logits[t, c] - lse[t]`` of its
    utterance's label columns, and the Viterbi kernel runs over those. ``scores`` are
    those log-probabilities. Working memory: ``T_total (U + 2)`` numbers of the computing
    dtype and the choice words. Values are checked as ``packed_ctc_align_from_logits``'s.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> logits = 4.0 * torch.nn.functional.one_hot(torch.tensor([1, 1, 0, 2, 0, 1]), 3)  # 4 + 2 frames
        >>> alignment = pk.packed_ctc_align_from_logits(logits, pk.cu_seqlens_from_lengths([4, 2]),
        ...                                             torch.tensor([[1, 2], [1, 0]]), [2, 1])
        >>> alignment.labels
        tensor([1, 1, 0, 2, 0, 1])
        >>> alignment.log_likelihood.round(decimals=4)  # each utterance's best path
        tensor([-0.1439, -0.0720])
    """
    return _alignment_of("packed_ctc_align_from_logits", _ALIGN_LOGITS_CHECKS, _ctc_align_from_logits, logits,
                         "logits", cu_seqlens, targets, target_lengths, blank,
                         lambda logits: logits.to(compute_dtype(logits.dtype)).log_softmax(-1))
