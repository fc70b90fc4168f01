"""Sinkhorn on logits spread over ``+-100``: every kernel, every layout, forward and both backwards.

A row whose logits all lie far below their column maxima has entries of
``exp(X - colmax X)`` below float32's normal range, and the reciprocal of its row sum
overflows. The kernels start from the matrix balanced by row and column maxima instead
(and the padded stage takes its first iteration in the log domain), so they must stay
finite wherever float64 is, and close to it. The kernels on the scaling vectors also
absorb them into the matrix every few iterations, which bounds every sum they take
(:func:`~packed_kernels.ops.sinkhorn.triton_kernels.absorb_period`).

References: float64 autograd through the textbook loop on the same logits (rounded to
the dtype under test first), and the implicit gradient by least squares on the
weighted system in float64 NumPy (:mod:`sinkhorn_cases`).
"""
import dataclasses
import math

import pytest
import torch

from packed_kernels import sinkhorn, sinkhorn_backward
from packed_kernels.ops.sinkhorn import padded_torch, triton_kernels
from packed_kernels.ops.sinkhorn.triton_kernels import Layout

from assertions import assert_close
from sinkhorn_cases import NARROW_ROW_EXAMPLES, loop_reference, random_logits, weighted_implicit_reference, wide_logits

#: the kernels' n: one token per thread (2, 4, 8) and tiles, padded (3, 5, 7, 17) or not (16, 32)
RANGE_NS = [2, 3, 4, 5, 7, 8, 16, 17, 32]
DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: (atol, rtol) of R and of the gradients. The references see the logits rounded to the
#: dtype, so what is left is float32 arithmetic and the rounding of the results to the
#: dtype (bfloat16: up to one unit in the last place of numbers just below 1, 2^-8).
TOLERANCES = {torch.float32: ((1e-5, 1e-5), (1e-5, 1e-4)),
              torch.float16: ((1e-3, 2e-3), (1e-3, 4e-3)),
              torch.bfloat16: ((8e-3, 1e-2), (1e-2, 2e-2))}
ITERS = 20


def _crowded(n: int, low: float) -> torch.Tensor:
    """``n - 1`` rows whose only large logit is in the last column, whose only small one
    is in the last row: a doubly stochastic scaling must lift entries ``e^-low`` to the
    scale of the others, so the scaling vectors keep spreading, by up to a factor
    ``e^low`` (beyond float32's range for ``low`` near 100)."""
    x = torch.full((n, n), -low, dtype=torch.float64)
    x[: n - 1, n - 1] = 0.0
    x[n - 1, : n - 1] = 0.0
    return x


