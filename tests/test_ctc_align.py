"""Forced alignment over packed sequences: the three stages against each other, against
the CTC loss, against torchaudio where it is installed, and on bad input.

References: the float64 NumPy Viterbi (:func:`ctc_align_numpy`), one utterance at a time;
the padded PyTorch stage; ``packed_ctc_loss`` (the sum over all paths bounds the best one).
Labels, tokens and spans must equal the reference exactly, ties included (uniform
log-probabilities make every path tie, small integers make ties of every kind): the tie
rule is part of the result.
"""
from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import pytest
import torch

import packed_kernels as pk
from packed_kernels import runtime
from packed_kernels.ops.ctc import align as align_module
from packed_kernels.ops.ctc.naive_numpy import ctc_align_numpy
from packed_kernels.ops.ctc.padded_torch import ctc_align_padded
from packed_kernels.ops.ctc.triton_kernels import choice_words_per_frame
from tests.assertions import assert_close, unwritten_memory_is_nan
from tests.test_ctc import make_batch
from tests.test_ctc_inputs import BAD_INPUTS, EMPTY_BATCHES, good_arguments

NEG_INF = float("-inf")
SCORE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


#: The inputs of the parity tests: ``random`` log-probabilities (no ties), ``uniform`` ones
#: (every path through the trellis scores the same) and ``integers`` (scores drawn from
#: -1, -2, -3, exact in every dtype: ties between every pair of predecessors, on the best
#: path too).
INPUTS = ("random", "uniform", "integers")


def log_probs_of(batch, dtype=torch.float64, inputs: str = "random") -> torch.Tensor:
    """The batch's log-probabilities in ``dtype``, as :data:`INPUTS` names them."""
    log_probs = batch.log_probs
    if inputs == "uniform":
        log_probs = torch.full_like(log_probs, -float(np.log(log_probs.shape[1])))
    elif inputs == "integers":
        g = torch.Generator().manual_seed(log_probs.shape[0] * 7 + log_probs.shape[1])
        log_probs = -torch.randint(1, 4, log_probs.shape, generator=g).to(log_probs)
    return log_probs.to(dtype)


def reference(log_probs: torch.Tensor, batch, blank: int = 0):
    """The NumPy stage on each utterance of ``log_probs`` as float64 (the values the kernels read)."""
    values = log_probs.double().cpu().numpy()
    cu, targets, lengths = (t.cpu().numpy() for t in (batch.cu_seqlens, batch.targets, batch.target_lengths))
    return [ctc_align_numpy(values[cu[b]:cu[b + 1]], targets[b, :lengths[b]], blank) for b in range(len(lengths))]


def utterance_spans(alignment: pk.CTCAlignment, b: int) -> torch.Tensor:
    offsets = alignment.span_offsets
    return alignment.spans[int(offsets[b]):int(offsets[b + 1])]


def check_alignment(alignment: pk.CTCAlignment, expected, batch, dtype=torch.float64, where: str = "") -> None:
    """``alignment`` (a packed batch's) against the per-utterance references ``expected``."""
    cu = batch.cu_seqlens.cpu()
    B = len(expected)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert alignment.scores.dtype == alignment.log_likelihood.dtype == compute
    assert alignment.labels.dtype == alignment.tokens.dtype == alignment.spans.dtype == torch.int64
    lengths = [len(spans) for _, _, _, spans, _ in expected]
    assert alignment.span_offsets.tolist() == np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
    tolerance = SCORE_TOLERANCE[compute]
    for b in range(B):
        labels, tokens, scores, spans, log_likelihood = expected[b]
        rows = slice(int(cu[b]), int(cu[b + 1]))
        name = f"{where}utterance {b}"
        assert alignment.labels[rows].tolist() == labels.tolist(), f"{name}: labels"
        assert alignment.tokens[rows].tolist() == tokens.tolist(), f"{name}: tokens"
        assert utterance_spans(alignment, b).tolist() == spans.tolist(), f"{name}: spans"
        assert_close(f"{name}: scores", alignment.scores[rows], torch.from_numpy(scores), atol=tolerance,
                     rtol=tolerance)
        assert_close(f"{name}: log_likelihood", alignment.log_likelihood[b],
                     torch.tensor(log_likelihood, dtype=torch.float64), atol=tolerance, rtol=tolerance)
    # rows of spans beyond the last token's: -1
    assert bool((alignment.spans[int(alignment.span_offsets[-1]):] == -1).all())


