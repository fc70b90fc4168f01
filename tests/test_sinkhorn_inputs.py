"""Sinkhorn's arguments: the bad-input table, the bounds of ``iters`` and ``cg_iters``,
mixed dtypes of ``R`` and ``grad_R``, non-finite logits."""
import numpy as np
import pytest
import torch

from packed_kernels import sinkhorn, sinkhorn_backward
from packed_kernels.ops.sinkhorn import triton_kernels

from assertions import assert_close
from sinkhorn_cases import loop_reference, random_logits

MAX_ITERS = triton_kernels.MAX_ITERS
LARGE_N = triton_kernels.MAX_KERNEL_N + 1


def _zeros(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


# Each case: (id, call(device), exception, message pattern). The calls past an upper
# bound take meta tensors: without the check they would return at once (and on real
# tensors run for a very long time, as cg_iters=10**9 once did).
BAD_INPUTS = [
    ("logits-ndarray", lambda d: sinkhorn(np.zeros((3, 3))), TypeError, "logits must be a torch.Tensor"),
    ("logits-int32", lambda d: sinkhorn(_zeros(2, 3, 3, dtype=torch.int32, device=d)), TypeError,
     "logits must be float32"),
    ("logits-2x3x4", lambda d: sinkhorn(_zeros(2, 3, 4, device=d)), ValueError,
     r"logits must have shape \(\.\.\., n, n\).*\(2, 3, 4\)"),
    ("logits-1d", lambda d: sinkhorn(_zeros(3, device=d)), ValueError, "logits must .*at least 2 dims"),
    ("logits-n0", lambda d: sinkhorn(_zeros(2, 0, 0, device=d)), ValueError, "logits must have n >= 1"),
    ("iters-0", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), 0), ValueError,
     r"iters must be in \[1, 1048576\] \(2\*\*20\); got 0"),
    ("iters-negative", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), -5), ValueError, "iters must be in .*got -5"),
    ("iters-2**20+1-meta", lambda d: sinkhorn(_zeros(2, 3, 3, device="meta"), MAX_ITERS + 1), ValueError,
     "iters must be in .*got 1048577"),
    ("iters-10**12-unrolled-meta", lambda d: sinkhorn(_zeros(2, 3, 3, device="meta"), 10 ** 12, backward="unrolled"),
     ValueError, "iters must be in"),
    ("iters-float", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), 2.0), TypeError, "iters must be an int"),
    ("iters-bool", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), True), TypeError, "iters must be an int"),
    ("backward-exact", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), backward="exact"), ValueError,
     "backward must be one of"),
    ("cg-0", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), cg_iters=0), ValueError,
     r"cg_iters must be in \[1, 2n\] = \[1, 6\] for n = 3 .*; got 0"),
    ("cg-2n+1-meta", lambda d: sinkhorn(_zeros(2, 3, 3, device="meta"), cg_iters=7), ValueError,
     r"cg_iters must be in \[1, 2n\] = \[1, 6\] for n = 3 .*; got 7"),
    ("cg-10**9-meta", lambda d: sinkhorn(_zeros(2, 4, 4, device="meta"), cg_iters=10 ** 9), ValueError,
     r"cg_iters must be in \[1, 2n\] = \[1, 8\]"),
    ("cg-2n+1-large-n-meta", lambda d: sinkhorn(_zeros(1, LARGE_N, LARGE_N, device="meta"), cg_iters=2 * LARGE_N + 1),
     ValueError, rf"cg_iters must be in \[1, 2n\] = \[1, {2 * LARGE_N}\]"),
    ("cg-float", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), cg_iters=4.0), TypeError,
     "cg_iters must be None or an int"),
    ("cg-with-unrolled", lambda d: sinkhorn(_zeros(2, 3, 3, device=d), backward="unrolled", cg_iters=4), ValueError,
     "cg_iters applies to backward='implicit'"),
    ("R-list", lambda d: sinkhorn_backward([[1.0]], _zeros(1, 1, device=d)), TypeError, "R must be a torch.Tensor"),
    ("R-int64", lambda d: sinkhorn_backward(_zeros(3, 3, dtype=torch.int64, device=d), _zeros(3, 3, device=d)),
     TypeError, "R must be float32"),
    ("R-3x2", lambda d: sinkhorn_backward(_zeros(3, 2, device=d), _zeros(3, 2, device=d)), ValueError,
     r"R must have shape \(\.\.\., n, n\)"),
    ("grad-list", lambda d: sinkhorn_backward(_zeros(3, 3, device=d), [[0.0] * 3] * 3), TypeError,
     "grad_R must be a torch.Tensor"),
    ("grad-shape", lambda d: sinkhorn_backward(_zeros(2, 3, 3, device=d), _zeros(2, 3, 2, device=d)), ValueError,
     r"grad_R must have the shape of R \(2, 3, 3\); got \(2, 3, 2\)"),
    ("grad-int32", lambda d: sinkhorn_backward(_zeros(3, 3, device=d), _zeros(3, 3, dtype=torch.int32, device=d)),
     TypeError, "grad_R must be a floating-point tensor"),
    ("grad-other-device", lambda d: sinkhorn_backward(_zeros(3, 3, device=d), _zeros(3, 3, device="meta")),
     ValueError, "grad_R must be on R's device"),
    ("backward-cg-0", lambda d: sinkhorn_backward(_zeros(3, 3, device=d), _zeros(3, 3, device=d), 0), ValueError,
     r"cg_iters must be in \[1, 2n\] = \[1, 6\]"),
    ("backward-cg-10**9-meta", lambda d: sinkhorn_backward(_zeros(3, 3, device="meta"), _zeros(3, 3, device="meta"),
                                                             10 ** 9), ValueError, r"cg_iters must be in \[1, 2n\]"),
    ("backward-cg-bool", lambda d: sinkhorn_backward(_zeros(3, 3, device=d), _zeros(3, 3, device=d), True), TypeError,
     "cg_iters must be None or an int"),
]


