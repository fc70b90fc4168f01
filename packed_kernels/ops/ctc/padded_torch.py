"""CTC loss, stage 2: the alpha recursion vectorised over a padded batch in PyTorch.

All utterances of the batch advance together, one frame per step: the state is a
``(B, S)`` tensor of ``alpha`` log-variables, ``S = 2U + 1`` for the widest target.
Utterances that have already ended keep their last ``alpha`` (a mask freezes them),
so after the loop each row holds ``alpha_{T_b - 1}`` of its own utterance. Autograd
differentiates through the loop, so no backward recursion is written here.

Autograd returns the *true* derivative of the loss with respect to ``log_probs``,
``-exp(gamma_t(c) + nll - log_probs[t, c])``. PyTorch's own ``ctc_loss`` returns that
plus ``exp(log_probs[t, c])`` (see :mod:`.naive_numpy`); the two agree once the
gradient flows through the ``log_softmax`` that produced ``log_probs``. Compare this
stage with the others on the gradient of the logits.

:func:`ctc_align_padded` is forced alignment over the same padded batch: the recursion
with the maximum in place of the log-sum-exp, each state's choice of predecessor kept
per frame, and a backtrace from the last frame, vectorised over the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PaddedAlignment", "ctc_align_padded", "ctc_loss_padded"]

_NEG_INF = float("-inf")


def _logsumexp3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) + exp(b) + exp(c))`` with finite gradients where all three are ``-inf``."""
    m = torch.maximum(torch.maximum(a, b), c).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    total = torch.exp(a - m) + torch.exp(b - m) + torch.exp(c - m)
    # The double `where` keeps log's gradient (1/total) out of unreachable states.
    positive = total > 0
    safe = torch.where(positive, total, torch.ones_like(total))
    return torch.where(positive, torch.log(safe) + m, torch.full_like(total, _NEG_INF))


def _trellis(log_probs: torch.Tensor, input_lengths, targets, target_lengths, blank: int):
    """What both recursions share, over a padded batch: ``(B, T, C, S, input_lengths,
    target_lengths, s, ext, ext_states, can_skip)``. The extended labels ``ext`` are the
    blank at even states and ``targets[(s - 1) / 2]`` at odd ones (the blank beyond each
    target); ``can_skip`` marks the states a path may enter from two states back (a label
    that differs from the label before it)."""
    B, T, C = log_probs.shape
    device = log_probs.device
    S = 2 * targets.shape[1] + 1
    input_lengths = input_lengths.to(device=device, dtype=torch.long)
    target_lengths = target_lengths.to(device=device, dtype=torch.long)
    s = torch.arange(S, device=device)
    ext = torch.full((B, S), blank, dtype=torch.long, device=device)
    ext[:, 1::2] = targets.to(device=device, dtype=torch.long).clamp(0, C - 1)
    ext_states = s[None, :] < (2 * target_lengths[:, None] + 1)
    ext = torch.where(ext_states, ext, torch.full_like(ext, blank))
    prev2 = torch.cat([torch.full((B, 2), -1, dtype=torch.long, device=device), ext[:, :-2]], dim=1)[:, :S]
    can_skip = (s[None, :] > 1) & (ext != prev2)
    return B, T, C, S, input_lengths, target_lengths, s, ext, ext_states, can_skip


