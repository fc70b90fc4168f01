"""CTC loss over packed sequences: the three stages against each other and against PyTorch.

References: ``torch.nn.functional.ctc_loss`` run on the padded batch (loss and
gradient), the float64 NumPy stage, and ``torch.autograd.gradcheck``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import packed_kernels as pk
from packed_kernels.ops.ctc.triton_kernels import (
    ctc_backward_triton,
    ctc_forward_config,
    ctc_forward_triton,
    ctc_gradient_config,
)
from packed_kernels.ops.ctc.naive_numpy import ctc_loss_numpy, ctc_utterance_numpy
from packed_kernels.ops.ctc.padded_torch import ctc_loss_padded
from tests.assertions import assert_close, unwritten_memory_is_nan


@dataclass
class Batch:
    """One CTC problem in both layouts, float64."""

    logits: torch.Tensor  # (T_total, C), packed
    cu_seqlens: torch.Tensor  # int32 (B + 1,)
    input_lengths: torch.Tensor  # int64 (B,)
    targets: torch.Tensor  # (B, U)
    target_lengths: torch.Tensor  # (B,)

    @property
    def log_probs(self) -> torch.Tensor:
        return self.logits.log_softmax(-1)

    def padded(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``(T_total, ...)`` packed rows to ``(T, B, ...)``, PyTorch's ctc layout."""
        out = pk.unpack(pk.Packed(packed, self.cu_seqlens, self.input_lengths), padding_value=fill)
        return out.transpose(0, 1)

    def packed(self, padded_tbc: torch.Tensor) -> torch.Tensor:
        return pk.pack(padded_tbc.transpose(0, 1), self.input_lengths).data


def make_batch(input_lengths: List[int], C: int, target_lengths: List[int], U: Optional[int] = None,
               *, seed: int, blank: int = 0, labels: Optional[List[List[int]]] = None,
               junk: bool = True, device: str = "cpu") -> Batch:
    """Random logits; targets avoid the blank unless ``labels`` says otherwise; junk beyond lengths."""
    g = torch.Generator().manual_seed(seed)
    U = max(target_lengths, default=0) if U is None else U
    B = len(input_lengths)
    logits = torch.randn(sum(input_lengths), C, generator=g, dtype=torch.float64) * 2
    non_blank = torch.tensor([c for c in range(C) if c != blank])
    targets = non_blank[torch.randint(0, len(non_blank), (B, U), generator=g)]
    if junk and U:
        # beyond each length: ids that would be invalid if they were read
        beyond = torch.arange(U)[None, :] >= torch.tensor(target_lengths)[:, None]
        junk_ids = torch.randint(-7, C + 7, (B, U), generator=g)
        targets = torch.where(beyond, junk_ids, targets)
    if labels is not None:
        for b, row in enumerate(labels):
            targets[b, : len(row)] = torch.tensor(row)
    lengths = torch.tensor(input_lengths, dtype=torch.int64)
    return Batch(logits.to(device), pk.cu_seqlens_from_lengths(lengths).to(device), lengths.to(device),
                 targets.to(device), torch.tensor(target_lengths, dtype=torch.int64).to(device))


def run_packed(batch: Batch, dtype=torch.float64, **kwargs):
    """Loss and ``d loss / d log_probs`` (PyTorch's convention) from ``packed_ctc_loss``, with
    uninitialised memory reading as NaN (an entry no kernel writes would show)."""
    x = batch.log_probs.to(dtype).detach().requires_grad_()
    with unwritten_memory_is_nan():
        loss = pk.packed_ctc_loss(x, batch.cu_seqlens, batch.targets, batch.target_lengths, **kwargs)
        (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), grad


def run_torch(batch: Batch, **kwargs):
    """Same, from ``F.ctc_loss`` on the padded ``(T, B, C)`` batch, the gradient packed back."""
    x = batch.padded(batch.log_probs.detach()).requires_grad_()
    targets = batch.targets.clamp(0, x.shape[-1] - 1)  # junk beyond lengths is never read, but keep it legal
    loss = F.ctc_loss(x, targets, batch.input_lengths, batch.target_lengths, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), batch.packed(grad)


