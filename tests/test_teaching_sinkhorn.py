"""The chapter's teaching kernel (one matrix per program, log-space iterations) against
the float64 NumPy stage, on fresh random inputs and on edge cases."""
import numpy as np
import pytest
import torch

from packed_kernels.ops.sinkhorn import naive_numpy
from packed_kernels.ops.sinkhorn.teaching import sinkhorn_teaching

from assertions import assert_close

#: float32 log-space iterations against float64 divisions: a few float32 rounding units
ATOL, RTOL = 2e-6, 1e-5


def _numpy_reference(logits: torch.Tensor, iters: int) -> np.ndarray:
    """The NumPy stage, one matrix at a time, on the float32 rounding of ``logits``."""
    x = logits.float().double().numpy()
    return np.stack([naive_numpy.sinkhorn_numpy(m, iters) for m in x]).reshape(x.shape)


def _logits(T, n, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, n, n, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("iters", [1, 3, 20], ids=lambda t: f"iters{t}")
def test_matches_the_numpy_stage(device, n, iters):
    T = {1: 9, 2: 9, 4: 17, 8: 7, 16: 3, 32: 2}[n]
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh inputs each run; the seed is in the message
    logits = _logits(T, n, 2.0, seed)
    R = sinkhorn_teaching(logits.to(device), iters)
    assert R.dtype == torch.float32 and R.shape == (T, n, n)
    assert_close(f"R (seed {seed})", R, _numpy_reference(logits, iters), atol=ATOL, rtol=RTOL)
    # the row step comes last: every row sums to one after any number of iterations
    assert_close("row sums", R.sum(-1), torch.ones(T, n), atol=1e-5, rtol=0)


def test_every_program_writes_its_own_matrix(device):
    """Many matrices, each different: a program reading or writing a neighbour's is seen."""
    logits = _logits(200, 4, 1.0, 7) + torch.arange(200, dtype=torch.float64)[:, None, None] % 5
    R = sinkhorn_teaching(logits.to(device), 5)
    assert_close("R", R, _numpy_reference(logits, 5), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scale", [30.0, 60.0], ids=lambda s: f"scale{s:g}")
def test_large_logits_stay_finite(device, scale):
    """Logits far past float32's ``exp`` range (``exp(88)`` overflows): log-sum-exp takes
    each column's and row's largest entry out first."""
    logits = _logits(11, 4, scale, 3)
    R = sinkhorn_teaching(logits.to(device), 20)
    assert torch.isfinite(R).all()
    assert_close("R", R, _numpy_reference(logits, 20), atol=1e-5, rtol=1e-4)


def test_a_constant_shift_changes_nothing(device):
    """Adding a constant to a column cancels in the first column step."""
    logits = _logits(6, 8, 1.0, 11)
    shifted = logits + 40.0 * torch.arange(8, dtype=torch.float64)
    assert_close("R", sinkhorn_teaching(shifted.to(device), 20),
                 _numpy_reference(logits, 20), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_dtypes_are_computed_in_float32(device, dtype):
    logits = _logits(5, 4, 1.0, 5).to(dtype)
    R = sinkhorn_teaching(logits.to(device), 20)
    assert R.dtype == torch.float32
    assert_close("R", R, _numpy_reference(logits.double(), 20), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_non_contiguous_and_empty_inputs(device, dtype):
    # two iterations: far from the limit, where R of the transpose is not R transposed
    logits = _logits(5, 4, 2.0, 9).to(dtype)
    transposed = logits.to(device).transpose(-1, -2)
    assert not transposed.is_contiguous()
    assert_close("R of a transposed view", sinkhorn_teaching(transposed, 2),
                 _numpy_reference(logits.transpose(-1, -2), 2), atol=ATOL, rtol=RTOL)
    assert sinkhorn_teaching(torch.empty(0, 4, 4, device=device)).shape == (0, 4, 4)


@pytest.mark.parametrize("shape, iters, message", [
    ((3, 3, 3), 20, "power of two"),
    ((3, 4, 8), 20, "shape"),
    ((4, 4), 20, "shape"),
    ((3, 4, 4), 0, "iters"),
])
def test_bad_input_is_refused(shape, iters, message):
    with pytest.raises(ValueError, match=message):
        sinkhorn_teaching(torch.zeros(shape), iters)
