"""CTC loss with the rest of PyTorch: its custom ops under ``torch.library.opcheck``,
``torch.func.grad``, ``meta`` tensors and ``FakeTensorMode``, autocast, ``torch.compile``,
CUDA graphs, CPU tensors on a machine whose kernels are compiled for a GPU (the padded
PyTorch stage), and the docstring's example.

References: ``torch.nn.functional.ctc_loss`` on the padded batch, the float64 NumPy stage,
autograd, and the kernels' own result where a test checks that another path gives the same.
"""
from __future__ import annotations

import contextlib
import doctest
import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import packed_kernels as pk
from packed_kernels import runtime
from packed_kernels.ops.ctc import api as ctc_api
from tests.assertions import assert_close
from tests.test_ctc import make_batch, run_numpy, run_packed
from tests.test_ctc_inputs import BAD_INPUTS, good_arguments


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def _no_kernel(*args, **kwargs):
    raise AssertionError("a CTC kernel was launched for tensors the kernels do not take")


@contextlib.contextmanager
def kernels_compiled_for_the_gpu():
    """As on a machine whose kernels are compiled for a GPU: CPU tensors are not theirs, so
    they take the padded PyTorch stage. The launchers raise, so a kernel cannot stand in."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "KERNEL_DEVICE", "cuda")
        patch.setattr(ctc_api, "ctc_forward_triton", _no_kernel)
        patch.setattr(ctc_api, "ctc_backward_triton", _no_kernel)
        yield


def _arguments(batch, x, **kwargs):
    return (x, batch.cu_seqlens, batch.targets, batch.target_lengths), kwargs


def _on(batch, device):
    """``batch`` with every tensor on ``device``."""
    return type(batch)(*(getattr(batch, f).to(device) for f in
                         ("logits", "cu_seqlens", "input_lengths", "targets", "target_lengths")))


# --------------------------------------------------------------------------------------
# the custom ops


def _opcheck_batch(device):
    """Targets shorter than U, an empty target and a zero-frame utterance: the forward must
    still write every entry of what it returns (states beyond a target are -inf)."""
    return make_batch([7, 0, 6, 4], 6, [3, 0, 1, 2], 4, seed=71, labels=[[1, 1, 2], [], [5], [3, 3]],
                      device=device)


OPCHECK_OPTIONS = [("none", False), ("mean", True), ("sum", False)]
OPCHECK_IDS = [f"{reduction}-zero_infinity{zero_infinity}" for reduction, zero_infinity in OPCHECK_OPTIONS]


@pytest.mark.parametrize("reduction, zero_infinity", OPCHECK_OPTIONS[:2], ids=OPCHECK_IDS[:2])
def test_opcheck_ctc_loss(device, reduction, zero_infinity):
    """``packed_kernels::ctc_loss``: schema, fake implementation, autograd formula, and eager
    against AOTAutograd (which traces the backward op as well)."""
    batch = _opcheck_batch(device)
    x = batch.log_probs.float().detach().requires_grad_()
    torch.library.opcheck(torch.ops.packed_kernels.ctc_loss.default,
                          (x, batch.cu_seqlens, batch.targets, batch.target_lengths, 0, reduction, zero_infinity))


@pytest.mark.parametrize("reduction, zero_infinity, dtype", [
    (*options, dtype) for options, dtype in zip(OPCHECK_OPTIONS, (torch.float32, torch.float32, torch.bfloat16))],
    ids=[f"{name}-{_dtype_name(dtype)}" for name, dtype in zip(OPCHECK_IDS, (torch.float32, torch.float32,
                                                                          torch.bfloat16))])
def test_opcheck_ctc_loss_backward(device, reduction, zero_infinity, dtype):
    """``packed_kernels::ctc_loss_backward`` on what the forward op saves for it (its fake
    gradient has the dtype of ``log_probs``: autograd would cast a wrong one silently)."""
    batch = _opcheck_batch(device)
    x = batch.log_probs.to(dtype).detach()
    arguments = (x, batch.cu_seqlens, batch.targets, batch.target_lengths)
    loss, nll, *saved = torch.ops.packed_kernels.ctc_loss.default(*arguments, 0, reduction, zero_infinity)
    if nll.numel() == 0:  # the loss is the per-utterance losses themselves
        nll = loss
    grad_loss = torch.linspace(0.5, 2.0, loss.numel(), device=device).reshape(loss.shape)
    torch.library.opcheck(torch.ops.packed_kernels.ctc_loss_backward.default,
                          (grad_loss, *arguments, nll, *saved, 0, reduction, zero_infinity))


def test_forward_op_writes_every_entry(device):
    """The alpha/beta state beyond each target (``s > 2L``) is -inf, not whatever memory held,
    and two calls return bitwise the same outputs."""
    batch = _opcheck_batch(device)
    arguments = (batch.log_probs.float(), batch.cu_seqlens, batch.targets, batch.target_lengths, 0, "none", False)
    first = torch.ops.packed_kernels.ctc_loss.default(*arguments)
    state = first[2]
    S = 2 * batch.targets.shape[1] + 1
    for b, L in enumerate(batch.target_lengths.tolist()):
        rows = slice(int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1]))
        beyond = state[:, rows, 2 * L + 1:]
        assert beyond.shape[-1] == S - 2 * L - 1
        assert bool((beyond == float("-inf")).all()), f"utterance {b}: states beyond 2L = {2 * L} not -inf"
    second = torch.ops.packed_kernels.ctc_loss.default(*arguments)
    for name, a, b in zip(("loss", "nll", "state", "labels", "slots", "run_starts"), first, second):
        assert torch.equal(a, b), f"{name} differs between two calls"


# --------------------------------------------------------------------------------------
# torch.func


def test_torch_func_grad(device):
    """``torch.func.grad`` of the loss equals autograd's gradient and the NumPy stage's."""
    batch = make_batch([9, 0, 6, 4], 7, [3, 0, 2, 1], seed=73, device=device)
    x = batch.log_probs.detach()

    def loss_of(z):
        return pk.packed_ctc_loss(z, batch.cu_seqlens, batch.targets, batch.target_lengths, reduction="mean")

    grad = torch.func.grad(loss_of)(x)
    _, expected = run_packed(batch, reduction="mean")
    assert torch.equal(grad, expected)
    assert_close("func.grad vs numpy", grad, run_numpy(batch, reduction="mean")[1], atol=1e-10, rtol=1e-8)


# --------------------------------------------------------------------------------------
# shapes only: meta tensors and FakeTensorMode

SHAPE_CASES = [(dtype, reduction) for dtype in (torch.float32, torch.bfloat16, torch.float64)
               for reduction in ("none", "mean")]
SHAPE_IDS = [f"{_dtype_name(dtype)}-{reduction}" for dtype, reduction in SHAPE_CASES]


def _real_and_shapes_batch(device, dtype):
    batch = make_batch([5, 0, 3], 6, [2, 0, 1], seed=79, device=device)
    return batch, batch.log_probs.to(dtype).detach()


def _loss_and_grad(x, batch, reduction):
    x = x.clone().requires_grad_()
    loss = pk.packed_ctc_loss(x, batch.cu_seqlens, batch.targets, batch.target_lengths, reduction=reduction)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss, grad


def _assert_same_metadata(loss, grad, real_loss, real_grad):
    assert (tuple(loss.shape), loss.dtype) == (tuple(real_loss.shape), real_loss.dtype)
    assert (tuple(grad.shape), grad.dtype) == (tuple(real_grad.shape), real_grad.dtype)


@pytest.mark.parametrize("dtype, reduction", SHAPE_CASES, ids=SHAPE_IDS)
def test_meta_tensors(device, dtype, reduction):
    """On ``meta`` tensors the loss and its gradient have the real call's shapes and dtypes."""
    batch, x = _real_and_shapes_batch(device, dtype)
    real_loss, real_grad = _loss_and_grad(x, batch, reduction)
    meta = _on(batch, "meta")
    loss, grad = _loss_and_grad(x.to("meta"), meta, reduction)
    assert loss.device.type == "meta" and grad.device.type == "meta"
    _assert_same_metadata(loss, grad, real_loss, real_grad)