def run_numpy(batch: Batch, blank=0, reduction="mean", zero_infinity=False):
    loss, grad = ctc_loss_numpy(batch.log_probs.cpu().numpy(), batch.cu_seqlens.cpu().numpy(),
                                batch.targets.cpu().numpy(), batch.target_lengths.cpu().numpy(),
                                blank, reduction, zero_infinity)
    return torch.from_numpy(np.asarray(loss)), torch.from_numpy(grad)


def torch_cpu_last_frame_quirk(batch: Batch, blank: int) -> torch.Tensor:
    """Mask of gradient entries where PyTorch's *CPU* kernel is known to differ.

    At an utterance's last frame, PyTorch's CPU backward initialises the gradient of
    the last label's class by assignment, assuming it differs from the blank; when the
    last target id *is* the blank, the blank states' share is overwritten instead of
    added. Its CUDA kernel, the NumPy stage and gradcheck agree with each other there.
    """
    mask = torch.zeros(batch.logits.shape, dtype=torch.bool)
    if batch.logits.device.type != "cpu":
        return mask
    for b in range(len(batch.input_lengths)):
        L, n = int(batch.target_lengths[b]), int(batch.input_lengths[b])
        if L and n and int(batch.targets[b, L - 1]) == blank:
            mask[int(batch.cu_seqlens[b + 1]) - 1, blank] = True
    return mask


def check_against_references(batch: Batch, blank=0, reduction="mean", zero_infinity=False):
    kwargs = dict(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
    loss, grad = run_packed(batch, **kwargs)
    ref_loss, ref_grad = run_numpy(batch, **kwargs)
    assert_close("loss vs numpy", loss, ref_loss, atol=1e-10, rtol=1e-10)
    assert_close("grad vs numpy", grad, ref_grad, atol=1e-10, rtol=1e-8)
    torch_loss, torch_grad = run_torch(batch, **kwargs)
    assert_close("loss vs torch", loss, torch_loss, atol=1e-10, rtol=1e-10)
    keep = ~torch_cpu_last_frame_quirk(batch, blank).to(grad.device)
    assert_close("grad vs torch", grad[keep], torch_grad[keep], atol=1e-10, rtol=1e-8)


# --------------------------------------------------------------------------------------
# parity


PARITY_CASES = [
    # (input lengths, C, target lengths, U, blank, reduction)
    ([7, 5, 9], 6, [2, 3, 4], None, 0, "mean"),
    ([13, 1, 8, 0, 11], 29, [4, 1, 3, 0, 5], 7, 0, "none"),
    ([17, 12], 5, [5, 6], None, 4, "sum"),
    ([1], 3, [1], None, 1, "mean"),
    ([10, 3, 6, 9], 11, [0, 1, 2, 4], 4, 5, "none"),
    # U = 16 fills a power of two: the U + 1 label pairs need the next block of lanes and slots
    # (enough frames for the repeats: an impossible utterance would hide its gradient in NaN)
    ([30, 7], 6, [16, 3], 16, 0, "mean"),
]


@pytest.mark.parametrize(
    "input_lengths, C, target_lengths, U, blank, reduction",
    PARITY_CASES,
    ids=[f"B{len(c[0])}-T{max(c[0])}-C{c[1]}-U{c[3] or max(c[2])}-blank{c[4]}-{c[5]}" for c in PARITY_CASES],
)
def test_packed_matches_torch_and_numpy(device, input_lengths, C, target_lengths, U, blank, reduction):
    batch = make_batch(input_lengths, C, target_lengths, U, seed=len(input_lengths) * 100 + C, blank=blank,
                       device=device)
    check_against_references(batch, blank=blank, reduction=reduction)


EDGE_CASES = {
    # name: (input lengths, C, target lengths, U, labels, zero_infinity)
    "repeated-labels": ([12, 9], 7, [5, 4], None, [[3, 3, 5, 3, 3], [2, 2, 2, 2]], False),
    "repeats-need-blanks": ([6], 5, [4], None, [[1, 1, 1, 2]], False),  # 4 labels + 2 blanks: 6 frames, exact
    "target-id-equals-blank": ([9, 8], 5, [3, 2], None, [[0, 2, 0], [3, 0]], False),
    "empty-targets": ([5, 4], 4, [0, 0], 3, None, False),
    "zero-frame-utterances": ([0, 6, 0], 4, [0, 2, 2], None, None, False),
    "filler-zero-length": ([8, 5, 0, 0], 6, [3, 2, 0, 0], None, None, False),
    "impossible-inf": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]], False),
    "impossible-zero-infinity": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]], True),
    "wide-targets-buffer": ([9, 4], 6, [2, 1], 11, None, False),
    "length-one": ([1, 1, 2], 3, [1, 0, 1], None, None, False),
    "zero-frames-one-label": ([0, 4, 0], 5, [1, 2, 0], None, None, False),
}


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_edge_cases(device, case, reduction):
    input_lengths, C, target_lengths, U, labels, zero_infinity = EDGE_CASES[case]
    batch = make_batch(input_lengths, C, target_lengths, U, seed=7, labels=labels, device=device)
    check_against_references(batch, reduction=reduction, zero_infinity=zero_infinity)


