"""Integer arguments (iters, cg_iters, num_segments, blank): Python and NumPy integers
are accepted and give the same result; bools, floats and tensors are refused."""
import numpy as np
import pytest
import torch

import packed_kernels as pk
from packed_kernels.validation import integer_argument


def test_integer_argument():
    assert integer_argument("k", 3) == 3 and type(integer_argument("k", np.int64(3))) is int
    assert integer_argument("k", np.uint8(7)) == 7
    for bad in (True, 2.0, torch.tensor(2), "2", None):
        with pytest.raises(TypeError, match="k must be an int"):
            integer_argument("k", bad)


def test_numpy_integers_in_the_public_functions(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 4, generator=g).to(device)
    assert torch.equal(pk.sinkhorn(logits, iters=np.int32(7)), pk.sinkhorn(logits, iters=7))
    R = pk.sinkhorn(logits, iters=30)
    grad = torch.randn(3, 4, 4, generator=g).to(device)
    assert torch.equal(pk.sinkhorn_backward(R, grad, cg_iters=np.int64(5)), pk.sinkhorn_backward(R, grad, cg_iters=5))
    with pytest.raises(TypeError, match="iters must be an int"):
        pk.sinkhorn(logits, iters=torch.tensor(7))

    idx = torch.tensor([0, 0, 1, 3], dtype=torch.int32, device=device)
    x = torch.randn(4, 3, generator=g).to(device)
    assert torch.equal(pk.segmented_sum(x, idx, np.int64(5)), pk.segmented_sum(x, idx, 5))
    assert pk.segmented_mean(x, idx, np.int16(4)).shape == (4, 3)
    with pytest.raises(TypeError, match="num_segments must be a Python int"):
        pk.segmented_sum(x, idx, torch.tensor(5))

    lengths = torch.tensor([5, 3])
    log_probs = torch.randn(8, 4, generator=g, dtype=torch.float64).log_softmax(-1).to(device)
    cu = pk.cu_seqlens_from_lengths(lengths).to(device)
    targets = torch.tensor([[1, 2], [3, 0]], device=device)
    target_lengths = torch.tensor([2, 1], device=device)
    want = pk.packed_ctc_loss(log_probs, cu, targets, target_lengths, blank=0, reduction="none")
    got = pk.packed_ctc_loss(log_probs, cu, targets, target_lengths, blank=np.int64(0), reduction="none")
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="blank must be an int"):
        pk.packed_ctc_loss(log_probs, cu, targets, target_lengths, blank=0.0)
