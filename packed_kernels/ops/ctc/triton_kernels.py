"""CTC loss, stage 3: Triton kernels over a packed batch, and their launchers.

Two steps, one after the other:

1. The forward (:func:`ctc_forward_triton`): :func:`ctc_label_groups_kernel`, grid
   ``(B,)``, sorts each utterance's target ids so that the gradient pass can sum
   repeated classes in a fixed order, and checks the values of ``cu_seqlens``,
   ``target_lengths`` and ``targets`` on the way (:data:`CHECK_NAMES`; a violation goes
   to the error word of :mod:`packed_kernels.validation`); then
   :func:`ctc_alpha_beta_pairs_kernel`, grid ``(B, 2)``: for each utterance, program
   ``(b, 0)`` runs the ``alpha`` recursion forward in time while program ``(b, 1)``
   runs the ``beta`` recursion backward in time; each stores its state for every frame
   in a packed ``(T_total, 2U + 1)`` buffer, one row per packed frame, and the
   ``alpha`` program writes the utterance's loss.
2. The gradient (:func:`ctc_backward_triton`): :func:`ctc_gradient_kernel`, grid
   ``(cdiv(T_total, ROWS),)``: fully parallel over packed rows. Every packed row belongs
   to exactly one utterance, so each program writes its own gradient rows once, with no
   atomics.

Forced alignment (:func:`ctc_align_triton`, :func:`ctc_align_from_logits_triton`) is one
more kernel, :func:`ctc_viterbi_kernel`, grid ``(B,)``: the same recursion with the maximum
in place of the log-sum-exp, two bits per state and frame for each state's best
predecessor, and the walk back through them in the same program. Concatenated (1-D)
targets are padded on the device first (:func:`ctc_padded_targets_triton`).

From logits (:func:`ctc_logits_forward_triton`, :func:`ctc_logits_backward_triton`) and
from a linear layer's input (:func:`ctc_linear_forward_triton`,
:func:`ctc_linear_backward_triton`, chunks of frames at a time), the same two steps run
over gathered columns: :func:`ctc_logits_normaliser_kernel` reduces each row of logits
to its log-sum-exp and its ``U + 1`` label log-probabilities, the recursion runs over
those columns, and :func:`ctc_logits_gradient_kernel` writes ``g (softmax - occupancy)``
for the logits in one pass over the rows.

Log-probabilities are read in their own dtype and every sum is done in float32
(float64 for float64 inputs). The launchers take their launch choices as a
:class:`CTCForwardConfig` and a :class:`CTCGradientConfig`, chosen by
:func:`ctc_forward_config` and :func:`ctc_gradient_config`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from ... import runtime
from ...validation import error_word, report_violation

__all__ = [
    "CHECK_NAMES",
    "CTCForwardConfig",
    "CTCGradientConfig",
    "REDUCTION_CODES",
    "compute_dtype",
    "CTCAlignConfig",
    "ctc_align_config",
    "ctc_align_from_logits_triton",
    "ctc_align_triton",
    "ctc_alpha_beta_pairs_kernel",
    "choice_words_per_frame",
    "ctc_concatenated_targets_kernel",
    "ctc_padded_targets_triton",
    "ctc_viterbi_kernel",
    "ctc_backward_triton",
    "ctc_forward_config",
    "ctc_forward_triton",
    "ctc_gradient_config",
    "ctc_gradient_kernel",
    "ctc_label_groups_kernel",
    "ctc_linear_backward_triton",
    "ctc_linear_forward_triton",
    "ctc_logits_backward_triton",
    "ctc_logits_forward_triton",
    "ctc_logits_gradient_kernel",
    "ctc_logits_normaliser_kernel",
    "LINEAR_CHUNK_ELEMENTS",
    "linear_chunk_frames",
]

#: How the gradient kernel weighs each utterance's loss (the batch reduction's
#: derivative): ``grad_loss[b]`` per utterance, one ``grad_loss`` for the sum, or
#: ``grad_loss / (B max(L_b, 1))`` for the mean.
REDUCTION_NONE = tl.constexpr(0)
REDUCTION_SUM = tl.constexpr(1)
REDUCTION_MEAN = tl.constexpr(2)
#: The ``reduction`` argument of the public function, as the kernel's constant.
REDUCTION_CODES = {"none": REDUCTION_NONE.value, "sum": REDUCTION_SUM.value, "mean": REDUCTION_MEAN.value}
#: The value checks of :func:`ctc_label_groups_kernel`, in the order the forward launchers
#: take their codes (``checks``): ``cu_seqlens`` starts at 0, is non-decreasing and ends
#: at ``T_total``; each target length lies in ``[0, U]``; each target id within its
#: target length lies in ``[0, C)``.
CHECK_NAMES = ("cu_seqlens_start", "cu_seqlens_order", "cu_seqlens_end", "target_lengths", "targets")


@triton.jit
def _logaddexp(a, b):
    m = tl.maximum(a, b)
    m = tl.where(m == float("-inf"), 0.0, m)
    return tl.log(tl.exp(a - m) + tl.exp(b - m)) + m


@triton.jit
def _logaddexp3(a, b, c):
    m = tl.maximum(tl.maximum(a, b), c)
    # all three -inf (an unreachable state): keep it -inf instead of -inf - -inf = NaN
    m = tl.where(m == float("-inf"), 0.0, m)
    return tl.log(tl.exp(a - m) + tl.exp(b - m) + tl.exp(c - m)) + m


@triton.jit
def _first_frame_states(row_ptr, blank_offset, label_offset, has_frames, k, label_lane, dtype: tl.constexpr):
    """The state at an utterance's first frame, ``(blank_state, label_state)`` per lane:
    the frame's log-probability of the blank in lane 0's blank state and of the first
    label in its label state, ``-inf`` everywhere else (and everywhere for an utterance
    without frames). ``row_ptr`` points at the frame's row of log-probabilities."""
    NEG_INF: tl.constexpr = float("-inf")
    # (a scalar condition joins a lane mask through tl.where, as in the recursion's masks)
    blank_emit = tl.load(row_ptr + blank_offset, mask=has_frames, other=NEG_INF).to(dtype)
    label_emit = tl.load(row_ptr + label_offset, mask=tl.where(has_frames, label_lane, False),
                         other=NEG_INF).to(dtype)
    blank_state = tl.where(k == 0, blank_emit, NEG_INF)
    label_state = tl.where((k == 0) & label_lane, label_emit, NEG_INF)
    return blank_state, label_state