FAKE_CASES = [(*case, "kernels") for case in SHAPE_CASES] + [
    (torch.bfloat16, "mean", "padded-stage"), (torch.float64, "none", "padded-stage")]


@pytest.mark.parametrize("dtype, reduction, path", FAKE_CASES,
                         ids=[f"{_dtype_name(d)}-{r}-{p}" for d, r, p in FAKE_CASES])
def test_fake_tensor_mode(device, dtype, reduction, path):
    """Under ``FakeTensorMode`` (no value is read) the loss and its gradient have the real
    call's shapes and dtypes, through the kernels' fake implementations or the padded stage."""
    if path == "padded-stage":
        device = "cpu"
    batch, x = _real_and_shapes_batch(device, dtype)
    real_loss, real_grad = _loss_and_grad(x, batch, reduction)
    with contextlib.ExitStack() as stack:
        if path == "padded-stage":
            stack.enter_context(kernels_compiled_for_the_gpu())
        mode = stack.enter_context(FakeTensorMode())
        fake = type(batch)(*(mode.from_tensor(getattr(batch, f)) for f in
                             ("logits", "cu_seqlens", "input_lengths", "targets", "target_lengths")))
        loss, grad = _loss_and_grad(mode.from_tensor(x), fake, reduction)
        _assert_same_metadata(loss, grad, real_loss, real_grad)


