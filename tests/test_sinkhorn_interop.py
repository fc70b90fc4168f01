"""Sinkhorn beyond the kernels' own calls: the padded PyTorch stage in their place (``n``
above the kernels', CPU tensors on a machine whose kernels are compiled for the GPU,
many unrolled iterations), shape inference (``meta`` tensors, ``FakeTensorMode``), the
custom ops (``torch.library.opcheck``, ``torch.compile``), ``torch.func.grad``,
autocast, and the docstring examples."""
import doctest

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from packed_kernels import runtime, sinkhorn, sinkhorn_backward
from packed_kernels.ops.sinkhorn import api, padded_torch, triton_kernels

from assertions import assert_close
from sinkhorn_cases import birkhoff, implicit_reference, loop_reference, random_logits, shape_id

BACKWARDS = ["implicit", "unrolled"]
LARGE_N = triton_kernels.MAX_KERNEL_N + 1
DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _as_on_a_gpu_machine(monkeypatch):
    """From here on the kernels are compiled for the GPU, as on a machine with one: CPU
    tensors are not theirs, and a CPU tensor that reaches a launcher fails the test."""
    monkeypatch.setattr(runtime, "KERNEL_DEVICE", "cuda")

    def launcher(*args, **kwargs):
        raise AssertionError("a CPU tensor reached a kernel launcher")

    for name in ("sinkhorn_forward_triton", "sinkhorn_implicit_backward_triton", "sinkhorn_unrolled_backward_triton"):
        monkeypatch.setattr(api, name, launcher)


def _forward_and_grad(x, iters, backward, grad_R, **kwargs):
    x = x.detach().clone().requires_grad_()
    R = sinkhorn(x, iters, backward=backward, **kwargs)
    R.backward(grad_R)
    return R.detach(), x.grad


# --------------------------------------------------------------------------- the padded stage in the kernels' place


@pytest.mark.parametrize("backward", BACKWARDS)
def test_large_n_uses_padded_stage(device, backward):
    x = random_logits((2, LARGE_N, LARGE_N), 1.0, seed=51).to(device)
    g = random_logits((2, LARGE_N, LARGE_N), 1.0, seed=52).to(device)
    _, grad = _forward_and_grad(x, 5, backward, g)
    if backward == "unrolled":
        _, ref = loop_reference(x, 5, g)
    else:
        ref = padded_torch.implicit_backward_padded(padded_torch.sinkhorn_padded(x.cpu(), 5), g.cpu())
    assert_close(f"n={LARGE_N} {backward}", grad, ref, atol=1e-10, rtol=1e-8)