@triton.jit
def ctc_alpha_beta_pairs_kernel(
    log_probs_ptr, stride_lp_t, stride_lp_c,
    cu_seqlens_ptr,
    targets_ptr, stride_tg_b, stride_tg_u,
    target_lengths_ptr,
    state_ptr, stride_direction, stride_state,
    nll_ptr,
    T_total, C, U, blank,
    BLOCK_U: tl.constexpr,
):
    """Forward (``alpha``) and backward (``beta``) recursions of one utterance; grid ``(B, 2)``.

    Program ``(b, 0)`` computes, for the frames ``t`` of utterance ``b`` and the states
    ``s < 2L + 1`` of its extended label sequence ``l'`` (blank at even ``s``)::

        alpha_0(s) = lp[0, l'_s]                                   (s < 2)
        alpha_t(s) = lp[t, l'_s] + logsumexp(alpha_{t-1}(s), alpha_{t-1}(s-1),
                                             alpha_{t-1}(s-2) if s > 1 and l'_{s-2} != l'_s)
        nll        = -logsumexp(alpha_{T-1}(2L), alpha_{T-1}(2L-1))

    (``nll = 0`` for an utterance with no frames and an empty target, ``inf`` with no
    frames and a non-empty target.) Program ``(b, 1)`` computes ``beta``, the same
    recursion run backward in time over the reversed target. One code path serves both.

    The states alternate blank, label, blank, ...: lane ``k`` holds the blank state
    ``e_k`` (``s = 2k``) and the label state ``o_k`` (``s = 2k + 1``, label ``l_{k+1}``)::

        e_k <- lp[t, blank]  + logsumexp(e_k, o_{k-1})
        o_k <- lp[t, l_{k+1}] + logsumexp(o_k, e_k, o_{k-1} if l_{k+1} != l_k)

    Only ``o`` has to move between lanes, by one: one ``tl.gather`` per step. The
    blank's emission is one number per frame. For ``beta`` lane ``k`` holds
    ``s = 2L - 2k`` and ``s = 2L - 2k - 1``. The emissions do not depend on the
    recursion; they are loaded two frames ahead so that their memory latency overlaps
    the recursion instead of lengthening it.
    """
    b = tl.program_id(0)
    direction = tl.program_id(1)
    backward = direction == 1
    NEG_INF: tl.constexpr = float("-inf")
    # Clamps keep every access in bounds even for inputs that could not be validated
    # (while tracing or capturing); valid inputs pass through unchanged.
    start = _clamp_index(tl.load(cu_seqlens_ptr + b), 0, T_total)
    end = _clamp_index(tl.load(cu_seqlens_ptr + b + 1), start, T_total)
    n_frames = end - start
    L = _clamp_index(tl.load(target_lengths_ptr + b), 0, U)

    k = tl.arange(0, BLOCK_U)
    blank_lane = k <= L
    label_lane = k < L
    target_row = targets_ptr + b.to(tl.int64) * stride_tg_b
    position = tl.where(backward, L - 1 - k, k)  # target index of o_k
    label = tl.load(target_row + position * stride_tg_u, mask=label_lane, other=blank)
    label = _clamp_index(label, 0, C - 1)
    before = tl.where(backward, L - k, k - 1)  # target index of o_{k-1}
    label_before = tl.load(target_row + before * stride_tg_u, mask=label_lane & (k >= 1), other=blank)
    label_before = _clamp_index(label_before, 0, C - 1)
    can_skip = label_lane & (k >= 1) & (label != label_before)
    blank_column = tl.where(backward, 2 * L - 2 * k, 2 * k)
    label_column = tl.where(backward, 2 * L - 2 * k - 1, 2 * k + 1)
    # Lanes beyond the target write -inf to the states ``2L + 1 <= s <= 2U`` (``2k`` and
    # ``2k + 1`` in either direction), so that every entry of the state is written.
    blank_column = tl.where(blank_lane, blank_column, 2 * k)
    label_column = tl.where(label_lane, label_column, 2 * k + 1)
    blank_store = k <= U
    label_store = k < U

    state_ptr += direction.to(tl.int64) * stride_direction
    dtype = state_ptr.dtype.element_ty
    label_offset = label.to(tl.int64) * stride_lp_c
    blank_offset = blank * stride_lp_c
    first_row = tl.where(backward, end - 1, start).to(tl.int64)
    row_step = tl.where(backward, -1, 1).to(tl.int64)
    has_frames = n_frames > 0
    # (a scalar condition joins a lane mask through tl.where: the interpreter rejects
    # the broadcast view that `lanes & scalar` gives as a load or store mask)
    blank_state, label_state = _first_frame_states(log_probs_ptr + first_row * stride_lp_t, blank_offset,
                                                   label_offset, has_frames, k, label_lane, dtype)
    out = state_ptr + first_row * stride_state
    tl.store(out + blank_column, blank_state, mask=tl.where(has_frames, blank_store, False))
    tl.store(out + label_column, label_state, mask=tl.where(has_frames, label_store, False))

    # prefetch the emissions of the next two frames
    row_1 = first_row + row_step
    row_2 = row_1 + row_step
    blank_next = tl.load(log_probs_ptr + row_1 * stride_lp_t + blank_offset, mask=n_frames > 1,
                         other=NEG_INF).to(dtype)
    label_next = tl.load(log_probs_ptr + row_1 * stride_lp_t + label_offset,
                         mask=tl.where(n_frames > 1, label_lane, False), other=NEG_INF).to(dtype)
    blank_after = tl.load(log_probs_ptr + row_2 * stride_lp_t + blank_offset, mask=n_frames > 2,
                          other=NEG_INF).to(dtype)
    label_after = tl.load(log_probs_ptr + row_2 * stride_lp_t + label_offset,
                          mask=tl.where(n_frames > 2, label_lane, False), other=NEG_INF).to(dtype)

    row = first_row
    for t in range(1, n_frames):
        row += row_step
        blank_emit = blank_next
        label_emit = label_next
        blank_next = blank_after
        label_next = label_after
        ahead = row + 2 * row_step
        blank_after = tl.load(log_probs_ptr + ahead * stride_lp_t + blank_offset, mask=t + 2 < n_frames,
                              other=NEG_INF).to(dtype)
        label_after = tl.load(log_probs_ptr + ahead * stride_lp_t + label_offset,
                              mask=tl.where(t + 2 < n_frames, label_lane, False), other=NEG_INF).to(dtype)
        label_before_state = tl.gather(label_state, tl.maximum(k - 1, 0), 0)
        label_before_state = tl.where(k >= 1, label_before_state, NEG_INF)
        new_blank = _logaddexp(blank_state, label_before_state) + blank_emit
        new_label = _logaddexp3(label_state, blank_state, tl.where(can_skip, label_before_state, NEG_INF)) + label_emit
        blank_state = tl.where(blank_lane, new_blank, NEG_INF)
        label_state = tl.where(label_lane, new_label, NEG_INF)
        out = state_ptr + row * stride_state
        tl.store(out + blank_column, blank_state, mask=blank_store)
        tl.store(out + label_column, label_state, mask=label_store)

    if direction == 0:
        final_blank = tl.max(tl.where(k == L, blank_state, NEG_INF), axis=0)
        final_label = tl.max(tl.where(k == L - 1, label_state, NEG_INF), axis=0)
        nll = -_logaddexp(final_blank, final_label)
        no_frames_nll = tl.where(L == 0, 0.0, float("inf")).to(nll.dtype)
        nll = tl.where(has_frames, nll, no_frames_nll)
        tl.store(nll_ptr + b, nll)


@triton.jit
def _clamp_index(value, low, high):
    """``value`` clamped to ``[low, high]``, then int32: clamped in its own dtype first,
    so that an int64 value beyond int32 clamps instead of wrapping."""
    return tl.minimum(tl.maximum(value, low), high).to(tl.int32)


