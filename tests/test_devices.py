"""Tensors on a GPU other than the current one: every kernel family launches on its
inputs' device (Triton itself launches on the current device). Needs two GPUs."""
import pytest
import torch
import torch.nn.functional as F

import packed_kernels as pk
from packed_kernels import runtime
from packed_kernels.ops.sinkhorn import padded_torch as sinkhorn_padded

from assertions import assert_close

pytestmark = pytest.mark.skipif(runtime.INTERPRETED or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")
OTHER = "cuda:1"


@pytest.fixture(autouse=True)
def current_device_is_the_first():
    with torch.cuda.device(0):
        yield


def test_segment_ops_on_the_other_gpu():
    g = torch.Generator(device=OTHER).manual_seed(0)
    idx = torch.sort(torch.randint(0, 1000, (50_000,), device=OTHER, generator=g)).values.int()
    x = torch.randn(50_000, 3, device=OTHER, generator=g, dtype=torch.float64).requires_grad_()
    out = pk.segmented_mean(x, idx, 1000)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    counts = torch.bincount(idx, minlength=1000).clamp(min=1).double()[:, None]
    want = torch.zeros(1000, 3, device=OTHER, dtype=torch.float64).index_add_(0, idx.long(), x.detach()) / counts
    assert out.device == torch.device(OTHER)
    assert_close("mean", out, want, atol=1e-12, rtol=1e-12)
    assert_close("d mean", grad, (2 * want / counts)[idx.long()], atol=1e-12, rtol=1e-12)


def test_sinkhorn_on_the_other_gpu():
    logits = torch.randn(4096, 4, 4, device=OTHER, dtype=torch.float64).requires_grad_()
    # 300 iterations: converged, where the implicit gradient equals the unrolled one
    for backward in ("implicit", "unrolled"):
        R = pk.sinkhorn(logits, 300, backward=backward)
        (grad,) = torch.autograd.grad(R.square().sum(), logits)
        wide = logits.detach().clone().requires_grad_()
        R_ref = sinkhorn_padded.sinkhorn_padded(wide, 300)
        (grad_ref,) = torch.autograd.grad(R_ref.square().sum(), wide)
        assert R.device == torch.device(OTHER)
        assert_close(f"R ({backward})", R, R_ref, atol=1e-10, rtol=1e-10)
        assert_close(f"grad ({backward})", grad, grad_ref, atol=1e-8, rtol=1e-8)


def test_ctc_on_the_other_gpu():
    g = torch.Generator(device=OTHER).manual_seed(1)
    lengths = torch.tensor([50, 31, 77], device=OTHER)
    target_lengths = torch.tensor([10, 7, 20], device=OTHER)
    log_probs = torch.randn(int(lengths.sum()), 12, device=OTHER, generator=g, dtype=torch.float64)
    log_probs = log_probs.log_softmax(-1).requires_grad_()
    targets = torch.randint(1, 12, (3, 20), device=OTHER, generator=g)
    loss = pk.packed_ctc_loss(log_probs, pk.cu_seqlens_from_lengths(lengths), targets, target_lengths)
    (grad,) = torch.autograd.grad(loss, log_probs)
    padded = torch.nn.utils.rnn.pad_sequence(list(log_probs.detach().split(lengths.tolist())))
    padded.requires_grad_()
    ref = F.ctc_loss(padded, targets, lengths, target_lengths)
    (grad_padded,) = torch.autograd.grad(ref, padded)
    grad_ref = torch.cat([grad_padded[:n, b] for b, n in enumerate(lengths.tolist())])
    assert_close("loss", loss, ref, atol=1e-10, rtol=1e-10)
    assert_close("grad", grad, grad_ref, atol=1e-10, rtol=1e-8)


def test_lstm_on_the_other_gpu():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    lstm = torch.nn.LSTM(20, 64, num_layers=2, bidirectional=True, batch_first=True).to(OTHER)
    x = torch.randn(5, 40, 20, device=OTHER)
    with torch.no_grad():
        y, (h, c) = pk.PersistentLSTM.from_torch(lstm)(x)
        y_ref, (h_ref, c_ref) = lstm(x)
    assert y.device == torch.device(OTHER)
    for name, a, b in (("y", y, y_ref), ("h_n", h, h_ref), ("c_n", c, c_ref)):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)
