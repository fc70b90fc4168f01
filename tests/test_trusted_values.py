"""What the kernels give for offsets, lengths and indices that break their rules.

Whatever the values, the kernels stay in bounds and give the result of clamped values,
and the violation is reported (here, where the tests run traced calls, by the next
``check_errors``). ``packed_ctc_loss``'s kernels clamp every index they read (int64
values in int64, before any int32 conversion): utterance ``b`` is frames
``[clamp(cu[b], 0, T_total), clamp(cu[b + 1], start_b, T_total))``, its target the first
``clamp(target_lengths[b], 0, U)`` ids of ``targets[b]``, each clamped to ``[0, C)``; rows
of no utterance get a zero gradient and the mean divides by the clamped lengths. The
segment operations clamp ``idx`` to ``[0, num_segments)``. These tests hold both to that
result, to float64 rounding: the float64 NumPy stages run on the clamped values are the
references. They call the CTC custom ops directly (what a traced call runs), the segment
operations under a dispatch mode (which makes a call traced while still running the
kernels), and one public function of each inside ``torch.compile``.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import packed_kernels as pk
from packed_kernels.ops.ctc.naive_numpy import ctc_utterance_numpy
from tests.assertions import assert_close, unwritten_memory_is_nan
from tests.segment_cases import OPS, PUBLIC, make_inputs, numpy_backward, numpy_forward

INT32_MAX, INT32_MIN = 2 ** 31 - 1, -2 ** 31


class Traced(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it a call counts as traced (the host
    value checks are skipped), and every operator, the kernels' included, runs as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------
# CTC: the custom ops on out-of-range values


def clamped_ctc_reference(log_probs, cu_seqlens, targets, target_lengths, blank, reduction, grad_loss):
    """The loss and its gradient (PyTorch's convention, for the upstream ``grad_loss``) that
    the kernels promise for any values: each offset, length and id clamped as the module
    docstring says, then the NumPy stage, one utterance at a time. Rows that belong to no
    utterance do not touch the loss: their gradient is 0. ``"mean"`` divides by the clamped
    lengths."""
    log_probs = log_probs.detach().cpu().double().numpy()
    cu, ids, lengths = (t.cpu().numpy().astype(np.int64) for t in (cu_seqlens, targets, target_lengths))
    grad_loss = grad_loss.detach().cpu().double().numpy()
    T_total, C = log_probs.shape
    B, U = len(cu) - 1, ids.shape[1]
    nll, grad = np.zeros(B), np.zeros((T_total, C))
    clamped_lengths = np.clip(lengths, 0, U)
    for b in range(B):
        start = min(max(cu[b], 0), T_total)
        end = min(max(cu[b + 1], start), T_total)
        L = clamped_lengths[b]
        nll[b], g = ctc_utterance_numpy(log_probs[start:end], np.clip(ids[b, :L], 0, C - 1), blank)
        weight = {"none": grad_loss[b] if grad_loss.ndim else 0.0, "sum": grad_loss,
                  "mean": grad_loss / (B * max(L, 1))}[reduction]
        grad[start:end] += weight * g
    if reduction == "none":
        loss = nll
    elif reduction == "sum":
        loss = nll.sum()
    else:
        loss = (nll / np.maximum(clamped_lengths, 1)).mean() if B else np.nan
    return torch.as_tensor(loss), torch.from_numpy(grad)


def _log_probs(T_total, C, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T_total, C, generator=g, dtype=torch.float64).log_softmax(-1).to(device)


#: Targets of three utterances with U = 3 (C = 5, blank 0): possible in 4 frames each.
TARGETS = [[1, 2, 3], [2, 3, 1], [4, 1, 2]]

CTC_CASES = {
    # name: (T_total, cu_seqlens, targets, target_lengths); int32 extremes, or int64 beyond them
    "in-range": (12, [0, 4, 8, 12], TARGETS, [2, 3, 1]),
    "cu_seqlens-beyond-T_total": (12, [0, 5, 40, INT32_MAX], TARGETS, [2, 2, 0]),
    "cu_seqlens-below-0": (12, [INT32_MIN, 5, 9, 12], TARGETS, [2, 1, 3]),
    # rows 9-11, or 0-2, belong to no utterance: their gradient is 0
    "cu_seqlens-short-of-T_total": (12, [0, 4, 7, 9], TARGETS, [2, 1, 1]),
    "cu_seqlens-starting-after-0": (12, [3, 6, 9, 12], TARGETS, [2, 1, 1]),
    "cu_seqlens-int64-beyond-int32": (12, [0, 4, 2 ** 32 + 8, 2 ** 33], TARGETS, [2, 3, 1]),
    "target_lengths-beyond-U": (12, [0, 4, 8, 12], TARGETS, [2, 10 ** 6, INT32_MAX]),
    "target_lengths-negative": (12, [0, 4, 8, 12], TARGETS, [-1, INT32_MIN, 3]),
    "target_lengths-int64-beyond-int32": (12, [0, 4, 8, 12], TARGETS, [2, 2 ** 32 + 1, -2 ** 40]),
    # 6 and 8 both become 4, a repeated label; -1 and -9 both the blank
    "target-ids-out-of-range": (12, [0, 4, 8, 12], [[-7, INT32_MAX, 0], [6, 8, 2], [3, -1, -9]], [2, 3, 3]),
    "target-ids-int64-beyond-int32": (12, [0, 4, 8, 12], [[1, 2, 3], [2, 2 ** 32 + 1, 1], [-2 ** 40, 1, 2]],
                                      [2, 3, 3]),
    "no-frames-at-all": (0, [0, 3, 7, 10], TARGETS, [2, 0, -1]),
    "no-utterances": (12, [7], [[0, 0, 0]][:0], []),
}


def _index_tensor(values, device):
    """int32, or int64 where a value lies beyond int32."""
    wide = any(not INT32_MIN <= v <= INT32_MAX for v in torch.tensor(values, dtype=torch.int64).flatten().tolist())
    return torch.tensor(values, dtype=torch.int64 if wide else torch.int32, device=device)


def _guarded(t):
    """``t`` as a contiguous view into a larger buffer whose entries before and after it hold
    a large value: a kernel that read past either end would see it, and change its result."""
    flat = t.reshape(-1)
    buffer = torch.full((flat.numel() + 8,), INT32_MAX, dtype=t.dtype, device=t.device)
    view = buffer[4:4 + flat.numel()].view(t.shape)
    view.copy_(t)
    return view


def _ctc_case(name, device):
    """The case's tensors, the index tensors guarded (see :func:`_guarded`)."""
    T_total, cu, targets, lengths = CTC_CASES[name]
    x = _log_probs(T_total, 5, device)
    targets = torch.tensor(targets, dtype=torch.int64).reshape(len(cu) - 1, 3)
    return (x, _guarded(_index_tensor(cu, device)), _guarded(targets.to(device)),
            _guarded(_index_tensor(lengths, device)))


def _upstream(reduction, B, device):
    """An upstream gradient of values that float32 cannot hold (a float32 rounding shows)."""
    g = torch.Generator().manual_seed(B + 11)
    shape = (B,) if reduction == "none" else ()
    return (0.5 + torch.rand(shape, generator=g, dtype=torch.float64) / 3).to(device)


def _ctc_op_loss_and_grad(x, cu, targets, lengths, reduction, grad_loss, blank=0):
    """The custom op a traced call runs, and its registered gradient (uninitialised memory
    reading as NaN: an entry that no kernel writes shows)."""
    x = x.detach().requires_grad_()
    with unwritten_memory_is_nan():
        loss = torch.ops.packed_kernels.ctc_loss.default(x, cu, targets, lengths, blank, reduction, False)[0]
        (grad,) = torch.autograd.grad(loss, x, grad_loss)
    return loss.detach(), grad


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("case", list(CTC_CASES))
def test_ctc_kernels_clamp_offsets_lengths_and_ids(case, reduction, device):
    x, cu, targets, lengths = _ctc_case(case, device)
    grad_loss = _upstream(reduction, cu.shape[0] - 1, device)
    loss, grad = _ctc_op_loss_and_grad(x, cu, targets, lengths, reduction, grad_loss)
    # the op checks the values as packed_ctc_loss, and reports the argument they break
    # (either one, where two are broken)
    broken = {"in-range": None, "no-frames-at-all": "cu_seqlens|target_lengths", "no-utterances": "cu_seqlens",
              "target-ids-out-of-range": "targets", "target-ids-int64-beyond-int32": "targets"}.get(
        case, case.split("-")[0])
    if broken:
        with pytest.raises(ValueError, match=f"^packed_ctc_loss: ({broken}) must "):
            pk.check_errors()
    expected_loss, expected_grad = clamped_ctc_reference(x, cu, targets, lengths, 0, reduction, grad_loss)
    assert_close(f"{case} {reduction} loss", loss, expected_loss, atol=1e-12, rtol=1e-12)
    assert_close(f"{case} {reduction} gradient", grad, expected_grad, atol=1e-12, rtol=1e-10)


def test_ctc_decreasing_offsets_give_each_utterance_its_clamped_frames(device):
    """``cu_seqlens = [0, 8, 3, 12]``: utterance 1 is ``[8, 8)`` (its end clamped up to its
    start) and utterance 2 is ``[3, 12)``, overlapping utterance 0. Each loss is that of its
    own frames. (A row of two utterances has no single owner for the gradient kernel; only
    the losses are promised.)"""
    x = _log_probs(12, 5, device)
    cu = torch.tensor([0, 8, 3, 12], dtype=torch.int32, device=device)
    targets = torch.tensor(TARGETS, device=device)
    lengths = torch.tensor([3, 0, 2], device=device)
    loss = torch.ops.packed_kernels.ctc_loss.default(x, cu, targets, lengths, 0, "none", False)[0]
    with pytest.raises(ValueError, match=re.escape("packed_ctc_loss: cu_seqlens must be non-decreasing, "
                                                   "which fails at entry 2")):
        pk.check_errors()
    expected = clamped_ctc_reference(x, cu, targets, lengths, 0, "none", torch.ones(3))[0]
    assert_close("losses of overlapping utterances", loss, expected, atol=1e-12, rtol=1e-12)


def test_ctc_public_function_inside_torch_compile_clamps(device):
    """Inside ``torch.compile`` out-of-range target ids and lengths reach the kernels, and
    the loss and gradient are the clamped ones; the kernels report the violation, which a
    later check raises (the compiled call does not stop for it)."""
    torch._dynamo.reset()
    x, cu, targets, lengths = _ctc_case("target-ids-out-of-range", device)
    lengths = torch.tensor([2, 3, 10 ** 6], dtype=torch.int64, device=device)
    grad_loss = _upstream("none", 3, device)

    def loss_of(z, cu, targets, lengths):
        return pk.packed_ctc_loss(z, cu, targets, lengths, reduction="none")

    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    z = x.detach().requires_grad_()
    loss = compiled(z, cu, targets, lengths)
    (grad,) = torch.autograd.grad(loss, z, grad_loss)
    reported = "^packed_ctc_loss: (targets|target_lengths) must "  # both are broken: either
    with pytest.raises(ValueError, match=reported):
        pk.check_errors()  # the compiled call's report
    expected_loss, expected_grad = clamped_ctc_reference(x, cu, targets, lengths, 0, "none", grad_loss)
    assert_close("compiled loss", loss, expected_loss, atol=1e-12, rtol=1e-12)
    assert_close("compiled gradient", grad, expected_grad, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match=reported), pk.strict_checks():
        loss_of(z, cu, targets, lengths)  # eager and strict: the same values are refused within the call


# --------------------------------------------------------------------------------------
# segment operations: idx out of range while traced


def _idx_case(name, device):
    """``idx`` (as the call passes it) and the ``num_segments`` of each case; rows 0-1 in
    segment 0, rows 2-4 in 1, rows 5-6 in 2, and the case changes the first or last rows."""
    base = [0, 0, 1, 1, 1, 2, 2]
    values, dtype = {
        "idx-beyond-num_segments": ([0, 0, 1, 1, 1, 4, INT32_MAX], torch.int32),
        "idx-negative": ([INT32_MIN, -1, 1, 1, 1, 2, 2], torch.int32),
        "idx64-beyond-int32": ([0, 0, 1, 1, 1, 2 ** 32 + 1, 2 ** 40], torch.int64),
        "idx64-below-int32": ([-2 ** 40, 0, 1, 1, 1, 2, 2], torch.int64),
    }[name]
    assert len(values) == len(base)
    return torch.tensor(values, dtype=dtype, device=device), 3


IDX_CASES = ["idx-beyond-num_segments", "idx-negative", "idx64-beyond-int32", "idx64-below-int32"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", IDX_CASES)
def test_segment_operations_clamp_idx_while_traced(case, op, device):
    """Traced, ``idx`` is clamped to ``[0, num_segments)`` (a sorted ``idx`` stays sorted):
    the output and the first derivatives are those of the clamped ``idx``."""
    idx, S = _idx_case(case, device)
    clamped = idx.clamp(0, S - 1).int()
    width = None if op not in ("matvec", "mul_broadcast") else 3
    inputs = [t.requires_grad_() for t in make_inputs(op, idx.shape[0], S, width, torch.float64, device, seed=5)]
    grad = torch.randn(numpy_forward(op, inputs, clamped, S).shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(6)).to(device)
    with Traced(), unwritten_memory_is_nan():
        out = PUBLIC[op](*inputs, idx, S)
        firsts = torch.autograd.grad(out, inputs, grad)
    assert_close(f"{op} {case}", out, numpy_forward(op, inputs, clamped, S), atol=1e-12, rtol=1e-12)
    for k, (got, want) in enumerate(zip(firsts, numpy_backward(op, inputs, clamped, S, grad))):
        assert_close(f"{op} {case} d/input{k}", got, want, atol=1e-12, rtol=1e-10)
    _assert_reported(op, "idx must lie in [0, num_segments)")


def _assert_reported(op, words):
    """The traced call's check reported its violation too: the next check raises it."""
    function = "segmented_" + op.replace("_broadcast", "")
    with pytest.raises(ValueError, match=re.escape(f"{function}: {words}")):
        pk.check_errors()


@pytest.mark.parametrize("capturing", [False, True])
def test_a_call_while_a_cuda_graph_is_captured_reports_later(capturing, device, monkeypatch):
    """During a capture (CUDA initialised, the current stream capturing: stood in for
    here) a call counts as traced: an ``idx`` out of range is clamped, and reported by a
    later check instead of within the call."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    idx, S = _idx_case("idx-beyond-num_segments", device)
    x = torch.arange(1.0, 8.0, dtype=torch.float64, device=device)
    assert pk.dispatch.is_traced(x) is capturing
    if not capturing:
        with pytest.raises(ValueError, match="idx"):
            pk.segmented_sum(x, idx, S)
        return
    want = torch.zeros(S, dtype=torch.float64, device=device).index_add_(0, idx.clamp(0, S - 1).long(), x)
    assert_close("sum captured", pk.segmented_sum(x, idx, S), want, atol=0, rtol=0)
    _assert_reported("sum", "idx must lie in [0, num_segments)")


@pytest.mark.parametrize("op", ["mul", "mul_broadcast", "matvec"])
def test_row_wise_operations_take_an_unsorted_idx_while_traced(op, device):
    """``mul`` and ``matvec`` read one segment row per row: an unsorted (clamped) ``idx``
    gives their exact result, and the gradient of ``x`` (a row-wise map too)."""
    idx = torch.tensor([2, 0, 5, 1, -3, 0, 2], dtype=torch.int32, device=device)
    S = 3
    clamped = idx.clamp(0, S - 1)
    x, y = make_inputs(op, idx.shape[0], S, 3, torch.float64, device, seed=8)
    x.requires_grad_()
    with Traced():
        out = PUBLIC[op](x, y, idx, S)
    assert_close(f"{op} unsorted", out, numpy_forward(op, (x, y), clamped, S), atol=1e-12, rtol=1e-12)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).to(device)
    with Traced():
        (got,) = torch.autograd.grad(out, x, grad)
    assert_close(f"{op} unsorted d/x", got, numpy_backward(op, (x, y), clamped, S, grad)[0], atol=1e-12, rtol=1e-10)
    _assert_reported(op, "idx must lie in [0, num_segments)")


@pytest.mark.parametrize("op", OPS)
def test_rows_without_any_segment_are_refused_while_traced(op, device):
    """``num_segments = 0`` with rows: no ``idx`` value can be valid, which the shapes alone
    show, so it is refused traced as well as eager (a clamp has no segment to go to)."""
    width = None if op not in ("matvec", "mul_broadcast") else 3
    inputs = make_inputs(op, 4, 0, width, torch.float64, device, seed=1)
    idx = torch.zeros(4, dtype=torch.int32, device=device)
    for context in (Traced, torch.no_grad):
        with context(), pytest.raises(ValueError, match=r"idx must be < num_segments \(0\)"):
            PUBLIC[op](*inputs, idx, 0)


def test_segment_sum_inside_torch_compile_clamps(device):
    """Inside ``torch.compile`` out-of-range values of ``idx`` are clamped, in the forward
    and in the compiled backward, and reported to the next eager call."""
    torch._dynamo.reset()
    idx, S = _idx_case("idx-beyond-num_segments", device)
    x = make_inputs("sum", idx.shape[0], S, 3, torch.float64, device, seed=2)[0].requires_grad_()
    compiled = torch.compile(lambda x, idx: pk.segmented_sum(x, idx, S), fullgraph=True, backend="aot_eager")
    out = compiled(x, idx)
    clamped = idx.clamp(0, S - 1)
    assert_close("compiled sum", out, numpy_forward("sum", (x,), clamped, S), atol=1e-12, rtol=1e-12)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    (got,) = torch.autograd.grad(out, x, grad)
    assert_close("compiled sum d/x", got, numpy_backward("sum", (x,), clamped, S, grad)[0], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=re.escape("segmented_sum: idx must lie in [0, num_segments)")):
        pk.segmented_sum(x, idx, S)  # the compiled call's report
    with pytest.raises(ValueError, match=re.escape("segmented_sum: idx must lie in [0, num_segments)")):
        pk.segmented_sum(x, idx, S)  # eager: the same idx is refused