def test_many_unrolled_iterations_use_padded_stage(device):
    iters = triton_kernels.MAX_UNROLLED_ITERS + 1
    x = random_logits((3, 3, 3), 1.0, seed=55).to(device)
    g = random_logits((3, 3, 3), 1.0, seed=56).to(device)
    _, grad = _forward_and_grad(x, iters, "unrolled", g)
    _, ref = loop_reference(x, iters, g)
    assert_close(f"unrolled, {iters} iterations", grad, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("backward", BACKWARDS)
def test_cpu_tensors_on_a_gpu_machine_run_the_padded_stage(monkeypatch, device, backward, dtype):
    # The kernels' results on their device first, then the same inputs as CPU tensors on
    # a machine whose kernels are compiled for the GPU.
    x = random_logits((2, 5, 4, 4), 2.0, seed=61, dtype=dtype)
    g = random_logits((2, 5, 4, 4), 1.0, seed=62, dtype=dtype)
    kernel_R, kernel_grad = _forward_and_grad(x.to(device), 12, backward, g.to(device))
    _as_on_a_gpu_machine(monkeypatch)
    R, grad = _forward_and_grad(x, 12, backward, g)
    assert R.device.type == "cpu" and R.dtype == dtype and grad.dtype == dtype
    if dtype == torch.bfloat16:
        # computed in float32 as the kernels compute it: at most one bfloat16 rounding apart
        assert_close("R", R, kernel_R, atol=0, rtol=2 ** -7)
        assert_close("grad", grad, kernel_grad, atol=2e-2, rtol=2e-2)
    else:
        tol = dict(atol=1e-13, rtol=1e-11) if dtype == torch.float64 else dict(atol=2e-6, rtol=1e-5)
        assert_close("R", R, kernel_R, **tol)
        assert_close("grad", grad, kernel_grad, **{k: v * 10 for k, v in tol.items()})
    if dtype == torch.float64 and backward == "unrolled":
        ref_R, ref_grad = loop_reference(x, 12, g)
        assert_close("R vs loop", R, ref_R, atol=1e-13, rtol=1e-12)
        assert_close("grad vs loop", grad, ref_grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=DTYPE_NAMES.get)
def test_sinkhorn_backward_of_cpu_tensors_on_a_gpu_machine(monkeypatch, device, dtype):
    R = birkhoff(5, 6, seed=63).to(dtype).requires_grad_()  # the result is not differentiable all the same
    g = random_logits((6, 5, 5), 1.0, seed=64, dtype=dtype)
    kernel = sinkhorn_backward(R.to(device), g.to(device))
    _as_on_a_gpu_machine(monkeypatch)
    got = sinkhorn_backward(R, g)
    assert got.device.type == "cpu" and got.dtype == dtype
    assert not kernel.requires_grad and not got.requires_grad
    tol = dict(atol=1e-10, rtol=1e-8) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    assert_close("vs kernel", got, kernel, **tol)
    assert_close("vs least squares", got, implicit_reference(R, g), **tol)


# --------------------------------------------------------------------------- shape inference

SHAPE_CASES = [
    ((2, 3, 4, 4), "implicit", None, torch.float32),
    ((5, 3, 3), "unrolled", None, torch.bfloat16),
    ((2, 5, 5), "implicit", 10, torch.float64),
    ((2, LARGE_N, LARGE_N), "implicit", None, torch.float32),
    ((0, 2, 2), "unrolled", None, torch.float16),
]


def _shape_case_id(case):
    shape, backward, cg_iters, dtype = case
    return f"{shape_id(shape)}-{backward}-cg{cg_iters}-{DTYPE_NAMES[dtype]}"


@pytest.mark.parametrize("case", SHAPE_CASES, ids=_shape_case_id)
def test_meta_tensors_and_fake_tensors_give_the_real_shapes_and_dtypes(device, case):
    shape, backward, cg_iters, dtype = case
    x = random_logits(shape, 1.0, seed=71, dtype=dtype).to(device)
    g = random_logits(shape, 1.0, seed=72, dtype=dtype).to(device)
    R, grad = _forward_and_grad(x, 3, backward, g, cg_iters=cg_iters)
    standalone = sinkhorn_backward(R, g, cg_iters=cg_iters)

    meta_R, meta_grad = _forward_and_grad(x.to("meta"), 3, backward, g.to("meta"), cg_iters=cg_iters)
    meta_standalone = sinkhorn_backward(R.to("meta"), g.to("meta"), cg_iters=cg_iters)
    for name, real, meta in (("R", R, meta_R), ("grad", grad, meta_grad), ("sinkhorn_backward", standalone,
                                                                            meta_standalone)):
        assert meta.is_meta, name
        assert (meta.shape, meta.dtype) == (real.shape, real.dtype), name

    with FakeTensorMode() as mode:
        fake_x, fake_g, fake_R = (mode.from_tensor(t) for t in (x, g, R))
        fake_R_out, fake_grad = _forward_and_grad(fake_x, 3, backward, fake_g, cg_iters=cg_iters)
        fake_standalone = sinkhorn_backward(fake_R, fake_g, cg_iters=cg_iters)
    for name, real, fake in (("R", R, fake_R_out), ("grad", grad, fake_grad), ("sinkhorn_backward", standalone,
                                                                                fake_standalone)):
        assert isinstance(fake, FakeTensor), name
        assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device), name


# --------------------------------------------------------------------------- custom ops


