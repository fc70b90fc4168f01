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
"""
from __future__ import annotations

import torch

__all__ = ["ctc_loss_padded"]

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
    B, T, C = log_probs.shape
    device = log_probs.device
    U = targets.shape[1]
    S = 2 * U + 1
    input_lengths = input_lengths.to(device=device, dtype=torch.long)
    target_lengths = target_lengths.to(device=device, dtype=torch.long)
    s = torch.arange(S, device=device)
    # extended labels: blank at even s, targets[(s - 1) / 2] at odd s
    ext = torch.full((B, S), blank, dtype=torch.long, device=device)
    ext[:, 1::2] = targets.to(device=device, dtype=torch.long).clamp(0, C - 1)
    ext_states = s[None, :] < (2 * target_lengths[:, None] + 1)
    ext = torch.where(ext_states, ext, torch.full_like(ext, blank))
    prev2 = torch.cat([torch.full((B, 2), -1, dtype=torch.long, device=device), ext[:, :-2]], dim=1)
    can_skip = (s[None, :] > 1) & (ext != prev2)

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
