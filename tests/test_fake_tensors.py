"""Fake tensors give shapes on every kind of machine: under ``FakeTensorMode``, CPU fake
tensors take the custom ops' fake implementations, also where the kernels are compiled for
a GPU (stood in for here), instead of the padded stages, whose value-dependent shapes a
fake tensor cannot give."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import packed_kernels as pk
from packed_kernels import runtime


@pytest.mark.parametrize("kernel_device", ["as here", "cuda"])
def test_fake_cpu_tensors_give_shapes(kernel_device, monkeypatch):
    if kernel_device == "cuda":
        monkeypatch.setattr(runtime, "KERNEL_DEVICE", "cuda")
    with FakeTensorMode():
        x, idx = torch.randn(10, 3), torch.tensor([0, 0, 1, 1, 1, 3, 3, 3, 3, 3])
        assert pk.segmented_sum(x, idx, 4).shape == (4, 3)
        assert pk.segmented_mean(x, idx, 4).shape == (4, 3)
        assert pk.segmented_dot(x, x, idx, 4).shape == (4,)
        assert pk.segmented_matvec(x, torch.randn(4, 3, 2), idx, 4).shape == (10, 2)
        assert pk.sinkhorn(torch.randn(5, 4, 4)).shape == (5, 4, 4)
        log_probs = torch.randn(12, 6).log_softmax(-1)
        cu_seqlens, targets, lengths = torch.tensor([0, 5, 12]), torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2])
        assert pk.packed_ctc_loss(log_probs, cu_seqlens, targets, lengths, reduction="none").shape == (2,)
        assert pk.packed_ctc_align(log_probs, cu_seqlens, targets, lengths).labels.shape == (12,)