def _opcheck_cases():
    x3 = random_logits((5, 3, 3), 1.0, seed=81)
    x4 = random_logits((5, 4, 4), 1.0, seed=82, dtype=torch.float32)
    g3 = random_logits((5, 3, 3), 1.0, seed=83)
    g4 = random_logits((5, 4, 4), 1.0, seed=84, dtype=torch.float32)
    R3, R4 = padded_torch.sinkhorn_padded(x3, 30), padded_torch.sinkhorn_padded(x4, 30)
    # (op, arguments): -1 selects the direct solve; the forward's logits require grad,
    # so that opcheck also runs its registered backward
    return {
        "forward-n3-f64-implicit-direct": ("sinkhorn_forward", (x3.requires_grad_(), 4, False, -1)),
        "forward-n4-f32-implicit-cg8": ("sinkhorn_forward", (x4.clone().requires_grad_(), 4, False, 8)),
        "forward-n4-f32-unrolled": ("sinkhorn_forward", (x4.clone().requires_grad_(), 4, True, -1)),
        "implicit-n3-f64-direct": ("sinkhorn_implicit_backward", (R3, g3, -1)),
        "implicit-n4-f32-cg8": ("sinkhorn_implicit_backward", (R4, g4, 8)),
        "unrolled-n4-f32-it4": ("sinkhorn_unrolled_backward", (x4, g4, 4)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(device, case):
    name, arguments = _opcheck_cases()[case]
    arguments = tuple(a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                      for a in arguments)
    op = getattr(torch.ops.packed_kernels, name).default
    torch.library.opcheck(op, arguments)


@pytest.mark.parametrize("backward", BACKWARDS)
def test_torch_compile_fullgraph(device, backward):
    x = random_logits((5, 4, 4), 2.0, seed=91, dtype=torch.float32).to(device)
    g = random_logits((5, 4, 4), 1.0, seed=92, dtype=torch.float32).to(device)

    def f(t):
        return (sinkhorn(t * 1.5, 10, backward=backward) * g).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    xe = x.clone().requires_grad_()
    compiled(xc).backward()
    f(xe).backward()
    assert_close("compiled grad", xc.grad, xe.grad, atol=0, rtol=0)


# --------------------------------------------------------------------------- torch.func, autocast

PATHS = ["kernels", "large-n", "cpu-on-gpu"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backward", BACKWARDS)
def test_func_grad(monkeypatch, device, path, backward):
    n, T = (LARGE_N, 2) if path == "large-n" else (4, 6)
    x = random_logits((T, n, n), 1.0, seed=101 + n)
    g = random_logits((T, n, n), 1.0, seed=102 + n)
    if backward == "unrolled":
        iters = 7
        _, ref = loop_reference(x, iters, g)
    else:
        iters = 100  # converged: the implicit gradient is the gradient of the limit
        R_ref, _ = loop_reference(x, iters)
        assert float((R_ref.sum(-2) - 1).abs().max()) < 1e-13
        ref = implicit_reference(R_ref, g)
    if path == "cpu-on-gpu":
        _as_on_a_gpu_machine(monkeypatch)
    else:
        x, g = x.to(device), g.to(device)
    grad = torch.func.grad(lambda t: (sinkhorn(t, iters, backward=backward) * g).sum())(x)
    assert_close(f"torch.func.grad {backward} ({path})", grad, ref, atol=1e-11, rtol=1e-9)


AUTOCAST_CASES = [(path, backward) for path in PATHS for backward in BACKWARDS] + [("many-iters", "unrolled")]


@pytest.mark.parametrize("path,backward", AUTOCAST_CASES, ids=lambda v: str(v))
def test_autocast_changes_nothing(monkeypatch, device, path, backward):
    # No PyTorch op computes Sinkhorn, so autocast has no precedent to follow: the
    # result keeps the input's dtype and bits, on every path.
    n = LARGE_N if path == "large-n" else 4
    iters = triton_kernels.MAX_UNROLLED_ITERS + 1 if path == "many-iters" else 10
    x = random_logits((3, n, n), 2.0, seed=111, dtype=torch.float32)
    g = random_logits((3, n, n), 1.0, seed=112, dtype=torch.float32)
    if path == "cpu-on-gpu":
        _as_on_a_gpu_machine(monkeypatch)
    else:
        x, g = x.to(device), g.to(device)
    R, grad = _forward_and_grad(x, iters, backward, g)
    standalone = sinkhorn_backward(R, g)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        R_autocast, grad_autocast = _forward_and_grad(x, iters, backward, g)
        standalone_autocast = sinkhorn_backward(R, g)
    for name, plain, autocast in (("R", R, R_autocast), ("grad", grad, grad_autocast),
                                  ("sinkhorn_backward", standalone, standalone_autocast)):
        assert autocast.dtype == torch.float32, name
        assert torch.equal(autocast, plain), name


# --------------------------------------------------------------------------- documentation


@pytest.mark.parametrize("function", [sinkhorn, sinkhorn_backward], ids=lambda f: f.__name__)
def test_docstring_example_runs(function):
    (example,) = doctest.DocTestFinder().find(function, function.__name__, globs={})
    assert example.examples, f"{function.__name__} has no Example"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(example)
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} example lines of {function.__name__} failed"
