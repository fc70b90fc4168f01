"""CTC loss, a teaching kernel: the alpha recursion alone, one utterance per program.

For utterance ``b`` of a packed batch (rows ``cu_seqlens[b]`` to ``cu_seqlens[b+1]`` of
``log_probs``, ``T`` frames) and its target ``l_1 .. l_L``, the extended labels are
``l' = (blank, l_1, blank, l_2, ..., l_L, blank)``, ``S = 2L + 1`` states. In log space::

    alpha_0(s) = lp[0, l'_s]                                   for s in {0, 1}
    alpha_t(s) = lp[t, l'_s] + logsumexp(alpha_{t-1}(s), alpha_{t-1}(s-1),
                                         alpha_{t-1}(s-2) if l'_s != l'_{s-2})
    nll        = -logsumexp(alpha_{T-1}(S-1), alpha_{T-1}(S-2))

The skip from ``s - 2`` is allowed only into a label state whose label differs from the
label two states before (a blank is never skipped into). An utterance with no frames has
``nll = 0`` if its target is empty and ``inf`` otherwise, as in ``F.ctc_loss``.

:func:`ctc_alpha_teaching_kernel` keeps one state per lane of a block of ``BLOCK_S``
lanes, so one frame is one step of the loop: two ``tl.gather`` fetch each state's
predecessors ``s - 1`` and ``s - 2`` from the previous frame. It returns the loss only;
the production kernels (:mod:`.triton_kernels`) also run ``beta``, hold two states per
lane, load ahead, check their inputs and write the gradient. This one assumes valid
inputs (ids in ``[0, C)``, lengths within ``targets``) and a contiguous batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import _kernel_numerics

__all__ = ["ctc_alpha_teaching_kernel", "ctc_loss_teaching"]


@triton.jit
def ctc_alpha_teaching_kernel(log_probs_ptr, cu_seqlens_ptr, targets_ptr, target_lengths_ptr,
                              nll_ptr, C, U, blank, BLOCK_S: tl.constexpr):
    """Negative log-likelihood of utterance ``tl.program_id(0)``; lane ``s`` holds ``alpha(s)``."""
    NEG_INF: tl.constexpr = float("-inf")
    b = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + b)
    n_frames = tl.load(cu_seqlens_ptr + b + 1) - start
    L = tl.load(target_lengths_ptr + b)
    s = tl.arange(0, BLOCK_S)
    in_trellis = s < 2 * L + 1
    is_label = (s % 2 == 1) & in_trellis  # odd states hold l_{(s+1)/2}, even ones the blank
    label = tl.load(targets_ptr + b * U + (s - 1) // 2, mask=is_label, other=blank)
    label_two_back = tl.load(targets_ptr + b * U + (s - 3) // 2, mask=is_label & (s >= 3), other=blank)
    can_skip = is_label & (s >= 3) & (label != label_two_back)
    rows = log_probs_ptr + start.to(tl.int64) * C  # the utterance's first frame
    first_states = tl.where(n_frames > 0, 2, 0)  # an alignment starts in state 0 or 1
    alpha = tl.load(rows + label, mask=in_trellis & (s < first_states), other=NEG_INF)
    for t in range(1, n_frames):
        rows += C  # frame t's row
        one_back = tl.where(s >= 1, tl.gather(alpha, tl.maximum(s - 1, 0), 0), NEG_INF)
        two_back = tl.where(can_skip, tl.gather(alpha, tl.maximum(s - 2, 0), 0), NEG_INF)
        top = tl.maximum(tl.maximum(alpha, one_back), two_back)
        top = tl.where(top == NEG_INF, 0.0, top)  # an unreachable state stays -inf, not NaN
        total = tl.log(tl.exp(alpha - top) + tl.exp(one_back - top) + tl.exp(two_back - top)) + top
        alpha = total + tl.load(rows + label, mask=in_trellis, other=NEG_INF)
    last = in_trellis & (s >= 2 * L - 1)  # the final label state and the final blank
    final = tl.where(last & (n_frames > 0), alpha, NEG_INF)
    top = tl.max(final, 0)
    top = tl.where(top == NEG_INF, 0.0, top)
    nll = -(tl.log(tl.sum(tl.exp(final - top), 0)) + top)  # inf where no alignment fits
    nll = tl.where((n_frames == 0) & (L == 0), 0.0, nll)
    tl.store(nll_ptr + b, nll)


def ctc_loss_teaching(log_probs: torch.Tensor, cu_seqlens: torch.Tensor, targets: torch.Tensor,
                      target_lengths: torch.Tensor, blank: int = 0) -> torch.Tensor:
    """Per-utterance CTC loss (``reduction="none"``, no gradient) of packed ``log_probs``
    ``(T_total, C)``, with ``targets`` ``(B, U)`` padded and ``target_lengths`` ``(B,)``:
    one program per utterance, a ``(B,)`` tensor in the dtype of ``log_probs``."""
    log_probs = log_probs.contiguous()
    targets = targets.contiguous()
    B, U = targets.shape
    nll = torch.empty(B, dtype=log_probs.dtype, device=log_probs.device)
    block = triton.next_power_of_2(2 * U + 1)  # every state of the longest target
    with _kernel_numerics():  # -inf states are meant; the interpreter's numpy would warn
        ctc_alpha_teaching_kernel[(B,)](log_probs, cu_seqlens, targets, target_lengths, nll,
                                       log_probs.shape[1], U, blank, BLOCK_S=block)
    return nll