def align(batch, log_probs, **kwargs) -> pk.CTCAlignment:
    with unwritten_memory_is_nan():
        return pk.packed_ctc_align(log_probs, batch.cu_seqlens, batch.targets, batch.target_lengths, **kwargs)


# --------------------------------------------------------------------------------------
# parity with the NumPy stage


PARITY_CASES = [
    # (input lengths, C, target lengths, U, blank)
    ([7], 5, [3], None, 0),
    ([9, 5], 7, [3, 2], 4, 0),
    ([13, 1, 8, 0, 11], 9, [4, 1, 3, 0, 5], 7, 0),
    ([11, 7, 9], 3, [4, 2, 3], None, 2),
    ([15, 6, 10, 3], 11, [5, 2, 4, 1], 6, 5),
    # 17 labels: 35 states, three choice words per frame and 32 lanes
    ([41, 5], 7, [17, 2], 17, 0),
]
PARITY_IDS = [f"B{len(c[0])}-T{max(c[0])}-C{c[1]}-U{c[3] or max(c[2])}-blank{c[4]}" for c in PARITY_CASES]


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("input_lengths, C, target_lengths, U, blank", PARITY_CASES, ids=PARITY_IDS)
def test_kernel_matches_numpy(device, input_lengths, C, target_lengths, U, blank, inputs):
    batch = make_batch(input_lengths, C, target_lengths, U, seed=len(input_lengths) * 31 + C, blank=blank,
                       labels=[[1, 1, 2]] if max(target_lengths) >= 3 else None, device=device)
    log_probs = log_probs_of(batch, inputs=inputs)
    check_alignment(align(batch, log_probs, blank=blank), reference(log_probs, batch, blank), batch)