def test_impossible_alignment_values(device):
    """An impossible alignment has an infinite loss and a NaN gradient on its frames; zero_infinity
    makes both 0. The possible utterance beside it keeps its loss and gradient (the NumPy stage's)."""
    batch = make_batch([3, 5], 5, [3, 1], labels=[[2, 2, 2], [1]], seed=3, device=device)
    for zero_infinity in (False, True):
        loss, grad = run_packed(batch, reduction="none", zero_infinity=zero_infinity)
        ref_loss, ref_grad = run_numpy(batch, reduction="none", zero_infinity=zero_infinity)
        if zero_infinity:
            assert loss[0].item() == 0.0 and torch.equal(grad[:3], torch.zeros_like(grad[:3]))
        else:
            assert loss[0].item() == float("inf") and bool(grad[:3].isnan().all())
        assert_close(f"loss, zero_infinity={zero_infinity}", loss, ref_loss, atol=1e-12, rtol=1e-12)
        assert_close(f"gradient, zero_infinity={zero_infinity}", grad, ref_grad, atol=1e-12, rtol=1e-10)


def test_torch_cpu_quirk_is_where_we_say(device):
    """The one place PyTorch's CPU gradient is excluded from the comparisons really differs from the
    true gradient, and our kernel agrees with the NumPy stage there (the sum over the blank states)."""
    batch = make_batch([6], 4, [2], labels=[[2, 0]], seed=11, device=device)
    grad = run_packed(batch, reduction="sum")[1]
    ref_grad = run_numpy(batch, reduction="sum")[1]
    assert_close("grad vs numpy at the last frame", grad[-1], ref_grad[-1], atol=1e-10, rtol=1e-8)
    if device == "cpu":
        torch_grad = run_torch(batch, reduction="sum")[1]
        quirk = torch_cpu_last_frame_quirk(batch, 0)
        assert quirk.sum() == 1
        assert not torch.allclose(torch_grad[quirk], grad[quirk])


# --------------------------------------------------------------------------------------
# gradients: gradcheck, the logits, the padded stage


