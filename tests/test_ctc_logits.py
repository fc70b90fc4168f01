"""The CTC loss from logits and from a linear layer's input, against independent references.

References, all float64 on the padded batch with gradients by autograd:
``torch.nn.functional.ctc_loss`` of ``F.linear(...).log_softmax(-1)``; the padded PyTorch
stage (autograd through the recursion) where PyTorch's CPU backward is wrong (the last
label equal to the blank); and ``packed_ctc_loss`` of the ``log_softmax``. Also: gradcheck,
half dtypes, ``torch.compile``, the custom ops under ``opcheck``, the fallback for tensors
the kernels do not take, a bad-input table, and the tensors kept for the backward.
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
from packed_kernels.ops.ctc import logits as logits_api
from packed_kernels.ops.ctc.padded_torch import ctc_loss_padded
from packed_kernels.ops.ctc.triton_kernels import LINEAR_CHUNK_ELEMENTS, linear_chunk_frames
from tests.assertions import assert_close
from tests.test_ctc import make_batch

F64 = dict(atol=1e-10, rtol=1e-8)


# --------------------------------------------------------------------------------------
# references and runners


def torch_reference(batch, logits, **options):
    """``F.ctc_loss`` of ``log_softmax(logits)`` on the padded ``(T, B, C)`` batch."""
    C = logits.shape[1]
    log_probs = batch.padded(logits.log_softmax(-1))
    return F.ctc_loss(log_probs, batch.targets.clamp(0, C - 1), batch.input_lengths, batch.target_lengths,
                      **options)


def padded_stage_reference(batch, logits, **options):
    """The padded PyTorch stage (autograd through the alpha recursion) of ``log_softmax(logits)``."""
    C = logits.shape[1]
    log_probs = batch.padded(logits.log_softmax(-1)).transpose(0, 1)
    return ctc_loss_padded(log_probs, batch.input_lengths, batch.targets.clamp(0, C - 1), batch.target_lengths,
                           **options)


def composition_reference(batch, logits, **options):
    """``packed_ctc_loss`` of ``log_softmax(logits)``."""
    return pk.packed_ctc_loss(logits.log_softmax(-1), batch.cu_seqlens, batch.targets, batch.target_lengths,
                              **options)


REFERENCES = {"torch": torch_reference, "padded": padded_stage_reference, "composition": composition_reference}


def linear_inputs(batch, D, *, seed, bias=True, dtype=torch.float64):
    """``hidden (T_total, D)``, ``weight (C, D)``, ``bias (C,)``: logits of about unit scale times 2."""
    g = torch.Generator().manual_seed(seed)
    T_total, C = batch.logits.shape
    hidden = torch.randn(T_total, D, generator=g, dtype=torch.float64)
    weight = torch.randn(C, D, generator=g, dtype=torch.float64) * (2 / D ** 0.5)
    b = torch.randn(C, generator=g, dtype=torch.float64) if bias else None
    device = batch.logits.device
    return [None if t is None else t.to(device, dtype) for t in (hidden, weight, b)]


def loss_and_grads(loss_of, leaves):
    """The loss (detached) and the gradient of its sum with respect to each leaf."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    loss = loss_of(*leaves)
    grads = torch.autograd.grad(loss.sum(), leaves)
    return loss.detach(), grads


def run_from_logits(batch, logits, **options):
    return loss_and_grads(lambda z: pk.packed_ctc_loss_from_logits(
        z, batch.cu_seqlens, batch.targets, batch.target_lengths, **options), [logits])


def run_linear(batch, hidden, weight, bias, chunk_frames=None, **options):
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    def loss_of(h, w, *b):
        return pk.linear_packed_ctc_loss(h, w, b[0] if b else None, batch.cu_seqlens, batch.targets,
                                         batch.target_lengths, chunk_frames=chunk_frames, **options)

    return loss_and_grads(loss_of, leaves)


def run_reference(reference, batch, leaves, make_logits, **options):
    """``reference`` (a name of :data:`REFERENCES`) of the logits ``make_logits(*leaves)``, on the CPU."""
    cpu = type(batch)(*(getattr(batch, f).cpu() for f in
                        ("logits", "cu_seqlens", "input_lengths", "targets", "target_lengths")))
    return loss_and_grads(lambda *xs: REFERENCES[reference](cpu, make_logits(*xs), **options),
                          [t.cpu().double() for t in leaves])


def check_from_logits(batch, references, **options):
    loss, (grad,) = run_from_logits(batch, batch.logits, **options)
    assert grad.dtype == batch.logits.dtype
    for reference in references:
        ref_loss, (ref_grad,) = run_reference(reference, batch, [batch.logits], lambda z: z, **options)
        assert_close(f"loss vs {reference}", loss, ref_loss, **F64)
        assert_close(f"dlogits vs {reference}", grad, ref_grad, **F64)


