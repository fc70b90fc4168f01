"""Property tests of ``packed_ctc_loss`` against an independent float64 CTC forward recursion.

Random batches: utterances of 0 to 7 frames (zero-frame and one-frame ones), targets
of 0 to 4 labels with repeats and ids equal to the blank, junk ids beyond each target
length, impossible alignments, every reduction, ``zero_infinity`` on and off, any
blank, four dtypes, strided ``log_probs`` (transposed, sliced, expanded) and index
tensors of int32 or int64, strided targets, offsets and target lengths. The loss and
its gradient (for a random upstream gradient) are compared with
:func:`tests.references.ctc_loss_reference`; two identical calls give the same bits,
as the kernels promise (no atomics, every sum in a fixed order). The same batches are
aligned by ``packed_ctc_align`` and compared with the float64 NumPy Viterbi, utterance by
utterance.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

import numpy as np

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import packed_kernels as pk
from packed_kernels.ops.ctc.naive_numpy import ctc_align_numpy
from tests.assertions import assert_close
from tests.references import LAYOUTS, as_layout, ctc_loss_reference, property_settings, rounded

#: Tolerance (atol = rtol) of the gradient by the input dtype; the loss is computed in
#: float32 for every dtype but float64, from the same rounded log-probabilities. float32
#: leaves room for the GPU's approximate exp and log.
GRADIENT_TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LOSS_TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-6, torch.float16: 5e-6, torch.bfloat16: 5e-6}


@dataclass(frozen=True)
class CTCCase:
    """One batch: frames and targets per utterance, and how the call lays them out."""

    input_lengths: Tuple[int, ...]
    target_lengths: Tuple[int, ...]
    targets: Tuple[Tuple[int, ...], ...]  # (B, U), junk beyond each target length
    num_classes: int
    blank: int
    reduction: str
    zero_infinity: bool
    dtype: torch.dtype
    layout: str  # of log_probs
    index_dtype: torch.dtype
    targets_layout: str
    strided_lengths: bool  # cu_seqlens and target_lengths as views of stride 2
    seed: int


@st.composite
def ctc_cases(draw, dtype: torch.dtype, reduction: str) -> CTCCase:
    """A random batch of 1 to 4 utterances whose log-probabilities are of ``dtype``.

    Each utterance has from 2 frames fewer to 3 frames more than its target's labels
    (at least 0): mostly alignments that exist, and impossible ones (too few frames, or
    repeated labels that need a blank between them) too."""
    B = draw(st.integers(1, 4))
    C = draw(st.integers(2, 5))
    U = draw(st.integers(0, 4))
    blank = draw(st.integers(0, C - 1))
    target_lengths = tuple(draw(st.lists(st.integers(0, U), min_size=B, max_size=B)))
    input_lengths = tuple(max(0, L + draw(st.integers(-2, 3))) for L in target_lengths)
    rows = []
    for length in target_lengths:
        labels = draw(st.lists(st.integers(0, C - 1), min_size=length, max_size=length))  # blank and repeats too
        junk = draw(st.lists(st.integers(-3, C + 3), min_size=U - length, max_size=U - length))
        rows.append(tuple(labels + junk))
    return CTCCase(
        input_lengths=input_lengths, target_lengths=target_lengths, targets=tuple(rows), num_classes=C,
        blank=blank, reduction=reduction, zero_infinity=draw(st.booleans()),
        dtype=dtype, layout=draw(st.sampled_from(LAYOUTS)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        targets_layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        strided_lengths=draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def inputs(case: CTCCase, device):
    """``(log_probs float64 rounded to the case's dtype, cu_seqlens, targets, target_lengths, grad_output)``."""
    g = torch.Generator().manual_seed(case.seed)
    T_total, B = sum(case.input_lengths), len(case.input_lengths)
    log_probs = rounded((2 * torch.randn(T_total, case.num_classes, generator=g, dtype=torch.float64)).log_softmax(-1),
                        case.dtype)
    U = len(case.targets[0]) if case.targets else 0
    targets = torch.tensor(case.targets, dtype=case.index_dtype).reshape(B, U)
    cu_seqlens = torch.tensor([0] + [sum(case.input_lengths[: b + 1]) for b in range(B)], dtype=case.index_dtype)
    target_lengths = torch.tensor(case.target_lengths, dtype=case.index_dtype)
    grad_output = torch.randn((B,) if case.reduction == "none" else (), generator=g, dtype=torch.float64)
    lengths_layout = "sliced" if case.strided_lengths else "contiguous"
    return (log_probs, as_layout(cu_seqlens.to(device), lengths_layout),
            as_layout(targets.to(device), case.targets_layout), as_layout(target_lengths.to(device), lengths_layout),
            grad_output)


def package_loss_and_gradient(case: CTCCase, device, log_probs, cu_seqlens, targets, target_lengths, grad_output):
    leaf = log_probs.to(device=device, dtype=case.dtype).requires_grad_()
    loss = pk.packed_ctc_loss(as_layout(leaf, case.layout), cu_seqlens, targets, target_lengths, blank=case.blank,
                              reduction=case.reduction, zero_infinity=case.zero_infinity)
    loss.backward(grad_output.to(device=device, dtype=loss.dtype))
    return loss.detach(), leaf.grad


def reference_loss_and_gradient(case: CTCCase, log_probs, cu_seqlens, targets, target_lengths, grad_output):
    """The reference at the view the package reads, and its gradient carried back to the leaf."""
    leaf = log_probs.clone().requires_grad_()
    view = as_layout(leaf, case.layout)
    loss, grad_view = ctc_loss_reference(view, cu_seqlens.cpu(), targets.cpu(), target_lengths.cpu(),
                                         blank=case.blank, reduction=case.reduction,
                                         zero_infinity=case.zero_infinity, grad_output=grad_output)
    (grad,) = torch.autograd.grad(view, leaf, grad_view) if leaf.numel() else (torch.zeros_like(leaf),)
    return loss, grad


def _case(**fields) -> CTCCase:
    base = dict(input_lengths=(3, 0, 1, 4), target_lengths=(2, 0, 1, 3), targets=((1, 1, 9), (0, -1, 5), (2, 7, 7),
                (2, 0, 2)), num_classes=3, blank=0, reduction="mean", zero_infinity=False, dtype=torch.float64,
                layout="contiguous", index_dtype=torch.int64, targets_layout="contiguous",
                strided_lengths=False, seed=3)
    return CTCCase(**{**base, **fields})


#: Zero-frame utterances with and without targets, a repeated label that needs a blank
#: between (three frames for "1 1"), an impossible alignment, the blank inside a target,
#: an empty batch.
EDGE_CASES = {
    "zero-frames-repeats-blank-in-target": _case(),
    "zero-infinity-sum": _case(zero_infinity=True, reduction="sum"),
    "only-zero-frame-utterances": _case(input_lengths=(0, 0), target_lengths=(0, 0), targets=((), ()),
                                        reduction="none"),
    "impossible-repeats": _case(input_lengths=(1, 2), target_lengths=(1, 2), targets=((1, 1), (2, 2)),
                                reduction="none", blank=2),
    "blank-ids-in-targets": _case(input_lengths=(4, 2), target_lengths=(3, 2), targets=((1, 0, 1), (0, 0, 4)),
                                  reduction="none"),
    "empty-batch": _case(input_lengths=(), target_lengths=(), targets=(), reduction="sum"),
    "empty-batch-mean": _case(input_lengths=(), target_lengths=(), targets=(), reduction="mean"),  # NaN, as torch
}


def check_against_reference(case: CTCCase, device) -> None:
    tensors = inputs(case, device)
    loss, grad = package_loss_and_gradient(case, device, *tensors)
    want_loss, want_grad = reference_loss_and_gradient(case, *tensors)
    loss_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    assert loss.dtype == loss_dtype, f"loss dtype {loss.dtype}, expected {loss_dtype}"
    assert grad.dtype == case.dtype, f"gradient dtype {grad.dtype}, expected {case.dtype}"
    tol = LOSS_TOLERANCE[case.dtype]
    assert_close(f"{case.reduction} loss", loss, want_loss, atol=tol, rtol=tol)
    tol = GRADIENT_TOLERANCE[case.dtype]
    assert_close("d loss / d log_probs", grad, want_grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", list(GRADIENT_TOLERANCE), ids=str)
@property_settings(max_examples=4)
@given(data=st.data())
def test_packed_ctc_loss_matches_reference(device, dtype, reduction, data):
    check_against_reference(data.draw(ctc_cases(dtype, reduction), label="case"), device)


@pytest.mark.parametrize("edge", sorted(EDGE_CASES))
def test_packed_ctc_loss_on_edge_cases(device, edge):
    check_against_reference(EDGE_CASES[edge], device)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN payloads included."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


@property_settings(max_examples=6)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), reduction=st.sampled_from(["none", "sum", "mean"]),
       data=st.data())