def ctc_loss_padded(
    log_probs: torch.Tensor,
    input_lengths: torch.Tensor,
    targets: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """CTC loss of a padded batch, differentiable by autograd.

    Args:
        log_probs: ``(B, T, C)`` log-softmax outputs, batch first; frames at or
            beyond ``input_lengths[b]`` are ignored.
        input_lengths: ``(B,)`` integer frame counts.
        targets: ``(B, U)`` integer target ids; entries at or beyond
            ``target_lengths[b]`` are ignored.
        target_lengths: ``(B,)`` integer target lengths, at most ``U``.
        blank, reduction, zero_infinity: as in ``torch.nn.functional.ctc_loss``.

    Returns:
        ``(B,)`` losses for ``"none"``, otherwise a scalar, in ``log_probs``' dtype.
    """
    B, T, C, S, input_lengths, target_lengths, s, ext, ext_states, can_skip = _trellis(
        log_probs, input_lengths, targets, target_lengths, blank)
    device = log_probs.device

    neg_inf = torch.full((B, S), _NEG_INF, dtype=log_probs.dtype, device=device)
    emissions = torch.gather(log_probs, 2, ext[:, None, :].expand(B, T, S)) if T else None
    alpha = neg_inf
    if T:
        alpha = torch.where((s[None, :] < 2) & ext_states, emissions[:, 0], neg_inf)
    for t in range(1, T):
        stay = alpha
        advance = torch.cat([neg_inf[:, :1], alpha[:, :-1]], dim=1)
        skip = torch.where(can_skip, torch.cat([neg_inf[:, :2], alpha[:, :-2]], dim=1), neg_inf)
        step = _logsumexp3(stay, advance, skip) + emissions[:, t]
        step = torch.where(ext_states, step, neg_inf)
        alpha = torch.where((t < input_lengths)[:, None], step, alpha)

    last = 2 * target_lengths
    end_blank = alpha.gather(1, last[:, None]).squeeze(1)
    end_label = alpha.gather(1, (last - 1).clamp_min(0)[:, None]).squeeze(1)
    end_label = torch.where(target_lengths > 0, end_label, torch.full_like(end_label, _NEG_INF))
    zeros = torch.zeros_like(end_blank)
    log_likelihood = _logsumexp3(end_blank, end_label, torch.full_like(end_blank, _NEG_INF))
    # An utterance with no frames is certain when its target is empty, impossible otherwise.
    empty_ok = torch.where(target_lengths == 0, zeros, torch.full_like(zeros, _NEG_INF))
    log_likelihood = torch.where(input_lengths > 0, log_likelihood, empty_ok)
    loss = -log_likelihood
    if zero_infinity:
        loss = torch.where(torch.isinf(loss), zeros, loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return (loss / target_lengths.clamp_min(1).to(loss.dtype)).mean()
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


class PaddedAlignment(NamedTuple):
    """:func:`ctc_align_padded`'s result, padded: frames at or beyond ``input_lengths[b]``
    have label -1, token -1 and score 0; tokens at or beyond ``target_lengths[b]`` have
    the span ``(-1, -1)``."""

    labels: torch.Tensor  # (B, T) int64
    tokens: torch.Tensor  # (B, T) int64
    scores: torch.Tensor  # (B, T), log_probs' dtype
    spans: torch.Tensor  # (B, U, 2) int64, frames within each utterance
    log_likelihood: torch.Tensor  # (B,), log_probs' dtype


def ctc_align_padded(
    log_probs: torch.Tensor,
    input_lengths: torch.Tensor,
    targets: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
) -> PaddedAlignment:
    """The best CTC alignment of each utterance of a padded batch (no gradient).

    All utterances advance together, one frame per step, through the Viterbi recursion
    over a ``(B, S)`` state, ``S = 2U + 1``::

        delta_t(s) = log_probs[t, l'_s] + max(delta_{t-1}(s), delta_{t-1}(s-1), delta_{t-1}(s-2) if allowed)

    and each step's choice of predecessor (0 stay, 1 from ``s - 1``, 2 from ``s - 2``) is
    kept, ``(T, B, S)`` int8. On a tie the path stays, then advances by one rather than
    skipping; the path ends in state ``2L`` unless ``2L - 1`` is strictly better (see
    :func:`~.naive_numpy.ctc_viterbi_numpy`). The backtrace then walks all utterances back
    from their last frame at once. An utterance without a path of finite score gets
    ``labels = blank``, ``tokens = -1`` and ``scores = -inf`` on its frames, spans
    ``(-1, -1)`` and a log-likelihood of ``-inf``; one with no frames gets 0 for an empty
    target, ``-inf`` otherwise.

    Args:
        log_probs: ``(B, T, C)`` log-probabilities; frames at or beyond ``input_lengths[b]``
            are ignored.
        input_lengths: ``(B,)`` frame counts; targets, target_lengths, blank: as in
            :func:`ctc_loss_padded`.

    Returns:
        A :class:`PaddedAlignment`.
    """
    with torch.no_grad():
        return _align(log_probs, input_lengths, targets, target_lengths, blank)


def _align(log_probs, input_lengths, targets, target_lengths, blank):
    B, T, C, S, input_lengths, target_lengths, s, ext, ext_states, can_skip = _trellis(
        log_probs, input_lengths, targets, target_lengths, blank)
    device, U = log_probs.device, targets.shape[1]

    neg_inf = torch.full((B, S), _NEG_INF, dtype=log_probs.dtype, device=device)
    emissions = torch.gather(log_probs, 2, ext[:, None, :].expand(B, T, S)) if T else None
    choices = torch.zeros((T, B, S), dtype=torch.int8, device=device)
    delta = neg_inf
    if T:
        delta = torch.where((s[None, :] < 2) & ext_states, emissions[:, 0], neg_inf)
    for t in range(1, T):
        stay = delta
        advance = torch.cat([neg_inf[:, :1], delta[:, :-1]], dim=1)
        skip = torch.where(can_skip, torch.cat([neg_inf[:, :2], delta[:, :-2]], dim=1), neg_inf)
        # strictly greater: a tie keeps the earlier of stay, advance, skip
        advances = advance > stay
        best = torch.where(advances, advance, stay)
        skips = skip > best
        best = torch.where(skips, skip, best)
        choice = torch.where(skips, 2, advances.to(torch.int8)).to(torch.int8)
        active = (t < input_lengths)[:, None]
        delta = torch.where(active, torch.where(ext_states, best + emissions[:, t], neg_inf), delta)
        choices[t] = torch.where(active, choice, torch.zeros_like(choice))

    last = 2 * target_lengths
    end_blank = delta.gather(1, last[:, None]).squeeze(1)
    end_label = delta.gather(1, (last - 1).clamp_min(0)[:, None]).squeeze(1)
    end_label = torch.where(target_lengths > 0, end_label, torch.full_like(end_label, _NEG_INF))
    ends_on_label = end_label > end_blank
    state = torch.where(ends_on_label, last - 1, last)
    best = torch.where(ends_on_label, end_label, end_blank)
    has_frames = input_lengths > 0
    empty_ok = torch.where(target_lengths == 0, torch.zeros_like(best), torch.full_like(best, _NEG_INF))
    log_likelihood = torch.where(has_frames, best, empty_ok)
    possible = has_frames & (best > _NEG_INF)

    # the backtrace: each utterance's state stays at its end state until its last frame
    states = torch.full((B, T), -1, dtype=torch.long, device=device)
    for t in range(T - 1, -1, -1):
        active = t < input_lengths
        states[:, t] = torch.where(active, state, -1)
        if t > 0:
            state = state - choices[t].gather(1, state[:, None]).squeeze(1).long()

    frames = torch.arange(T, device=device)
    in_utterance = frames[None, :] < input_lengths[:, None]
    impossible_frame = in_utterance & ~possible[:, None]
    path = states.clamp_min(0)
    labels = torch.where(in_utterance, ext.gather(1, path), -1)
    labels = torch.where(impossible_frame, blank, labels)
    on_label = in_utterance & possible[:, None] & (states % 2 == 1)
    tokens = torch.where(on_label, (states - 1).div(2, rounding_mode="floor"), -1)
    scores = log_probs.gather(2, labels.clamp_min(0)[:, :, None]).squeeze(2) if T else log_probs.new_zeros((B, 0))
    scores = torch.where(in_utterance, scores, torch.zeros_like(scores))
    scores = torch.where(impossible_frame, torch.full_like(scores, _NEG_INF), scores)

    # each token's first and last frame; blank frames go to a spare column U
    column = torch.where(tokens >= 0, tokens, U)
    first = torch.full((B, U + 1), T, dtype=torch.long, device=device)
    first = first.scatter_reduce(1, column, frames.expand(B, T), "amin")
    last_frame = torch.full((B, U + 1), -1, dtype=torch.long, device=device)
    last_frame = last_frame.scatter_reduce(1, column, frames.expand(B, T), "amax")
    spans = torch.stack([torch.where(first < T, first, -1), last_frame], dim=2)[:, :U]
    return PaddedAlignment(labels, tokens, scores, spans, log_likelihood)