@pytest.mark.parametrize("call,exception,message", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input(device, call, exception, message):
    with pytest.raises(exception, match=message):
        call(device)


def test_bounds_themselves_are_accepted(device):
    # iters = 2**20 on meta tensors (the shapes only; the real call would iterate that
    # long); cg_iters = 2n for real, where it reaches the direct solve
    meta = torch.zeros(2, 3, 3, device="meta")
    assert sinkhorn(meta, MAX_ITERS).shape == (2, 3, 3)
    assert sinkhorn_backward(meta, meta, cg_iters=6).shape == (2, 3, 3)
    assert sinkhorn(torch.zeros(1, LARGE_N, LARGE_N, device="meta"), 3, cg_iters=2 * LARGE_N).is_meta
    # (both solve the same consistent system, converged or not)
    x = random_logits((4, 3, 3), 1.0, seed=1).to(device)
    R = sinkhorn(x, 10)
    g = random_logits((4, 3, 3), 1.0, seed=2).to(device)
    assert_close("cg_iters = 2n", sinkhorn_backward(R, g, cg_iters=6), sinkhorn_backward(R, g), atol=1e-10, rtol=1e-8)
    xg = x.clone().requires_grad_()
    sinkhorn(xg, 10, cg_iters=6).backward(g)
    assert_close("cg_iters = 2n through sinkhorn", xg.grad, sinkhorn_backward(R, g), atol=1e-10, rtol=1e-8)


# --------------------------------------------------------------------------- mixed dtypes

MIXED = [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float64),
         (torch.float64, torch.float32)]


@pytest.mark.parametrize("n", [4, LARGE_N], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("R_dtype,grad_dtype", MIXED, ids=lambda d: str(d).replace("torch.", ""))
def test_sinkhorn_backward_casts_grad_R_to_the_dtype_of_R(device, n, R_dtype, grad_dtype):
    # As autograd casts the gradient of an output to the output's dtype: grad_R is cast to
    # R's dtype first, and the result has R's dtype.
    x = random_logits((3, n, n), 1.0, seed=n, dtype=R_dtype).to(device).requires_grad_()
    g = random_logits((3, n, n), 1.0, seed=n + 1, dtype=grad_dtype).to(device)
    R = sinkhorn(x, 20)
    got = sinkhorn_backward(R.detach(), g)
    assert got.dtype == R_dtype
    assert torch.equal(got, sinkhorn_backward(R.detach(), g.to(R_dtype)))
    if n <= triton_kernels.MAX_KERNEL_N:
        # the kernels' autograd backward starts from the same R (the padded stage keeps
        # its float32 R for the backward of half-precision input)
        R.backward(g)
        assert x.grad.dtype == R_dtype
        assert torch.equal(got, x.grad)


# --------------------------------------------------------------------------- non-finite logits


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy, on purpose
def test_nan_and_inf_logits_stay_in_their_matrix(device):
    x = random_logits((4, 3, 3), 1.0, seed=71).to(device)
    x[1, 0, 2] = float("nan")
    x[2, 1, 1] = float("inf")
    x[3, 0, 0] = float("-inf")  # an exact zero, the rest of the matrix is finite
    x.requires_grad_()
    R = sinkhorn(x, 20, backward="unrolled")
    assert bool(torch.isnan(R[1]).all()) and bool(torch.isnan(R[2]).all())
    ref, _ = loop_reference(x.detach()[[0, 3]], 20)
    assert_close("finite matrices untouched", R[[0, 3]], ref, atol=1e-13, rtol=1e-12)
    assert float(R.detach()[3, 0, 0]) == 0.0
    R.backward(torch.ones_like(R))
    assert bool(torch.isfinite(x.grad[[0, 3]]).all())