def check_linear(batch, D, references, *, chunk_frames=None, bias=True, seed=0, **options):
    inputs = linear_inputs(batch, D, seed=seed, bias=bias)
    loss, grads = run_linear(batch, *inputs, chunk_frames=chunk_frames, **options)
    leaves = [t for t in inputs if t is not None]
    for reference in references:
        ref_loss, ref_grads = run_reference(reference, batch, leaves, lambda h, w, *b: F.linear(h, w, *b),
                                            **options)
        assert_close(f"loss vs {reference}", loss, ref_loss, **F64)
        for name, grad, ref_grad in zip(("hidden", "weight", "bias"), grads, ref_grads):
            assert_close(f"grad {name} vs {reference}", grad, ref_grad, **F64)


# --------------------------------------------------------------------------------------
# parity on odd shapes

PARITY_CASES = [
    # (input lengths, C, target lengths, U, blank, reduction)
    ([7, 5, 9, 4], 29, [2, 3, 4, 1], None, 0, "mean"),
    ([13, 1, 8, 11], 131, [4, 1, 3, 5], 7, 0, "none"),
    ([17, 12], 29, [5, 6], None, 28, "sum"),
    ([10, 3, 6], 11, [0, 1, 4], 4, 5, "mean"),
]
PARITY_IDS = [f"B{len(c[0])}-T{max(c[0])}-C{c[1]}-U{c[3] or max(c[2])}-blank{c[4]}-{c[5]}" for c in PARITY_CASES]


@pytest.mark.parametrize("input_lengths, C, target_lengths, U, blank, reduction", PARITY_CASES, ids=PARITY_IDS)
def test_from_logits_matches_references(device, input_lengths, C, target_lengths, U, blank, reduction):
    batch = make_batch(input_lengths, C, target_lengths, U, seed=C + len(input_lengths), blank=blank, device=device)
    check_from_logits(batch, ["torch", "composition"], blank=blank, reduction=reduction)


@pytest.mark.parametrize("input_lengths, C, target_lengths, U, blank, reduction", PARITY_CASES, ids=PARITY_IDS)
def test_linear_matches_references(device, input_lengths, C, target_lengths, U, blank, reduction):
    """Chunks of 3 frames, most of which end inside an utterance."""
    batch = make_batch(input_lengths, C, target_lengths, U, seed=C + len(input_lengths), blank=blank, device=device)
    check_linear(batch, 6, ["torch", "composition"], chunk_frames=3, seed=C, blank=blank, reduction=reduction)


@pytest.mark.parametrize("chunk_frames", [1, 2, 7, 16, None], ids=lambda c: f"chunk{c}")
def test_linear_chunk_boundaries(device, chunk_frames):
    """One frame per chunk, chunks ending one frame before or after an utterance's end (the
    utterances end at rows 7, 12, 21), a chunk spanning whole utterances, one chunk for all."""
    batch = make_batch([7, 5, 9], 29, [2, 3, 4], seed=3, labels=[[4, 4], [1, 2, 1], [5, 5, 0, 5]], device=device)
    check_linear(batch, 5, ["torch"], chunk_frames=chunk_frames, seed=13, reduction="none")


def test_linear_without_bias_and_with_a_frozen_weight(device):
    batch = make_batch([9, 6, 4], 29, [3, 2, 1], seed=5, device=device)
    check_linear(batch, 5, ["torch"], chunk_frames=4, bias=False, reduction="mean")
    hidden, weight, _ = linear_inputs(batch, 5, seed=6)
    loss, (grad_hidden,) = loss_and_grads(lambda h: pk.linear_packed_ctc_loss(
        h, weight, None, batch.cu_seqlens, batch.targets, batch.target_lengths, chunk_frames=4), [hidden])
    ref_loss, (ref_grad,) = run_reference("torch", batch, [hidden], lambda h: F.linear(h, weight.cpu()))
    assert_close("loss, frozen weight", loss, ref_loss, **F64)
    assert_close("grad hidden, frozen weight", grad_hidden, ref_grad, **F64)


# --------------------------------------------------------------------------------------
# the conventions: repeats, blanks in targets, empty targets, zero frames, impossible

EDGE_CASES = {
    # name: (input lengths, C, target lengths, U, labels, zero_infinity, references)
    "repeated-labels": ([12, 9], 7, [5, 4], None, [[3, 3, 5, 3, 3], [2, 5, 2, 2]], False, ["torch"]),
    # the last label equal to the blank: PyTorch's CPU backward is wrong there, so the padded stage
    "target-ids-equal-blank": ([9, 8], 5, [3, 2], None, [[0, 2, 0], [3, 0]], False, ["padded"]),
    "empty-targets": ([5, 4], 4, [0, 0], 3, None, False, ["torch"]),
    "zero-frame-utterances": ([0, 6, 0, 5], 4, [0, 2, 2, 1], None, None, False, ["torch"]),
    "impossible-inf": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]], False, ["torch"]),
    "impossible-zero_infinity": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]], True, ["torch"]),
}


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_from_logits_conventions(device, case, reduction):
    input_lengths, C, target_lengths, U, labels, zero_infinity, references = EDGE_CASES[case]
    batch = make_batch(input_lengths, C, target_lengths, U, seed=7, labels=labels, device=device)
    check_from_logits(batch, references, reduction=reduction, zero_infinity=zero_infinity)


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_linear_conventions(device, case, reduction="mean"):
    input_lengths, C, target_lengths, U, labels, zero_infinity, references = EDGE_CASES[case]
    batch = make_batch(input_lengths, C, target_lengths, U, seed=7, labels=labels, device=device)
    check_linear(batch, 4, references, chunk_frames=5, seed=11, reduction=reduction, zero_infinity=zero_infinity)