def test_gradcheck_through_log_softmax(device):
    """float64 gradcheck of ``log_softmax -> packed_ctc_loss``; the composition is how PyTorch checks
    its own ctc_loss, since its gradient convention is the gradient through a log-softmax."""
    batch = make_batch([5, 0, 3, 4], 5, [2, 0, 1, 3], 4, seed=5, labels=[[1, 1], [], [3], [2, 0, 2]],
                       device=device)
    logits = batch.logits.clone().requires_grad_()

    def loss_of(z):
        return pk.packed_ctc_loss(z.log_softmax(-1), batch.cu_seqlens, batch.targets, batch.target_lengths,
                                  reduction="none")

    assert torch.autograd.gradcheck(loss_of, (logits,), fast_mode=True)


def test_padded_stage_matches_torch_on_logits():
    """The padded PyTorch stage (autograd through the recursion) against F.ctc_loss, on the logits'
    gradient, where both gradient conventions agree; and its loss against the NumPy stage."""
    batch = make_batch([9, 4, 0, 7], 6, [3, 2, 0, 3], 5, seed=13, labels=[[1, 1, 2], [0, 3], [], [5, 5, 5]],
                       blank=0)
    for reduction, zero_infinity in [("mean", False), ("none", True), ("sum", False)]:
        kwargs = dict(blank=0, reduction=reduction, zero_infinity=zero_infinity)
        logits = batch.padded(batch.logits).transpose(0, 1).detach().requires_grad_()  # (B, T, C)
        loss = ctc_loss_padded(logits.log_softmax(-1), batch.input_lengths, batch.targets.clamp(0, 5),
                               batch.target_lengths, **kwargs)
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        ref_logits = batch.padded(batch.logits).detach().requires_grad_()  # (T, B, C)
        ref = F.ctc_loss(ref_logits.log_softmax(-1), batch.targets.clamp(0, 5), batch.input_lengths,
                         batch.target_lengths, **kwargs)
        (ref_grad,) = torch.autograd.grad(ref.sum(), ref_logits)
        assert_close(f"padded loss ({reduction})", loss, ref, atol=1e-10, rtol=1e-10)
        keep = torch.isfinite(ref_grad.transpose(0, 1))
        assert_close(f"padded logits grad ({reduction})", grad[keep], ref_grad.transpose(0, 1)[keep],
                     atol=1e-10, rtol=1e-8)
        numpy_loss = run_numpy(batch, **kwargs)[0]
        assert_close(f"padded loss vs numpy ({reduction})", loss, numpy_loss, atol=1e-10, rtol=1e-10)


def test_numpy_stage_against_torch():
    """The reference itself, against F.ctc_loss, utterance by utterance."""
    g = torch.Generator().manual_seed(17)
    for T, C, target in [(8, 5, [1, 2, 2]), (5, 3, [1]), (7, 4, [])]:
        log_probs = torch.randn(T, 1, C, generator=g, dtype=torch.float64).log_softmax(-1).requires_grad_()
        ref = F.ctc_loss(log_probs, torch.tensor([target or [0]]), torch.tensor([T]), torch.tensor([len(target)]),
                         reduction="sum")
        (ref_grad,) = torch.autograd.grad(ref, log_probs)
        nll, grad = ctc_utterance_numpy(log_probs.detach()[:, 0].numpy(), np.array(target, dtype=np.int64))
        assert_close("numpy nll", torch.tensor(nll, dtype=torch.float64), ref, atol=1e-12, rtol=1e-12)
        assert_close("numpy grad", torch.from_numpy(grad), ref_grad[:, 0], atol=1e-12, rtol=1e-10)


# --------------------------------------------------------------------------------------
# dtypes, layouts, variants