@pytest.mark.parametrize("inputs", INPUTS)
def test_float32_matches_numpy(device, inputs):
    """float32 in, float32 out: labels, tokens and spans exact, scores within 1e-5 (of the
    float64 reference run on the same float32 values)."""
    batch = make_batch([12, 7, 9], 9, [4, 2, 3], 5, seed=17, device=device)
    log_probs = log_probs_of(batch, torch.float32, inputs=inputs)
    check_alignment(align(batch, log_probs), reference(log_probs, batch), batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_inputs(device, dtype):
    """float16 and bfloat16 are read as such and computed in float32."""
    batch = make_batch([10, 6, 0, 8], 7, [3, 2, 0, 4], seed=19, device=device)
    log_probs = log_probs_of(batch, dtype)
    check_alignment(align(batch, log_probs), reference(log_probs, batch), batch, dtype)


def test_log_likelihood_is_the_sum_of_the_scores(device):
    """The path's score, summed frame by frame in order, is its log-likelihood to the bit."""
    batch = make_batch([13, 8, 11], 6, [4, 3, 5], seed=23, device=device)
    alignment = align(batch, log_probs_of(batch))
    cu = batch.cu_seqlens.tolist()
    for b in range(3):
        total = 0.0
        for value in alignment.scores[cu[b]:cu[b + 1]].tolist():
            total += value
        assert total == alignment.log_likelihood[b].item()


# --------------------------------------------------------------------------------------
# the stages against each other


def padded_stage(batch, log_probs, blank=0):
    lengths = batch.input_lengths.cpu()
    padded = pk.unpack(pk.Packed(log_probs.cpu(), batch.cu_seqlens.cpu(), lengths))
    return ctc_align_padded(padded, lengths, batch.targets.cpu(), batch.target_lengths.cpu(), blank)


@pytest.mark.parametrize("inputs", INPUTS)
def test_padded_stage_equals_the_kernel(device, inputs):
    """The padded stage, packed back, gives the kernel's path bitwise."""
    batch = make_batch([9, 0, 14, 4, 11], 8, [3, 2, 5, 0, 4], 6, seed=29, labels=[[1, 1, 2]], device=device)
    log_probs = log_probs_of(batch, inputs=inputs)
    alignment = align(batch, log_probs)
    padded = padded_stage(batch, log_probs)
    cu = batch.cu_seqlens.tolist()
    for b, length in enumerate(batch.input_lengths.tolist()):
        rows = slice(cu[b], cu[b + 1])
        L = int(batch.target_lengths[b])
        assert torch.equal(alignment.labels[rows].cpu(), padded.labels[b, :length])
        assert torch.equal(alignment.tokens[rows].cpu(), padded.tokens[b, :length])
        assert torch.equal(alignment.scores[rows].cpu(), padded.scores[b, :length])
        assert torch.equal(utterance_spans(alignment, b).cpu(), padded.spans[b, :L])
        assert bool((padded.spans[b, L:] == -1).all())
    assert torch.equal(alignment.log_likelihood.cpu(), padded.log_likelihood)


def test_packed_batch_equals_one_utterance_at_a_time(device):
    batch = make_batch([8, 0, 13, 5, 1], 6, [3, 1, 4, 2, 1], 5, seed=31, device=device)
    log_probs = log_probs_of(batch)
    together = align(batch, log_probs)
    cu = batch.cu_seqlens.tolist()
    for b in range(5):
        one = pk.packed_ctc_align(log_probs[cu[b]:cu[b + 1]], torch.tensor([0, cu[b + 1] - cu[b]], device=device),
                                  batch.targets[b:b + 1], batch.target_lengths[b:b + 1])
        rows = slice(cu[b], cu[b + 1])
        for field in ("labels", "tokens", "scores"):
            assert torch.equal(getattr(together, field)[rows], getattr(one, field)), f"utterance {b}: {field}"
        assert torch.equal(utterance_spans(together, b), utterance_spans(one, 0)), f"utterance {b}: spans"
        assert torch.equal(together.log_likelihood[b:b + 1], one.log_likelihood)


def test_from_logits_equals_log_softmax_then_align(device):
    """``packed_ctc_align_from_logits`` aligns ``log_softmax(logits)``, without forming it."""
    batch = make_batch([11, 6, 0, 9], 7, [4, 2, 1, 3], 5, seed=37, labels=[[3, 3, 2, 3]], device=device)
    # (not the integers: two paths that tie on the logits may differ in the last bit once
    # each frame's normaliser, computed two ways, is subtracted; uniform logits tie exactly)
    for inputs in ("random", "uniform"):
        logits = torch.zeros_like(batch.logits) if inputs == "uniform" else batch.logits
        with unwritten_memory_is_nan():
            alignment = pk.packed_ctc_align_from_logits(logits, batch.cu_seqlens, batch.targets,
                                                        batch.target_lengths)
        check_alignment(alignment, reference(logits.log_softmax(-1), batch), batch, where=f"{inputs} inputs: ")


def test_two_calls_give_the_same_bits(device):
    batch = make_batch([12, 7], 5, [4, 3], seed=41, device=device)
    log_probs = log_probs_of(batch, torch.float32)
    first, second = align(batch, log_probs), align(batch, log_probs)
    for field, a, b in zip(pk.CTCAlignment._fields, first, second):
        assert torch.equal(a, b), field


# --------------------------------------------------------------------------------------
# edge cases


EDGE_CASES = {
    # name: (input lengths, C, target lengths, U, labels)
    "empty-targets": ([5, 4], 4, [0, 0], 3, None),
    "repeated-labels": ([9, 6], 6, [2, 4], None, [[3, 3], [2, 2, 4, 4]]),
    "repeats-need-blanks": ([6], 5, [4], None, [[1, 1, 1, 2]]),  # 4 labels + 2 blanks: one path
    "target-id-equals-blank": ([9, 8], 5, [3, 2], None, [[0, 2, 0], [3, 0]]),
    "zero-frame-utterances": ([0, 6, 0], 4, [0, 2, 2], None, None),
    "too-long-for-the-frames": ([3, 7, 2], 6, [3, 2, 2], None, [[1, 1, 1], [2, 3], [4, 4]]),
    "one-frame-each": ([1, 1, 1], 3, [1, 0, 2], None, [[2], [], [1, 2]]),
    "wide-targets-buffer": ([9, 4], 6, [2, 1], 11, None),
}


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_edge_cases(device, case):
    input_lengths, C, target_lengths, U, labels = EDGE_CASES[case]
    batch = make_batch(input_lengths, C, target_lengths, U, seed=43, labels=labels, device=device)
    for inputs in INPUTS:
        log_probs = log_probs_of(batch, inputs=inputs)
        check_alignment(align(batch, log_probs), reference(log_probs, batch), batch, where=f"{inputs} inputs: ")


def test_impossible_utterances_are_marked_not_filled(device):
    """No alignment: log-likelihood -inf, the blank with token -1 and score -inf on every
    frame, spans -1; the possible utterances beside it are untouched."""
    batch = make_batch([3, 5, 2, 4], 5, [3, 1, 2, 2], labels=[[2, 2, 2], [1], [4, 4], [3, 1]], seed=47,
                       device=device)
    log_probs = log_probs_of(batch)
    log_probs[9:] = NEG_INF  # utterance 3: only -inf log-probabilities: no path of finite score
    alignment = align(batch, log_probs)
    for b, rows in [(0, slice(0, 3)), (2, slice(8, 10)), (3, slice(10, 14))]:
        assert alignment.log_likelihood[b].item() == NEG_INF
        assert alignment.labels[rows].tolist() == [0] * (rows.stop - rows.start)
        assert alignment.tokens[rows].tolist() == [-1] * (rows.stop - rows.start)
        assert alignment.scores[rows].tolist() == [NEG_INF] * (rows.stop - rows.start)
        assert bool((utterance_spans(alignment, b) == -1).all())
    assert torch.isfinite(alignment.log_likelihood[1])
    check_alignment(alignment, reference(log_probs, batch), batch)


def test_no_frames(device):
    """An utterance with no frames: log-likelihood 0 with an empty target (the empty path),
    -inf otherwise, and spans -1."""
    batch = make_batch([0, 0, 3], 4, [0, 2, 1], seed=53, device=device)
    alignment = align(batch, log_probs_of(batch))
    assert alignment.log_likelihood[:2].tolist() == [0.0, NEG_INF]
    assert utterance_spans(alignment, 1).tolist() == [[-1, -1], [-1, -1]]
    assert alignment.labels.shape == (3,)


def test_no_utterances(device):
    log_probs = torch.zeros(0, 5, device=device)
    for targets in (torch.zeros(0, 3, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long,
                                                                                     device=device)):
        alignment = pk.packed_ctc_align(log_probs, torch.zeros(1, dtype=torch.int32, device=device), targets,
                                        torch.zeros(0, dtype=torch.long, device=device))
        shapes = [tuple(t.shape) for t in alignment]
        assert shapes == [(0,), (0,), (0,), (0, 2), (1,), (0,)]
        assert alignment.span_offsets.tolist() == [0]


# --------------------------------------------------------------------------------------
# against the sum over all paths


def test_best_path_is_at_most_the_sum_over_paths(device):
    batch = make_batch([13, 1, 8, 0, 11, 4], 9, [4, 1, 3, 0, 5, 3], 7, seed=59, labels=[[], [], [], [], [],
                                                                                       [2, 2, 5]], device=device)
    log_probs = log_probs_of(batch)
    best = align(batch, log_probs).log_likelihood
    total = -pk.packed_ctc_loss(log_probs, batch.cu_seqlens, batch.targets, batch.target_lengths, reduction="none")
    assert bool((best <= total + 1e-12).all()), (best, total)
    assert bool((best < total - 1e-6)[batch.input_lengths > batch.target_lengths + 1].all())


def test_a_single_path_scores_the_whole_sum(device):
    """Where only one path exists (as many frames as labels and the blanks that repeats
    need, or an empty target), the best path is the sum over paths."""
    batch = make_batch([3, 4, 5, 2], 7, [3, 3, 0, 2], labels=[[1, 2, 3], [4, 4, 5], [], [6, 1]], seed=61,
                       device=device)
    log_probs = log_probs_of(batch)
    alignment = align(batch, log_probs)
    total = -pk.packed_ctc_loss(log_probs, batch.cu_seqlens, batch.targets, batch.target_lengths, reduction="none")
    assert_close("single path vs sum", alignment.log_likelihood, total, atol=1e-12, rtol=1e-12)
    # the repeat "4 4" takes a blank between its two tokens
    assert alignment.tokens[:7].tolist() == [0, 1, 2, 0, -1, 1, 2]


# --------------------------------------------------------------------------------------
# torchaudio


def test_torchaudio_forced_align_parity(device):
    """Utterance by utterance, ``torchaudio.functional.forced_align`` (random inputs: its tie
    rule differs from ours, so ties are avoided; targets without the blank, as it requires)."""
    functional = pytest.importorskip("torchaudio.functional")
    if not hasattr(functional, "forced_align"):
        pytest.skip("this torchaudio has no forced_align")
    batch = make_batch([14, 9, 11], 8, [4, 3, 5], seed=67, device=device)
    log_probs = log_probs_of(batch, torch.float32)
    alignment = align(batch, log_probs)
    cu = batch.cu_seqlens.tolist()
    for b in range(3):
        L, rows = int(batch.target_lengths[b]), slice(cu[b], cu[b + 1])
        labels, scores = functional.forced_align(log_probs[rows][None].cpu(),
                                                 batch.targets[b:b + 1, :L].cpu().int(), blank=0)
        assert alignment.labels[rows].tolist() == labels[0].tolist(), f"utterance {b}"
        assert_close(f"utterance {b} scores", alignment.scores[rows], scores[0], atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------
# gradients, modes, tracing, the padded stage for CPU tensors


def test_no_gradient_and_inference_mode(device):
    batch = make_batch([7, 5], 5, [2, 2], seed=71, device=device)
    leaf = log_probs_of(batch, torch.float32).requires_grad_()
    alignment = align(batch, leaf)
    assert not alignment.scores.requires_grad and not alignment.log_likelihood.requires_grad
    with torch.no_grad():
        assert torch.equal(align(batch, leaf).labels, alignment.labels)
    with torch.inference_mode():
        assert torch.equal(align(batch, leaf.detach()).labels, alignment.labels)


def test_meta_tensors_give_shapes():
    log_probs = torch.empty(20, 7, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    lengths = torch.empty(3, dtype=torch.int64, device="meta")
    padded = pk.packed_ctc_align(log_probs, cu, torch.empty(3, 5, dtype=torch.int64, device="meta"), lengths)
    assert [tuple(t.shape) for t in padded] == [(20,), (20,), (20,), (15, 2), (4,), (3,)]
    assert padded.scores.dtype == torch.float32
    concatenated = pk.packed_ctc_align_from_logits(log_probs, cu, torch.empty(9, dtype=torch.int64, device="meta"),
                                                   [2, 3, 4])
    assert tuple(concatenated.spans.shape) == (9, 2)


def test_opcheck_ctc_align(device):
    batch = make_batch([7, 0, 6, 4], 6, [3, 0, 1, 2], 4, seed=73, labels=[[1, 1, 2], [], [5], [3, 3]], device=device)
    arguments = (batch.cu_seqlens, batch.targets, batch.target_lengths, 0, 16)
    torch.library.opcheck(torch.ops.packed_kernels.ctc_align.default, (log_probs_of(batch, torch.float32),
                                                                         *arguments))
    torch.library.opcheck(torch.ops.packed_kernels.ctc_align_from_logits.default,
                          (batch.logits.float(), *arguments))


@pytest.mark.parametrize("form", ["padded", "concatenated-list"])
def test_torch_compile_fullgraph(device, form):
    """Traced without graph breaks, with padded targets, or 1-D targets and a list of lengths
    (the padding kernel is a custom op too)."""
    batch = make_batch([9, 5, 7], 7, [3, 2, 2], 4, seed=79, device=device)
    backend = "aot_eager" if runtime.INTERPRETED else "inductor"
    targets, lengths = batch.targets, batch.target_lengths
    if form == "concatenated-list":
        targets, lengths = concatenated(batch), batch.target_lengths.tolist()

    def step(logits, cu, targets, lengths):
        return pk.packed_ctc_align(logits.log_softmax(-1), cu, targets, lengths)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    logits = batch.logits.float()
    got = compiled(logits, batch.cu_seqlens, targets, lengths)
    expected = step(logits, batch.cu_seqlens, targets, lengths)
    for field, a, b in zip(pk.CTCAlignment._fields, got, expected):
        assert torch.equal(a, b), field


@contextlib.contextmanager
def kernels_compiled_for_the_gpu():
    """As on a machine whose kernels are compiled for a GPU: CPU tensors take the padded
    stage, and a kernel launch would fail the test."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("an alignment kernel was launched for tensors the kernels do not take")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime, "KERNEL_DEVICE", "cuda")
        patch.setattr(align_module, "ctc_align_triton", no_kernel)
        patch.setattr(align_module, "ctc_align_from_logits_triton", no_kernel)
        yield


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cpu_tensors_take_the_padded_stage(device, dtype):
    batch = make_batch([13, 1, 8, 0, 11], 9, [4, 1, 3, 0, 5], 7, seed=83, labels=[[2, 2]], device=device)
    log_probs = log_probs_of(batch, dtype)
    expected = align(batch, log_probs)
    expected_from_logits = pk.packed_ctc_align_from_logits(batch.logits.to(dtype), batch.cu_seqlens, batch.targets,
                                                           batch.target_lengths)
    cpu = [t.cpu() for t in (batch.cu_seqlens, batch.targets, batch.target_lengths)]
    with kernels_compiled_for_the_gpu():
        got = pk.packed_ctc_align(log_probs.cpu(), *cpu)
        got_from_logits = pk.packed_ctc_align_from_logits(batch.logits.to(dtype).cpu(), *cpu)
        concatenated = pk.packed_ctc_align(log_probs.cpu(), cpu[0], torch.tensor([2, 2, 5, 1, 1, 3, 4, 5, 1, 2, 3,
                                                                                  4, 5]), cpu[2])
    for field, a, b in zip(pk.CTCAlignment._fields, got, expected):
        assert torch.equal(a, b.cpu()), field
    tolerance = SCORE_TOLERANCE[torch.float64 if dtype == torch.float64 else torch.float32]
    for field, a, b in zip(pk.CTCAlignment._fields, got_from_logits, expected_from_logits):
        assert_close(f"from logits: {field}", a, b, atol=tolerance, rtol=tolerance)
    assert concatenated.span_offsets.tolist() == [0, 4, 5, 8, 8, 13]


FALLBACK_BAD_INPUTS = ["cu_seqlens-not-from-0", "cu_seqlens-decreasing", "targets-negative-id",
                       "target_lengths-too-long", "targets-1d-lengths-sum-short"]


@pytest.mark.parametrize("case", FALLBACK_BAD_INPUTS, ids=FALLBACK_BAD_INPUTS)
def test_cpu_tensors_checked_on_the_padded_stage(case):
    change, error, _, words = BAD_INPUTS[case]
    arguments = change(good_arguments("cpu"), "cpu")
    with kernels_compiled_for_the_gpu(), pytest.raises(error, match=re.escape(as_aligner(words))):
        pk.packed_ctc_align(**arguments)


# --------------------------------------------------------------------------------------
# bad input: packed_ctc_loss's table, naming the aligner


def as_aligner(words: str, function: str = "packed_ctc_align", rows: str = "log_probs") -> str:
    return words.replace("packed_ctc_loss:", f"{function}:").replace("log_probs.shape", f"{rows}.shape")


#: The rows of packed_ctc_loss's table about arguments the aligner takes too.
ALIGN_BAD_INPUTS = [name for name, row in BAD_INPUTS.items() if row[2] not in ("reduction", "zero_infinity")]


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("function", ["packed_ctc_align", "packed_ctc_align_from_logits"])
@pytest.mark.parametrize("case", ALIGN_BAD_INPUTS, ids=ALIGN_BAD_INPUTS)
def test_bad_input(device, case, function, strict):
    """The errors of ``packed_ctc_loss``, from the aligners: shapes, dtypes and devices at
    once; values checked on the device, raised within the call in strict mode (and for CPU
    tensors), otherwise by ``check_errors``."""
    change, error, argument, words = BAD_INPUTS[case]
    arguments = change(good_arguments(device), device)
    rows = "log_probs" if function == "packed_ctc_align" else "logits"
    if function != "packed_ctc_align":
        arguments["logits"] = arguments.pop("log_probs")
        words = words.replace("log_probs", "logits")
        argument = "logits" if argument == "log_probs" else argument
    words = as_aligner(words, function, rows)
    with pytest.raises(error, match=re.escape(words)) as raised, pk.strict_checks(strict):
        getattr(pk, function)(**arguments)
        if not strict:
            pk.check_errors()
    message = str(raised.value)
    assert message.startswith(f"{argument} ") or message.startswith(f"{function}: {argument} "), message
    pk.check_errors()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", list(EMPTY_BATCHES))
def test_no_utterances_checked(device, case, strict):
    T_total, cu, message = EMPTY_BATCHES[case]
    arguments = dict(log_probs=torch.zeros(T_total, 5, device=device), cu_seqlens=torch.tensor(cu, device=device),
                     targets=torch.zeros(0, 3, dtype=torch.long, device=device),
                     target_lengths=torch.zeros(0, dtype=torch.long, device=device))
    if message is None:
        assert pk.packed_ctc_align(**arguments).log_likelihood.shape == (0,)
        return
    with pytest.raises(ValueError, match="^" + re.escape(as_aligner(message))), pk.strict_checks(strict):
        pk.packed_ctc_align(**arguments)
        if not strict:
            pk.check_errors()


# --------------------------------------------------------------------------------------
# lengths as lists, targets concatenated: the same results in all five functions


def concatenated(batch) -> torch.Tensor:
    return torch.cat([batch.targets[b, :L] for b, L in enumerate(batch.target_lengths.tolist())])


def _five_functions(batch, targets, target_lengths):
    """Each function's result on one batch, given ``targets`` and ``target_lengths``."""
    cu = batch.cu_seqlens
    logits = batch.logits
    weight = torch.linspace(-1, 1, logits.shape[1] * logits.shape[1], dtype=logits.dtype,
                            device=logits.device).reshape(logits.shape[1], -1)
    return {
        "packed_ctc_loss": pk.packed_ctc_loss(batch.log_probs, cu, targets, target_lengths, reduction="none"),
        "packed_ctc_loss_from_logits": pk.packed_ctc_loss_from_logits(logits, cu, targets, target_lengths,
                                                                      reduction="mean"),
        "linear_packed_ctc_loss": pk.linear_packed_ctc_loss(logits, weight, None, cu, targets, target_lengths,
                                                            reduction="sum", chunk_frames=5),
        "packed_ctc_align": pk.packed_ctc_align(batch.log_probs, cu, targets, target_lengths),
        "packed_ctc_align_from_logits": pk.packed_ctc_align_from_logits(logits, cu, targets, target_lengths),
    }


def _same_result(name, got, expected, batch):
    if isinstance(expected, pk.CTCAlignment):
        for field in ("labels", "tokens", "scores", "span_offsets", "log_likelihood"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), f"{name}: {field}"
        for b in range(len(batch.target_lengths)):
            assert torch.equal(utterance_spans(got, b), utterance_spans(expected, b)), f"{name}: spans"
    else:
        assert_close(name, got, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("form", ["lengths-list", "targets-1d", "targets-1d-lengths-list"])
def test_lists_and_concatenated_targets_give_the_same_results(device, form):
    batch = make_batch([9, 0, 7, 4], 6, [3, 0, 2, 2], 5, seed=89, labels=[[1, 1, 2]], device=device)
    expected = _five_functions(batch, batch.targets, batch.target_lengths)
    targets = concatenated(batch) if form.startswith("targets-1d") else batch.targets
    lengths = batch.target_lengths.tolist() if form.endswith("lengths-list") else batch.target_lengths
    got = _five_functions(batch, targets, lengths)
    for name in expected:
        _same_result(f"{form} {name}", got[name], expected[name], batch)
    if form.startswith("targets-1d"):
        assert got["packed_ctc_align"].spans.shape == (7, 2)  # one row per id of the concatenated targets


def test_concatenated_targets_with_int32_and_tuples(device):
    batch = make_batch([6, 8], 5, [2, 3], seed=97, device=device)
    expected = pk.packed_ctc_align(batch.log_probs, batch.cu_seqlens, batch.targets, batch.target_lengths)
    got = pk.packed_ctc_align(batch.log_probs, batch.cu_seqlens, concatenated(batch).int(), (2, 3))
    _same_result("int32 1-D targets, tuple lengths", got, expected, batch)


# --------------------------------------------------------------------------------------
# the benchmark's alignment providers (on the CPU, at a tiny size)


def test_bench_align_providers_agree(monkeypatch):
    """Each provider factory of the ``align`` workload aligns the same batch: the packed
    kernel, the padded stage, the NumPy stage (and torchaudio, where installed) give one
    path per utterance."""
    from packed_kernels.bench import ctc as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    input_lengths, target_lengths = bench.utterance_lengths(3, 12, 3, seed=5)
    frames = input_lengths.tolist()
    paths = {}
    for name in ("triton", "padded", "numpy", "torchaudio_loop"):
        if name == "torchaudio_loop" and bench._torchaudio_forced_align() is None:
            continue
        result = bench._align_provider(name, 3, 12, 9, input_lengths, target_lengths, seed=7)()()
        if name == "triton":
            cu = np.cumsum([0] + frames)
            paths[name] = [result.labels[cu[b]:cu[b + 1]].tolist() for b in range(3)]
        elif name == "padded":
            paths[name] = [result.labels[b, :frames[b]].tolist() for b in range(3)]
        elif name == "numpy":
            paths[name] = [labels.tolist() for labels, *_ in result]
        else:
            paths[name] = [labels[0].tolist() for labels, _ in result]
    assert all(path == paths["numpy"] for path in paths.values()), paths
    cases = [case for case in bench.cases() if case.workload == "align"]
    assert [case.params["B"] for case in cases] == list(bench.ALIGN_BATCHES)
    assert all({"triton", "padded"} <= set(case.providers) for case in cases)
    assert [("numpy" in case.providers) for case in cases] == [B == 1 for B in bench.ALIGN_BATCHES]


# --------------------------------------------------------------------------------------
# the choice words


def test_choice_words_per_frame():
    """Two bits per state, sixteen states per int32 word: ``ceil((2U + 1) / 16)`` words."""
    assert [choice_words_per_frame(U) for U in (0, 7, 8, 15, 16, 100)] == [1, 1, 2, 2, 3, 13]


# --------------------------------------------------------------------------------------
# on the GPU: no host synchronisation, CUDA graphs, CPU tensors beside the kernels


@pytest.mark.gpu_only
def test_eager_calls_never_synchronise():
    """Under ``set_sync_debug_mode("error")``, and queued behind about a second of GPU work,
    each call returns at once: tensors, lengths as a list (a pinned copy), 1-D targets."""
    batch = make_batch([30, 12, 25, 0], 11, [6, 3, 5, 0], 8, seed=101, device="cuda")
    log_probs, logits, cu = batch.log_probs.float(), batch.logits.float(), batch.cu_seqlens
    flat, lengths, listed = concatenated(batch), batch.target_lengths, batch.target_lengths.tolist()
    leaf = log_probs.detach().requires_grad_()
    calls = {
        "align": lambda: pk.packed_ctc_align(log_probs, cu, batch.targets, lengths),
        "align, lengths as a list": lambda: pk.packed_ctc_align(log_probs, cu, batch.targets, listed),
        "align, 1-D targets": lambda: pk.packed_ctc_align(log_probs, cu, flat, lengths),
        "align from logits, 1-D targets and a list": lambda: pk.packed_ctc_align_from_logits(logits, cu, flat,
                                                                                             listed),
        "loss fwd+bwd, 1-D targets and a list": lambda: torch.autograd.grad(
            pk.packed_ctc_loss(leaf, cu, flat, listed), leaf),
    }
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU spin ahead of the call
        start = time.perf_counter()
        call()
        returned = time.perf_counter() - start
        torch.cuda.synchronize()
        assert returned < 0.25, f"{name} waited {returned:.3f} s for the GPU"
    pk.check_errors()


@pytest.mark.gpu_only
def test_cuda_graph_capture_and_replay():
    """Captured once, replayed with new frames, offsets, targets and lengths copied into the
    same buffers: each replay equals an eager call."""
    C, U = 11, 8
    batches = [
        make_batch([30, 12, 25, 0], C, [6, 3, 5, 0], U, seed=43, device="cuda"),
        make_batch([10, 30, 20, 7], C, [2, 8, 4, 3], U, seed=47, device="cuda"),
        make_batch([1, 1, 60, 5], C, [1, 0, 8, 5], U, seed=53, device="cuda"),
    ]
    T_total = batches[0].logits.shape[0]
    static = [torch.zeros(T_total, C, device="cuda"), torch.zeros(5, dtype=torch.int32, device="cuda"),
              torch.zeros(4, U, dtype=torch.long, device="cuda"), torch.zeros(4, dtype=torch.long, device="cuda")]

    def load(batch):
        for buffer, value in zip(static, (batch.log_probs.float(), batch.cu_seqlens, batch.targets.clamp(0, C - 1),
                                          batch.target_lengths)):
            buffer.copy_(value)

    load(batches[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            pk.packed_ctc_align(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = pk.packed_ctc_align(*static)
    for batch in batches[1:] + batches[:1]:
        load(batch)
        graph.replay()
        expected = pk.packed_ctc_align(*static)
        for field, a, b in zip(pk.CTCAlignment._fields, replayed, expected):
            assert torch.equal(a, b), field


@pytest.mark.gpu_only
def test_cpu_tensors_on_a_gpu_machine():
    """No patching: CPU tensors next to the compiled kernels take the padded stage, and give
    the CUDA result."""
    batch = make_batch([13, 1, 8, 0, 11], 9, [4, 1, 3, 0, 5], 7, seed=97, labels=[[2, 2]], device="cuda")
    for inputs in INPUTS:
        log_probs = log_probs_of(batch, torch.float32, inputs)
        expected = pk.packed_ctc_align(log_probs, batch.cu_seqlens, batch.targets, batch.target_lengths)
        got = pk.packed_ctc_align(log_probs.cpu(), batch.cu_seqlens.cpu(), batch.targets.cpu(),
                                  batch.target_lengths.cpu())
        assert got.labels.device.type == "cpu"
        for field, a, b in zip(pk.CTCAlignment._fields, got, expected):
            assert torch.equal(a, b.cpu()), f"{inputs} inputs: {field}"