@triton.jit
def _owner_of_rows(rows, cu_seqlens_ptr, B, ROWS: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(owner, in_utterance)`` of each packed row: the utterance owning it, the number of
    utterances that end at or before it (clamped to ``B - 1``, so every row reads a real
    utterance), and whether the row lies in that utterance's frames (rows before
    ``cu_seqlens[0]`` or from ``cu_seqlens[B]`` on belong to none)."""
    owner = tl.zeros((ROWS,), dtype=tl.int32)
    for first in range(0, B, BLOCK_B):
        ids = first + tl.arange(0, BLOCK_B)
        ends = tl.load(cu_seqlens_ptr + 1 + ids, mask=ids < B, other=0)
        ended = (ends[None, :] <= rows[:, None]) & (ids < B)[None, :]
        owner += tl.sum(ended.to(tl.int32), axis=1)
    owner = tl.minimum(owner, B - 1)
    in_utterance = (rows >= tl.load(cu_seqlens_ptr + owner)) & (rows < tl.load(cu_seqlens_ptr + owner + 1))
    return owner, in_utterance


@triton.jit
def _label_class_totals(
    lp_rows, stride_lp_c, normaliser, row_ok, owner, L, nll, alpha_rows, beta_rows,
    group_labels_ptr, group_slots_ptr, group_starts_ptr, stride_groups, C, U, blank,
    BLOCK_K: tl.constexpr,
):
    """The occupancy of each class of the target (and the blank) at each row, summed over
    its repeats: ``(column, lp, total, writes)``, each ``(ROWS, BLOCK_K)``.

    Row ``t``'s log-probabilities are ``lp[t, c] = scores[t, c] - normaliser[t]`` (the
    log-probabilities themselves with a zero normaliser, or logits and their per-row
    log-sum-exp). Slot ``j`` of the sorted list (see :func:`ctc_label_groups_kernel`)
    holds class ``column[j]`` and ``lp[t, column[j]]``; where ``writes[j]`` (the last slot
    of its class's run), ``total[j]`` is the class's occupancy
    ``o_t(c) = sum_{s: l'_s = c} exp(alpha_t(s) + beta_t(s) - lp[t, c] + nll)``.
    """
    NEG_INF: tl.constexpr = float("-inf")
    k = tl.arange(0, BLOCK_K)
    lp_blank = tl.load(lp_rows + blank * stride_lp_c, mask=row_ok, other=0.0).to(nll.dtype) - normaliser
    blank_ok = row_ok[:, None] & (k[None, :] <= L[:, None])
    blank_gamma = (tl.load(alpha_rows[:, None] + 2 * k[None, :], mask=blank_ok, other=NEG_INF)
                   + tl.load(beta_rows[:, None] + 2 * k[None, :], mask=blank_ok, other=NEG_INF))
    blank_occupancy = tl.where(blank_gamma == NEG_INF, 0.0,
                               tl.exp(blank_gamma - lp_blank[:, None] + nll[:, None]))
    blank_total = tl.sum(blank_occupancy, axis=1)

    groups = owner.to(tl.int64)[:, None] * stride_groups + k[None, :]
    in_list = row_ok[:, None] & (k < U + 1)[None, :]
    label = tl.load(group_labels_ptr + groups, mask=in_list, other=C)
    slot = tl.load(group_slots_ptr + groups, mask=in_list, other=U)
    run_start = tl.load(group_starts_ptr + groups, mask=in_list, other=0)
    label_after = tl.load(group_labels_ptr + groups + 1, mask=row_ok[:, None] & (k + 1 < U + 1)[None, :],
                          other=-1)
    used = in_list & (label < C) & (label >= 0)
    column = tl.where(used, label, 0)
    lp = tl.load(lp_rows[:, None] + column * stride_lp_c, mask=used, other=0.0).to(nll.dtype) - normaliser[:, None]
    is_blank_slot = slot >= U
    slot_ok = used & (~is_blank_slot) & (slot < L[:, None])
    label_state = 2 * tl.where(slot_ok, slot, 0) + 1
    slot_gamma = (tl.load(alpha_rows[:, None] + label_state, mask=slot_ok, other=NEG_INF)
                  + tl.load(beta_rows[:, None] + label_state, mask=slot_ok, other=NEG_INF))
    occupancy = tl.where(slot_gamma == NEG_INF, 0.0, tl.exp(slot_gamma - lp + nll[:, None]))
    occupancy = tl.where(is_blank_slot, blank_total[:, None], occupancy)
    prefix = tl.cumsum(occupancy, axis=1)
    before_run = tl.gather(prefix, tl.maximum(run_start - 1, 0), 1)
    total = prefix - tl.where(run_start > 0, before_run, 0.0)
    writes = used & (label != label_after)
    return column, lp, total, writes


@triton.jit
def ctc_gradient_kernel(
    log_probs_ptr, stride_lp_t, stride_lp_c,
    grad_ptr, stride_grad_t,
    cu_seqlens_ptr, target_lengths_ptr,
    nll_ptr, grad_loss_ptr, stride_grad_loss,
    alpha_ptr, beta_ptr, stride_state,
    group_labels_ptr, group_slots_ptr, group_starts_ptr, stride_groups,
    B, T_total, C, U, blank,
    ZERO_INFINITY: tl.constexpr,
    REDUCTION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Gradient of the per-utterance losses for ``ROWS`` packed frames; grid ``(cdiv(T_total, ROWS),)``.

    For frame ``t`` of utterance ``b``, with ``g`` the gradient of the loss with respect
    to ``nll_b`` (``grad_loss[b]`` for ``REDUCTION_NONE``, ``grad_loss`` for ``REDUCTION_SUM``,
    ``grad_loss / (B max(L_b, 1))`` for ``REDUCTION_MEAN``), PyTorch's convention
    (the derivative as if through a log-softmax) is::

        grad[t, c] = exp(lp[t, c]) * g - exp(gamma_t(c) + nll_b - lp[t, c]) * g,
        gamma_t(c) = log sum_{s: l'_s = c} exp(alpha_t(s) + beta_t(s)).

    The subtracted term is the *occupancy* of class ``c`` at frame ``t``: the posterior
    probability that the alignment emits ``c`` there,
    ``o_t(c) = sum_{s: l'_s = c} o_t(s)`` with ``o_t(s) = exp(alpha_t(s) + beta_t(s) - lp[t, l'_s] + nll)``
    (``beta`` includes frame ``t``'s emission, so it is taken out once). Each ``o_t(s)``
    lies in ``[0, 1]`` and they sum to 1 over ``s``, so they are summed in linear space
    with an absolute error of about one float32 rounding; no log-sum-exp is needed.

    The row is first written for every class as ``exp(lp) g - exp(-inf + nll - lp) g``:
    that is ``exp(lp) g`` for the classes outside the target, and NaN where PyTorch
    gives NaN (an impossible utterance, ``nll = inf``, or a class with ``lp = -inf``).
    Then the target classes and the blank are overwritten with ``o_t(c)`` subtracted.

    A class may occur several times in a target (``"hello"``) and the blank fills every
    even state. :func:`ctc_label_groups_kernel` has sorted each utterance's label slots
    by class, with one extra slot standing for all the blank states, and given each
    sorted slot the index where its run of equal classes starts. A prefix sum over the sorted slots then gives each
    class's total at the last slot of its run (prefix there minus prefix before the run),
    and only that slot writes the class's column: no atomics, and the order of every
    sum is fixed, so the gradient is bitwise the same on every run. With
    ``ZERO_INFINITY`` an utterance whose loss is infinite gets a zero gradient.
    """
    NEG_INF: tl.constexpr = float("-inf")
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T_total
    owner, in_utterance = _owner_of_rows(rows, cu_seqlens_ptr, B, ROWS, BLOCK_B)
    L = _clamp_index(tl.load(target_lengths_ptr + owner), 0, U)
    # a row outside every utterance gets a zero gradient (nll 0 keeps inf - inf out)
    nll = tl.where(in_utterance, tl.load(nll_ptr + owner), 0.0)
    g = tl.where(in_utterance, tl.load(grad_loss_ptr + owner * stride_grad_loss).to(nll.dtype), 0.0)
    if REDUCTION == REDUCTION_MEAN:
        g = g / B / tl.maximum(L, 1).to(nll.dtype)

    rows64 = rows.to(tl.int64)
    lp_rows = log_probs_ptr + rows64 * stride_lp_t
    grad_rows = grad_ptr + rows64 * stride_grad_t
    alpha_rows = alpha_ptr + rows64 * stride_state
    beta_rows = beta_ptr + rows64 * stride_state

    # Pass 1: the whole vocabulary, as if no class were in the target.
    for first in range(0, C, BLOCK_C):
        cols = first + tl.arange(0, BLOCK_C)
        inside = row_ok[:, None] & (cols < C)[None, :]
        lp = tl.load(lp_rows[:, None] + cols[None, :] * stride_lp_c, mask=inside, other=0.0).to(nll.dtype)
        value = tl.exp(lp) * g[:, None] - tl.exp(NEG_INF + nll[:, None] - lp) * g[:, None]
        if ZERO_INFINITY:
            value = tl.where((nll == float("inf"))[:, None], 0.0, value)
        tl.store(grad_rows[:, None] + cols[None, :], value.to(grad_ptr.dtype.element_ty), mask=inside)

    # Pass 2: the target classes and the blank.
    column, lp, total, writes = _label_class_totals(
        lp_rows, stride_lp_c, tl.zeros((ROWS,), dtype=nll.dtype), row_ok & in_utterance, owner, L, nll, alpha_rows, beta_rows,
        group_labels_ptr, group_slots_ptr, group_starts_ptr, stride_groups, C, U, blank, BLOCK_K)
    # the last term is 0, or NaN exactly where pass 1 wrote NaN
    value = (tl.exp(lp) * g[:, None] - total * g[:, None]
             - tl.exp(NEG_INF + nll[:, None] - lp) * g[:, None])
    if ZERO_INFINITY:
        value = tl.where((nll == float("inf"))[:, None], 0.0, value)
    # Pass 1's stores to these columns, from other threads, must land first.
    tl.debug_barrier()
    tl.store(grad_rows[:, None] + column, value.to(grad_ptr.dtype.element_ty), mask=writes)


@triton.jit
def _report_batch_values(word_ptr, start_code, order_code, end_code, length_code, id_code,
                         cu_seqlens_ptr, b, B, T_total, C, U, length, ids, k, L):
    """The value checks of :data:`CHECK_NAMES` that program ``b`` of a grid of ``max(B, 1)``
    makes (see :func:`ctc_label_groups_kernel`): ``length`` is ``target_lengths[b]`` as
    read (0 for ``b >= B``), ``L`` it clamped to ``[0, U]``, ``ids`` the target ids of
    lanes ``k < L`` as read, in their own dtype."""
    valid = b < B
    utterance = k.to(tl.int64) * 0 + b
    first = k == 0
    start = tl.load(cu_seqlens_ptr + b)
    end = tl.load(cu_seqlens_ptr + b + 1, mask=valid, other=0)
    last = tl.load(cu_seqlens_ptr + B)
    # (a program's later report overwrites its earlier one)
    report_violation(word_ptr, id_code, (k < L) & ((ids < 0) | (ids >= C)), utterance)
    report_violation(word_ptr, length_code, first & valid & ((length < 0) | (length > U)), utterance)
    report_violation(word_ptr, order_code, first & valid & (end < start), utterance + 1)
    report_violation(word_ptr, end_code, first & (b == 0) & (last != T_total), utterance * 0 + B)
    report_violation(word_ptr, start_code, first & (b == 0) & (start != 0), utterance * 0)


@triton.jit
def ctc_label_groups_kernel(
    targets_ptr, stride_tg_b, stride_tg_u,
    target_lengths_ptr, cu_seqlens_ptr,
    labels_ptr, slots_ptr, run_starts_ptr, stride_groups,
    B, T_total, C, U, blank,
    word_ptr, start_code, order_code, end_code, length_code, id_code,
    CHECK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Sort one utterance's label slots by class, for the gradient pass, and check the
    values of the batch description; grid ``(max(B, 1),)``.

    The list has ``U + 1`` slots: slot ``k < L`` holds target id ``l_{k+1}``, slots
    ``L <= k < U`` are unused (key ``C``, so they sort last) and slot ``U`` stands for all
    the blank states (key ``blank``). A counting sort places slot ``k`` at::

        rank(k)  = #{j : key_j < key_k} + #{j < k : key_j = key_k}      (stable)
        start(k) = #{j : key_j < key_k}                                   (its run's first rank)

    and writes ``labels[rank] = key``, ``slots[rank] = k``, ``run_starts[rank] = start``.
    The comparisons are done ``BLOCK_J`` slots at a time against all ``BLOCK_K``.

    With ``CHECK``, program ``b < B`` reports (:func:`~packed_kernels.validation.report_violation`
    into the error word at ``word_ptr``) ``order_code`` at entry ``b + 1`` where
    ``cu_seqlens[b + 1] < cu_seqlens[b]``, ``length_code`` at utterance ``b`` where
    ``target_lengths[b]`` lies outside ``[0, U]``, and ``id_code`` at utterance ``b``
    where one of its first ``L`` ids lies outside ``[0, C)``; program 0 also reports
    ``start_code`` at entry 0 where ``cu_seqlens[0] != 0`` and ``end_code`` at entry ``B``
    where ``cu_seqlens[B] != T_total``. Every value is compared in its own dtype, before
    the clamps, so an int64 value beyond int32 is refused rather than wrapped. With
    ``B = 0`` the one program checks ``cu_seqlens`` and writes nothing else.
    """
    b = tl.program_id(0)
    valid = b < B
    length = tl.load(target_lengths_ptr + b, mask=valid, other=0)
    L = _clamp_index(length, 0, U)
    target_row = targets_ptr + b.to(tl.int64) * stride_tg_b
    k = tl.arange(0, BLOCK_K)
    # (a scalar condition joins a lane mask through tl.where, as in the recursion's masks)
    in_list = tl.where(valid, k < U + 1, False)
    ids = tl.load(target_row + k * stride_tg_u, mask=k < L, other=0)
    key = _clamp_index(ids, 0, C - 1)
    key = tl.where(k < L, key, tl.where(k == U, blank, C))
    if CHECK:
        _report_batch_values(word_ptr, start_code, order_code, end_code, length_code, id_code,
                             cu_seqlens_ptr, b, B, T_total, C, U, length, ids, k, L)
    smaller = tl.zeros((BLOCK_K,), dtype=tl.int32)
    equal_before = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for first_j in range(0, U + 1, BLOCK_J):
        j = first_j + tl.arange(0, BLOCK_J)
        other = _clamp_index(tl.load(target_row + j * stride_tg_u, mask=j < L, other=0), 0, C - 1)
        other = tl.where(j < L, other, tl.where(j == U, blank, C))
        counted = (j < U + 1)[None, :]
        smaller += tl.sum(((other[None, :] < key[:, None]) & counted).to(tl.int32), axis=1)
        earlier_equal = (other[None, :] == key[:, None]) & (j[None, :] < k[:, None]) & counted
        equal_before += tl.sum(earlier_equal.to(tl.int32), axis=1)
    rank = tl.where(in_list, smaller + equal_before, 0)
    out = b.to(tl.int64) * stride_groups + rank
    tl.store(labels_ptr + out, key, mask=in_list)
    tl.store(slots_ptr + out, k, mask=in_list)
    tl.store(run_starts_ptr + out, smaller, mask=in_list)


@triton.jit
def ctc_logits_normaliser_kernel(
    logits_ptr, stride_lg_t, stride_lg_c,
    row_offset, n_rows,
    cu_seqlens_ptr,
    targets_ptr, stride_tg_b, stride_tg_u,
    lse_ptr, gathered_ptr, stride_gathered,
    B, C, U, blank,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Each frame's normaliser and the log-probabilities of its utterance's label columns,
    for ``n_rows`` rows of logits; grid ``(cdiv(n_rows, ROWS),)``.

    Row ``i`` of ``logits`` is packed frame ``t = row_offset + i`` (a chunk of the packed
    rows, or all of them), of utterance ``b``. With ``z = logits[i]``::

        lse[t]         = log sum_c exp(z[c])              (one pass, a running maximum)
        gathered[t, k] = z[l_k] - lse[t]                  (k < U: target id l_k = targets[b, k])
        gathered[t, U] = z[blank] - lse[t]

    so the recursion reads ``U + 1`` log-probabilities per frame and never the ``C`` of a
    log-softmax row. Ids beyond a target's length are clamped to ``[0, C)`` and their
    columns are never used. Sums in the dtype of ``lse`` (float32, float64 for float64).
    """
    NEG_INF: tl.constexpr = float("-inf")
    local = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = local < n_rows
    rows = row_offset + local
    owner, _ = _owner_of_rows(rows, cu_seqlens_ptr, B, ROWS, BLOCK_B)
    dtype = lse_ptr.dtype.element_ty
    z_rows = logits_ptr + local.to(tl.int64) * stride_lg_t

    running_max = tl.full((ROWS,), NEG_INF, dtype=dtype)
    running_sum = tl.zeros((ROWS,), dtype=dtype)
    for first in range(0, C, BLOCK_C):
        cols = first + tl.arange(0, BLOCK_C)
        inside = row_ok[:, None] & (cols < C)[None, :]
        z = tl.load(z_rows[:, None] + cols[None, :] * stride_lg_c, mask=inside, other=NEG_INF).to(dtype)
        new_max = tl.maximum(running_max, tl.max(z, axis=1))
        # a row whose logits so far are all -inf keeps a zero sum instead of -inf - -inf = NaN
        shift = tl.where(new_max == NEG_INF, 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        running_max = new_max
    lse = tl.log(running_sum) + tl.where(running_max == NEG_INF, 0.0, running_max)
    tl.store(lse_ptr + rows, lse, mask=row_ok)

    k = tl.arange(0, BLOCK_K)
    target_row = targets_ptr + owner.to(tl.int64)[:, None] * stride_tg_b
    ids = tl.load(target_row + k[None, :] * stride_tg_u, mask=row_ok[:, None] & (k < U)[None, :], other=0)
    ids = _clamp_index(ids, 0, C - 1)
    ids = tl.where((k == U)[None, :], blank, ids)
    in_list = row_ok[:, None] & (k < U + 1)[None, :]
    z = tl.load(z_rows[:, None] + ids * stride_lg_c, mask=in_list, other=0.0).to(dtype)
    out = gathered_ptr + rows.to(tl.int64)[:, None] * stride_gathered + k[None, :]
    tl.store(out, z - lse[:, None], mask=in_list)


@triton.jit
def ctc_logits_gradient_kernel(
    logits_ptr, stride_lg_t, stride_lg_c,
    grad_ptr, stride_grad_t, stride_grad_c,
    row_offset, n_rows,
    cu_seqlens_ptr, target_lengths_ptr,
    nll_ptr, grad_loss_ptr, stride_grad_loss, lse_ptr,
    alpha_ptr, beta_ptr, stride_state,
    group_labels_ptr, group_slots_ptr, group_starts_ptr, stride_groups,
    B, C, U, blank,
    ZERO_INFINITY: tl.constexpr,
    REDUCTION: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Gradient of the loss with respect to the logits, for ``n_rows`` rows; grid ``(cdiv(n_rows, ROWS),)``.

    Row ``i`` is packed frame ``t = row_offset + i`` of utterance ``b``; ``g`` is the
    gradient of the loss with respect to ``nll_b`` (as in :func:`ctc_gradient_kernel`).
    The CTC loss of ``log_softmax(z)`` has the gradient::

        dlogits[t, c] = g (softmax(z)[t, c] - o_t(c)),   softmax(z)[t, c] = exp(z[t, c] - lse[t])

    where the occupancy ``o_t(c)`` (see :func:`_label_class_totals`, with
    ``lp = z - lse``) is non-zero only on the blank and the target's classes, its repeats
    summed. Pass 1 writes ``g softmax`` over the whole row, reading each logit once; pass 2
    writes the ``U + 1`` label columns with the occupancy subtracted. Their logits are read
    before pass 1 runs, so ``grad`` may be ``logits`` itself (the gradient written in
    place). An impossible utterance (``nll = inf``) gets NaN rows, as the composition with
    PyTorch's ``log_softmax`` gives, or zero rows with ``ZERO_INFINITY``. A logit of
    ``-inf`` gets a zero gradient (its softmax and occupancy are 0).
    """
    local = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = local < n_rows
    rows = row_offset + local
    owner, in_utterance = _owner_of_rows(rows, cu_seqlens_ptr, B, ROWS, BLOCK_B)
    L = _clamp_index(tl.load(target_lengths_ptr + owner), 0, U)
    # a row outside every utterance gets a zero gradient (nll 0 keeps inf - inf out)
    nll = tl.where(in_utterance, tl.load(nll_ptr + owner), 0.0)
    g = tl.where(in_utterance, tl.load(grad_loss_ptr + owner * stride_grad_loss).to(nll.dtype), 0.0)
    if REDUCTION == REDUCTION_MEAN:
        g = g / B / tl.maximum(L, 1).to(nll.dtype)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    impossible = (nll == float("inf"))[:, None]
    if ZERO_INFINITY:
        undefined = 0.0
    else:
        undefined = float("nan")

    local64 = local.to(tl.int64)
    rows64 = rows.to(tl.int64)
    z_rows = logits_ptr + local64 * stride_lg_t
    grad_rows = grad_ptr + local64 * stride_grad_t
    alpha_rows = alpha_ptr + rows64 * stride_state
    beta_rows = beta_ptr + rows64 * stride_state

    # The label columns first: their logits must be read before pass 1 may overwrite them.
    column, lp, total, writes = _label_class_totals(
        z_rows, stride_lg_c, lse, row_ok & in_utterance, owner, L, nll, alpha_rows, beta_rows,
        group_labels_ptr, group_slots_ptr, group_starts_ptr, stride_groups, C, U, blank, BLOCK_K)
    label_value = tl.where(impossible, undefined, (tl.exp(lp) - total) * g[:, None])
    tl.debug_barrier()

    # Pass 1: the softmax over the whole vocabulary.
    for first in range(0, C, BLOCK_C):
        cols = first + tl.arange(0, BLOCK_C)
        inside = row_ok[:, None] & (cols < C)[None, :]
        z = tl.load(z_rows[:, None] + cols[None, :] * stride_lg_c, mask=inside, other=0.0).to(nll.dtype)
        value = tl.where(impossible, undefined, tl.exp(z - lse[:, None]) * g[:, None])
        tl.store(grad_rows[:, None] + cols[None, :] * stride_grad_c, value.to(grad_ptr.dtype.element_ty),
                 mask=inside)

    # Pass 2: the target classes and the blank; pass 1's stores there, from other threads,
    # must land first.
    tl.debug_barrier()
    tl.store(grad_rows[:, None] + column * stride_grad_c, label_value.to(grad_ptr.dtype.element_ty), mask=writes)



# ---------------------------------------------------------------------------------------
# forced alignment: the Viterbi path

#: The predecessor a trellis state takes on the best path, two bits per state in the
#: choice words of :func:`ctc_viterbi_kernel`: stay in ``s``, come from ``s - 1``, or from
#: ``s - 2`` (a skipped blank).
CHOICE_STAY = tl.constexpr(0)
CHOICE_ADVANCE = tl.constexpr(1)
CHOICE_SKIP = tl.constexpr(2)
#: Trellis states per 32-bit choice word (two bits each).
STATES_PER_WORD = 16
_STATES_PER_WORD_IN_KERNELS = tl.constexpr(STATES_PER_WORD)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@runtime.CachedLaunch
@triton.jit
def ctc_viterbi_kernel(
    log_probs_ptr, stride_lp_t, stride_lp_c,
    cu_seqlens_ptr,
    targets_ptr, stride_tg_b, stride_tg_u,
    target_lengths_ptr,
    choices_ptr, words_per_row,
    labels_ptr, tokens_ptr, scores_ptr,
    spans_ptr, span_rows, tail_rows, span_offsets_ptr, log_likelihood_ptr,
    B, T_total, C, U, blank,
    word_ptr, start_code, order_code, end_code, length_code, id_code,
    GATHERED: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The best (Viterbi) alignment of one utterance, and its backtrace; grid ``(max(B, 1),)``.

    The trellis of :func:`ctc_alpha_beta_pairs_kernel` with the maximum in place of the
    log-sum-exp (max-product instead of sum-product). Lane ``k`` holds the blank state
    ``e_k`` (``s = 2k``) and the label state ``o_k`` (``s = 2k + 1``, label ``l_{k+1}``)::

        e_k <- lp[t, blank]   + max(e_k, o_{k-1})
        o_k <- lp[t, l_{k+1}] + max(o_k, e_k, o_{k-1} if l_{k+1} != l_k)

    **Tie rule** (that of :func:`~.naive_numpy.ctc_viterbi_numpy`): a predecessor replaces
    the stay only if strictly greater, and the skip replaces the best of the other two
    only if strictly greater; so a tie stays, then advances by one rather than skipping.
    The path ends in state ``2L`` unless ``2L - 1`` is strictly better. Every comparison
    is exact, so the path is bitwise the same on every run and matches the other stages
    wherever their scores are equal.

    Each frame's choices (:data:`CHOICE_STAY`, :data:`CHOICE_ADVANCE`, :data:`CHOICE_SKIP`)
    go to memory as two bits per state: state ``s`` at bits ``2 (s mod 16)`` of word
    ``s // 16`` of the frame's row of ``ceil((2U + 1) / 16)`` int32 words (lane ``k``'s
    pair is one nibble; eight lanes make a word). After the last frame the same program
    walks back from the final state: ``s - choice_t(s)`` is the state at frame ``t - 1``.
    The next row of words is loaded one frame ahead, so the walk's chain is a select and a
    shift per frame, not a load. Then a pass over the frames, ``BLOCK_T`` at a time, turns
    the state ``s`` of frame ``t`` into its label (``l'_s``), token (``(s - 1) / 2`` for
    odd ``s``, else -1) and score (``lp[t, l'_s]``). A token's span is written by the walk
    where it enters the token's state (the last frame) and where it leaves it (the first
    frame), as frames within the utterance, at row ``span_offsets[b] + k`` of ``spans``:
    ``span_offsets[b]`` is the sum of the target lengths before ``b``, which each program
    adds up itself (``BLOCK_B`` at a time). The ``span_rows`` rows of ``spans`` may
    outnumber the tokens (room for ``B U`` of them): each program writes -1 to
    ``tail_rows`` of the rows after the last token's.

    Where no path has a finite score, the log-likelihood is ``-inf`` and the frames get
    the blank, token -1 and score ``-inf``, the spans -1; with no frames the
    log-likelihood is 0 for an empty target and ``-inf`` otherwise. With ``GATHERED``,
    row ``t`` of ``log_probs`` holds only the ``U + 1`` label columns of
    :func:`ctc_logits_normaliser_kernel` (column ``k`` for target position ``k``, column
    ``U`` for the blank). The program also checks the values of ``cu_seqlens``,
    ``target_lengths`` and ``targets`` (:func:`_report_batch_values`), and clamps every
    index it reads.
    """
    b = tl.program_id(0)
    valid = b < B
    NEG_INF: tl.constexpr = float("-inf")
    BLOCK_W: tl.constexpr = BLOCK_U // 8
    k = tl.arange(0, BLOCK_U)
    length = tl.load(target_lengths_ptr + b, mask=valid, other=0)
    L = _clamp_index(length, 0, U)
    target_row = targets_ptr + b.to(tl.int64) * stride_tg_b
    ids = tl.load(target_row + k * stride_tg_u, mask=k < L, other=0)
    _report_batch_values(word_ptr, start_code, order_code, end_code, length_code, id_code,
                         cu_seqlens_ptr, b, B, T_total, C, U, length, ids, k, L)

    # the spans of the utterances before this one, and of all of them
    span_start = tl.zeros((), dtype=tl.int64)
    span_total = tl.zeros((), dtype=tl.int64)
    for first in range(0, B, BLOCK_B):
        others = first + tl.arange(0, BLOCK_B)
        lengths = _clamp_index(tl.load(target_lengths_ptr + others, mask=others < B, other=0), 0, U).to(tl.int64)
        span_start += tl.sum(tl.where(others < b, lengths, 0), axis=0)
        span_total += tl.sum(lengths, axis=0)
    tl.store(span_offsets_ptr + b + 1, span_start + L, mask=valid)
    tl.store(span_offsets_ptr + b * 0, span_start * 0, mask=b == 0)
    # the rows after every target's spans (spans has room for B targets of U labels): -1,
    # tail_rows of them per program
    for first in range(0, tail_rows, BLOCK_U):
        tail = span_total + b.to(tl.int64) * tail_rows + first + k
        unused = ((first + k) < tail_rows) & (tail < span_rows)
        tl.store(spans_ptr + tail * 2, tail * 0 - 1, mask=unused)
        tl.store(spans_ptr + tail * 2 + 1, tail * 0 - 1, mask=unused)

    start = _clamp_index(tl.load(cu_seqlens_ptr + b), 0, T_total)
    end = _clamp_index(tl.load(cu_seqlens_ptr + b + 1, mask=valid, other=0), start, T_total)
    n_frames = tl.where(valid, end - start, 0)
    has_frames = n_frames > 0

    blank_lane = k <= L
    label_lane = k < L
    label = tl.where(label_lane, _clamp_index(ids, 0, C - 1), blank)
    label_before = tl.load(target_row + (k - 1) * stride_tg_u, mask=label_lane & (k >= 1), other=blank)
    label_before = _clamp_index(label_before, 0, C - 1)
    can_skip = label_lane & (k >= 1) & (label != label_before)
    if GATHERED:
        label_offset = k.to(tl.int64) * stride_lp_c
        blank_offset = U * stride_lp_c
    else:
        label_offset = label.to(tl.int64) * stride_lp_c
        blank_offset = blank * stride_lp_c

    dtype = scores_ptr.dtype.element_ty
    first_row = start.to(tl.int64)
    blank_state, label_state = _first_frame_states(log_probs_ptr + first_row * stride_lp_t, blank_offset,
                                                   label_offset, has_frames, k, label_lane, dtype)
    blank_next = tl.load(log_probs_ptr + (first_row + 1) * stride_lp_t + blank_offset, mask=n_frames > 1,
                         other=NEG_INF).to(dtype)
    label_next = tl.load(log_probs_ptr + (first_row + 1) * stride_lp_t + label_offset,
                         mask=tl.where(n_frames > 1, label_lane, False), other=NEG_INF).to(dtype)
    nibble_shift = 4 * (k % 8)
    w = tl.arange(0, BLOCK_W)
    word_store = w < words_per_row

    for t in range(1, n_frames):
        row = first_row + t
        blank_emit = blank_next
        label_emit = label_next
        ahead = row + 1
        blank_next = tl.load(log_probs_ptr + ahead * stride_lp_t + blank_offset, mask=t + 1 < n_frames,
                             other=NEG_INF).to(dtype)
        label_next = tl.load(log_probs_ptr + ahead * stride_lp_t + label_offset,
                             mask=tl.where(t + 1 < n_frames, label_lane, False), other=NEG_INF).to(dtype)
        label_before_state = tl.gather(label_state, tl.maximum(k - 1, 0), 0)
        label_before_state = tl.where(k >= 1, label_before_state, NEG_INF)
        # strictly greater: a tie keeps the stay, then the advance
        blank_advances = label_before_state > blank_state
        best_blank = tl.where(blank_advances, label_before_state, blank_state)
        label_advances = blank_state > label_state
        best_label = tl.where(label_advances, blank_state, label_state)
        skip = tl.where(can_skip, label_before_state, NEG_INF)
        label_skips = skip > best_label
        best_label = tl.where(label_skips, skip, best_label)
        blank_state = tl.where(blank_lane, best_blank + blank_emit, NEG_INF)
        label_state = tl.where(label_lane, best_label + label_emit, NEG_INF)
        label_choice = tl.where(label_skips, CHOICE_SKIP, tl.where(label_advances, CHOICE_ADVANCE, CHOICE_STAY))
        nibble = (blank_advances.to(tl.int32) | (label_choice.to(tl.int32) << 2)) << nibble_shift
        words = tl.reduce(tl.reshape(nibble, (BLOCK_W, 8)), 1, _bitwise_or)
        tl.store(choices_ptr + row * words_per_row + w, words, mask=word_store)

    final_blank = tl.max(tl.where(k == L, blank_state, NEG_INF), axis=0)
    final_label = tl.max(tl.where(k == L - 1, label_state, NEG_INF), axis=0)
    ends_on_label = final_label > final_blank
    best = tl.where(ends_on_label, final_label, final_blank)
    possible = has_frames & (best > NEG_INF)
    no_frames = tl.where(L == 0, 0.0, NEG_INF).to(dtype)
    tl.store(log_likelihood_ptr + b, tl.where(has_frames, best, no_frames), mask=valid)
    span_rows_of_b = span_start + k
    tl.store(spans_ptr + span_rows_of_b * 2, span_rows_of_b * 0 - 1,
             mask=tl.where(possible, False, label_lane & (span_rows_of_b < span_rows)))
    tl.store(spans_ptr + span_rows_of_b * 2 + 1, span_rows_of_b * 0 - 1,
             mask=tl.where(possible, False, label_lane & (span_rows_of_b < span_rows)))

    # The walk back reads the choice words that every thread of the program stored above.
    tl.debug_barrier()
    # Its chain per frame: select the state's word, shift, subtract. Nothing in it waits for
    # memory: the words are loaded a frame ahead, and the stores (the frame's state, into
    # ``tokens`` for now, and the spans) depend on registers only.
    state = tl.where(ends_on_label, 2 * L - 1, 2 * L)
    walked = tl.where(possible, n_frames, 0)
    last_row = first_row + walked - 1
    words = tl.load(choices_ptr + last_row * words_per_row + w, mask=tl.where(walked > 1, word_store, False),
                    other=0)
    entering = possible
    for i in range(0, walked):
        t = walked - 1 - i
        row = first_row + t
        words_next = tl.load(choices_ptr + (row - 1) * words_per_row + w,
                             mask=tl.where(t > 1, word_store, False), other=0)
        tl.store(tokens_ptr + row, state.to(tl.int64))
        word = tl.sum(tl.where(w == state // _STATES_PER_WORD_IN_KERNELS, words, 0), axis=0)
        choice = tl.where(t > 0, (word >> (2 * (state % _STATES_PER_WORD_IN_KERNELS))) & 3, CHOICE_STAY)
        leaving = (t == 0) | (choice != CHOICE_STAY)
        span_row = span_start + (state - 1) // 2
        spanned = ((state % 2) == 1) & (span_row < span_rows)
        tl.store(spans_ptr + span_row * 2 + 1, t.to(tl.int64), mask=spanned & entering)
        tl.store(spans_ptr + span_row * 2, t.to(tl.int64), mask=spanned & leaving)
        entering = leaving
        state = tl.maximum(state - choice, 0)
        words = words_next

    # Each frame's state to its label, token and score, BLOCK_T frames at a time (each
    # thread reads back the states it stores over).
    tl.debug_barrier()
    for first in range(0, n_frames, BLOCK_T):
        frames = first + tl.arange(0, BLOCK_T)
        in_frames = frames < n_frames
        walked_frames = tl.where(possible, in_frames, False)
        rows = first_row + frames
        states = tl.load(tokens_ptr + rows, mask=walked_frames, other=0).to(tl.int32)
        on_label = walked_frames & ((states % 2) == 1)
        token = tl.where(on_label, (states - 1) // 2, -1)
        label_id = tl.load(target_row + token * stride_tg_u, mask=on_label, other=blank)
        label_id = tl.where(on_label, _clamp_index(label_id, 0, C - 1), blank)
        if GATHERED:
            column = tl.where(on_label, token, U)
        else:
            column = label_id
        score = tl.load(log_probs_ptr + rows * stride_lp_t + column.to(tl.int64) * stride_lp_c, mask=walked_frames,
                        other=NEG_INF).to(dtype)
        tl.store(labels_ptr + rows, label_id.to(tl.int64), mask=in_frames)
        tl.store(tokens_ptr + rows, token.to(tl.int64), mask=in_frames)
        tl.store(scores_ptr + rows, score, mask=in_frames)


@runtime.CachedLaunch
@triton.jit
def ctc_concatenated_targets_kernel(
    targets_ptr, stride_targets, N,
    target_lengths_ptr,
    padded_ptr, stride_padded,
    lengths_ptr,
    B, U,
    word_ptr, lengths_code,
    BLOCK_U: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Concatenated targets (``F.ctc_loss``'s 1-D form) to padded ones; grid ``(B,)``.

    Utterance ``b``'s target is ``targets[o_b : o_b + L_b]`` with ``o_b = sum_{j < b} L_j``
    (each program adds up the lengths before its own, ``BLOCK_B`` at a time)::

        padded[b, k] = targets[o_b + k]     (k < min(L_b, U); 0 beyond)
        lengths[b]   = min(max(L_b, 0), U)

    It reports ``lengths_code`` at utterance ``b`` where ``L_b < 0``, where
    ``o_b + L_b > N`` or, for the last utterance, where ``o_b + L_b != N``: the lengths
    must be non-negative and sum to ``N``. Reads are clamped to ``[0, N)``.
    """
    b = tl.program_id(0)
    offset = tl.zeros((), dtype=tl.int64)
    for first in range(0, b, BLOCK_B):
        others = first + tl.arange(0, BLOCK_B)
        before = tl.load(target_lengths_ptr + others, mask=others < b, other=0).to(tl.int64)
        offset += tl.sum(tl.maximum(before, 0), axis=0)
    length = tl.load(target_lengths_ptr + b)
    end = offset + length
    lanes = tl.arange(0, BLOCK_U)
    first_lane = lanes == 0
    bad = (length < 0) | (end > N) | ((b == B - 1) & (end != N))
    report_violation(word_ptr, lengths_code, first_lane & bad, lanes.to(tl.int64) * 0 + b)
    L = tl.minimum(tl.maximum(length, 0), U)
    tl.store(lengths_ptr + b, L.to(lengths_ptr.dtype.element_ty))
    row = padded_ptr + b.to(tl.int64) * stride_padded
    for first in range(0, U, BLOCK_U):
        k = first + lanes
        source = tl.minimum(tl.maximum(offset + k, 0), N - 1)
        ids = tl.load(targets_ptr + source * stride_targets, mask=k < L, other=0)
        tl.store(row + k, ids, mask=k < U)


# ---------------------------------------------------------------------------------------
# the launchers


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in for ``log_probs`` of ``dtype``: float64 for
    float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernel_numerics():
    """Under the interpreter, numpy would warn about ``log(0) = -inf`` and ``-inf - -inf``,
    which the kernels produce on purpose for unreachable states (and then mask)."""
    if runtime.INTERPRETED:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore")
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class CTCForwardConfig:
    """Launch choices of the forward kernels (the label sort and the recursion)."""

    #: Lanes of the recursion (one per blank-and-label pair) and slots of the sort: a
    #: power of two covering the ``U + 1`` pairs.
    block_labels: int
    #: Slots the sort compares against all the others per step.
    sort_block: int
    sort_num_warps: int
    recursion_num_warps: int


def ctc_forward_config(U: int) -> CTCForwardConfig:
    """The forward's launch choices for targets padded to ``U`` labels."""
    block_labels = max(16, runtime.next_power_of_2(U + 1))
    return CTCForwardConfig(
        block_labels=block_labels,
        sort_block=max(1, min(16, 4096 // block_labels)),
        sort_num_warps=4,
        # The recursion is bound by each step's latency, not by throughput: one
        # (blank, label) pair per thread keeps a step's chain shortest.
        recursion_num_warps=max(1, min(16, block_labels // 32)),
    )


def _label_groups(targets, target_lengths, C: int, blank: int, config: CTCForwardConfig, cu_seqlens=None,
                  T_total: int = 0, checks: Optional[Sequence[int]] = None):
    """Each utterance's label slots sorted by class (see :func:`ctc_label_groups_kernel`):
    ``(labels, slots, run_starts)``, each int32 ``(B, U + 1)``. With ``checks`` (the codes
    of :data:`CHECK_NAMES`, in that order), the same launch checks ``cu_seqlens`` (against
    ``T_total`` rows), ``target_lengths`` and ``targets`` on the device; it then runs for
    ``B = 0`` too, with one program."""
    B, U = targets.shape
    labels, slots, run_starts = (torch.empty((B, U + 1), dtype=torch.int32, device=targets.device)
                                 for _ in range(3))
    if B or checks is not None:
        check = checks is not None
        codes = tuple(checks) if check else (0,) * len(CHECK_NAMES)
        ctc_label_groups_kernel[(max(B, 1),)](
            targets, targets.stride(0), targets.stride(1),
            target_lengths, cu_seqlens if check else target_lengths,
            labels, slots, run_starts, labels.stride(0),
            B, T_total, C, U, blank,
            error_word(targets.device), *codes,
            CHECK=check,
            BLOCK_K=config.block_labels,
            BLOCK_J=config.sort_block,
            num_warps=config.sort_num_warps,
        )
    return labels, slots, run_starts


def _alpha_beta(log_probs, cu_seqlens, targets, target_lengths, blank: int, U: int, config: CTCForwardConfig):
    """``(nll, state)`` from :func:`ctc_alpha_beta_pairs_kernel` over ``log_probs``' columns;
    ``U`` is the width the state is laid out for (the targets may be narrower)."""
    T_total, C = log_probs.shape
    B = cu_seqlens.shape[0] - 1
    dtype = compute_dtype(log_probs.dtype)
    nll = torch.empty(B, dtype=dtype, device=log_probs.device)
    # state[0] holds alpha, state[1] beta, one row per packed frame
    state = torch.empty((2, T_total, 2 * U + 1), dtype=dtype, device=log_probs.device)
    if B:
        ctc_alpha_beta_pairs_kernel[(B, 2)](
            log_probs, log_probs.stride(0), log_probs.stride(1),
            cu_seqlens,
            targets, targets.stride(0), targets.stride(1),
            target_lengths,
            state, state.stride(0), state.stride(1),
            nll,
            T_total, C, U, blank,
            BLOCK_U=config.block_labels,
            num_warps=config.recursion_num_warps,
        )
    return nll, state


@runtime.on_inputs_device
def ctc_forward_triton(log_probs, cu_seqlens, targets, target_lengths, blank: int, config: CTCForwardConfig,
                       checks: Optional[Sequence[int]] = None):
    """Per-utterance losses ``nll`` (B,), the ``(2, T_total, 2U + 1)`` alpha/beta state
    (``-inf`` beyond each target's ``2L + 1`` states) and the sorted label slots
    ``(labels, slots, run_starts)``, each int32 ``(B, U + 1)``.

    ``cu_seqlens`` and ``target_lengths`` must be contiguous; ``log_probs`` and
    ``targets`` may have any strides. ``checks``: the codes of the value checks
    (:data:`CHECK_NAMES`) that the label sort makes on the way, or ``None`` for none.
    """
    with _kernel_numerics():
        groups = _label_groups(targets, target_lengths, log_probs.shape[1], blank, config, cu_seqlens,
                               log_probs.shape[0], checks)
        nll, state = _alpha_beta(log_probs, cu_seqlens, targets, target_lengths, blank, targets.shape[1], config)
    return (nll, state, *groups)


@dataclasses.dataclass(frozen=True)
class CTCGradientConfig:
    """Launch choices of :func:`ctc_gradient_kernel`."""

    #: Packed rows per program (``ROWS``); a program's rows may span several utterances.
    rows_per_program: int
    #: Utterance ends compared per step when finding each row's utterance (``BLOCK_B``).
    block_batch: int
    #: Label slots per row: a power of two covering the ``U + 1`` slots (``BLOCK_K``).
    block_labels: int
    #: Classes per tile of the vocabulary pass (``BLOCK_C``).
    block_classes: int
    num_warps: int


def ctc_gradient_config(B: int, C: int, U: int, rows_per_program: Optional[int] = None) -> CTCGradientConfig:
    """The gradient kernel's launch choices for ``B`` utterances, ``C`` classes and targets
    padded to ``U`` labels; ``rows_per_program`` overrides the number of packed rows per
    program (the other choices follow from it)."""
    block_classes = min(1024, max(16, runtime.next_power_of_2(C)))
    block_labels = max(16, runtime.next_power_of_2(U + 1))
    block_width = max(block_classes, block_labels)
    if rows_per_program is None:
        # Several packed rows per program when rows are short (a small vocabulary, few
        # labels), so that each program's tiles hold about 2048 elements; under the
        # interpreter, as many as possible, since its cost is per program and per
        # operation, not per element.
        rows_per_program = 64 if runtime.INTERPRETED else max(1, min(32, 2048 // block_width))
    return CTCGradientConfig(
        rows_per_program=rows_per_program,
        block_batch=max(16, min(runtime.next_power_of_2(B), 4096 // rows_per_program)),
        block_labels=block_labels,
        block_classes=block_classes,
        # 8 warps for a 4096-element tile: 16 elements of each live tensor per thread.
        num_warps=max(1, min(8, rows_per_program * block_width // 512)),
    )


@runtime.on_inputs_device
def ctc_backward_triton(grad_loss, log_probs, cu_seqlens, targets, target_lengths, nll, state, labels, slots,
                        run_starts, blank: int, reduction: str, zero_infinity: bool, config: CTCGradientConfig):
    """``d loss / d log_probs`` (T_total, C) in log_probs' dtype, from the gradient of the loss.

    ``grad_loss`` is the gradient of the *reduced* loss: ``(B,)`` for ``"none"``, a scalar
    for ``"sum"`` and ``"mean"``; the kernel derives each utterance's share itself. The
    other tensors are ``ctc_forward_triton``'s inputs and outputs.
    """
    T_total, C = log_probs.shape
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    grad = torch.empty((T_total, C), dtype=log_probs.dtype, device=log_probs.device)
    if B == 0 or T_total == 0:
        return grad.zero_()
    if grad_loss.dtype != nll.dtype:
        grad_loss = grad_loss.to(nll.dtype)
    grad_stride = grad_loss.stride(0) if grad_loss.dim() == 1 else 0
    with _kernel_numerics():
        ctc_gradient_kernel[(runtime.cdiv(T_total, config.rows_per_program),)](
            log_probs, log_probs.stride(0), log_probs.stride(1),
            grad, grad.stride(0),
            cu_seqlens, target_lengths,
            nll, grad_loss, grad_stride,
            state[0], state[1], state.stride(1),
            labels, slots, run_starts, labels.stride(0),
            B, T_total, C, U, blank,
            ZERO_INFINITY=bool(zero_infinity),
            REDUCTION=REDUCTION_CODES[reduction],
            ROWS=config.rows_per_program,
            BLOCK_B=config.block_batch,
            BLOCK_K=config.block_labels,
            BLOCK_C=config.block_classes,
            num_warps=config.num_warps,
        )
    return grad


# ---------------------------------------------------------------------------------------
# the loss from logits, and from a linear layer's input

#: Elements of one chunk's logits that :func:`linear_chunk_frames` allows: 2**25 (64 MiB
#: in bfloat16), enough rows for the chunk's matrix products to run at full speed.
LINEAR_CHUNK_ELEMENTS = 2 ** 25


def linear_chunk_frames(C: int) -> int:
    """Frames per chunk of :func:`~packed_kernels.linear_packed_ctc_loss` when the caller
    gives none: as many as keep one chunk's ``(chunk_frames, C)`` logits within
    :data:`LINEAR_CHUNK_ELEMENTS` elements, and at least one. (A batch of fewer frames is
    one chunk of its own size.)"""
    return max(1, LINEAR_CHUNK_ELEMENTS // max(C, 1))


def _gathered_targets(labels, slots, run_starts, U: int):
    """The targets of the recursion over the gathered columns (:func:`ctc_logits_normaliser_kernel`):
    slot ``k``'s id becomes the first slot holding the same class. Column ``first`` holds
    the same log-probabilities as column ``k``, and equal classes keep equal ids, which is
    all the recursion compares (the skip rule)."""
    first = slots.gather(1, run_starts.long())
    return torch.empty_like(slots).scatter_(1, slots.long(), first)[:, :U]


def _normalise_rows(logits, row_offset: int, cu_seqlens, targets, lse, gathered, blank: int,
                    config: CTCGradientConfig):
    """:func:`ctc_logits_normaliser_kernel` over ``logits``, packed rows ``row_offset`` onwards."""
    n_rows, C = logits.shape
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    if n_rows == 0 or B == 0:
        return
    ctc_logits_normaliser_kernel[(runtime.cdiv(n_rows, config.rows_per_program),)](
        logits, logits.stride(0), logits.stride(1),
        row_offset, n_rows,
        cu_seqlens,
        targets, targets.stride(0), targets.stride(1),
        lse, gathered, gathered.stride(0),
        B, C, U, blank,
        ROWS=config.rows_per_program,
        BLOCK_B=config.block_batch,
        BLOCK_K=config.block_labels,
        BLOCK_C=config.block_classes,
        num_warps=config.num_warps,
    )


def _recursion_over_gathered(gathered, cu_seqlens, target_lengths, groups, config: CTCForwardConfig):
    """``(nll, state)``: the alpha/beta recursion over the ``U + 1`` gathered columns."""
    U = gathered.shape[1] - 1
    return _alpha_beta(gathered, cu_seqlens, _gathered_targets(*groups, U), target_lengths, U, U, config)


@runtime.on_inputs_device
def ctc_logits_forward_triton(logits, cu_seqlens, targets, target_lengths, blank: int,
                              forward_config: CTCForwardConfig, rows_config: CTCGradientConfig,
                              checks: Optional[Sequence[int]] = None):
    """The loss of ``log_softmax(logits)``: ``(nll, lse, state, labels, slots, run_starts)``.

    As :func:`ctc_forward_triton` (``checks`` too), plus ``lse`` (T_total,), each frame's
    log-sum-exp.
    The ``(T_total, U + 1)`` gathered log-probabilities the recursion reads are freed on
    return: what the gradient needs is ``logits``, ``lse`` and the state.
    """
    T_total, C = logits.shape
    U = targets.shape[1]
    dtype = compute_dtype(logits.dtype)
    lse = torch.empty(T_total, dtype=dtype, device=logits.device)
    gathered = torch.empty((T_total, U + 1), dtype=dtype, device=logits.device)
    with _kernel_numerics():
        groups = _label_groups(targets, target_lengths, C, blank, forward_config, cu_seqlens, T_total, checks)
        _normalise_rows(logits, 0, cu_seqlens, targets, lse, gathered, blank, rows_config)
        nll, state = _recursion_over_gathered(gathered, cu_seqlens, target_lengths, groups, forward_config)
    return (nll, lse, state, *groups)


def _project(hidden, weight, bias, out):
    """``hidden @ weight.T + bias`` into ``out`` (rows of a reused chunk buffer)."""
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


def _chunk_starts(T_total: int, chunk_frames: int):
    return range(0, T_total, chunk_frames)


@runtime.on_inputs_device
def ctc_linear_forward_triton(hidden, weight, bias, cu_seqlens, targets, target_lengths, blank: int,
                              chunk_frames: int, forward_config: CTCForwardConfig,
                              rows_config: CTCGradientConfig, checks: Optional[Sequence[int]] = None):
    """The loss of ``log_softmax(hidden @ weight.T + bias)``, ``chunk_frames`` rows of logits
    at a time: the outputs of :func:`ctc_logits_forward_triton` (which ``checks`` it makes too).

    Each chunk's logits go into one reused ``(chunk_frames, C)`` buffer, are reduced to
    their rows of ``lse`` and of the gathered label log-probabilities, and are overwritten
    by the next chunk. A chunk may end inside an utterance: the recursion runs once all
    rows are gathered. The products run with autocast off (the public function has cast
    the inputs as ``F.linear`` would).
    """
    T_total, C = hidden.shape[0], weight.shape[0]
    U = targets.shape[1]
    dtype = compute_dtype(hidden.dtype)
    lse = torch.empty(T_total, dtype=dtype, device=hidden.device)
    gathered = torch.empty((T_total, U + 1), dtype=dtype, device=hidden.device)
    buffer = hidden.new_empty((min(chunk_frames, T_total), C))
    with _kernel_numerics(), torch.autocast(hidden.device.type, enabled=False):
        groups = _label_groups(targets, target_lengths, C, blank, forward_config, cu_seqlens, T_total, checks)
        for start in _chunk_starts(T_total, chunk_frames):
            rows = hidden[start:start + chunk_frames]
            logits = _project(rows, weight, bias, buffer[:rows.shape[0]])
            _normalise_rows(logits, start, cu_seqlens, targets, lse, gathered, blank, rows_config)
        nll, state = _recursion_over_gathered(gathered, cu_seqlens, target_lengths, groups, forward_config)
    return (nll, lse, state, *groups)


def _logits_gradient(logits, grad, row_offset: int, grad_loss, cu_seqlens, target_lengths, nll, lse, state,
                     labels, slots, run_starts, blank: int, reduction: str, zero_infinity: bool,
                     config: CTCGradientConfig):
    """:func:`ctc_logits_gradient_kernel` over ``logits``, packed rows ``row_offset`` onwards,
    into ``grad`` (which may be ``logits``)."""
    n_rows, C = logits.shape
    B, U = cu_seqlens.shape[0] - 1, labels.shape[1] - 1
    if n_rows == 0:
        return
    grad_stride = grad_loss.stride(0) if grad_loss.dim() == 1 else 0
    ctc_logits_gradient_kernel[(runtime.cdiv(n_rows, config.rows_per_program),)](
        logits, logits.stride(0), logits.stride(1),
        grad, grad.stride(0), grad.stride(1),
        row_offset, n_rows,
        cu_seqlens, target_lengths,
        nll, grad_loss, grad_stride, lse,
        state[0], state[1], state.stride(1),
        labels, slots, run_starts, labels.stride(0),
        B, C, U, blank,
        ZERO_INFINITY=bool(zero_infinity),
        REDUCTION=REDUCTION_CODES[reduction],
        ROWS=config.rows_per_program,
        BLOCK_B=config.block_batch,
        BLOCK_K=config.block_labels,
        BLOCK_C=config.block_classes,
        num_warps=config.num_warps,
    )


@runtime.on_inputs_device
def ctc_logits_backward_triton(grad_loss, logits, cu_seqlens, target_lengths, nll, lse, state, labels, slots,
                               run_starts, blank: int, reduction: str, zero_infinity: bool,
                               config: CTCGradientConfig):
    """``d loss / d logits`` (T_total, C) in logits' dtype, from the gradient of the reduced
    loss (as in :func:`ctc_backward_triton`) and :func:`ctc_logits_forward_triton`'s outputs."""
    T_total, C = logits.shape
    grad = torch.empty((T_total, C), dtype=logits.dtype, device=logits.device)
    if cu_seqlens.shape[0] == 1 or T_total == 0:
        return grad.zero_()
    grad_loss = grad_loss.to(nll.dtype)
    with _kernel_numerics():
        _logits_gradient(logits, grad, 0, grad_loss, cu_seqlens, target_lengths, nll, lse, state, labels, slots,
                         run_starts, blank, reduction, zero_infinity, config)
    return grad


@runtime.on_inputs_device
def ctc_linear_backward_triton(grad_loss, hidden, weight, bias, cu_seqlens, target_lengths, nll, lse, state,
                               labels, slots, run_starts, blank: int, reduction: str, zero_infinity: bool,
                               chunk_frames: int, needs: Tuple[bool, bool, bool], config: CTCGradientConfig):
    """``(grad_hidden, grad_weight, grad_bias)`` of the loss of :func:`ctc_linear_forward_triton`,
    each in its input's dtype, ``None`` where ``needs`` (hidden, weight, bias) says no.

    Each chunk's logits are recomputed into the reused buffer, turned into their gradient
    there (:func:`ctc_logits_gradient_kernel`, in place), and multiplied out::

        grad_hidden[chunk] = dlogits @ weight
        grad_weight       += dlogits.T @ hidden[chunk]
        grad_bias         += dlogits.sum(0)

    For float16 and bfloat16 over several chunks the sums over chunks are kept in float32
    (each chunk's product rounded once), as one product over all frames would accumulate.
    """
    T_total, D = hidden.shape
    C = weight.shape[0]
    needs_hidden, needs_weight, needs_bias = needs
    needs_bias = needs_bias and bias is not None
    starts = _chunk_starts(T_total, chunk_frames)
    low_precision = hidden.dtype in (torch.float16, torch.bfloat16) and len(starts) > 1
    accumulate = torch.float32 if low_precision else hidden.dtype
    grad_hidden = torch.zeros((T_total, D), dtype=hidden.dtype, device=hidden.device) if needs_hidden else None
    grad_weight = torch.zeros((C, D), dtype=accumulate, device=hidden.device) if needs_weight else None
    grad_bias = torch.zeros(C, dtype=accumulate, device=hidden.device) if needs_bias else None
    if cu_seqlens.shape[0] > 1 and T_total > 0 and any(needs):
        grad_loss = grad_loss.to(nll.dtype)
        buffer = hidden.new_empty((min(chunk_frames, T_total), C))
        with _kernel_numerics(), torch.autocast(hidden.device.type, enabled=False):
            for start in starts:
                rows = hidden[start:start + chunk_frames]
                dlogits = _project(rows, weight, bias, buffer[:rows.shape[0]])
                _logits_gradient(dlogits, dlogits, start, grad_loss, cu_seqlens, target_lengths, nll, lse, state,
                                 labels, slots, run_starts, blank, reduction, zero_infinity, config)
                if needs_hidden:
                    torch.mm(dlogits, weight, out=grad_hidden[start:start + rows.shape[0]])
                if needs_weight:
                    if low_precision:
                        grad_weight += torch.mm(dlogits.t(), rows)
                    else:
                        grad_weight.addmm_(dlogits.t(), rows)
                if needs_bias:
                    grad_bias += dlogits.sum(0, dtype=accumulate)
    cast = (lambda t: None if t is None else t.to(hidden.dtype))
    return grad_hidden, cast(grad_weight), cast(grad_bias)


# ---------------------------------------------------------------------------------------
# forced alignment, and concatenated targets


@dataclasses.dataclass(frozen=True)
class CTCAlignConfig:
    """Launch choices of :func:`ctc_viterbi_kernel`."""

    #: Lanes of the recursion, one per blank-and-label pair: a power of two covering the
    #: ``U + 1`` pairs, at least 16 (two choice words).
    block_labels: int
    #: Target lengths added up per step for the span offsets (``BLOCK_B``).
    block_batch: int
    #: Frames per step of the pass that turns the path's states into the outputs (``BLOCK_T``).
    block_frames: int
    num_warps: int


def ctc_align_config(B: int, U: int) -> CTCAlignConfig:
    """The aligner's launch choices for ``B`` utterances and targets padded to ``U`` labels."""
    block_labels = max(16, runtime.next_power_of_2(U + 1))
    return CTCAlignConfig(
        block_labels=block_labels,
        block_batch=max(16, min(1024, runtime.next_power_of_2(B))),
        block_frames=128,
        # as the loss's recursion: one pair per thread keeps a step's chain shortest
        num_warps=max(1, min(16, block_labels // 32)),
    )


def choice_words_per_frame(U: int) -> int:
    """Int32 words of choices per packed frame, two bits for each of the ``2U + 1`` states."""
    return runtime.cdiv(2 * U + 1, STATES_PER_WORD)


def _viterbi(log_probs, C: int, cu_seqlens, targets, target_lengths, blank: int, span_rows: int,
             config: CTCAlignConfig, checks: Sequence[int], gathered: bool):
    """:func:`ctc_viterbi_kernel` over ``log_probs`` (``(T_total, C)``, or the ``(T_total,
    U + 1)`` gathered columns); ``C`` is the number of classes the target ids index."""
    T_total = log_probs.shape[0]
    B, U = cu_seqlens.shape[0] - 1, targets.shape[1]
    device = log_probs.device
    dtype = compute_dtype(log_probs.dtype)
    labels = torch.empty(T_total, dtype=torch.int64, device=device)
    tokens = torch.empty(T_total, dtype=torch.int64, device=device)
    scores = torch.empty(T_total, dtype=dtype, device=device)
    spans = torch.empty((span_rows, 2), dtype=torch.int64, device=device)
    span_offsets = torch.empty(B + 1, dtype=torch.int64, device=device)
    log_likelihood = torch.empty(B, dtype=dtype, device=device)
    words_per_row = choice_words_per_frame(U)
    choices = torch.empty((T_total, words_per_row), dtype=torch.int32, device=device)
    with _kernel_numerics():
        ctc_viterbi_kernel[(max(B, 1),)](
            log_probs, log_probs.stride(0), log_probs.stride(1),
            cu_seqlens,
            targets, targets.stride(0), targets.stride(1),
            target_lengths,
            choices, words_per_row,
            labels, tokens, scores,
            spans, span_rows, runtime.cdiv(span_rows, max(B, 1)), span_offsets, log_likelihood,
            B, T_total, C, U, blank,
            error_word(device), *checks,
            GATHERED=gathered,
            BLOCK_U=config.block_labels,
            BLOCK_B=config.block_batch,
            BLOCK_T=config.block_frames,
            num_warps=config.num_warps,
        )
    return labels, tokens, scores, spans, span_offsets, log_likelihood


@runtime.on_inputs_device
def ctc_align_triton(log_probs, cu_seqlens, targets, target_lengths, blank: int, span_rows: int,
                     config: CTCAlignConfig, checks: Sequence[int]):
    """The best alignment of every utterance: ``(labels, tokens, scores, spans, span_offsets,
    log_likelihood)`` (see :func:`~packed_kernels.packed_ctc_align`), one launch of
    :func:`ctc_viterbi_kernel`, which also checks the values (``checks``: the codes of
    :data:`CHECK_NAMES`). ``spans`` has ``span_rows`` rows. Working memory: the choice words,
    ``4 T_total ceil((2U + 1) / 16)`` bytes. ``cu_seqlens`` and ``target_lengths`` must be
    contiguous."""
    return _viterbi(log_probs, log_probs.shape[1], cu_seqlens, targets, target_lengths, blank, span_rows,
                    config, checks, gathered=False)


@runtime.on_inputs_device
def ctc_align_from_logits_triton(logits, cu_seqlens, targets, target_lengths, blank: int, span_rows: int,
                                 config: CTCAlignConfig, rows_config: CTCGradientConfig, checks: Sequence[int]):
    """As :func:`ctc_align_triton`, for ``log_softmax(logits)``: the normaliser kernel of
    the loss from logits (:func:`ctc_logits_normaliser_kernel`) reduces each row to the
    log-probabilities of its ``U + 1`` label columns, and the Viterbi kernel runs over
    those. Working memory: ``T_total (U + 2)`` numbers of the computing dtype and the
    choice words."""
    T_total, C = logits.shape
    U = targets.shape[1]
    dtype = compute_dtype(logits.dtype)
    lse = torch.empty(T_total, dtype=dtype, device=logits.device)
    gathered = torch.empty((T_total, U + 1), dtype=dtype, device=logits.device)
    with _kernel_numerics():
        _normalise_rows(logits, 0, cu_seqlens, targets, lse, gathered, blank, rows_config)
    return _viterbi(gathered, C, cu_seqlens, targets, target_lengths, blank, span_rows, config, checks,
                    gathered=True)


@runtime.on_inputs_device
def ctc_padded_targets_triton(targets, target_lengths, U: int, lengths_code: int):
    """``(padded, lengths)``: 1-D concatenated ``targets`` as ``(B, U)`` padded ones, and the
    lengths clamped to ``[0, U]`` (:func:`ctc_concatenated_targets_kernel`, which reports
    ``lengths_code`` where the lengths are negative or do not sum to ``targets.shape[0]``)."""
    B, N = target_lengths.shape[0], targets.shape[0]
    padded = torch.empty((B, U), dtype=targets.dtype, device=targets.device)
    lengths = torch.empty(B, dtype=target_lengths.dtype, device=targets.device)
    if B:
        ctc_concatenated_targets_kernel[(B,)](
            targets, targets.stride(0), N,
            target_lengths,
            padded, padded.stride(0),
            lengths,
            B, U,
            error_word(targets.device), lengths_code,
            BLOCK_U=min(1024, max(16, runtime.next_power_of_2(U))),
            BLOCK_B=max(16, min(1024, runtime.next_power_of_2(B))),
        )
    return padded, lengths
