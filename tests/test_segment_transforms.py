"""Segment operations under PyTorch's machinery: eager calls and traced ones, compile,
``torch.func``, ``meta`` tensors and ``FakeTensorMode``, ``torch.library.opcheck`` on every
custom op, autocast, and CPU tensors on a machine whose kernels are compiled for a GPU."""
import contextlib
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import packed_kernels as pk
from packed_kernels import runtime
from packed_kernels.dispatch import Operator
from packed_kernels.ops.segment import api, padded_torch


from assertions import assert_close
from segment_cases import LAUNCHERS, OPS, PADDED, PUBLIC, make_idx, make_inputs


def case_inputs(op, device, dtype=torch.float64, width=3, seed=4):
    """A small layout with an empty segment in the middle and one at the end, and the
    inputs of ``op`` on it."""
    lengths = [3, 0, 4, 1]
    idx = make_idx(lengths, device)
    num_segments = len(lengths) + 1
    inputs = make_inputs(op, idx.shape[0], num_segments, width, dtype, device, seed)
    return inputs, idx, num_segments


def first_and_second(fn, inputs, forward_context=contextlib.nullcontext):
    """The output of ``fn`` (computed under ``forward_context()``), the gradient of
    ``sum(out^2)`` and the gradient of the squared norm of that gradient (a second
    derivative), by autograd."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    with forward_context():
        out = fn(*inputs)
    firsts = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
    seconds = torch.autograd.grad(sum(f.square().sum() for f in firsts), inputs)
    return [out.detach(), *(f.detach() for f in firsts), *seconds]


# --- eager calls and traced calls ------------------------------------------------------------

def test_eager_calls_take_the_autograd_functions_and_traced_calls_the_custom_operators(device):
    """Eager calls (every derivative order) run as ``autograd.Function``s, with less host
    work; a call under a dispatch mode, as in ``torch.compile``'s tracing, takes the
    custom operator, and its backward formulas call custom operators too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    idx = make_idx([2, 0, 3], device)
    x = torch.randn(5, 3, dtype=torch.float64).to(device).requires_grad_()
    out = pk.segmented_mean(x, idx, 3)
    assert "Eager_segment_mean" in type(out.grad_fn).__name__
    (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    assert "Eager_segment_gather_over_count" in type(grad.grad_fn).__name__

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    (second,) = torch.autograd.grad(grad.square().sum(), x)
    with Recorder() as seen:
        traced = pk.segmented_mean(x, idx, 3)
        (traced_grad,) = torch.autograd.grad(traced.square().sum(), x, create_graph=True)
        (traced_second,) = torch.autograd.grad(traced_grad.square().sum(), x)
    assert any("packed_kernels.segment_mean" in op for op in seen.ops), seen.ops
    assert any("packed_kernels.segment_gather_over_count" in op for op in seen.ops), seen.ops
    assert torch.equal(traced, out)
    assert torch.equal(traced_grad, grad)
    assert torch.equal(traced_second, second)


def test_mean_writes_counts_only_for_autograd(device):
    """The row counts that mean's gradient divides by are written only when autograd can
    ask for them; the mean itself is the same bitwise either way, and gradients of every
    order (the third one divides by counts written inside the second) match autograd
    through the padded stage in float64."""
    lengths = [3, 0, 6, 1, 9]
    idx = make_idx(lengths, device)
    S = len(lengths) + 1
    x = torch.randn(idx.shape[0], 3, dtype=torch.float64).to(device)
    out, counts = api.segment_mean_op(x, idx, S, False, None)
    assert counts.numel() == 0
    out_counted, counts = api.segment_mean_op(x, idx, S, True, None)
    assert torch.equal(out, out_counted)
    assert counts.tolist() == lengths + [0]
    assert torch.equal(pk.segmented_mean(x, idx, S), out)
    with torch.no_grad():
        assert torch.equal(pk.segmented_mean(x.clone().requires_grad_(), idx, S), out)

    gen = torch.Generator().manual_seed(1)
    g0 = torch.randn(S, 3, dtype=torch.float64, generator=gen).to(device)
    v0 = torch.randn(x.shape, dtype=torch.float64, generator=gen).to(device)

    def third_order(mean, x):
        x, g, v = (t.clone().requires_grad_() for t in (x, g0, v0))
        first = torch.autograd.grad(mean(x, idx, S), x, g, create_graph=True)[0]
        second = torch.autograd.grad(first, g, v, create_graph=True)[0]
        third = torch.autograd.grad(second, v, torch.ones_like(second))[0]
        return first, second, third

    derivatives = zip(third_order(pk.segmented_mean, x), third_order(padded_torch.segmented_mean_padded, x))
    for k, (a, b) in enumerate(derivatives):
        assert_close(f"mean derivative {k + 1}", a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("op, idx_dtype", [pytest.param(op, torch.int32, id=op) for op in OPS]
                         + [pytest.param("mean", torch.int64, id="mean-idx64")])
def test_compile_fullgraph_forward_and_backward_match_eager(op, idx_dtype, device):
    torch._dynamo.reset()
    width = 3
    lengths = [4, 0, 7, 2]
    idx = make_idx(lengths, device).to(idx_dtype)
    num_segments = 5
    inputs = [t.requires_grad_() for t in make_inputs(op, idx.shape[0], num_segments, width,
                                                      torch.float64, device, seed=5)]

    def step(*args):
        out = PUBLIC[op](*args, idx, num_segments)
        return (out * out).sum()

    # aot_eager traces forward and backward exactly as inductor does (the custom operators
    # stay opaque); inductor's code generation is exercised on the GPU for two ops.
    backend = "inductor" if (not runtime.INTERPRETED and op in ("sum", "matvec")) else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    eager_loss = step(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs)
    assert_close(f"{op} compiled loss", loss, eager_loss, atol=1e-12, rtol=1e-12)
    for k, (a, b) in enumerate(zip(grads, eager_grads)):
        assert_close(f"{op} compiled d/input{k}", a, b, atol=1e-12, rtol=1e-12)



def test_calls_without_gradients_skip_the_autograd_function(device, monkeypatch):
    """With gradients off (``no_grad``, and a backward that builds no graph), or no input
    that requires a gradient, an operator runs its implementation alone; with gradients on
    and an input that requires one (``create_graph=True`` and a cotangent that requires a
    gradient), its ``autograd.Function``. Same results either way."""
    inputs, idx, S = case_inputs("sum", device)
    x = inputs[0].requires_grad_()
    want = padded_torch.segmented_sum_padded(x.detach(), idx, S)

    class Refused:
        @staticmethod
        def apply(*args):
            raise AssertionError("autograd.Function applied")

    monkeypatch.setattr(api.segment_gather_op, "eager", Refused)
    with torch.no_grad():
        assert_close("sum without grad", api.segment_sum_op(x, idx, S, None), want, atol=1e-12, rtol=1e-12)
    out = pk.segmented_sum(x, idx, S)
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, x, grad_out)  # the backward's gather: no graph, no Function
    assert_close("d/dx", grad, grad_out[idx], atol=0, rtol=0)
    (grad,) = torch.autograd.grad(pk.segmented_sum(x, idx, S), x, grad_out, create_graph=True)
    assert_close("d/dx, a cotangent without a gradient", grad, grad_out[idx], atol=0, rtol=0)
    with pytest.raises(AssertionError, match="autograd.Function applied"):
        torch.autograd.grad(pk.segmented_sum(x, idx, S), x, grad_out.requires_grad_(), create_graph=True)


def test_mean_backward_counts_the_rows_when_the_forward_did_not(device):
    """A ``mean`` whose forward skipped the row counts (``with_counts=False``, as a tracer
    or opcheck may call it) is still differentiable, to second order, on every path: the
    eager operator, the custom op and under ``torch.func.grad``; against the padded stage."""
    idx = make_idx([3, 0, 6, 1], device)
    S = 5
    x = torch.randn(idx.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    want = first_and_second(lambda t: padded_torch.segmented_mean_padded(t, idx, S), [x])
    for label, mean in (("eager", api.segment_mean_op), ("custom op", api.segment_mean_op.custom_op)):
        got = first_and_second(lambda t: mean(t, idx, S, False, None)[0], [x])
        for k, (a, b) in enumerate(zip(got, want)):
            assert_close(f"mean without counts, {label}, result {k}", a, b, atol=1e-12, rtol=1e-12)

    def loss(t):
        return api.segment_mean_op(t, idx, S, False, None)[0].square().sum()

    (first,) = torch.autograd.grad(padded_torch.segmented_mean_padded(x.requires_grad_(), idx, S).square().sum(), x)
    assert_close("torch.func.grad of mean without counts", torch.func.grad(loss)(x.detach()), first,
                 atol=1e-12, rtol=1e-12)


# --- torch.func ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_torch_func_grad_first_and_second_order(op, device):
    """``torch.func.grad`` of a scalar of each operation, and ``grad`` of a scalar of that
    gradient (second order), for every differentiable input, against autograd through the
    padded stage in float64."""
    inputs, idx, S = case_inputs(op, device)
    argnums = tuple(range(len(inputs)))

    def loss(fn):
        return lambda *args: fn(*args, idx, S).square().sum()

    def gradient_norm(fn):
        return lambda *args: sum(g.square().sum() for g in torch.func.grad(loss(fn), argnums)(*args))

    reference = first_and_second(lambda *args: PADDED[op](*args, idx, S), inputs)[1:]
    got = [*torch.func.grad(loss(PUBLIC[op]), argnums)(*inputs),
           *torch.func.grad(gradient_norm(PUBLIC[op]), argnums)(*inputs)]
    for k, (a, b) in enumerate(zip(got, reference)):
        order = "first" if k < len(inputs) else "second"
        assert_close(f"{op} torch.func {order} derivative #{k % len(inputs)}", a, b, atol=1e-11, rtol=1e-10)


@pytest.mark.parametrize("op", OPS)
def test_torch_func_jvp_first_and_second_order(op, device):
    """Forward mode: ``torch.func.jvp`` of each operation with a tangent for every input,
    and ``jvp`` of that ``jvp`` (forward over forward, second order), against the padded
    stage's. (``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``: test_segment_vmap.)"""
    inputs, idx, S = case_inputs(op, device)
    gen = torch.Generator().manual_seed(9)
    tangents = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype).to(device) for t in inputs)
    others = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype).to(device) for t in inputs)

    def derivatives(fn):
        def first(*args):
            return torch.func.jvp(lambda *a: fn(*a, idx, S), args, tangents)[1]
        return first(*inputs), torch.func.jvp(first, tuple(inputs), others)[1]

    for order, a, b in zip(("first", "second"), derivatives(PUBLIC[op]), derivatives(PADDED[op])):
        assert_close(f"{op} jvp, {order} order", a, b, atol=1e-11, rtol=1e-10)