def test_impossible_utterance_rows(device):
    """An impossible utterance: infinite loss and NaN gradient rows; under zero_infinity, zero rows
    and a finite gradient for the rest."""
    batch = make_batch([3, 5], 5, [3, 1], labels=[[2, 2, 2], [1]], seed=3, device=device)
    loss, (grad,) = run_from_logits(batch, batch.logits, reduction="none")
    assert torch.isinf(loss[0]) and torch.isfinite(loss[1])
    assert torch.isnan(grad[:3]).all() and torch.isfinite(grad[3:]).all()
    loss, (grad,) = run_from_logits(batch, batch.logits, reduction="none", zero_infinity=True)
    assert loss[0] == 0 and (grad[:3] == 0).all() and (grad[3:] != 0).any()
    hidden, weight, bias = linear_inputs(batch, 3, seed=4)
    loss, (grad_hidden, grad_weight, grad_bias) = run_linear(batch, hidden, weight, bias, chunk_frames=2,
                                                             reduction="sum", zero_infinity=True)
    assert loss.isfinite() and (grad_hidden[:3] == 0).all() and grad_weight.isfinite().all()


def test_masked_logits_get_zero_gradient(device):
    """A logit of -inf: the documented gradient is 0 there (its softmax and posterior vanish) and the
    rest as for a logit so negative that its probability is 0 in float64."""
    batch = make_batch([6, 5], 5, [2, 1], seed=91, labels=[[1, 2], [3]], device=device)
    masked, finite = batch.logits.clone(), batch.logits.clone()
    for z, value in ((masked, float("-inf")), (finite, -1e4)):
        z[:4, 4] = value
        z[7:, 2] = value
    loss, (grad,) = run_from_logits(batch, masked, reduction="mean")
    ref_loss, (ref_grad,) = run_reference("torch", batch, [finite], lambda z: z, reduction="mean")
    assert_close("loss with masked logits", loss, ref_loss, **F64)
    assert (grad[:4, 4] == 0).all() and (grad[7:, 2] == 0).all()
    assert_close("dlogits with masked logits", grad, ref_grad, **F64)


# --------------------------------------------------------------------------------------
# gradcheck, dtypes


def test_gradcheck(device):
    batch = make_batch([4, 0, 3], 7, [2, 0, 2], 3, seed=5, labels=[[1, 1], [], [2, 0]], device=device)
    logits = batch.logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: pk.packed_ctc_loss_from_logits(
        z, batch.cu_seqlens, batch.targets, batch.target_lengths, reduction="none"), (logits,), fast_mode=True)
    inputs = [t.requires_grad_() for t in linear_inputs(batch, 3, seed=9)]
    assert torch.autograd.gradcheck(lambda h, w, b: pk.linear_packed_ctc_loss(
        h, w, b, batch.cu_seqlens, batch.targets, batch.target_lengths, reduction="mean", chunk_frames=3),
        inputs, fast_mode=True)


HALF = [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)]


