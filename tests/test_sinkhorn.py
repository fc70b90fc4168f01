"""Sinkhorn forward and its two backwards against independent references.

References (:mod:`sinkhorn_cases`): the float64 NumPy stage (iterations, hand-written
reverse mode, least squares on the singular implicit system), autograd through the
PyTorch loop, finite differences of the converged map (gradcheck). The padded-stage
fallbacks, tracing and transforms are in ``test_sinkhorn_interop.py``, bad input in
``test_sinkhorn_inputs.py``.
"""
import dataclasses

import pytest
import torch

from packed_kernels import runtime, sinkhorn, sinkhorn_backward
from packed_kernels.ops.sinkhorn import naive_numpy, padded_torch, triton_kernels
from packed_kernels.ops.sinkhorn.triton_kernels import Layout

from assertions import assert_close
from sinkhorn_cases import (NS, birkhoff, implicit_reference, loop_reference, random_logits, tokens_for,
                            weighted_implicit_reference)

#: n of the one-token-per-thread kernels, and of the forward's two tokens a thread
TOKEN_PER_THREAD_N = [2, 4, 8]
STAGGERED_N = [2, 4]
#: n of the forward that spreads a matrix over n/4 lanes of a warp (powers of two and not)
COLUMN_GROUP_N = [9, 16, 17, 32]


def _forward_triton(x, iters, layout=None, **fields):
    """The forward launcher with the default configuration, or with ``layout`` and ``fields`` changed."""
    config = triton_kernels.forward_config(x.shape[-1], x.dtype, layout=layout)
    return triton_kernels.sinkhorn_forward_triton(x, iters, dataclasses.replace(config, **fields))


def _implicit_triton(R, g, cg_iters=None, layout=None, **fields):
    config = triton_kernels.implicit_backward_config(R.shape[-1], R.dtype, cg_iters is not None, layout=layout)
    return triton_kernels.sinkhorn_implicit_backward_triton(R, g, cg_iters, dataclasses.replace(config, **fields))


def _unrolled_triton(x, g, iters, layout=None, **fields):
    config = triton_kernels.unrolled_backward_config(x.shape[-1], x.dtype, iters, layout=layout)
    return triton_kernels.sinkhorn_unrolled_backward_triton(x, g, iters, dataclasses.replace(config, **fields))


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("n", NS, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("scale", [1.0, 4.0], ids=lambda s: f"scale{s:g}")
def test_forward_matches_references(device, n, scale):
    T = tokens_for(n)
    x64 = random_logits((T, n, n), scale, seed=n * 10 + int(scale))
    R = sinkhorn(x64.float().to(device), 20)
    ref32, _ = loop_reference(x64.float().double(), 20)
    assert R.dtype == torch.float32 and R.shape == (T, n, n)
    assert_close("R fp32", R, ref32, atol=2e-6, rtol=1e-5)
    ref, _ = loop_reference(x64, 20)
    assert_close("R fp64", sinkhorn(x64.to(device), 20), ref, atol=1e-13, rtol=1e-12)
    numpy_ref = naive_numpy.sinkhorn_numpy(x64[0].numpy(), 20)
    assert_close("R vs numpy", ref[0], numpy_ref, atol=1e-14, rtol=1e-13)


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (7, 5, 5), (3, 3), (1, 1, 1)], ids=lambda s: "x".join(map(str, s)))
def test_forward_leading_dims_and_marginals(device, shape):
    x = random_logits(shape, 1.0, seed=sum(shape)).to(device)
    R = sinkhorn(x, 200)
    assert R.shape == x.shape
    ones = torch.ones(shape[:-1], dtype=torch.float64)
    assert_close("row sums", R.sum(-1), ones, atol=1e-12, rtol=0)
    assert_close("column sums", R.sum(-2), ones, atol=1e-10, rtol=0)