def test_idx_check_reads_plain_tensors_under_torch_func(device):
    """The check of ``idx`` is a kernel too: under ``torch.func.grad`` (and ``grad`` of
    ``grad``) an ``idx`` made inside the transform is a wrapper without storage, which it
    must still read; a good one reports nothing, a bad one its violation."""
    idx = make_idx([2, 0, 3, 1], device)
    x = torch.randn(idx.shape[0], dtype=torch.float64, device=device)

    def loss(x, shift=0):
        inner = idx + torch.zeros_like(idx) + shift  # made inside the transform: a wrapper
        return pk.segmented_sum(x, inner, 4).square().sum() + pk.segmented_sum(x, idx, 4).square().sum()

    want = 4 * padded_torch.segmented_sum_padded(x, idx, 4)[idx]
    assert_close("grad", torch.func.grad(loss)(x), want, atol=1e-12, rtol=1e-12)
    assert_close("grad of grad", torch.func.grad(lambda t: torch.func.grad(loss)(t).sum())(x), 4 * torch.tensor(
        [2.0, 2.0, 3.0, 3.0, 3.0, 1.0], dtype=torch.float64, device=device), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=re.escape("segmented_sum: idx must lie in [0, num_segments)")):
        torch.func.grad(lambda t: loss(t, shift=1))(x)
        pk.check_errors()