# --------------------------------------------------------------------------------------
# autocast


@pytest.mark.parametrize("path", ["kernels", "padded-stage"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=_dtype_name)
def test_autocast_like_torch_ctc_loss(device, dtype, path):
    """Under bfloat16 autocast, ``F.ctc_loss`` computes in float32 (float64 stays float64): the
    same loss, loss dtype and gradient dtype."""
    if path == "padded-stage":
        device = "cpu"
    batch = make_batch([8, 5, 7], 6, [3, 2, 2], seed=83, device=device)
    x = batch.log_probs.to(dtype).detach().requires_grad_()
    padded = batch.padded(x.detach()).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        # ctc_loss_cuda has no float16/bfloat16 kernel, even under autocast: there the
        # reference is F.ctc_loss on the float32-cast input, as autocast would need.
        low = dtype in (torch.float16, torch.bfloat16) and device != "cpu"
        expected = F.ctc_loss(padded.float() if low else padded, batch.targets.clamp(0, 5), batch.input_lengths,
                              batch.target_lengths)
        with kernels_compiled_for_the_gpu() if path == "padded-stage" else contextlib.nullcontext():
            loss = pk.packed_ctc_loss(x, batch.cu_seqlens, batch.targets, batch.target_lengths)
            (grad,) = torch.autograd.grad(loss, x)
    (expected_grad,) = torch.autograd.grad(expected, padded)
    assert loss.dtype == expected.dtype and grad.dtype == expected_grad.dtype == dtype
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    assert_close("autocast loss", loss, expected, atol=tolerance, rtol=tolerance)
    grad_tolerance = 1e-10 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 1e-2
    assert_close("autocast grad", grad, batch.packed(expected_grad), atol=grad_tolerance, rtol=grad_tolerance)


# --------------------------------------------------------------------------------------
# CPU tensors on a machine whose kernels are compiled for a GPU

FALLBACK_CASES = {
    # name: (input lengths, C, target lengths, U, labels, blank, reduction, zero_infinity, dtype)
    "B5-T13-C29-U7-none": ([13, 1, 8, 0, 11], 29, [4, 1, 3, 0, 5], 7, None, 0, "none", False, torch.float64),
    "B3-T9-C6-U4-mean": ([7, 5, 9], 6, [2, 3, 4], None, None, 0, "mean", False, torch.float64),
    "B2-T17-C5-blank4-sum": ([17, 12], 5, [5, 6], None, None, 4, "sum", False, torch.float64),
    "repeats-and-blank-ids": ([12, 9], 7, [5, 3], None, [[3, 3, 5, 3, 3], [2, 0, 2]], 0, "none", False, torch.float64),
    "impossible-inf": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]], 0, "none", False, torch.float64),
    "impossible-zero_infinity-mean": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]], 0, "mean", True,
                                      torch.float64),
    "bfloat16-mean": ([11, 6, 9], 13, [3, 2, 4], 5, None, 0, "mean", False, torch.bfloat16),
    "float16-none": ([11, 6, 9], 13, [3, 2, 4], 5, None, 0, "none", False, torch.float16),
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES), ids=list(FALLBACK_CASES))
def test_cpu_tensors_take_the_padded_stage(device, case):
    """The padded PyTorch stage gives what the kernels give: loss, dtypes, and the gradient in
    PyTorch's convention, NaN and zeroed rows of impossible utterances included."""
    input_lengths, C, target_lengths, U, labels, blank, reduction, zero_infinity, dtype = FALLBACK_CASES[case]
    batch = make_batch(input_lengths, C, target_lengths, U, seed=89, blank=blank, labels=labels, device=device)
    options = dict(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
    expected_loss, expected_grad = run_packed(batch, dtype=dtype, **options)
    with kernels_compiled_for_the_gpu():
        loss, grad = run_packed(_on(batch, "cpu"), dtype=dtype, **options)
    assert loss.device.type == "cpu" and (loss.dtype, grad.dtype) == (expected_loss.dtype, expected_grad.dtype)
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    grad_atol = 1e-10 if dtype == torch.float64 else 1e-2
    assert_close("padded-stage loss", loss, expected_loss, atol=atol, rtol=atol)
    assert_close("padded-stage grad", grad, expected_grad, atol=grad_atol, rtol=grad_atol)


def test_cpu_tensors_take_the_padded_stage_with_masked_classes(device):
    """Classes masked to ``lp = -inf`` in some frames: PyTorch's gradient formula is NaN
    there, and the padded stage's gradient is NaN exactly where the kernels' is."""
    batch = make_batch([6, 5], 5, [2, 1], seed=91, labels=[[1, 2], [3]], device=device)
    batch.logits[:4, 4] = float("-inf")
    batch.logits[7:, 2] = float("-inf")
    expected_loss, expected_grad = run_packed(batch, reduction="mean")
    assert bool(expected_grad.isnan().any()) and bool(expected_grad.isfinite().any())
    with kernels_compiled_for_the_gpu():
        loss, grad = run_packed(_on(batch, "cpu"), reduction="mean")
    assert_close("padded-stage loss", loss, expected_loss, atol=1e-10, rtol=1e-10)
    assert_close("padded-stage grad", grad, expected_grad, atol=1e-10, rtol=1e-8)


def test_cpu_tensors_take_the_padded_stage_under_func_grad(device):
    batch = make_batch([9, 0, 6, 4], 7, [3, 0, 2, 1], seed=73, device=device)
    _, expected = run_packed(batch, reduction="sum")
    cpu = _on(batch, "cpu")
    with kernels_compiled_for_the_gpu():
        grad = torch.func.grad(lambda z: pk.packed_ctc_loss(z, cpu.cu_seqlens, cpu.targets, cpu.target_lengths,
                                                            reduction="sum"))(cpu.log_probs.detach())
    assert_close("func.grad through the padded stage", grad, expected, atol=1e-10, rtol=1e-8)


FALLBACK_BAD_INPUTS = ["cu_seqlens-not-from-0", "cu_seqlens-decreasing", "cu_seqlens-short-of-T_total",
                       "targets-negative-id", "target_lengths-negative", "target_lengths-too-long", "blank-too-large"]


@pytest.mark.parametrize("case", FALLBACK_BAD_INPUTS, ids=FALLBACK_BAD_INPUTS)
def test_cpu_tensors_checked_on_the_padded_stage(case):
    """The padded stage's inputs get the same value checks as the kernels'."""
    change, error, _, words = BAD_INPUTS[case]
    arguments = change(good_arguments("cpu"), "cpu")
    with kernels_compiled_for_the_gpu(), pytest.raises(error, match=re.escape(words)):
        pk.packed_ctc_loss(**arguments)


@pytest.mark.gpu_only
def test_cpu_tensors_on_a_gpu_machine():
    """No patching: CPU tensors next to the compiled kernels give the CUDA result."""
    batch = make_batch([13, 1, 8, 0, 11], 9, [4, 1, 3, 0, 5], 7, seed=97, device="cuda")
    expected_loss, expected_grad = run_packed(batch, dtype=torch.float32, reduction="none")
    loss, grad = run_packed(_on(batch, "cpu"), dtype=torch.float32, reduction="none")
    assert loss.device.type == "cpu"
    assert_close("cpu loss", loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert_close("cpu grad", grad, expected_grad, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# torch.compile and CUDA graphs


def test_torch_compile_fullgraph(device):
    """Traced without graph breaks (dynamo + AOTAutograd); Inductor compiles it on the GPU."""
    batch = make_batch([9, 5, 7], 7, [3, 2, 2], 4, seed=41, device=device)
    backend = "aot_eager" if runtime.INTERPRETED else "inductor"

    def step(x, cu, targets, lengths):
        return pk.packed_ctc_loss(x.log_softmax(-1), cu, targets, lengths, reduction="mean")

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    logits = batch.logits.float().detach().requires_grad_()
    loss = compiled(logits, batch.cu_seqlens, batch.targets, batch.target_lengths)
    (grad,) = torch.autograd.grad(loss, logits)
    logits_eager = batch.logits.float().detach().requires_grad_()
    expected = step(logits_eager, batch.cu_seqlens, batch.targets, batch.target_lengths)
    (expected_grad,) = torch.autograd.grad(expected, logits_eager)
    assert_close("compiled loss", loss, expected, atol=1e-6, rtol=1e-6)
    assert_close("compiled grad", grad, expected_grad, atol=1e-7, rtol=1e-5)


@pytest.mark.gpu_only
def test_cuda_graph_capture_and_replay(device):
    """Captured once; replayed with new frames, frame counts, targets and target lengths copied into
    the same buffers (the same B, U and T_total), each replay equals an eager run."""
    C, U = 11, 8
    batches = [
        make_batch([30, 12, 25, 0], C, [6, 3, 5, 0], U, seed=43, device=device),
        make_batch([10, 30, 20, 7], C, [2, 8, 4, 3], U, seed=47, device=device),
        make_batch([1, 1, 60, 5], C, [1, 0, 8, 5], U, seed=53, device=device),
    ]
    T_total = batches[0].logits.shape[0]
    assert all(b.logits.shape[0] == T_total for b in batches)
    static_x = torch.zeros(T_total, C, device=device, requires_grad=True)
    static_cu = torch.zeros(5, dtype=torch.int32, device=device)
    static_targets = torch.zeros(4, U, dtype=torch.long, device=device)
    static_lengths = torch.zeros(4, dtype=torch.long, device=device)

    def load(batch):
        with torch.no_grad():
            static_x.copy_(batch.log_probs.float())
        static_cu.copy_(batch.cu_seqlens)
        static_targets.copy_(batch.targets.clamp(0, C - 1))
        static_lengths.copy_(batch.target_lengths)

    def step():
        loss = pk.packed_ctc_loss(static_x, static_cu, static_targets, static_lengths, reduction="mean")
        (grad,) = torch.autograd.grad(loss, static_x)
        return loss, grad

    load(batches[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile the kernels before capturing
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_grad = step()
    for batch in batches[1:] + batches[:1]:
        load(batch)
        graph.replay()
        torch.cuda.synchronize()
        expected_loss, expected_grad = run_packed(batch, dtype=torch.float32, reduction="mean")
        assert_close("replayed loss", static_loss, expected_loss, atol=0, rtol=0)
        assert_close("replayed grad", static_grad, expected_grad, atol=0, rtol=0)


# --------------------------------------------------------------------------------------
# the docstring


def test_docstring_example_runs():
    tests = doctest.DocTestFinder().find(pk.packed_ctc_loss, "packed_ctc_loss", globs={})
    runner = doctest.DocTestRunner()
    for test in tests:
        runner.run(test)
    assert runner.tries > 0 and runner.failures == 0