def test_packed_ctc_loss_is_bitwise_deterministic(device, dtype, reduction, data):
    """The same call twice gives the same bits of the loss and of the gradient."""
    case = data.draw(ctc_cases(dtype, reduction), label="case")
    tensors = inputs(case, device)
    (loss_a, grad_a), (loss_b, grad_b) = (package_loss_and_gradient(case, device, *tensors) for _ in range(2))
    assert same_bits(loss_a, loss_b), "the loss differs between two identical calls"
    assert same_bits(grad_a, grad_b), "the gradient differs between two identical calls"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@property_settings(max_examples=5)
@given(data=st.data())
def test_packed_ctc_align_matches_numpy_viterbi(device, dtype, data):
    """Labels, tokens and spans as the NumPy stage's, scores and log-likelihoods within the
    loss's tolerance. (In float32 the rows are never the expanded view: identical rows make
    paths that tie in exact arithmetic, which float32 sums may round apart.)"""
    case = data.draw(ctc_cases(dtype, "none"), label="case")
    if dtype != torch.float64 and case.layout == "expanded":
        case = dataclasses.replace(case, layout="sliced")
    log_probs, cu_seqlens, targets, target_lengths, _ = inputs(case, device)
    alignment = pk.packed_ctc_align(as_layout(log_probs.to(device=device, dtype=dtype), case.layout), cu_seqlens,
                                    targets, target_lengths, blank=case.blank)
    values = as_layout(log_probs, case.layout).numpy()
    cu = np.concatenate([[0], np.cumsum(case.input_lengths, dtype=np.int64)])
    tolerance = LOSS_TOLERANCE[dtype]
    for b, L in enumerate(case.target_lengths):
        labels, tokens, scores, spans, log_likelihood = ctc_align_numpy(
            values[cu[b]:cu[b + 1]], np.asarray(case.targets[b][:L]), case.blank)
        rows = slice(int(cu[b]), int(cu[b + 1]))
        first = int(alignment.span_offsets[b])
        assert alignment.labels[rows].tolist() == labels.tolist(), f"utterance {b}: labels"
        assert alignment.tokens[rows].tolist() == tokens.tolist(), f"utterance {b}: tokens"
        assert alignment.spans[first:first + L].tolist() == spans.tolist(), f"utterance {b}: spans"
        assert_close(f"utterance {b}: scores", alignment.scores[rows], scores, atol=tolerance, rtol=tolerance)
        assert_close(f"utterance {b}: log_likelihood", alignment.log_likelihood[b],
                     torch.tensor(log_likelihood, dtype=torch.float64), atol=tolerance, rtol=tolerance)