@pytest.mark.parametrize(
    "dtype, atol, rtol",
    [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 2e-2, 3e-2), (torch.float16, 4e-3, 4e-3)],
    ids=["float32", "bfloat16", "float16"],
)
def test_dtypes(device, dtype, atol, rtol):
    batch = make_batch([11, 6, 9], 13, [3, 2, 4], 5, seed=19, device=device)
    loss, grad = run_packed(batch, dtype=dtype, reduction="none")
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    # the reference sees the same rounded inputs, in float64
    rounded = batch.log_probs.to(dtype).double().cpu().numpy()
    ref_loss, ref_grad = ctc_loss_numpy(rounded, batch.cu_seqlens.cpu().numpy(), batch.targets.cpu().numpy(),
                                        batch.target_lengths.cpu().numpy(), 0, "none", False)
    assert_close(f"{dtype} loss", loss, torch.from_numpy(ref_loss), atol=1e-4, rtol=1e-5)
    assert_close(f"{dtype} grad", grad, torch.from_numpy(ref_grad), atol=atol, rtol=rtol)


def test_float32_matches_torch_float32(device):
    batch = make_batch([14, 9, 12], 17, [4, 3, 5], 6, seed=23, device=device)
    x = batch.log_probs.float().detach().requires_grad_()
    loss = pk.packed_ctc_loss(x, batch.cu_seqlens, batch.targets, batch.target_lengths)
    (grad,) = torch.autograd.grad(loss, x)
    padded = batch.padded(x.detach()).requires_grad_()
    ref = F.ctc_loss(padded, batch.targets.clamp(0, 16), batch.input_lengths, batch.target_lengths)
    (ref_grad,) = torch.autograd.grad(ref, padded)
    assert_close("float32 loss vs torch", loss, ref, atol=1e-6, rtol=1e-5)
    assert_close("float32 grad vs torch", grad, batch.packed(ref_grad), atol=2e-6, rtol=1e-5)


def test_strided_log_probs_and_int32_indices(device):
    """A non-contiguous log_probs view, int32 targets and lengths: same results."""
    batch = make_batch([6, 8], 9, [2, 3], seed=29, device=device)
    expected_loss, expected_grad = run_packed(batch, reduction="none")
    wide = torch.full((batch.logits.shape[0], 2 * 9), float("nan"), dtype=torch.float64, device=device)
    wide[:, ::2] = batch.log_probs
    x = wide[:, ::2].detach().requires_grad_()
    assert not x.is_contiguous()
    loss = pk.packed_ctc_loss(x, batch.cu_seqlens.to(torch.int32), batch.targets.to(torch.int32),
                              batch.target_lengths.to(torch.int32), reduction="none")
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert torch.equal(loss.detach(), expected_loss) and torch.equal(grad, expected_grad)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view with a stride of 2 along its first dimension (junk in between)."""
    wide = torch.stack([t, torch.full_like(t, 10 ** 6)], 1)
    view = wide[:, 0]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


@pytest.mark.parametrize("which", ["cu_seqlens", "targets", "target_lengths"])
def test_strided_offsets_targets_and_lengths(device, which):
    """cu_seqlens, targets or target_lengths as strided views: the same loss and gradient."""
    batch = make_batch([6, 8, 5], 9, [2, 3, 1], seed=31, device=device)
    expected_loss, expected_grad = run_packed(batch, reduction="none")
    args = {"cu_seqlens": batch.cu_seqlens, "targets": batch.targets, "target_lengths": batch.target_lengths}
    args[which] = _strided(args[which])
    x = batch.log_probs.detach().clone().requires_grad_()
    loss = pk.packed_ctc_loss(x, args["cu_seqlens"], args["targets"], args["target_lengths"], reduction="none")
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert torch.equal(loss.detach(), expected_loss) and torch.equal(grad, expected_grad)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gradient_rows_per_program(device, rows):
    """The gradient pass gives the same result whatever the number of packed rows per program,
    including programs whose rows span several utterances (and a zero-frame one)."""
    batch = make_batch([5, 0, 3, 9, 1], 6, [2, 0, 1, 3, 1], seed=67, labels=[[1, 1], [], [2], [3, 0, 3]],
                       device=device)
    B, U = len(batch.input_lengths), batch.targets.shape[1]
    log_probs = batch.log_probs.detach()
    arguments = (log_probs, batch.cu_seqlens, batch.targets, batch.target_lengths)
    config = ctc_gradient_config(B, log_probs.shape[1], U, rows_per_program=rows)
    assert config.rows_per_program == rows
    with unwritten_memory_is_nan():
        nll, *saved = ctc_forward_triton(*arguments, 0, ctc_forward_config(U))
        grad = ctc_backward_triton(torch.ones_like(nll), *arguments, nll, *saved, 0, "none", False, config)
    ref_loss, ref_grad = run_numpy(batch, reduction="none")
    assert_close("loss vs numpy", nll, ref_loss, atol=1e-10, rtol=1e-10)
    assert_close("grad vs numpy", grad, ref_grad, atol=1e-10, rtol=1e-8)
    torch_loss, torch_grad = run_torch(batch, reduction="none")
    assert_close("loss vs torch", nll, torch_loss, atol=1e-10, rtol=1e-10)
    keep = ~torch_cpu_last_frame_quirk(batch, 0).to(grad.device)
    assert_close("grad vs torch", grad[keep], torch_grad[keep], atol=1e-10, rtol=1e-8)


def test_label_groups_kernel_is_a_stable_sort(device):
    """The slots the gradient pass sums by class: a stable sort of the target ids (unused slots last,
    the blank slot ``U`` among the classes), with each run's first index."""
    g = torch.Generator().manual_seed(61)
    B, U, C, blank = 5, 40, 6, 2
    targets = torch.randint(0, C, (B, U), generator=g).to(device)
    lengths = torch.tensor([40, 0, 17, 1, 33]).to(device)
    labels, slots, run_starts = ctc_forward_triton(
        torch.zeros(3, C, device=device), torch.tensor([0, 1, 1, 2, 3, 3], dtype=torch.int32, device=device),
        targets, lengths, blank, ctc_forward_config(U))[2:]
    position = torch.arange(U + 1)
    for b in range(B):
        L = int(lengths[b])
        keys = torch.cat([targets[b].cpu(), torch.tensor([0])])
        keys = torch.where(position < L, keys, torch.full_like(keys, C))
        keys[U] = blank
        expected_labels, expected_slots = torch.sort(keys, stable=True)
        assert labels[b].tolist() == expected_labels.tolist()
        assert slots[b].tolist() == expected_slots.tolist()
        firsts = [int((expected_labels < v).sum()) for v in expected_labels]
        assert run_starts[b].tolist() == firsts


