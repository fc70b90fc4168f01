"""CTC loss, stage 1: the forward-backward algorithm in NumPy float64, one utterance at a time.

This is the reference every other stage is checked against. It follows the textbook
recursions over the *extended label sequence* literally, in log space, with loops a
reader can step through.

Notation for one utterance with ``T`` frames, ``log_probs`` of shape ``(T, C)`` and a
target ``l_1 .. l_L``:

* extended labels ``l'`` of length ``S = 2L + 1``: a blank, ``l_1``, a blank, ``l_2``,
  ..., ``l_L``, a blank (``l'_s`` is the blank for even ``s``, ``l_{(s+1)/2}`` for odd ``s``);
* ``alpha_t(s)``: log-probability of all alignments of the first ``t + 1`` frames that
  end in state ``s`` (the emission of frame ``t`` included);
* ``beta_t(s)``: log-probability of all alignments of frames ``t .. T-1`` that start in
  state ``s`` and finish in one of the last two states (emission of frame ``t``
  included, as PyTorch stores it);
* the loss is ``nll = -log(exp(alpha_{T-1}(S-1)) + exp(alpha_{T-1}(S-2)))``.

Forced alignment (:func:`ctc_align_numpy`) runs the same trellis with the maximum in
place of the log-sum-exp (:func:`ctc_viterbi_numpy`), then follows the best predecessors
back from the last frame.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

__all__ = [
    "extended_labels",
    "ctc_alpha_beta_numpy",
    "ctc_utterance_numpy",
    "ctc_loss_numpy",
    "ctc_viterbi_numpy",
    "ctc_align_numpy",
    "STAY",
    "ADVANCE",
    "SKIP",
]

NEG_INF = -np.inf


def extended_labels(target: np.ndarray, blank: int) -> np.ndarray:
    """``[blank, l_1, blank, l_2, ..., l_L, blank]``, length ``2L + 1``."""
    ext = np.full(2 * len(target) + 1, blank, dtype=np.int64)
    ext[1::2] = target
    return ext


def _logsumexp(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    m = values.max() if values.size else NEG_INF
    if m == NEG_INF:
        return NEG_INF
    return float(np.log(np.exp(values - m).sum()) + m)


def ctc_alpha_beta_numpy(
    log_probs: np.ndarray, target: np.ndarray, blank: int = 0
) -> Tuple[np.ndarray, np.ndarray]:
    """Forward (``alpha``) and backward (``beta``) log-variables of one utterance, ``(T, 2L+1)`` each.

    Recursions (a state may stay, advance by one, or skip one blank when the labels on
    both sides of that blank differ; PyTorch applies this rule to any target id,
    the blank's included)::

        alpha_0(s) = log_probs[0, l'_s]                  for s in {0, 1}
        alpha_t(s) = log_probs[t, l'_s] + logsumexp(alpha_{t-1}(s), alpha_{t-1}(s-1),
                                                    alpha_{t-1}(s-2) if s > 1 and l'_{s-2} != l'_s)
        beta_{T-1}(s) = log_probs[T-1, l'_s]             for s in {S-1, S-2}
        beta_t(s) = log_probs[t, l'_s] + logsumexp(beta_{t+1}(s), beta_{t+1}(s+1),
                                                   beta_{t+1}(s+2) if s < S-2 and l'_{s+2} != l'_s)
    """
    T = log_probs.shape[0]
    ext = extended_labels(np.asarray(target, dtype=np.int64), blank)
    S = len(ext)
    alpha = np.full((T, S), NEG_INF)
    beta = np.full((T, S), NEG_INF)
    if T == 0:
        return alpha, beta
    for s in range(min(2, S)):
        alpha[0, s] = log_probs[0, ext[s]]
    for t in range(1, T):
        for s in range(S):
            terms = [alpha[t - 1, s]]
            if s > 0:
                terms.append(alpha[t - 1, s - 1])
            if s > 1 and ext[s - 2] != ext[s]:
                terms.append(alpha[t - 1, s - 2])
            alpha[t, s] = _logsumexp(terms) + log_probs[t, ext[s]]
    for s in range(max(S - 2, 0), S):
        beta[T - 1, s] = log_probs[T - 1, ext[s]]
    for t in range(T - 2, -1, -1):
        for s in range(S):
            terms = [beta[t + 1, s]]
            if s < S - 1:
                terms.append(beta[t + 1, s + 1])
            if s < S - 2 and ext[s + 2] != ext[s]:
                terms.append(beta[t + 1, s + 2])
            beta[t, s] = _logsumexp(terms) + log_probs[t, ext[s]]
    return alpha, beta


def ctc_utterance_numpy(
    log_probs: np.ndarray, target: np.ndarray, blank: int = 0
) -> Tuple[float, np.ndarray]:
    """Loss ``nll`` and its gradient ``(T, C)`` for one utterance, in PyTorch's convention.

    With ``gamma_t(c) = log sum_{s: l'_s = c} exp(alpha_t(s) + beta_t(s))`` the derivative
    of ``nll`` with respect to ``log_probs[t, c]`` is ``-exp(gamma_t(c) + nll - 2 log_probs[t, c])``
    times ``exp(log_probs[t, c])``, i.e. ``-exp(gamma_t(c) + nll - log_probs[t, c])`` (``beta``
    holds frame ``t``'s emission once more). PyTorch returns that plus ``exp(log_probs[t, c])``:
    the gradient *through a log-softmax* expressed per log-probability. The extra term
    sums to a constant per frame and cancels in the log-softmax's backward, so both
    conventions give the same gradient for the logits. Frames of an impossible
    alignment (``nll = inf``) get NaN, as in PyTorch.
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    T, C = log_probs.shape
    target = np.asarray(target, dtype=np.int64)
    L = len(target)
    if T == 0:
        return (0.0 if L == 0 else np.inf), np.zeros((0, C))
    alpha, beta = ctc_alpha_beta_numpy(log_probs, target, blank)
    S = 2 * L + 1
    ends = [alpha[T - 1, S - 1]] + ([alpha[T - 1, S - 2]] if L > 0 else [])
    nll = -_logsumexp(ends)
    ext = extended_labels(target, blank)
    grad = np.empty((T, C))
    with np.errstate(invalid="ignore"):
        for t in range(T):
            for c in range(C):
                gamma = _logsumexp([alpha[t, s] + beta[t, s] for s in range(S) if ext[s] == c])
                grad[t, c] = np.exp(log_probs[t, c]) - np.exp(gamma + nll - log_probs[t, c])
    return nll, grad


def ctc_loss_numpy(
    log_probs: np.ndarray,
    cu_seqlens: np.ndarray,
    targets: np.ndarray,
    target_lengths: np.ndarray,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """Packed batch: ``log_probs (T_total, C)``, utterance ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]``.

    Returns ``(loss, grad)``: the reduced loss (shape ``(B,)`` for ``"none"``, a scalar
    otherwise) and ``d sum(loss) / d log_probs`` in PyTorch's convention, ``(T_total, C)``.
    ``"mean"`` divides each utterance's loss by its target length (at least 1), then
    averages over the batch.
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    B = len(cu) - 1
    losses = np.zeros(B)
    grad = np.zeros_like(log_probs)
    for b in range(B):
        L = int(target_lengths[b])
        rows = slice(cu[b], cu[b + 1])
        nll, g = ctc_utterance_numpy(log_probs[rows], np.asarray(targets[b][:L]), blank)
        if zero_infinity and np.isinf(nll):
            nll, g = 0.0, np.zeros_like(g)
        if reduction == "mean":
            weight = 1.0 / (max(L, 1) * B)
        else:
            weight = 1.0
        losses[b] = nll
        grad[rows] = g * weight
    if reduction == "none":
        return losses, grad
    if reduction == "sum":
        return np.asarray(losses.sum()), grad
    if reduction == "mean":
        lengths = np.maximum(np.asarray(target_lengths[:B], dtype=np.float64), 1.0)
        return np.asarray((losses / lengths).mean() if B else np.nan), grad
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


#: A state's predecessor on the best path, as a choice of the Viterbi recursion: the same
#: state (``s``), the one before (``s - 1``), or two before (``s - 2``, a skipped blank).
STAY, ADVANCE, SKIP = 0, 1, 2


def ctc_viterbi_numpy(
    log_probs: np.ndarray, target: np.ndarray, blank: int = 0
) -> Tuple[np.ndarray, np.ndarray]:
    """The Viterbi variables ``delta`` ``(T, 2L+1)`` of one utterance and each state's
    choice of predecessor ``(T, 2L+1)`` (:data:`STAY`, :data:`ADVANCE`, :data:`SKIP`).

    The forward recursion of :func:`ctc_alpha_beta_numpy` with the maximum in place of the
    log-sum-exp: ``delta_t(s)`` is the log-probability of the *best* alignment of the first
    ``t + 1`` frames that ends in state ``s``::

        delta_0(s) = log_probs[0, l'_s]                  for s in {0, 1}
        delta_t(s) = log_probs[t, l'_s] + max(delta_{t-1}(s), delta_{t-1}(s-1),
                                              delta_{t-1}(s-2) if s > 1 and l'_{s-2} != l'_s)

    **Tie rule**: the predecessors are tried in the order stay, ``s - 1``, ``s - 2``, and a
    later one is taken only if it is strictly greater than the best so far; so on a tie the
    path stays, and advances by one rather than skipping. (Unreachable states, all
    predecessors ``-inf``, choose :data:`STAY`.) Row 0 of the choices is :data:`STAY`.
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    T = log_probs.shape[0]
    ext = extended_labels(np.asarray(target, dtype=np.int64), blank)
    S = len(ext)
    delta = np.full((T, S), NEG_INF)
    choices = np.full((T, S), STAY, dtype=np.int64)
    if T == 0:
        return delta, choices
    for s in range(min(2, S)):
        delta[0, s] = log_probs[0, ext[s]]
    for t in range(1, T):
        for s in range(S):
            best, choice = delta[t - 1, s], STAY
            if s > 0 and delta[t - 1, s - 1] > best:
                best, choice = delta[t - 1, s - 1], ADVANCE
            if s > 1 and ext[s - 2] != ext[s] and delta[t - 1, s - 2] > best:
                best, choice = delta[t - 1, s - 2], SKIP
            delta[t, s] = best + log_probs[t, ext[s]]
            choices[t, s] = choice
    return delta, choices


def ctc_align_numpy(
    log_probs: np.ndarray, target: np.ndarray, blank: int = 0
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """The best alignment of one utterance: ``(labels, tokens, scores, spans, log_likelihood)``.

    * ``labels`` ``(T,)``: the class each frame emits on the best path, ``l'_{s_t}``;
    * ``tokens`` ``(T,)``: the target position ``k`` (0-based) of a frame in label state
      ``s_t = 2k + 1``, -1 for a frame in a blank state (repeated labels are told apart);
    * ``scores`` ``(T,)``: ``log_probs[t, labels[t]]``;
    * ``spans`` ``(L, 2)``: the first and the last frame of each target token;
    * ``log_likelihood``: the best path's log-probability, ``max(delta_{T-1}(2L), delta_{T-1}(2L-1))``,
      the sum of the ``scores`` in frame order.

    The path ends in state ``2L`` (a final blank) unless ``2L - 1`` is strictly better
    (ties end on the blank), then follows each state's choice of :func:`ctc_viterbi_numpy`
    back to frame 0. With no frames, the log-likelihood is 0 for an empty target and
    ``-inf`` otherwise. Where no path has a finite score (too few frames for the target,
    or ``-inf`` log-probabilities in the way) the log-likelihood is ``-inf``, every frame
    gets ``labels = blank``, ``tokens = -1``, ``scores = -inf``, and every span is
    ``(-1, -1)``.
    """
    log_probs = np.asarray(log_probs, dtype=np.float64)
    T = log_probs.shape[0]
    target = np.asarray(target, dtype=np.int64)
    L = len(target)
    ext = extended_labels(target, blank)
    S = len(ext)
    labels = np.full(T, blank, dtype=np.int64)
    tokens = np.full(T, -1, dtype=np.int64)
    scores = np.full(T, NEG_INF)
    spans = np.full((L, 2), -1, dtype=np.int64)
    if T == 0:
        return labels, tokens, scores, spans, (0.0 if L == 0 else NEG_INF)
    delta, choices = ctc_viterbi_numpy(log_probs, target, blank)
    state = S - 1
    if L > 0 and delta[T - 1, S - 2] > delta[T - 1, S - 1]:
        state = S - 2
    log_likelihood = float(delta[T - 1, state])
    if log_likelihood == NEG_INF:
        return labels, tokens, scores, spans, log_likelihood
    for t in range(T - 1, -1, -1):
        labels[t] = ext[state]
        scores[t] = log_probs[t, ext[state]]
        if state % 2 == 1:
            k = (state - 1) // 2
            tokens[t] = k
            spans[k, 0] = t
            if spans[k, 1] < 0:
                spans[k, 1] = t
        state -= choices[t, state] if t > 0 else 0
    return labels, tokens, scores, spans, log_likelihood