def test_forward_non_contiguous_and_empty(device):
    base = random_logits((6, 5, 5), 2.0, seed=3).to(device)
    x = base.transpose(-1, -2)[::2]  # strided in every dim
    assert not x.is_contiguous()
    assert_close("non-contiguous", sinkhorn(x, 20), loop_reference(x.cpu(), 20)[0], atol=1e-13, rtol=1e-12)
    empty = torch.zeros(0, 4, 4, device=device)
    assert sinkhorn(empty, 20).shape == (0, 4, 4)
    empty_grad = torch.zeros(0, 4, 4, device=device, requires_grad=True)
    sinkhorn(empty_grad, 5, backward="unrolled").sum().backward()
    assert empty_grad.grad.shape == (0, 4, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backward", ["implicit", "unrolled"])
def test_low_precision_inputs(device, dtype, backward):
    x = random_logits((33, 4, 4), 2.0, seed=5, dtype=dtype).to(device).requires_grad_()
    grad = random_logits((33, 4, 4), 1.0, seed=6, dtype=dtype).to(device)
    R = sinkhorn(x, 20, backward=backward)
    assert R.dtype == dtype
    x32 = x.detach().float()
    ref = sinkhorn(x32, 20)  # float32 compute on the same (rounded) inputs
    assert_close("R low precision", R, ref, atol=1e-2, rtol=1e-2)
    R.backward(grad)
    assert x.grad.dtype == dtype
    x32.requires_grad_()
    sinkhorn(x32, 20, backward=backward).backward(grad.float())
    assert_close("grad low precision", x.grad, x32.grad, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- unrolled backward


@pytest.mark.parametrize("n", NS, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("iters", [1, 3, 20], ids=lambda i: f"it{i}")
def test_unrolled_backward_matches_autograd_through_loop(device, n, iters):
    T = tokens_for(n)
    x64 = random_logits((T, n, n), 3.0, seed=100 + n + iters)  # peaked
    g64 = random_logits((T, n, n), 1.0, seed=200 + n + iters)
    _, ref = loop_reference(x64, iters, g64)
    for dtype, atol, rtol in [(torch.float64, 1e-12, 1e-10), (torch.float32, 2e-5, 1e-4)]:
        x = x64.to(dtype).to(device).clone().requires_grad_()
        sinkhorn(x, iters, backward="unrolled").backward(g64.to(dtype).to(device))
        if dtype == torch.float32:
            _, ref = loop_reference(x64.float().double(), iters, g64.float().double())
        assert_close(f"unrolled grad {dtype}", x.grad, ref, atol=atol, rtol=rtol)


def test_unrolled_backward_matches_numpy_reverse_mode():
    x = random_logits((5, 5), 2.0, seed=7)
    g = random_logits((5, 5), 1.0, seed=8)
    _, ref = loop_reference(x, 9, g)
    assert_close("numpy reverse mode", naive_numpy.unrolled_backward_numpy(x.numpy(), g.numpy(), 9), ref,
                 atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("iters", [2, 7, 40], ids=lambda i: f"it{i}")
def test_unrolled_backward_checkpoint_segments(device, iters):
    # several segment layouts (seg_len, num_segs) of the recompute-from-checkpoint scheme
    x64 = random_logits((9, 3, 3), 2.0, seed=iters)
    g64 = random_logits((9, 3, 3), 1.0, seed=iters + 1)
    _, ref = loop_reference(x64, iters, g64)
    got = _unrolled_triton(x64.to(device), g64.to(device), iters)
    assert_close(f"segments {triton_kernels.checkpoint_segments(iters)}", got, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("n", TOKEN_PER_THREAD_N, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_one_token_per_thread_kernels_match_tile_kernels(device, n, dtype):
    # These n run kernels that keep a whole matrix in one thread by default; the tile
    # kernels (checked against the references above for every n) must agree.
    x = random_logits((45, n, n), 3.0, seed=600 + n, dtype=dtype).to(device)
    g = random_logits((45, n, n), 1.0, seed=700 + n, dtype=dtype).to(device)
    tol = dict(atol=1e-13, rtol=1e-11) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    assert triton_kernels.forward_config(n, dtype).layout is Layout.TOKEN_PER_THREAD
    R = _forward_triton(x, 20)
    assert_close("forward", R, _forward_triton(x, 20, layout=Layout.TILE), **tol)
    # every reciprocal its own (no pairs of sums sharing one)
    assert_close("forward, unpaired", _forward_triton(x, 20, reciprocal_pairs=0), R, **tol)
    assert_close("implicit", _implicit_triton(R, g), _implicit_triton(R, g, layout=Layout.TILE), **tol)
    for iters in (1, 20):
        assert_close(f"unrolled it{iters}", _unrolled_triton(x, g, iters),
                     _unrolled_triton(x, g, iters, layout=Layout.TILE), **tol)


@pytest.mark.parametrize("n", COLUMN_GROUP_N, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_column_group_kernels_match_tile_kernels(device, n, dtype):
    # From n = 9 on the forward and the direct implicit backward spread a matrix over
    # n/4 lanes by default (sums across the group by shuffles, padded columns masked
    # where n is not a multiple of four); the tile kernels are the ones checked against
    # the references at every n.
    assert triton_kernels.forward_config(n, dtype).layout is Layout.COLUMN_GROUP
    # the implicit backward from n = 9 to 16 only (beyond, the tile kernel is faster)
    implicit = triton_kernels.implicit_backward_config(n, dtype, False).layout
    assert implicit is (Layout.COLUMN_GROUP if n <= 16 else Layout.TILE)
    x = random_logits((37, n, n), 3.0, seed=800 + n, dtype=dtype).to(device)
    g = random_logits((37, n, n), 1.0, seed=900 + n, dtype=dtype).to(device)
    tol = dict(atol=1e-13, rtol=1e-11) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    R = _forward_triton(x, 20)
    assert_close("forward", R, _forward_triton(x, 20, layout=Layout.TILE), **tol)
    # the last step normalises rows: each sums to one, no padded column counted in its sum
    assert_close("row sums", R.sum(-1), torch.ones_like(R[..., 0]), atol=1e-5, rtol=0)
    assert_close("implicit", _implicit_triton(R, g), _implicit_triton(R, g, layout=Layout.TILE), **tol)


@pytest.mark.parametrize("n", [8, 17, 33], ids=lambda n: f"n{n}")
def test_column_group_layout_only_where_its_kernels_exist(n):
    if n != 17:
        with pytest.raises(ValueError, match="Layout.COLUMN_GROUP takes n from 9 to 32"):
            triton_kernels.forward_config(n, torch.float32, layout=Layout.COLUMN_GROUP)
    with pytest.raises(ValueError, match="Layout.COLUMN_GROUP takes n from 9 to 16"):
        triton_kernels.implicit_backward_config(n, torch.float32, False, layout=Layout.COLUMN_GROUP)
    # conjugate gradient and the unrolled backward have tile kernels only
    for config in (lambda: triton_kernels.implicit_backward_config(16, torch.float32, True, layout=Layout.COLUMN_GROUP),
                   lambda: triton_kernels.unrolled_backward_config(16, torch.float32, 5, layout=Layout.COLUMN_GROUP)):
        with pytest.raises(ValueError, match="direct implicit backward only"):
            config()


@pytest.mark.parametrize("n", STAGGERED_N, ids=lambda n: f"n{n}")
def test_forward_pairs_on_every_tile(device, n):
    # Where n <= 4, two sums share one reciprocal, 1/(ab), on every tile: between
    # absorptions every sum lies within 2^+-40 (absorb_period), whatever the logits.
    # Token 150 (second tile) has its first n/2 rows about e^-70 below the others: the
    # product of two of its row sums of exp(X - colmax X) would be below float32's
    # range (a shared reciprocal of it: inf, then NaN), those of the balanced matrix are
    # not. Every token is checked against the float64 loop and against no pairs.
    config = triton_kernels.forward_config(n, torch.float32)
    assert config.staggered and config.reciprocal_pairs > 0
    block = config.block
    T = 3 * block + 5
    x64 = random_logits((T, n, n), 2.0, seed=950 + n)
    x64[150, : n // 2] -= 70.0
    x = x64.float()
    ref, _ = loop_reference(x.double(), 20)
    R = _forward_triton(x.to(device), 20)
    assert_close("R", R, ref, atol=2e-6, rtol=1e-5)
    assert_close("R, unpaired", R, _forward_triton(x.to(device), 20, reciprocal_pairs=0), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n,iters", [(4, 20), (8, 20), (3, 5)], ids=lambda v: str(v))
def test_launchers_split_inputs_beyond_32_bit_offsets(device, n, iters):
    # Inputs of more than max_launch_elements elements run in slices of whole tokens
    # (the kernels index with 32-bit offsets). With the limit lowered, every launcher
    # must give the same bits as one launch. Token 140 is peaked (see the pairing test
    # above).
    x = random_logits((300, n, n), 1.0, seed=960 + n, dtype=torch.float32).to(device)
    g = random_logits((300, n, n), 1.0, seed=970 + n, dtype=torch.float32).to(device)
    peaked = x.clone()
    peaked[140, : n // 2] -= 70.0
    R = _forward_triton(x, iters)
    whole = (_forward_triton(peaked, iters), _unrolled_triton(x, g, iters), _implicit_triton(R, g))
    limit = 130 * n * n
    assert [(p.start, p.stop) for p in triton_kernels._token_slices(300, n, limit)] == [(0, 128), (128, 256), (256, 300)]
    sliced = (_forward_triton(peaked, iters, max_launch_elements=limit),
              _unrolled_triton(x, g, iters, max_launch_elements=limit),
              _implicit_triton(R, g, max_launch_elements=limit))
    for name, a, b in zip(("forward", "unrolled", "implicit"), sliced, whole):
        assert torch.equal(a, b), name


def test_launch_in_slices_launches_once_per_slice():
    # What the launchers hand each launch: the whole tensors themselves where one slice
    # covers every token, else one view per slice, rows of the output in step with the inputs.
    x, g = torch.randn(300, 4, 4), torch.randn(300, 4, 4)
    config = triton_kernels.forward_config(4, torch.float32)
    calls = []

    def launch(out, a, b, iters, cfg):
        calls.append((out, a, b))
        out.copy_(a + b)

    out = triton_kernels._launch_in_slices(launch, (x, g), 20, config)
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is x and calls[0][2] is g
    assert torch.equal(out, x + g)
    calls.clear()
    limited = dataclasses.replace(config, max_launch_elements=130 * 16)
    out = triton_kernels._launch_in_slices(launch, (x, g), 20, limited)
    assert [c[1].shape[0] for c in calls] == [128, 128, 44]
    assert [c[1].data_ptr() - x.data_ptr() for c in calls] == [0, 128 * 16 * 4, 256 * 16 * 4]
    assert all(c[0].data_ptr() - out.data_ptr() == c[1].data_ptr() - x.data_ptr() for c in calls)
    assert torch.equal(out, x + g)


def _stub_launches(monkeypatch, kernel_name):
    """``(caps, launches)``: the register caps the launchers ask :func:`runtime.register_cap`
    for, and ``(grid, num_warps)`` of each launch of ``kernel_name``, which is stubbed (what
    the launcher asks for, not what the compiler makes of it)."""
    caps, launches = [], []
    real_cap = runtime.register_cap
    monkeypatch.setattr(runtime, "register_cap", lambda cap: caps.append(cap) or real_cap(cap))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs["num_warps"]))

    monkeypatch.setattr(triton_kernels, kernel_name, Kernel())
    return caps, launches


def test_unrolled_backward_launch_takes_the_configured_register_cap(monkeypatch):
    # The n = 4 float32 configuration caps registers; the cap must reach the launch.
    config = triton_kernels.unrolled_backward_config(4, torch.float32, 20)
    assert config.max_registers is not None and not config.scratch
    caps, launches = _stub_launches(monkeypatch, "sinkhorn_unrolled_backward_small_kernel")
    x = torch.randn(300, 4, 4)
    triton_kernels._launch_unrolled_backward(torch.empty_like(x), x, torch.randn_like(x), 20, config)
    assert launches == [((runtime.cdiv(300, config.block),), config.num_warps)]
    assert caps == [config.max_registers]


def test_unrolled_scratch_variant_at_n4_takes_programs_that_all_fit():
    # The scratch programs loop over tiles, so a program that is not resident runs its
    # tiles after the others: at n = 4 eight 128-token programs an SM do not fit its
    # registers in float32, eight 64-token programs do.
    config = triton_kernels.unrolled_backward_config(4, torch.float32, 30)
    assert config.scratch and config.scratch_programs_per_sm == 8
    assert config.block == 64 and config.num_warps == 2
    # at n = 2 (32 registers a thread in float32) eight 128-token programs fit
    assert triton_kernels.unrolled_backward_config(2, torch.float32, 40).block == 128


@pytest.mark.parametrize("n", [17, 32], ids=lambda n: f"n{n}")
def test_wide_column_group_forward_launches_one_warp_programs_under_a_register_cap(monkeypatch, n):
    # Spread over eight lanes a matrix needs about 186 registers a thread in float32;
    # the configuration caps them so that more programs fit an SM, and the cap must
    # reach the launch.
    config = triton_kernels.forward_config(n, torch.float32)
    assert (config.block, config.num_warps, config.max_registers) == (4, 1, 168)
    assert triton_kernels.forward_config(n, torch.float64).max_registers is None
    assert triton_kernels.forward_config(16, torch.float32).max_registers is None
    caps, launches = _stub_launches(monkeypatch, "sinkhorn_forward_group_kernel")
    x = torch.randn(30, n, n)
    triton_kernels._launch_forward(torch.empty_like(x), x, 20, config)
    assert launches == [((8,), 1)]
    assert caps == [168]


@pytest.mark.parametrize("n,iters", [(8, 20), (4, 30), (2, 40)], ids=lambda v: str(v))
def test_unrolled_scratch_variant_loops_over_tiles(device, n, iters):
    # n = 8, or more iterations than the registers keep: u_t of every iteration goes to a
    # scratch buffer. More tiles than programs, so programs reuse their scratch, and a
    # last tile that is partly past the end; the references are autograd through the
    # float64 loop (on a sample) and the checkpointed tile kernel (on every token).
    config = triton_kernels.unrolled_backward_config(n, torch.float32, iters)
    assert config.scratch
    block = config.block
    if device == "cuda":
        T = 2 * runtime.sm_count(torch.device("cuda")) * config.scratch_programs_per_sm * block + 7
    else:
        T = 5 * block + 7  # 4 programs in the interpreter
    x64 = random_logits((T, n, n), 3.0, seed=800 + n)  # peaked
    g64 = random_logits((T, n, n), 1.0, seed=900 + n)
    sample = torch.arange(0, T, max(1, T // 40))
    _, ref = loop_reference(x64[sample], iters, g64[sample])
    got64 = _unrolled_triton(x64.to(device), g64.to(device), iters)
    assert_close("float64, sample", got64[sample.to(device)], ref, atol=1e-12, rtol=1e-10)
    tiles = _unrolled_triton(x64.to(device), g64.to(device), iters, layout=Layout.TILE)
    assert_close("float64, every token", got64, tiles, atol=1e-12, rtol=1e-10)
    x32, g32 = x64.float().to(device), g64.float().to(device)
    got32 = _unrolled_triton(x32, g32, iters)
    assert_close("float32, every token", got32, tiles, atol=2e-5, rtol=1e-4)


def test_unrolled_gradcheck(device):
    x = random_logits((3, 3, 3), 1.5, seed=11).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 6, backward="unrolled"), (x,), eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- implicit backward


@pytest.mark.parametrize("n", NS, ids=lambda n: f"n{n}")
def test_implicit_backward_matches_least_squares_on_doubly_stochastic(device, n):
    T = min(tokens_for(n), 12)
    R = birkhoff(n, T, seed=n)
    g = random_logits((T, n, n), 1.0, seed=300 + n)
    ref = implicit_reference(R, g)
    assert_close("implicit fp64 direct", sinkhorn_backward(R.to(device), g.to(device)), ref, atol=1e-11, rtol=1e-9)
    assert_close("implicit fp64 cg", sinkhorn_backward(R.to(device), g.to(device), cg_iters=2 * n), ref,
                 atol=1e-9, rtol=1e-7)
    got32 = sinkhorn_backward(R.float().to(device), g.float().to(device))
    assert_close("implicit fp32 direct", got32, ref, atol=2e-6 * float(g.abs().max()), rtol=1e-4)


#: n and layout of the implicit kernels' elimination: tiles (padded at 3 and 5), both
#: kernels at 4, a column group at 16, a padded tile at 17
NEAR_PERMUTATION_CASES = [(3, None), (4, None), (4, Layout.TILE), (5, None), (16, None), (17, None)]


def _case_id(case):
    n, layout = case
    return f"n{n}" + ("-tile" if layout is Layout.TILE else "")


@pytest.mark.parametrize("peak", [0.5, 2.0, 6.0], ids=lambda p: f"peak{p:g}")
@pytest.mark.parametrize("case", NEAR_PERMUTATION_CASES, ids=_case_id)
def test_implicit_float32_near_permutation(device, case, peak):
    # Nearly permutation matrices: the float32 direct solve must match the float64
    # answer. At the larger peaks blocks of columns are linked only through entries far
    # below rounding level, where the elimination cuts the link.
    n, layout = case
    T = 64 if n == 4 else 24
    R = birkhoff(n, T, seed=int(peak) + 10 * n, peak=peak)
    g = random_logits((T, n, n), 1.0, seed=17 + n)
    ref = implicit_reference(R, g)
    # The direct solve (the default) stays at rounding level. Conjugate gradient (always
    # the tiles) is less robust here, compiled (fused multiply-adds, approximate
    # division) more so than under the interpreter.
    for cg_iters, bound in ((None, 1e-5), (2 * n, 1e-2)):
        if layout is Layout.TILE:
            if cg_iters is not None:
                continue
            got = _implicit_triton(R.float().to(device), g.float().to(device), layout=layout)
        else:
            got = sinkhorn_backward(R.float().to(device), g.float().to(device), cg_iters=cg_iters)
        rel = float((got.cpu().double() - ref).norm() / ref.norm())
        assert rel < bound, f"float32 implicit gradient (cg_iters={cg_iters}) relative error {rel:.2e}"


@pytest.mark.parametrize("case", NEAR_PERMUTATION_CASES, ids=_case_id)
def test_implicit_float32_of_peaked_logits(device, case):
    # The forward's own R on peaked logits, against least squares on the weighted system
    # at the same R: logits of std 30 (entries down to far below rounding level, columns
    # not yet summing to 1 after 20 iterations), and two diagonal blocks of mild logits
    # linked only through entries about e^-40 below them (the elimination must cut that
    # link: solving through it puts the rounding noise of one block, divided by the
    # link's weight, into every gradient of the other).
    n, layout = case
    half = n // 2  # (the block of the last columns, eliminated first, has two or more)
    blocks = random_logits((12, n, n), 1.0, seed=42 + n)
    blocks[:, :half, half:] -= 40.0
    blocks[:, half:, :half] -= 40.0
    x = torch.cat([random_logits((12, n, n), 30.0, seed=40 + n), blocks]).float().to(device)
    g = random_logits((24, n, n), 1.0, seed=41 + n, dtype=torch.float32).to(device)
    R = sinkhorn(x, 20)
    ref = weighted_implicit_reference(R, g)
    got = _implicit_triton(R, g, layout=layout) if layout is Layout.TILE else sinkhorn_backward(R, g)
    rel = float((got.cpu().double() - ref).norm() / ref.norm())
    assert rel < 1e-5, f"float32 implicit gradient relative error {rel:.2e}"


@pytest.mark.parametrize("n", [2, 3, 4, 8], ids=lambda n: f"n{n}")
def test_implicit_equals_unrolled_at_convergence(device, n):
    x = random_logits((6, n, n), 0.7, seed=400 + n).to(device)
    g = random_logits((6, n, n), 1.0, seed=500 + n).to(device)
    xi = x.clone().requires_grad_()
    xu = x.clone().requires_grad_()
    sinkhorn(xi, 80, backward="implicit").backward(g)
    sinkhorn(xu, 80, backward="unrolled").backward(g)
    assert_close("implicit vs unrolled, converged", xi.grad, xu.grad, atol=1e-10, rtol=1e-8)


def test_implicit_gradcheck_against_converged_map(device):
    # finite differences of the 40-step map (converged to rounding level at these mild
    # logits) vs the implicit gradient
    x = random_logits((2, 3, 3), 0.4, seed=21)
    assert float((padded_torch.sinkhorn_padded(x, 40).sum(-2) - 1).abs().max()) < 1e-14
    x = x.to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 40, backward="implicit"), (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [3, 5, 16], ids=lambda n: f"n{n}")
def test_implicit_cg_matches_direct_and_padded(device, n):
    R = sinkhorn(random_logits((7, n, n), 2.0, seed=n).to(device), 20)
    g = random_logits((7, n, n), 1.0, seed=n + 1).to(device)
    direct = sinkhorn_backward(R, g)
    assert_close("cg vs direct", sinkhorn_backward(R, g, cg_iters=2 * n), direct, atol=1e-10, rtol=1e-8)
    assert_close("padded torch cg vs direct", padded_torch.implicit_backward_padded(R.cpu(), g.cpu()), direct,
                 atol=1e-10, rtol=1e-8)


def test_sinkhorn_backward_is_the_autograd_implicit_backward(device):
    x = random_logits((4, 2, 5, 5), 1.0, seed=31).to(device).requires_grad_()
    g = random_logits((4, 2, 5, 5), 1.0, seed=32).to(device)
    R = sinkhorn(x, 20)
    R.backward(g)
    assert_close("standalone", sinkhorn_backward(R.detach(), g), x.grad, atol=0, rtol=0)


#: grad_R laid out otherwise than contiguously, built on the device from float64 draws
GRAD_LAYOUTS = {
    "transposed": lambda base, wide, one: base.transpose(-1, -2),
    "expanded": lambda base, wide, one: one.expand(base.shape),
    "strided": lambda base, wide, one: wide[..., ::2],
    "matrix-transposed": lambda base, wide, one: one[0].t(),
}


@pytest.mark.parametrize("layout", list(GRAD_LAYOUTS))
@pytest.mark.parametrize("n", [3, 4], ids=lambda n: f"n{n}")
def test_non_contiguous_grad_R(device, n, layout):
    # Both backwards, through autograd and sinkhorn_backward, against float64 autograd
    # through the loop: the unrolled one at 12 iterations, the implicit one on mild
    # logits at 60 iterations (converged to rounding level, where the two gradients
    # agree). "matrix-transposed": a single (n, n) matrix, grad_R = g.t().
    T = 1 if layout == "matrix-transposed" else 5
    shape = (n, n) if layout == "matrix-transposed" else (T, n, n)
    x = random_logits(shape, 0.5, seed=60 + n)
    base = random_logits((T, n, n), 1.0, seed=61 + n).to(device)
    wide = random_logits((T, n, 2 * n), 1.0, seed=62 + n).to(device)
    one = random_logits((1, n, n), 1.0, seed=63 + n).to(device)
    grad = GRAD_LAYOUTS[layout](base, wide, one)
    assert grad.shape == shape and not grad.is_contiguous()
    for backward, iters in (("unrolled", 12), ("implicit", 60)):
        _, ref = loop_reference(x, iters, grad.cpu())
        xg = x.to(device).clone().requires_grad_()
        R = sinkhorn(xg, iters, backward=backward)
        R.backward(grad)
        assert_close(f"{backward} gradient", xg.grad, ref, atol=1e-11, rtol=1e-9)
        if backward == "implicit":
            assert_close("sinkhorn_backward", sinkhorn_backward(R.detach(), grad), ref, atol=1e-11, rtol=1e-9)


def test_permutation_gives_zero_implicit_gradient(device):
    R = torch.eye(4, dtype=torch.float64)[[2, 0, 3, 1]].expand(3, 4, 4).contiguous().to(device)
    g = random_logits((3, 4, 4), 1.0, seed=41).to(device)
    out = sinkhorn_backward(R, g)
    assert bool(torch.isfinite(out).all())
    assert_close("gradient at a permutation", out, torch.zeros(3, 4, 4), atol=1e-15, rtol=0)