# --------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("n", sorted(NARROW_ROW_EXAMPLES), ids=lambda n: f"n{n}")
@pytest.mark.parametrize("iters", [1, ITERS], ids=lambda i: f"it{i}")
def test_examples_with_a_row_far_below_its_column_maxima(device, n, iters):
    # n = 2 runs the one-token-per-thread kernels, n = 3 the tiles
    x64 = torch.tensor(NARROW_ROW_EXAMPLES[n], dtype=torch.float64)
    g64 = random_logits((n, n), 1.0, seed=n)
    ref, ref_grad = loop_reference(x64, iters, g64)
    if n == 2 and iters == 1:  # row 0 holds e^-94 and e^-95 after the column step
        first = 1 / (1 + math.exp(-1))
        assert_close("first iteration", ref, torch.tensor([[first, 1 - first], [0.5, 0.5]], dtype=torch.float64),
                     atol=1e-15, rtol=0)
    x = x64.float().to(device).requires_grad_()
    R = sinkhorn(x, iters, backward="unrolled")
    R.backward(g64.float().to(device))
    assert_close("R", R, ref, atol=1e-6, rtol=1e-5)
    assert_close("unrolled gradient", x.grad, ref_grad, atol=1e-6, rtol=1e-5)
    implicit = sinkhorn_backward(R.detach(), g64.float().to(device))
    assert_close("implicit gradient", implicit, weighted_implicit_reference(R, g64), atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- every n, every dtype


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("n", RANGE_NS, ids=lambda n: f"n{n}")
def test_wide_logits_forward_and_both_backwards(device, n, dtype):
    # the default kernels for n; wide_logits holds uniform draws over +-100 and the
    # structured worst cases (rows or a column far below the rest, a near-permutation,
    # two blocks linked only through tiny entries), the first four only for large tiles
    x64 = wide_logits(n, seed=n, count=4 if n >= 16 else 8)
    g64 = random_logits(x64.shape, 1.0, seed=100 + n)
    x, g = x64.to(dtype).to(device), g64.to(dtype).to(device)
    ref, ref_grad = loop_reference(x.double(), ITERS, g.double())
    assert bool(torch.isfinite(ref).all() and torch.isfinite(ref_grad).all())
    (R_atol, R_rtol), (g_atol, g_rtol) = TOLERANCES[dtype]
    xg = x.clone().requires_grad_()
    R = sinkhorn(xg, ITERS, backward="unrolled")
    R.backward(g)
    assert R.dtype == dtype and xg.grad.dtype == dtype
    assert_close("R", R, ref, atol=R_atol, rtol=R_rtol)
    assert_close("unrolled gradient", xg.grad, ref_grad, atol=g_atol, rtol=g_rtol)
    # the implicit gradient of the forward's own R (rounded to the dtype, as autograd keeps it)
    implicit = sinkhorn_backward(R.detach(), g)
    assert_close("implicit gradient", implicit, weighted_implicit_reference(R, g), atol=g_atol, rtol=g_rtol)


@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_wide_logits_tile_kernels_where_one_token_per_thread_is_the_default(device, n):
    x = wide_logits(n, seed=50 + n).float().to(device)
    g = random_logits(x.shape, 1.0, seed=60 + n).float().to(device)
    ref, ref_grad = loop_reference(x.double(), ITERS, g.double())
    configs = (triton_kernels.forward_config(n, torch.float32, layout=Layout.TILE),
               triton_kernels.unrolled_backward_config(n, torch.float32, ITERS, layout=Layout.TILE),
               triton_kernels.implicit_backward_config(n, torch.float32, False, layout=Layout.TILE))
    R = triton_kernels.sinkhorn_forward_triton(x, ITERS, configs[0])
    assert_close("R", R, ref, atol=1e-5, rtol=1e-5)
    assert_close("unrolled gradient", triton_kernels.sinkhorn_unrolled_backward_triton(x, g, ITERS, configs[1]),
                 ref_grad, atol=1e-5, rtol=1e-4)
    assert_close("implicit gradient", triton_kernels.sinkhorn_implicit_backward_triton(R, g, None, configs[2]),
                 weighted_implicit_reference(R, g), atol=1e-5, rtol=1e-4)


def test_wide_logits_padded_stage(device):
    # n above the kernels' (and CPU tensors on a GPU machine) run the padded stage, in
    # float32 for half-precision input
    n = triton_kernels.MAX_KERNEL_N + 1
    x = wide_logits(n, seed=7).float()
    g = random_logits(x.shape, 1.0, seed=8).float()
    ref, ref_grad = loop_reference(x.double(), ITERS, g.double())
    xg = x.clone().to(device).requires_grad_()
    R = sinkhorn(xg, ITERS, backward="unrolled")
    R.backward(g.to(device))
    assert_close("R", R, ref, atol=1e-5, rtol=1e-5)
    assert_close("unrolled gradient", xg.grad, ref_grad, atol=1e-5, rtol=1e-4)
    for iters in (1, ITERS):
        assert_close(f"padded stage, {iters} iterations", padded_torch.sinkhorn_padded(x, iters),
                     loop_reference(x.double(), iters)[0], atol=1e-5, rtol=1e-5)
    implicit = sinkhorn_backward(R.detach(), g.to(device))
    assert_close("implicit gradient", implicit, weighted_implicit_reference(R, g), atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- absorbing the scaling vectors


@pytest.mark.parametrize("n,layout", [(2, None), (4, None), (8, None), (3, Layout.TILE)], ids=lambda v: str(v))
@pytest.mark.parametrize("absorb_every", [1, 3])
def test_absorptions_change_nothing_but_rounding(device, n, layout, absorb_every):
    # Every kernel on the scaling vectors, with absorptions closer together than its
    # default, so that several blocks (and their reverse) run: the forward (staggered
    # at n = 2, 4), the unrolled backward with the scaling vectors in registers (7
    # iterations) and in the scratch buffer (n = 8).
    iters = 7
    x = wide_logits(n, seed=70 + n).float().to(device)
    g = random_logits(x.shape, 1.0, seed=80 + n).float().to(device)
    ref, ref_grad = loop_reference(x.double(), iters, g.double())
    forward = triton_kernels.forward_config(n, torch.float32, layout=layout)
    unrolled = triton_kernels.unrolled_backward_config(n, torch.float32, iters, layout=layout)
    R = triton_kernels.sinkhorn_forward_triton(x, iters, dataclasses.replace(forward, absorb_every=absorb_every))
    assert_close("R", R, ref, atol=1e-5, rtol=1e-5)
    if layout is None:
        grad = triton_kernels.sinkhorn_unrolled_backward_triton(
            x, g, iters, dataclasses.replace(unrolled, absorb_every=absorb_every))
        assert_close(f"unrolled gradient (scratch {unrolled.scratch})", grad, ref_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n,iters", [(4, 60), (8, 40)], ids=lambda v: str(v))
def test_absorptions_keep_long_runs_in_range(device, n, iters):
    # _crowded drives the spread of the scaling vectors past float32's range: without
    # absorptions, within these iterations, the forward's shared reciprocals (n = 4) and
    # the unrolled backward's u_i v_j overflow. The balanced matrix has entries 1 and
    # e^-95 (below the normal range, above the smallest subnormal) only.
    x64 = torch.stack([_crowded(n, 95.0), _crowded(n, 95.0).t()])
    x = x64.float().to(device)
    g = random_logits(x.shape, 1.0, seed=90 + n).float().to(device)
    ref, ref_grad = loop_reference(x.double(), iters, g.double())
    forward = triton_kernels.forward_config(n, torch.float32)
    unrolled = triton_kernels.unrolled_backward_config(n, torch.float32, iters)
    assert forward.reciprocal_pairs == (1 if n == 4 else 0) and unrolled.scratch
    assert_close("R", triton_kernels.sinkhorn_forward_triton(x, iters, forward), ref, atol=1e-6, rtol=1e-5)
    assert_close("unrolled gradient", triton_kernels.sinkhorn_unrolled_backward_triton(x, g, iters, unrolled),
                 ref_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 32], ids=lambda n: f"n{n}")
def test_absorb_period_bounds_every_sum(n):
    # The bound of absorb_period, on the float64 iterates of the kernels' scheme with the
    # package's period: from the balanced K and u = u0 (or an absorbed K and u = 1), after
    # t iterations of a block every sum K^T u, K v (whose reciprocals the kernels take,
    # two at a time where they share one) and every u, v lie in [n^-t, n^t], so within
    # 2^+-40. Without absorptions the crowded inputs spread u and v beyond that.
    period = triton_kernels.absorb_period(n)
    assert float(n) ** period <= 2.0 ** 40 < float(n) ** (period + 1)
    x = torch.cat([wide_logits(n, seed=n), torch.stack([_crowded(n, 95.0), _crowded(n, 95.0).t()])])
    shifted = x - x.amax(dim=-2, keepdim=True)
    row_max = shifted.amax(dim=-1, keepdim=True)
    balanced = torch.exp(shifted - row_max)

    def iterate(absorb: bool):
        K, u = balanced, torch.exp(row_max[..., 0])
        for t in range(300):
            p = (K * u[..., :, None]).sum(-2)
            v = 1 / p
            q = (K * v[..., None, :]).sum(-1)
            u = 1 / q
            yield t % period + 1 if absorb else t + 1, (p, q, u, v)
            if absorb and (t + 1) % period == 0:
                K = u[..., :, None] * K * v[..., None, :]
                u = torch.ones_like(u)

    for step, values in iterate(absorb=True):
        exponent = max(float(value.log2().abs().max()) for value in values)
        assert exponent <= step * math.log2(n) + 1e-6, f"a sum or scaling vector at 2^{exponent:.1f}"
    if n > 2:  # (the crowded 2 x 2 matrix is a well-scaled permutation)
        spread = max(float(torch.cat(values[2:], -1).log2().abs().max()) for _, values in iterate(absorb=False))
        assert spread > 40, spread