@pytest.mark.parametrize("dtype, tolerance", HALF, ids=["bfloat16", "float16"])
def test_half_dtypes_from_logits(device, dtype, tolerance):
    """float32 compute from half logits: the loss in float32, the gradient in the logits' dtype,
    close to the float64 reference of the same rounded logits."""
    batch = make_batch([11, 6, 9], 29, [3, 2, 4], 5, seed=19, device=device)
    rounded = batch.logits.to(dtype)
    loss, (grad,) = run_from_logits(batch, rounded, reduction="none")
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    ref_loss, (ref_grad,) = run_reference("torch", batch, [rounded.double()], lambda z: z, reduction="none")
    assert_close(f"{dtype} loss", loss, ref_loss, atol=1e-4, rtol=1e-5)
    assert_close(f"{dtype} dlogits", grad, ref_grad, atol=tolerance / 10, rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", HALF, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("chunk_frames", [4, None], ids=["chunks", "one-chunk"])
def test_half_dtypes_linear(device, dtype, tolerance, chunk_frames):
    """Half inputs: float32 loss, gradients in the inputs' dtype, close to the float32 run of the
    same function and to the float64 reference (whose logits are not rounded to ``dtype``)."""
    batch = make_batch([11, 6, 9], 29, [3, 2, 4], 5, seed=19, device=device)
    inputs = linear_inputs(batch, 8, seed=23)
    loss, grads = run_linear(batch, *[t.to(dtype) for t in inputs], chunk_frames=chunk_frames)
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    rounded = [t.to(dtype).float() for t in inputs]
    loss32, grads32 = run_linear(batch, *rounded, chunk_frames=chunk_frames)
    ref_loss, ref_grads = run_reference("torch", batch, rounded, lambda h, w, b: F.linear(h, w, b))
    assert_close(f"{dtype} loss vs float32", loss, loss32, atol=0, rtol=tolerance / 3)
    assert_close(f"{dtype} loss vs float64", loss, ref_loss, atol=0, rtol=tolerance / 3)
    for name, grad, grad32, ref_grad in zip(("hidden", "weight", "bias"), grads, grads32, ref_grads):
        scale = float(ref_grad.abs().max())
        assert_close(f"{dtype} grad {name} vs float32", grad, grad32, atol=tolerance * scale, rtol=tolerance)
        assert_close(f"{dtype} grad {name} vs float64", grad, ref_grad, atol=tolerance * scale, rtol=tolerance)


def test_mixed_dtypes_promote(device):
    """float32 hidden with a float64 weight and bias: computed in float64, each gradient in its
    input's dtype."""
    batch = make_batch([7, 5], 11, [2, 2], seed=29, device=device)
    hidden, weight, bias = linear_inputs(batch, 4, seed=31)
    loss, grads = run_linear(batch, hidden.float(), weight, bias, chunk_frames=3)
    assert loss.dtype == torch.float64
    assert [g.dtype for g in grads] == [torch.float32, torch.float64, torch.float64]
    ref_loss, ref_grads = run_reference("torch", batch, [hidden.float().double(), weight, bias],
                                        lambda h, w, b: F.linear(h, w, b))
    assert_close("promoted loss", loss, ref_loss, **F64)
    assert_close("promoted grad hidden", grads[0], ref_grads[0], atol=1e-6, rtol=1e-6)


def test_autocast_casts_like_f_linear(device):
    """Under bfloat16 autocast the projection runs in bfloat16, as F.linear's does; the loss is
    float32 and the gradients come back in the float32 inputs' dtype."""
    batch = make_batch([7, 5], 11, [2, 2], seed=37, device=device)
    inputs = [t.float() for t in linear_inputs(batch, 8, seed=41)]
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, grads = run_linear(batch, *inputs, chunk_frames=4)
        expected_logits = F.linear(*inputs)
    assert expected_logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    expected = run_from_logits(batch, expected_logits.detach())[0]
    assert_close("autocast loss", loss, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# the chunk rule


def test_default_chunk_frames():
    assert LINEAR_CHUNK_ELEMENTS == 2 ** 25
    assert linear_chunk_frames(1025) == 2 ** 25 // 1025
    assert linear_chunk_frames(65536) == 512
    assert linear_chunk_frames(2 ** 26) == 1


# --------------------------------------------------------------------------------------
# what the backward keeps


def _saved_tensors(loss_of):
    """The tensors autograd keeps for the backward of ``loss_of()``."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of()
    return saved


def test_backward_keeps_no_logits_sized_tensor(device):
    """Nothing of T_total x C elements is saved for the backward, except the logits the caller
    passed in (the loss from logits); the composition with log_softmax saves such a tensor."""
    batch = make_batch([9, 7, 8], 131, [3, 2, 2], seed=43, device=device)
    T_total, C = batch.logits.shape
    logits = batch.logits.clone().requires_grad_()
    saved = _saved_tensors(lambda: pk.packed_ctc_loss_from_logits(logits, batch.cu_seqlens, batch.targets,
                                                                  batch.target_lengths))
    assert saved and all(t.numel() < T_total * C or t.data_ptr() == logits.data_ptr() for t in saved)
    hidden, weight, bias = [t.requires_grad_() for t in linear_inputs(batch, 8, seed=47)]
    saved = _saved_tensors(lambda: pk.linear_packed_ctc_loss(hidden, weight, bias, batch.cu_seqlens, batch.targets,
                                                             batch.target_lengths, chunk_frames=5))
    assert saved and max(t.numel() for t in saved) < T_total * C
    saved = _saved_tensors(lambda: composition_reference(batch, F.linear(hidden, weight, bias)))
    assert max(t.numel() for t in saved) == T_total * C  # the hook sees what a composition keeps


# --------------------------------------------------------------------------------------
# the custom ops, torch.compile, shapes only


def _opcheck_batch(device):
    """A target shorter than U, an empty target and a zero-frame utterance."""
    return make_batch([4, 0, 3], 6, [2, 0, 1], 3, seed=71, labels=[[1, 1], [], [5]], device=device)


def test_opcheck_from_logits(device):
    """``packed_kernels::ctc_loss_from_logits`` (schema, fake, autograd, eager against AOTAutograd)
    and its backward op in bfloat16 (whose fake gradient must have the logits' dtype)."""
    batch = _opcheck_batch(device)
    z = batch.logits.float().requires_grad_()
    rest = (batch.cu_seqlens, batch.targets, batch.target_lengths)
    torch.library.opcheck(torch.ops.packed_kernels.ctc_loss_from_logits.default, (z, *rest, 0, "mean", True))
    z = batch.logits.to(torch.bfloat16)
    options = (0, "none", False)
    loss, nll, *saved = torch.ops.packed_kernels.ctc_loss_from_logits.default(z, *rest, *options)
    grad_loss = torch.linspace(0.5, 2.0, loss.numel(), device=device)
    torch.library.opcheck(torch.ops.packed_kernels.ctc_loss_from_logits_backward.default,
                          (grad_loss, z, batch.cu_seqlens, batch.target_lengths, loss, *saved, *options))


def test_opcheck_linear(device):
    """``packed_kernels::ctc_linear_loss`` with a bias, its backward op without one."""
    batch = _opcheck_batch(device)
    hidden, weight, bias = [t.float() for t in linear_inputs(batch, 4, seed=73)]
    rest = (batch.cu_seqlens, batch.targets, batch.target_lengths)
    options = (0, "sum", False, 3)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    torch.library.opcheck(torch.ops.packed_kernels.ctc_linear_loss.default, (*leaves, *rest, *options))
    loss, nll, *saved = torch.ops.packed_kernels.ctc_linear_loss.default(hidden, weight, None, *rest, *options)
    torch.library.opcheck(torch.ops.packed_kernels.ctc_linear_loss_backward.default,
                          (torch.tensor(1.5, device=device), hidden, weight, None, batch.cu_seqlens,
                           batch.target_lengths, nll, *saved, *options, True, True, False))


def test_torch_compile_fullgraph(device):
    """Both functions traced without graph breaks, forward and backward, equal to eager."""
    batch = make_batch([9, 5, 7], 13, [3, 2, 2], 4, seed=41, device=device)
    backend = "aot_eager" if runtime.INTERPRETED else "inductor"

    def step(z, h, w, b, cu, targets, lengths):
        return (pk.packed_ctc_loss_from_logits(z, cu, targets, lengths, reduction="mean")
                + pk.linear_packed_ctc_loss(h, w, b, cu, targets, lengths, reduction="sum", chunk_frames=4))

    inputs = [batch.logits.float()] + [t.float() for t in linear_inputs(batch, 5, seed=43)]
    rest = (batch.cu_seqlens, batch.targets, batch.target_lengths)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss, grads = loss_and_grads(lambda *xs: compiled(*xs, *rest), inputs)
    expected, expected_grads = loss_and_grads(lambda *xs: step(*xs, *rest), inputs)
    assert_close("compiled loss", loss, expected, atol=1e-5, rtol=1e-6)
    for name, grad, expected_grad in zip(("logits", "hidden", "weight", "bias"), grads, expected_grads):
        assert_close(f"compiled grad {name}", grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_fake_tensor_mode(device):
    """Under FakeTensorMode (no value read), the losses and gradients have the real call's shapes and dtypes."""
    batch = make_batch([5, 0, 3], 6, [2, 0, 1], seed=79, device=device)
    inputs = [batch.logits.to(torch.bfloat16)] + linear_inputs(batch, 3, seed=83, dtype=torch.bfloat16)

    def losses(z, h, w, b, cu, targets, lengths):
        leaves = [t.clone().requires_grad_() for t in (z, h, w, b)]
        first = pk.packed_ctc_loss_from_logits(leaves[0], cu, targets, lengths, reduction="none")
        second = pk.linear_packed_ctc_loss(*leaves[1:], cu, targets, lengths, chunk_frames=2)
        return [first, second, *torch.autograd.grad(first.sum() + second, leaves)]

    real = losses(*inputs, batch.cu_seqlens, batch.targets, batch.target_lengths)
    with FakeTensorMode() as mode:
        fake = losses(*[mode.from_tensor(t) for t in inputs],
                      *[mode.from_tensor(t) for t in (batch.cu_seqlens, batch.targets, batch.target_lengths)])
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


# --------------------------------------------------------------------------------------
# CPU tensors on a machine whose kernels are compiled for a GPU


def _no_kernel(*args, **kwargs):
    raise AssertionError("a CTC kernel was launched for tensors the kernels do not take")


@contextlib.contextmanager
def kernels_compiled_for_the_gpu():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "KERNEL_DEVICE", "cuda")
        for name in ("ctc_logits_forward_triton", "ctc_logits_backward_triton", "ctc_linear_forward_triton",
                     "ctc_linear_backward_triton"):
            patch.setattr(logits_api, name, _no_kernel)
        yield


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_cpu_tensors_take_the_padded_stage(device, dtype):
    batch = make_batch([9, 1, 7], 13, [3, 1, 2], labels=[[2, 2, 5], [0], [4, 0]], seed=89, device=device)
    cpu = type(batch)(*(getattr(batch, f).cpu() for f in
                        ("logits", "cu_seqlens", "input_lengths", "targets", "target_lengths")))
    inputs = linear_inputs(batch, 4, seed=97, dtype=dtype)
    expected = [run_from_logits(batch, batch.logits.to(dtype), reduction="none"),
                run_linear(batch, *inputs, chunk_frames=3, reduction="mean")]
    with kernels_compiled_for_the_gpu():
        got = [run_from_logits(cpu, batch.logits.to(dtype).cpu(), reduction="none"),
               run_linear(cpu, *[t.cpu() for t in inputs], chunk_frames=3, reduction="mean")]
    tolerance = 1e-10 if dtype == torch.float64 else 1e-2
    for (loss, grads), (expected_loss, expected_grads) in zip(got, expected):
        assert loss.dtype == expected_loss.dtype and [g.dtype for g in grads] == [g.dtype for g in expected_grads]
        assert_close("padded-stage loss", loss, expected_loss, atol=tolerance, rtol=tolerance)
        for grad, expected_grad in zip(grads, expected_grads):
            assert_close("padded-stage grad", grad, expected_grad, atol=tolerance, rtol=tolerance)


# --------------------------------------------------------------------------------------
# bad input


def _good(device):
    batch = make_batch([4, 3], 5, [2, 1], 3, seed=59, device=device)
    hidden, weight, bias = [t.float() for t in linear_inputs(batch, 3, seed=61)]
    return dict(cu_seqlens=batch.cu_seqlens, targets=batch.targets, target_lengths=batch.target_lengths,
                logits=batch.logits.float(), hidden=hidden, weight=weight, bias=bias)


def _from_logits(a):
    return pk.packed_ctc_loss_from_logits(a["logits"], a["cu_seqlens"], a["targets"], a["target_lengths"],
                                          **a.get("options", {}))


def _linear(a):
    return pk.linear_packed_ctc_loss(a["hidden"], a["weight"], a["bias"], a["cu_seqlens"], a["targets"],
                                     a["target_lengths"], **a.get("options", {}))


def _other_device(device):
    return "meta" if device == "cpu" else "cpu"


def _value_error(function, argument, requirement, where):
    return f"{function}: {argument} {requirement}, which fails at {where}"


FROM_LOGITS, LINEAR = "packed_ctc_loss_from_logits", "linear_packed_ctc_loss"
IDS = "must lie in [0, C) within each target length"


def _with(name, values):
    """A change that replaces argument ``name`` by a tensor of ``values``."""
    return lambda a, d: dict(a, **{name: torch.tensor(values, device=d)})


#: The good targets, ``[[2, 2, 0], [1, -2, 3]]`` (lengths 2 and 1), with the first id spoiled.
_FIRST_ID_TOO_LARGE = _with("targets", [[5, 2, 0], [1, -2, 3]])

BAD_INPUTS = {
    # name: (function, change to the good arguments, error type, argument the message names, words it contains)
    "logits-not-tensor": (_from_logits, lambda a, d: dict(a, logits=a["logits"].tolist()), TypeError, "logits",
                          "must be a torch.Tensor"),
    "logits-int": (_from_logits, lambda a, d: dict(a, logits=a["logits"].long()), TypeError, "logits",
                   "got torch.int64"),
    "logits-3d": (_from_logits, lambda a, d: dict(a, logits=a["logits"][None]), ValueError, "logits", "must be 2-D"),
    # values checked on the device: the message names the function first
    "logits-rows-not-T_total": (_from_logits, lambda a, d: dict(a, logits=a["logits"][:-1]), ValueError,
                                "cu_seqlens", _value_error(FROM_LOGITS, "cu_seqlens",
                                                           "must end at T_total = logits.shape[0]", "entry 2")),
    "logits-blank-too-large": (_from_logits, lambda a, d: dict(a, options=dict(blank=5)), ValueError, "blank",
                               "must lie in [0, C=5)"),
    "logits-targets-id-too-large": (_from_logits, _FIRST_ID_TOO_LARGE, ValueError,
                                    "targets", _value_error(FROM_LOGITS, "targets", IDS, "utterance 0")),
    "logits-target_lengths-too-long": (_from_logits, _with("target_lengths", [4, 1]), ValueError,
                                       "target_lengths", _value_error(FROM_LOGITS, "target_lengths",
                                                                      "must lie in [0, U = targets.shape[1]]",
                                                                      "utterance 0")),
    "logits-cu_seqlens-not-from-0": (_from_logits, _with("cu_seqlens", [1, 4, 7]), ValueError,
                                     "cu_seqlens", _value_error(FROM_LOGITS, "cu_seqlens", "must start at 0",
                                                                "entry 0")),
    "logits-reduction-unknown": (_from_logits, lambda a, d: dict(a, options=dict(reduction="average")),
                                 ValueError, "reduction", "must be one of"),
    "hidden-not-tensor": (_linear, lambda a, d: dict(a, hidden=a["hidden"].tolist()), TypeError, "hidden",
                          "must be a torch.Tensor"),
    "hidden-int": (_linear, lambda a, d: dict(a, hidden=a["hidden"].long()), TypeError, "hidden", "got torch.int64"),
    "hidden-1d": (_linear, lambda a, d: dict(a, hidden=a["hidden"][:, 0]), ValueError, "hidden", "must be 2-D"),
    "hidden-rows-not-T_total": (_linear, lambda a, d: dict(a, hidden=a["hidden"][:-1]), ValueError, "cu_seqlens",
                                _value_error(LINEAR, "cu_seqlens", "must end at T_total = hidden.shape[0]",
                                             "entry 2")),
    "weight-int": (_linear, lambda a, d: dict(a, weight=a["weight"].long()), TypeError, "weight", "got torch.int64"),
    "weight-1d": (_linear, lambda a, d: dict(a, weight=a["weight"][:, 0]), ValueError, "weight", "must be 2-D"),
    "weight-D-mismatch": (_linear, lambda a, d: dict(a, weight=a["weight"][:, :2]), ValueError, "weight",
                          "must have shape (C, D=3)"),
    "weight-no-classes": (_linear, lambda a, d: dict(a, weight=a["weight"][:0], bias=None), ValueError, "weight",
                          "must have at least one class"),
    "weight-other-device": (_linear, lambda a, d: dict(a, weight=a["weight"].to(_other_device(d))), ValueError,
                            "weight", "must be on hidden's device"),
    "bias-int": (_linear, lambda a, d: dict(a, bias=a["bias"].long()), TypeError, "bias", "got torch.int64"),
    "bias-2d": (_linear, lambda a, d: dict(a, bias=a["bias"][None]), ValueError, "bias", "must be 1-D"),
    "bias-wrong-length": (_linear, lambda a, d: dict(a, bias=a["bias"][:-1]), ValueError, "bias",
                          "must have shape (C=5,)"),
    "bias-other-device": (_linear, lambda a, d: dict(a, bias=a["bias"].to(_other_device(d))), ValueError, "bias",
                          "must be on hidden's device"),
    "linear-blank-beyond-classes": (_linear, lambda a, d: dict(a, options=dict(blank=5)), ValueError, "blank",
                                    "must lie in [0, C=5)"),
    "linear-targets-id-too-large": (_linear, _FIRST_ID_TOO_LARGE, ValueError, "targets",
                                    _value_error(LINEAR, "targets", IDS, "utterance 0")),
    "linear-cu_seqlens-decreasing": (_linear, _with("cu_seqlens", [0, 8, 7]), ValueError, "cu_seqlens",
                                     _value_error(LINEAR, "cu_seqlens", "must be non-decreasing", "entry 2")),
    "linear-target_lengths-negative": (_linear, lambda a, d: dict(a, target_lengths=a["target_lengths"] - 2),
                                       ValueError, "target_lengths", f"{LINEAR}: target_lengths must lie in [0, U"),
    "linear-target_lengths-wrong-batch": (_linear, lambda a, d: dict(a, target_lengths=a["target_lengths"][:1]),
                                          ValueError, "target_lengths", "must have shape"),
    "linear-zero_infinity-not-bool": (_linear, lambda a, d: dict(a, options=dict(zero_infinity=1)), TypeError,
                                      "zero_infinity", "must be a bool"),
    "chunk_frames-zero": (_linear, lambda a, d: dict(a, options=dict(chunk_frames=0)), ValueError, "chunk_frames",
                          "must be >= 1"),
    "chunk_frames-float": (_linear, lambda a, d: dict(a, options=dict(chunk_frames=4.0)), TypeError, "chunk_frames",
                           "got float"),
    "chunk_frames-bool": (_linear, lambda a, d: dict(a, options=dict(chunk_frames=True)), TypeError, "chunk_frames",
                          "got bool"),
}

_NAMES = {_from_logits: FROM_LOGITS, _linear: LINEAR}


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input(device, case, strict):
    """Each bad input raises its error: in strict mode (and for CPU tensors) within the
    call, otherwise no later than ``check_errors``; the message starts with the argument,
    or with the function and the argument for the values checked on the device."""
    function, change, error, argument, words = BAD_INPUTS[case]
    arguments = change(_good(device), device)
    with pytest.raises(error, match=re.escape(words)) as raised, pk.strict_checks(strict):
        function(arguments)
        if not strict:
            pk.check_errors()
    message = str(raised.value)
    assert message.startswith(f"{argument} ") or message.startswith(f"{_NAMES[function]}: {argument} "), message
    pk.check_errors()


SAME_CHECK_CASES = {
    # name: (change to the good arguments, the argument and the rest of the message)
    "cu_seqlens-decreasing": (lambda a, d: dict(a, cu_seqlens=torch.tensor([0, 8, 7], device=d)),
                              "cu_seqlens must be non-decreasing, which fails at entry 2"),
    "cu_seqlens-short": (lambda a, d: dict(a, cu_seqlens=torch.tensor([0, 4, 6], device=d)),
                         "cu_seqlens must end at T_total = {rows}.shape[0], which fails at entry 2"),
    "target_lengths-too-long-last": (lambda a, d: dict(a, target_lengths=torch.tensor([2, 4], device=d),
                                                       targets=torch.tensor([[2, 2, 0], [1, 2, 3]], device=d)),
                                     "target_lengths must lie in [0, U = targets.shape[1]], "
                                     "which fails at utterance 1"),
    "targets-negative-last": (lambda a, d: dict(a, targets=torch.tensor([[1, 2, 0], [-1, 0, 0]], device=d)),
                              f"targets {IDS}, which fails at utterance 1"),
}


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", list(SAME_CHECK_CASES))
def test_the_three_functions_report_the_same_check(device, case, strict):
    """The same bad value gives the same message from the three functions, each naming
    itself (and the argument that holds its ``T_total`` rows)."""
    change, rest = SAME_CHECK_CASES[case]
    arguments = change(_good(device), device)
    calls = {"packed_ctc_loss": ("log_probs", lambda: pk.packed_ctc_loss(
                 arguments["logits"].log_softmax(-1), arguments["cu_seqlens"], arguments["targets"],
                 arguments["target_lengths"])),
             FROM_LOGITS: ("logits", lambda: _from_logits(arguments)),
             LINEAR: ("hidden", lambda: _linear(arguments))}
    for name, (rows, call) in calls.items():
        with pytest.raises(ValueError) as raised, pk.strict_checks(strict):
            call()
            if not strict:
                pk.check_errors()
        assert str(raised.value) == f"{name}: " + rest.format(rows=rows)


def test_good_arguments_pass(device):
    good = _good(device)
    assert torch.isfinite(_from_logits(good)) and torch.isfinite(_linear(good))


# --------------------------------------------------------------------------------------
# the docstrings


@pytest.mark.parametrize("function", [pk.packed_ctc_loss_from_logits, pk.linear_packed_ctc_loss],
                         ids=lambda f: f.__name__)
def test_docstring_example_runs(function):
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(function, function.__name__, globs={}):
        runner.run(test)
    assert runner.tries > 0 and runner.failures == 0


# --------------------------------------------------------------------------------------
# the benchmark's cases and memory plan (shapes only: no GPU needed)


def test_head_memory_plan_follows_its_assumptions():
    """The plan's peaks, recomputed here from its documented assumptions, at C = 65536 in bfloat16:
    torch holds three float32 (T B, C) tensors in log_softmax's backward, packed_log_softmax three
    bfloat16 (T_total, C) ones, the loss from logits two, and the linear loss none."""
    from packed_kernels.bench.ctc import HEAD_PROVIDERS, HEAD_SEED, HEAD_SHAPE, head_memory_plan, utterance_lengths

    B, T, D, ratio = HEAD_SHAPE
    lengths, target_lengths = utterance_lengths(B, T, ratio, HEAD_SEED)
    T_total, T_max, U, C = int(lengths.sum()), int(lengths.max()), int(target_lengths.max()), 65536
    state = 2 * T_total * (2 * U + 1) * 4
    plans = head_memory_plan(C, torch.bfloat16)
    assert set(plans) == set(HEAD_PROVIDERS)
    assert plans["torch"].bytes == 3 * T_max * B * C * 4
    assert plans["packed_log_softmax"].bytes == 3 * T_total * C * 2
    assert plans["packed_from_logits"].bytes == 2 * T_total * C * 2 + T_total * 4 + state
    chunk = linear_chunk_frames(C)
    linear = chunk * C * 2 + T_total * 4 + state + C * D * 4 + C * 4 + T_total * D * 2 + C * D * 2 + C * 2
    assert plans["linear_packed"].bytes == linear
    for C in (8192, 32768, 65536):
        for dtype in (torch.bfloat16, torch.float32):
            peaks = [head_memory_plan(C, dtype)[name].bytes for name in HEAD_PROVIDERS]
            assert peaks == sorted(peaks, reverse=True), (C, dtype, peaks)


def test_bench_cases_describe_the_head_workload():
    from packed_kernels.bench.ctc import HEAD_DTYPES, HEAD_PROVIDERS, HEAD_VOCABULARIES, cases

    head = [case for case in cases() if case.workload == "head fwd+bwd"]
    assert sorted((case.params["C"], case.params["dtype"]) for case in head) == sorted(
        (C, dtype) for C in HEAD_VOCABULARIES for dtype in HEAD_DTYPES)
    assert all(tuple(case.providers) == HEAD_PROVIDERS for case in head)
    assert all(case.notes[f"plan_bytes_{name}"] > 0 for case in head for name in HEAD_PROVIDERS)
