"""The chapter's teaching kernel (the alpha recursion alone) against the NumPy stage.

Each case draws a fresh packed batch and compares the kernel's per-utterance loss with
the float64 NumPy stage's forward loss (``ctc_loss_numpy``, ``reduction="none"``),
including the awkward cases: utterances with no frames, empty targets, repeated labels
(where the skip is forbidden), a target id equal to the blank, and alignments that do
not fit (loss ``inf``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import packed_kernels as pk
from packed_kernels.ops.ctc.naive_numpy import ctc_loss_numpy
from packed_kernels.ops.ctc.teaching import ctc_loss_teaching


def _numpy_loss(log_probs, cu_seqlens, targets, target_lengths, blank):
    loss, _ = ctc_loss_numpy(log_probs.double().cpu().numpy(), cu_seqlens.cpu().numpy(),
                             targets.cpu().numpy(), target_lengths.cpu().numpy(), blank, "none")
    return loss


def _check(log_probs, frames, targets, target_lengths, device, blank=0, rtol=1e-12):
    cu_seqlens = pk.cu_seqlens_from_lengths(frames)
    want = _numpy_loss(log_probs, cu_seqlens, targets, target_lengths, blank)
    got = ctc_loss_teaching(log_probs.to(device), cu_seqlens.to(device), targets.to(device),
                            target_lengths.to(device), blank=blank)
    assert got.dtype == log_probs.dtype and got.shape == (len(frames),)
    got = got.double().cpu().numpy()
    assert np.array_equal(np.isinf(got), np.isinf(want)), (got, want)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=rtol)
    return got, want


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("B,T,C,U", [(1, 9, 5, 3), (5, 23, 7, 6), (3, 40, 4, 12), (6, 17, 29, 5)],
                         ids=lambda v: str(v))
def test_random_batches_match_numpy(device, seed, B, T, C, U):
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, T + 1, (B,), generator=g)
    target_lengths = torch.randint(0, U + 1, (B,), generator=g)
    # few classes make repeated labels (and forbidden skips) common
    targets = torch.randint(1, C, (B, U), generator=g)
    log_probs = torch.randn(int(frames.sum()), C, generator=g, dtype=torch.float64).log_softmax(-1)
    _check(log_probs, frames, targets, target_lengths, device)


def test_awkward_utterances(device):
    frames = torch.tensor([9, 0, 0, 6, 11, 3, 1, 4])
    target_lengths = torch.tensor([3, 0, 2, 4, 4, 3, 0, 2])
    targets = torch.tensor([
        [1, 2, 3, 9],   # junk beyond the length is never read
        [4, 4, 4, 4],   # no frames, empty target: loss 0
        [1, 2, 0, 0],   # no frames, a target: loss inf
        [3, 3, 5, 3],   # repeated labels
        [2, 0, 6, 1],   # the blank inside the target
        [5, 5, 5, 0],   # 3 frames cannot hold "5 5 5" (it needs 5): inf
        [1, 1, 1, 1],   # one frame, empty target: the blank alone
        [6, 6, 0, 0],   # "6 6" needs 3 frames (6, blank, 6): 4 fit
    ])
    log_probs = (torch.randn(int(frames.sum()), 7, dtype=torch.float64) * 2).log_softmax(-1)
    got, want = _check(log_probs, frames, targets, target_lengths, device)
    assert got[1] == 0.0 and np.isinf(got[2]) and np.isinf(got[5])
    assert np.isfinite(got[7])


def test_the_last_class_as_blank_and_float32(device):
    g = torch.Generator().manual_seed(7)
    frames = torch.tensor([12, 5, 8])
    target_lengths = torch.tensor([4, 2, 3])
    targets = torch.randint(0, 5, (3, 4), generator=g)  # ids 0..4; the blank is 5
    log_probs = torch.randn(int(frames.sum()), 6, generator=g, dtype=torch.float64).log_softmax(-1)
    _check(log_probs, frames, targets, target_lengths, device, blank=5)
    _check(log_probs.float(), frames, targets, target_lengths, device, blank=5, rtol=1e-5)


def test_agrees_with_the_package_and_pytorch(device):
    g = torch.Generator().manual_seed(3)
    frames = torch.tensor([30, 17, 25])
    target_lengths = torch.tensor([6, 5, 1])
    targets = torch.randint(1, 9, (3, 6), generator=g)
    log_probs = torch.randn(int(frames.sum()), 9, generator=g).log_softmax(-1)
    cu_seqlens = pk.cu_seqlens_from_lengths(frames)
    args = [t.to(device) for t in (cu_seqlens, targets, target_lengths)]
    got = ctc_loss_teaching(log_probs.to(device), *args)
    package = pk.packed_ctc_loss(log_probs.to(device), *args, reduction="none")
    padded = pk.unpack(pk.Packed(log_probs, cu_seqlens, frames)).transpose(0, 1)
    pytorch = torch.nn.functional.ctc_loss(padded, targets, frames, target_lengths, reduction="none")
    torch.testing.assert_close(got.cpu(), package.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu(), pytorch, rtol=1e-5, atol=1e-5)


def test_the_benchmark_times_the_teaching_kernel_beside_the_production_one():
    from packed_kernels.bench import ctc

    cases = list(ctc.cases())
    forward = [case for case in cases if case.workload == "fwd"]
    assert len(forward) == len(ctc.SHAPES)
    for case in forward:
        assert {"triton_teaching", "triton_packed", "torch"} <= set(case.providers)
    for case in (case for case in cases if case.workload == "fwd+bwd"):
        assert {"triton_packed", "triton_packed_graph", "torch", "torch_compiled"} <= set(case.providers)