def test_torch_func_vjp(device):
    """``torch.func.vjp`` of ``matvec`` (both inputs) against autograd of the padded stage."""
    (v, m), idx, S = case_inputs("matvec", device)
    out, pullback = torch.func.vjp(lambda a, b: pk.segmented_matvec(a, b, idx, S), v, m)
    cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(8)).to(device)
    wide = [v.clone().requires_grad_(), m.clone().requires_grad_()]
    want = torch.autograd.grad(padded_torch.segmented_matvec_padded(*wide, idx, S), wide, cotangent)
    for k, (a, b) in enumerate(zip(pullback(cotangent), want)):
        assert_close(f"matvec vjp #{k}", a, b, atol=1e-12, rtol=1e-12)


# --- meta tensors and FakeTensorMode ------------------------------------------------------

SHAPE_CASES = [pytest.param(op, width, id=f"{op}-{'scalar' if width is None else f'D{width}'}")
               for op in OPS for width in (None, 3) if width is not None or op not in ("matvec", "mul_broadcast")]


def _shapes(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("op, width", SHAPE_CASES)
def test_meta_tensors_infer_shapes_and_dtypes(op, width, device):
    """On ``meta`` tensors (int32 and int64 ``idx``, float32 inputs or bfloat16 with
    float32) the output and the gradients of both orders have the shapes and dtypes of
    the real call's, without a kernel."""
    inputs, idx, S = case_inputs(op, device, torch.float32, width)
    dtypes = [(torch.float32,) * len(inputs)] + ([(torch.bfloat16, torch.float32)] if len(inputs) == 2 else [])
    for dtypes_of_inputs in dtypes:
        typed = [t.to(dtype) for t, dtype in zip(inputs, dtypes_of_inputs)]
        real = first_and_second(lambda *args: PUBLIC[op](*args, idx, S), typed)
        for segment_ids in (idx, idx.long()):
            meta = first_and_second(lambda *args: PUBLIC[op](*args, segment_ids.to("meta"), S),
                                    [t.to("meta") for t in typed])
            assert all(t.is_meta for t in meta)
            assert _shapes(meta) == _shapes(real), (dtypes_of_inputs, segment_ids.dtype)


@pytest.mark.parametrize("op", OPS)
def test_fake_tensor_mode_infers_shapes_and_dtypes(op, device):
    """Under ``FakeTensorMode`` the output and first derivatives have the real call's
    shapes and dtypes (int64 ``idx``; the host value checks are skipped)."""
    inputs, idx, S = case_inputs(op, device, torch.float32)
    real = first_and_second(lambda *args: PUBLIC[op](*args, idx, S), inputs)
    idx64 = idx.long()
    with FakeTensorMode() as mode:
        fake_inputs = [mode.from_tensor(t) for t in inputs]
        fake_idx = mode.from_tensor(idx64)
        out = PUBLIC[op](*[t.requires_grad_() for t in fake_inputs], fake_idx, S)
        firsts = torch.autograd.grad(out.square().sum(), fake_inputs)
    assert _shapes([out, *firsts]) == _shapes(real[:1 + len(inputs)])


# --- torch.library.opcheck ---------------------------------------------------------------------

def _opcheck_cases(device):
    """Small arguments of every custom op of the segment operations (the backward ones
    included), by name; inputs that the op differentiates require grad."""
    gen = torch.Generator().manual_seed(6)
    idx = make_idx([2, 3, 0, 1], device)
    S = 4

    def rand(*shape, grad=True):
        return torch.randn(shape, dtype=torch.float64, generator=gen).to(device).requires_grad_(grad)

    x = rand(6, 3, grad=False)
    r, counts = api.segment_rms_op(x, idx, S, None)  # a consistent (r, counts): r = 0 where empty
    return {
        "sum": (api.segment_sum_op, (rand(6, 3), idx, S, None)),
        "gather": (api.segment_gather_op, (rand(S, 3), idx, None)),
        "mean-with-counts": (api.segment_mean_op, (rand(6, 3), idx, S, True, None)),
        "mean-without-counts": (api.segment_mean_op, (rand(6, 3), idx, S, False, None)),
        "gather_over_count": (api.segment_gather_over_count_op, (rand(S, 3), idx, counts, None)),
        # sum, mean and their adjoints take one-dimensional rows too
        "sum-1d": (api.segment_sum_op, (rand(6), idx, S, None)),
        "gather-1d": (api.segment_gather_op, (rand(S), idx, None)),
        "mean-1d": (api.segment_mean_op, (rand(6), idx, S, True, None)),
        "gather_over_count-1d": (api.segment_gather_over_count_op, (rand(S), idx, counts, None)),
        "dot-rowwise": (api.segment_dot_op, (rand(6, 3), rand(6, 3), idx, S, True, None)),
        "dot-columns": (api.segment_dot_op, (rand(6, 3), rand(6, 3), idx, S, False, None)),
        "scale_rows": (api.segment_scale_rows_op, (rand(6, 3), rand(S, 3), idx, None)),
        "scale_rows-broadcast": (api.segment_scale_rows_op, (rand(6, 3), rand(S, 1), idx, None)),
        "rms": (api.segment_rms_op, (rand(6, 3), idx, S, None)),
        "rms_backward": (api.segment_rms_backward_op,
                         (rand(S, 1), x.clone().requires_grad_(), r.clone().requires_grad_(), counts, idx, None)),
        # not differentiable itself (rms_norm is differentiable twice)
        "rms_double_backward": (api.segment_rms_double_backward_op, (rand(S, 1, grad=False), rand(S, 1, grad=False),
                                                                     r, counts)),
        "matvec": (api.segment_matvec_op, (rand(6, 3), rand(S, 3, 2), idx, False, None)),
        "matvec-transposed": (api.segment_matvec_op, (rand(6, 2), rand(S, 3, 2), idx, True, None)),
        "outer": (api.segment_outer_op, (rand(6, 3), rand(6, 2), idx, S, None)),
        # not differentiable: the checked int32 idx (the codes are those of segmented_sum)
        "check_idx": (api.segment_check_idx_op, (idx.long(), S, *(c.code for c in api._idx_checks("segmented_sum")))),
    }


OPCHECK_CASES = ["sum", "gather", "mean-with-counts", "mean-without-counts", "gather_over_count", "sum-1d",
                 "gather-1d", "mean-1d", "gather_over_count-1d", "dot-rowwise",
                 "dot-columns", "scale_rows", "scale_rows-broadcast", "rms", "rms_backward", "rms_double_backward",
                 "matvec", "matvec-transposed", "outer", "check_idx"]


def test_opcheck_covers_every_segment_custom_op(device):
    cases = _opcheck_cases(device)
    assert list(cases) == OPCHECK_CASES
    checked = {op.qualified_name for op, _ in cases.values()}
    registered = {op.qualified_name for op in vars(api).values() if isinstance(op, Operator)}
    assert checked == registered and len(registered) == 12


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, device):
    op, args = _opcheck_cases(device)[case]
    torch.library.opcheck(op.custom_op, args)