def test_deterministic(device):
    """Bitwise the same loss and gradient on every run, with repeated labels and the blank in targets."""
    batch = make_batch([40, 33, 21], 9, [8, 7, 5], seed=37, labels=[[1, 1, 2, 1, 0, 1, 1, 3]], device=device)
    runs = [run_packed(batch, dtype=torch.float32, blank=0, reduction="mean") for _ in range(3)]
    for loss, grad in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][1])
    rounded = batch.log_probs.float().double().cpu().numpy()
    ref_loss, ref_grad = ctc_loss_numpy(rounded, batch.cu_seqlens.cpu().numpy(), batch.targets.cpu().numpy(),
                                        batch.target_lengths.cpu().numpy(), 0, "mean", False)
    assert_close("float32 loss", runs[0][0], torch.from_numpy(np.asarray(ref_loss)), atol=1e-5, rtol=1e-5)
    assert_close("float32 gradient", runs[0][1], torch.from_numpy(ref_grad), atol=2e-6, rtol=1e-4)


def test_empty_batch(device):
    x = torch.zeros(0, 5, device=device, requires_grad=True)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    targets = torch.zeros(0, 3, dtype=torch.long, device=device)
    lengths = torch.zeros(0, dtype=torch.long, device=device)
    with unwritten_memory_is_nan():
        loss = pk.packed_ctc_loss(x, cu, targets, lengths, reduction="sum")
        loss.backward()
    assert loss.item() == 0
    assert torch.equal(x.grad, torch.zeros(0, 5, device=device))