# --- autocast -------------------------------------------------------------------------------

@contextlib.contextmanager
def _kernel_device_is_cuda(monkeypatch):
    """CPU tensors as on a machine with a GPU: they take the padded stage, and a kernel
    launch would fail the test."""
    from packed_kernels.ops.segment import triton_kernels as tk

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for a tensor the kernels do not take")

    with monkeypatch.context() as patch:
        patch.setattr(runtime, "KERNEL_DEVICE", "cuda")
        for name in LAUNCHERS:
            patch.setattr(tk, name, refuse)
        yield


@pytest.mark.parametrize("op", ["sum", "mean", "dot", "mul", "rms_norm", "matvec"])
def test_autocast_leaves_the_operations_alone(op, device, monkeypatch):
    """A forward under ``torch.autocast`` to bfloat16 (the backward outside, as PyTorch
    recommends) computes, as ``index_add`` and ``scatter_add`` do, in the inputs' dtype:
    bitwise the result and gradients of the call without autocast, on the kernels, on
    the padded stage (CPU tensors on a GPU machine, where ``matvec``'s ``einsum`` would
    be autocast) and under ``FakeTensorMode`` (the custom ops)."""
    inputs, idx, S = case_inputs(op, device, torch.float32)
    want = first_and_second(lambda *args: PUBLIC[op](*args, idx, S), inputs)
    got = first_and_second(lambda *args: PUBLIC[op](*args, idx, S), inputs,
                           lambda: torch.autocast(device, dtype=torch.bfloat16))
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.float32 and torch.equal(a, b), f"{op} under autocast: result {k}"
    with torch.autocast(device, dtype=torch.bfloat16), FakeTensorMode() as mode:
        fake = PUBLIC[op](*[mode.from_tensor(t) for t in inputs], mode.from_tensor(idx), S)
    assert fake.dtype == torch.float32

    cpu_inputs = [t.cpu() for t in inputs]
    cpu_want = first_and_second(lambda *args: PADDED[op](*args, idx.cpu(), S), cpu_inputs)
    with _kernel_device_is_cuda(monkeypatch):
        cpu_got = first_and_second(lambda *args: PUBLIC[op](*args, idx.cpu(), S), cpu_inputs,
                                   lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for k, (a, b) in enumerate(zip(cpu_got, cpu_want)):
        assert a.dtype == torch.float32 and torch.equal(a, b), f"{op} padded stage under autocast: result {k}"


# --- CPU tensors on a machine with a GPU ----------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_cpu_tensors_on_a_gpu_machine_take_the_padded_stage(op, device, monkeypatch):
    """With the kernels compiled for the GPU, CPU tensors are computed by the padded
    PyTorch stage, launching no kernel: the kernels' result and derivatives of both
    orders in float64 (int64 idx), the kernels' dtype and result in bfloat16 (computed in
    float32), and inputs of two dtypes promoted."""
    inputs, idx, S = case_inputs(op, device)
    want = first_and_second(lambda *args: PUBLIC[op](*args, idx, S), inputs)
    low = [t.to(torch.bfloat16) for t in inputs]
    want_low = PUBLIC[op](*low, idx, S)
    cpu, cpu_low = [t.cpu() for t in inputs], [t.cpu() for t in low]
    with _kernel_device_is_cuda(monkeypatch):
        got = first_and_second(lambda *args: PUBLIC[op](*args, idx.cpu().long(), S), cpu)
        got_low = PUBLIC[op](*cpu_low, idx.cpu(), S)
        mixed = PUBLIC[op](cpu[0].to(torch.bfloat16), *cpu[1:], idx.cpu(), S) if len(cpu) == 2 else None
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(f"{op} padded stage for CPU tensors, result {k}", a, b, atol=1e-12, rtol=1e-10)
    assert got_low.dtype == torch.bfloat16
    # computed in float32 and rounded once, as the kernels do
    assert torch.equal(got_low, PADDED[op](*[t.float() for t in cpu_low], idx.cpu(), S).to(torch.bfloat16))
    assert_close(f"{op} padded stage for CPU tensors in bfloat16", got_low, want_low, atol=1e-2, rtol=1e-2)
    if mixed is not None:
        assert mixed.dtype == torch.float64
        assert_close(f"{op} padded stage, bfloat16 with float64", mixed,
                     PADDED[op](cpu[0].to(torch.bfloat16).double(), cpu[1], idx.cpu(), S), atol=1e-12, rtol=1e-12)
