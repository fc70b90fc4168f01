"""PersistentLSTM on a CUDA GPU: the cooperative configurations (their programs wait
for each other, which deadlocks under the interpreter), CUDA graphs, and what a GPU
machine adds: cuDNN under autograd and autocast, CPU modules beside it."""
import time

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import packed_kernels as pk
from packed_kernels import Packed, PersistentLSTM, pack, unpack
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig

from assertions import assert_close
from lstm_cases import (
    ATOL, CTA_BARRIER, FOUR_GATES, HALF_ATOL, HALF_DTYPES, ROW_SUMS, RTOL, STEP_COUNTER, TAGGED_WORDS, TAGGED_WORDS_PTX,
    TENSOR_CORES, assert_outputs_close, assert_runs_match, config_with_gate_default, make_half_lstm, make_lstm,
    packed_reference, param_id,
)

@pytest.mark.gpu_only
@pytest.mark.parametrize("B,H", [(1, 128), (5, 40), (32, 128), (128, 128), (16, 256), (3, 200), (300, 64), (1000, 32)],
                         ids=lambda v: str(v))
def test_cooperative_default_configuration_repeated(B, H):
    """Every output of many runs under load equals nn.LSTM (a stale read would show up as a moving error)."""
    lstm = make_lstm(60, H, 2, True, device="cuda", seed=B + H)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.randint(1, 97, (B,), generator=torch.Generator().manual_seed(B)).cuda()
    lengths[0] = 96
    padded = torch.randn(B, 96, 60, device="cuda")
    busy = torch.randn(2048, 2048, device="cuda")

    def load():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            busy @ busy  # other work in flight on the GPU at the same time

    with torch.no_grad():
        assert_runs_match(model, lstm, padded, lengths, 10, before_run=load)
        torch.cuda.synchronize()


@pytest.mark.gpu_only
@pytest.mark.parametrize(
    "units,product,num_warps,prefetch_steps,wait,rows_per_tile",
    [(16, ROW_SUMS, 4, 1, STEP_COUNTER, 2), (16, FOUR_GATES, 4, 2, STEP_COUNTER, 2),
     (32, FOUR_GATES, 4, 1, STEP_COUNTER, 2), (8, FOUR_GATES, 2, 2, STEP_COUNTER, 2),
     (16, TENSOR_CORES, 4, 2, STEP_COUNTER, 16), (16, FOUR_GATES, 4, 1, STEP_COUNTER, 4),
     # step-tagged words; one row of 64 units over 4 or 8 warps holds every word in several threads
     (16, ROW_SUMS, 4, 1, TAGGED_WORDS, 2), (32, FOUR_GATES, 4, 1, TAGGED_WORDS, 4),
     (16, TENSOR_CORES, 4, 2, TAGGED_WORDS, 16),
     (16, FOUR_GATES, 4, 2, TAGGED_WORDS, 1), (32, FOUR_GATES, 8, 2, TAGGED_WORDS, 1),
     (32, FOUR_GATES, 8, 1, TAGGED_WORDS, 2), (8, FOUR_GATES, 2, 2, TAGGED_WORDS, 2),
     # the poll loop in PTX: one word a thread, words held twice, several words a thread
     (16, FOUR_GATES, 4, 2, TAGGED_WORDS_PTX, 1), (32, FOUR_GATES, 8, 2, TAGGED_WORDS_PTX, 1),
     (32, FOUR_GATES, 8, 1, TAGGED_WORDS_PTX, 2), (8, FOUR_GATES, 2, 2, TAGGED_WORDS_PTX, 2),
     (32, FOUR_GATES, 4, 1, TAGGED_WORDS_PTX, 4), (16, ROW_SUMS, 4, 1, TAGGED_WORDS_PTX, 2)],
    ids=param_id)
def test_cooperative_variants(units, product, num_warps, prefetch_steps, wait, rows_per_tile):
    lstm = make_lstm(13, 64, 2, True, device="cuda")
    lengths = torch.tensor([30, 17, 1, 9, 5, 2, 11], device="cuda")
    padded = torch.randn(7, 30, 13, device="cuda")
    config = config_with_gate_default(programs_per_tile=64 // units, rows_per_tile=rows_per_tile, product=product,
                                      wait=wait, num_warps=num_warps, prefetch_steps=prefetch_steps)
    with torch.no_grad():
        assert_runs_match(PersistentLSTM.from_torch(lstm, config), lstm, padded, lengths, 5)


# (programs_per_tile, rows_per_tile, product, wait, num_warps) and the options of each
COOPERATIVE_OPTIONS = [
    ((2, 1, FOUR_GATES, TAGGED_WORDS, 8), dict(prefetch_steps=2, l2_prefetch_steps=8)),
    ((2, 2, FOUR_GATES, TAGGED_WORDS, 8), dict(l2_prefetch_steps=1, fast_math=False)),
    ((4, 2, ROW_SUMS, STEP_COUNTER, 4), dict(l2_prefetch_steps=3)),
    ((4, 16, TENSOR_CORES, STEP_COUNTER, 4), dict(l2_prefetch_steps=8, fast_math=True)),
    ((1, 4, FOUR_GATES, CTA_BARRIER, 4), dict(l2_prefetch_steps=2, fast_math=True)),
    ((2, 1, FOUR_GATES, TAGGED_WORDS, 8), dict(prefetch_steps=2, l2_prefetch_steps=8, tiles_per_program=4)),
    ((2, 2, FOUR_GATES, TAGGED_WORDS, 8), dict(tiles_per_program=3)),
    ((4, 2, ROW_SUMS, STEP_COUNTER, 4), dict(tiles_per_program=2)),
    ((4, 16, TENSOR_CORES, STEP_COUNTER, 4), dict(tiles_per_program=2)),
    ((2, 2, FOUR_GATES, TAGGED_WORDS_PTX, 8), dict(tiles_per_program=3)),
    ((2, 1, FOUR_GATES, TAGGED_WORDS_PTX, 8), dict(prefetch_steps=2, l2_prefetch_steps=8, tiles_per_program=2)),
    ((2, 2, FOUR_GATES, TAGGED_WORDS_PTX, 8), dict(l2_prefetch_steps=1, fast_math=False, tiles_per_program=2)),
]


@pytest.mark.gpu_only
@pytest.mark.parametrize("config", [
    config_with_gate_default(programs_per_tile=k, rows_per_tile=rows, product=product, wait=wait, num_warps=warps,
                             **options)
    for (k, rows, product, wait, warps), options in COOPERATIVE_OPTIONS],
    ids=lambda c: f"K{c.programs_per_tile}-rows{c.rows_per_tile}-{c.product.name}-{c.wait.name}"
                  f"-l2{c.l2_prefetch_steps}-fast{c.fast_math}-tiles{c.tiles_per_program}")
def test_cooperative_options(config):
    """Prefetching into L2 is only a hint, the single-instruction gate arithmetic stays
    within 1e-5, and a program that runs several tiles one after another waits on the
    words of all of them: same results, including for sequences shorter than the
    look-ahead, a hidden size that leaves masked units, and tiles past the last sequence."""
    lstm = make_lstm(13, 40, 2, True, device="cuda")
    lengths = torch.tensor([30, 17, 1, 9, 5, 2, 11], device="cuda")
    padded = torch.randn(7, 30, 13, device="cuda")
    model = PersistentLSTM.from_torch(lstm, config)
    with torch.no_grad():
        assert_runs_match(model, lstm, padded, lengths, 3)
        out, (h, c) = model(padded)
        ref, (h_ref, c_ref) = lstm(padded)
        assert_close("y (padded)", out, ref, atol=ATOL, rtol=RTOL)
        assert_close("h_n (padded)", h, h_ref, atol=ATOL, rtol=RTOL)
        # saturated gates: e^z overflows and underflows in every step
        out, (h, c) = model(padded * 300)
        ref, (h_ref, c_ref) = lstm(padded * 300)
    assert_close("y (saturated)", out, ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n (saturated)", c, c_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu_only
def test_cooperative_launch_refuses_more_programs_than_sms():
    lstm = make_lstm(3, 128, 1, True, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match="resident"):
        too_many = RecurrenceConfig(programs_per_tile=128, rows_per_tile=1, product=ROW_SUMS, wait=STEP_COUNTER)
        PersistentLSTM.from_torch(lstm, too_many)(torch.randn(2, 2, 3, device="cuda"))


@pytest.mark.gpu_only
@pytest.mark.parametrize("tiles_per_program", [1, 3])
def test_batch_larger_than_one_launch_runs_in_several(tiles_per_program):
    """More rows than the GPU can hold cooperating at once: consecutive launches, same result."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lstm = make_lstm(5, 16, 2, True, device="cuda")
    # tiles_per_program * sms // 4 rows per launch
    config = config_with_gate_default(programs_per_tile=2, rows_per_tile=1, product=FOUR_GATES, wait=STEP_COUNTER,
                                      tiles_per_program=tiles_per_program)
    lengths = torch.randint(1, 20, (sms + 7,), generator=torch.Generator().manual_seed(3)).cuda()
    padded = torch.randn(sms + 7, 19, 5, device="cuda")
    hx = (torch.randn(4, sms + 7, 16, device="cuda"), torch.randn(4, sms + 7, 16, device="cuda"))
    with torch.no_grad():
        out, (h, c) = PersistentLSTM.from_torch(lstm, config)(pack(padded, lengths), hx)
        ref, (h_ref, c_ref) = packed_reference(lstm, padded, lengths, hx)
    assert_close("y", out.data, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu_only
def test_cuda_graph_capture_replays():
    """A captured call (the custom op path, no host reads) replays to the eager result."""
    lstm = make_lstm(60, 128, 2, True, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([50, 17, 33, 1, 50, 8, 2, 40], device="cuda")
    x = torch.randn(8, 50, 60, device="cuda")
    packed = pack(x, lengths)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile the kernels, prepare the weights
            model(x)
            model(packed)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, (h, c) = model(x)
            out, (h_packed, c_packed) = model(packed)
        x.copy_(torch.randn_like(x))
        packed.data.copy_(pack(x, lengths).data)
        graph.replay()
        ref, (h_ref, c_ref) = lstm(x)
        ref_packed, (h_ref_packed, _) = packed_reference(lstm, x, lengths)
    assert_close("y", y, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)
    assert_close("packed y", out.data, ref_packed, atol=ATOL, rtol=RTOL)
    assert_close("packed h_n", h_packed, h_ref_packed, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu_only
@pytest.mark.parametrize("batch", [128, 256])
def test_large_batch_defaults(batch):
    """Hidden 128: batch 128 runs one launch of CUDA-core programs with two tiles each,
    batch 256 one launch of 16-row tensor-core programs (tf32x3; the choice itself is
    held on the host by test_lstm_stages); both must match cuDNN in float32 to the same
    tolerance, run after run."""
    lstm = make_lstm(60, 128, 2, True, device="cuda")
    lengths = torch.randint(1, 41, (batch,), generator=torch.Generator().manual_seed(5)).cuda()
    lengths[0] = 40
    padded = torch.randn(batch, 40, 60, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    with torch.no_grad():
        assert_runs_match(model, lstm, padded, lengths, 5)
        y = model(padded)[0]
        assert_close("padded y", y, lstm(padded)[0], atol=ATOL, rtol=RTOL)


def _captured(model, x):
    """``model(x)`` warmed up on a side stream, then captured in a CUDA graph:
    ``(graph, outputs)``; replaying the graph rewrites the outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = model(x)
    return graph, outputs


@pytest.mark.gpu_only
def test_cuda_graph_replay_follows_weights_changed_through_data():
    """The kernels' weights are read from the parameters inside the captured graph: an
    update through ``.data`` after capture is seen at the next replay."""
    lstm = make_lstm(20, 64, 2, True, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(4, 30, 20, device="cuda")
    with torch.no_grad():
        graph, (y, (h, c)) = _captured(model, x)
        for p in lstm.parameters():
            p.data.mul_(0.5)
        graph.replay()
        assert_outputs_close((y, (h, c)), lstm(x))


#: The forms of a call: what to call the model with, from the padded batch and its lengths (CPU).
CALL_FORMS = {
    "padded": lambda x, lengths: ((x,), {}),
    "padded-lengths": lambda x, lengths: ((x,), {"lengths": lengths.cuda()}),
    "padded-host-lengths": lambda x, lengths: ((x,), {"lengths": lengths}),
    "packed": lambda x, lengths: ((pack(x, lengths.cuda()),), {}),
    "packed-sequence": lambda x, lengths: ((pack_padded_sequence(x, lengths, batch_first=True,
                                                                  enforce_sorted=False),), {}),
}


def _assert_call_matches(form, output, lstm, x, lengths):
    y, state = output
    if form == "padded":
        assert_outputs_close((y, state), lstm(x))
    elif form == "packed-sequence":
        ref, ref_state = lstm(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        assert_outputs_close((y.data, state), (ref.data, ref_state))
    else:
        assert_outputs_close((y.data if form == "packed" else pack(y, lengths).data, state),
                             packed_reference(lstm, x, lengths))


@pytest.mark.gpu_only
@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_calls_never_wait_for_the_gpu(form):
    """No form of call synchronises with the GPU (its values are checked on the device):
    none under sync debug mode "error", and each returns while the GPU still spins on
    about a second of work queued before it."""
    lstm = make_lstm(20, 64, 2, True, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([25, 7, 1, 12])
    x = torch.randn(4, 25, 20, device="cuda")
    args, kwargs = CALL_FORMS[form](x, lengths)
    with torch.no_grad(), pk.strict_checks(False):
        model(*args, **kwargs)  # compiles the kernels; allocates the error word and pinned blocks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.cuda._sleep(2_000_000_000)
            start = time.perf_counter()
            output = model(*args, **kwargs)
            elapsed = time.perf_counter() - start
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert elapsed < 0.5, f"the call took {elapsed:.3f} s: it waited for the GPU"
        _assert_call_matches(form, output, lstm, x, lengths)


#: (id, arguments from the padded batch x (4, 25, 20) of lengths [25, 7, 1, 12], the start of the message)
GPU_BAD_VALUES = [
    ("lengths-huge", lambda x: ((x,), {"lengths": torch.tensor([25, 2 ** 40, 1, -3], device="cuda")}),
     "PersistentLSTM: lengths must lie in [0, T]"),
    ("packed-cu_seqlens-past-rows", lambda x: ((Packed(pack(x, [25, 7, 1, 12]).data,
                                                      torch.tensor([0, 10 ** 6, -10 ** 6, 33, 45], device="cuda",
                                                                   dtype=torch.int32),
                                                      torch.tensor([25, 7, 1, 12], device="cuda")),), {}),
     "PersistentLSTM: packed.cu_seqlens must be [0, cumsum(packed.lengths)]"),
    ("packed-lengths-huge", lambda x: ((Packed(pack(x, [25, 7, 1, 12]).data[:40],
                                              torch.tensor([0, 25, 32, 33, 45], device="cuda", dtype=torch.int32),
                                              torch.tensor([25, 7, 1, 2 ** 40], device="cuda")),), {}),
     "PersistentLSTM: packed.cu_seqlens must be [0, cumsum(packed.lengths)]"),
]


@pytest.mark.gpu_only
@pytest.mark.parametrize("make,message", [case[1:] for case in GPU_BAD_VALUES],
                         ids=[case[0] for case in GPU_BAD_VALUES])
def test_bad_values_on_the_gpu_are_reported_without_a_wait(make, message):
    """Bad values stay inside the tensors (clamped on the device; the CUDA context stays
    usable) and are reported by check_errors in the default mode, within the call in strict
    mode; the next call is right."""
    lstm = make_lstm(20, 64, 2, True, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(4, 25, 20, device="cuda")
    args, kwargs = make(x)
    with torch.no_grad():
        with pk.strict_checks(False):
            model(*args, **kwargs)
            with pytest.raises(ValueError) as info:
                pk.check_errors()
        assert str(info.value).startswith(message), str(info.value)
        with pytest.raises(ValueError) as info, pk.strict_checks(True):
            model(*args, **kwargs)
        assert str(info.value).startswith(message), str(info.value)
        assert_outputs_close(model(x), lstm(x))


@pytest.mark.gpu_only
def test_autograd_on_the_gpu_is_cudnn():
    lstm = make_lstm(20, 64, 2, True, device="cuda").train()
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(3, 25, 20, device="cuda", requires_grad=True)
    with pytest.warns(UserWarning, match="a gradient is needed"):
        y, (h, c) = model(x)
    (y.square().sum() + h.sum()).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in lstm.parameters()]
    x.grad = None
    lstm.zero_grad()
    ref, (h_ref, c_ref) = lstm(x)
    (ref.square().sum() + h_ref.sum()).backward()
    assert torch.equal(y, ref) and torch.equal(h, h_ref) and torch.equal(c, c_ref)
    for (name, p), g in zip([("x", x)] + list(lstm.named_parameters()), grads):
        assert_close(f"{name}.grad", g, p.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu_only
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_autograd_in_eval_mode_on_the_gpu(packed):
    """cuDNN's RNN backward refuses eval mode; the module then differentiates through
    PyTorch's native LSTM, whose gradients match cuDNN's in training mode (dropout 0)."""
    lstm = make_lstm(20, 64, 2, True, device="cuda").eval()
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(3, 25, 20, device="cuda", requires_grad=True)
    lengths = torch.tensor([25, 7, 1])
    with pytest.warns(UserWarning, match="a gradient is needed"):
        y, (h, c) = model(pack(x, lengths)) if packed else model(x)
    y = unpack(y, total_length=25) if packed else y
    (y.square().sum() + h.sum()).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in lstm.parameters()]
    x.grad = None
    lstm.zero_grad()
    lstm.train()
    ref, (h_ref, c_ref) = lstm(torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
                               if packed else x)
    ref = torch.nn.utils.rnn.pad_packed_sequence(ref, batch_first=True, total_length=25)[0] if packed else ref
    (ref.square().sum() + h_ref.sum()).backward()
    assert_close("y", y, ref, atol=1e-5, rtol=1e-5)
    assert_close("h", h, h_ref, atol=1e-5, rtol=1e-5)
    for (name, p), g in zip([("x", x)] + list(lstm.named_parameters()), grads):
        assert_close(f"{name}.grad", g, p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast_on_the_gpu_is_nn_lstm_under_autocast(dtype):
    lstm = make_lstm(20, 64, 2, True, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(3, 25, 20, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        with pytest.warns(UserWarning, match="autocast is enabled for cuda"):
            y, (h, c) = model(x)
        ref, (h_ref, c_ref) = lstm(x)
    # nn.LSTM's own dtype under this autocast (cuDNN's LSTM need not give ``dtype`` itself)
    assert y.dtype == ref.dtype and ref.dtype in (torch.float16, torch.bfloat16)
    assert torch.equal(y, ref) and torch.equal(h, h_ref) and torch.equal(c, c_ref)


@pytest.mark.gpu_only
def test_cpu_module_on_a_gpu_machine_is_nn_lstm():
    lstm = make_lstm(5, 16, 2, True)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 7, 5)
    lengths = torch.tensor([7, 3])
    with torch.no_grad():
        y, (h, c) = model(x)
        ref, (h_ref, c_ref) = lstm(x)
        out, state = model(pack(x, lengths))
        assert_outputs_close((out.data, state), packed_reference(lstm, x, lengths))
    assert torch.equal(y, ref) and torch.equal(h, h_ref) and torch.equal(c, c_ref)


# ----------------------------------------------------------------------------------------
# Float16 and bfloat16: W_hh held and h exchanged in the dtype


def _busy_gpu():
    """Starts a float32 matmul on a side stream (other work in flight at the same time)."""
    busy = torch.randn(2048, 2048, device="cuda")

    def load():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            busy @ busy
    return load


def _assert_half_runs(model, f32, dtype, padded, lengths, runs, hx=None, atol=None):
    """``runs`` calls on the packed batch under a concurrent matmul: the first within
    ``atol`` (:data:`HALF_ATOL`) of the float32 module on the PackedSequence, every later
    one bitwise equal to it (the arithmetic is the same each run: a stale read of the
    exchange would change it)."""
    load = _busy_gpu()
    ref = packed_reference(f32, padded.float(), lengths, None if hx is None else tuple(t.float() for t in hx))
    packed = pack(padded, lengths)
    first = None
    for run in range(runs):
        load()
        out, (h, c) = model(packed, hx)
        assert out.data.dtype == h.dtype == c.dtype == dtype
        if first is None:
            first = (out.data, h, c)
            assert_outputs_close((out.data.float(), (h.float(), c.float())), ref, atol=atol or HALF_ATOL[dtype],
                                 rtol=0)
        else:
            for name, a, e in zip(("y", "h_n", "c_n"), (out.data, h, c), first):
                assert torch.equal(a, e), f"{name} of run {run} differs from run 0"
    torch.cuda.synchronize()


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("B,H", [(1, 128), (32, 128), (64, 128), (128, 128), (32, 256), (1, 512), (32, 512)],
                         ids=lambda v: str(v))
def test_half_default_configuration_repeated(dtype, B, H):
    """The default configurations of float16 and bfloat16 (cooperative CUDA-core programs,
    the tensor cores from two launches' worth of rows at hidden 128, hidden 512 with W_hh
    held in the dtype) under load, run after run."""
    lstm, f32, _ = make_half_lstm(dtype, 60, H, 2, True, device="cuda", seed=B + H)
    lengths = torch.randint(1, 65, (B,), generator=torch.Generator().manual_seed(B)).cuda()
    lengths[0] = 64
    padded = torch.randn(B, 64, 60, device="cuda").to(dtype)
    hx = tuple(torch.randn(4, B, H, device="cuda").to(dtype) for _ in range(2))
    with torch.no_grad():
        _assert_half_runs(PersistentLSTM.from_torch(lstm), f32, dtype, padded, lengths, 6, hx)


#: (programs_per_tile, rows_per_tile, product, wait, num_warps) and options, over hidden 40 or 64
HALF_VARIANTS = [
    ((4, 1, FOUR_GATES, TAGGED_WORDS_PTX, 4), dict(prefetch_steps=2)),
    ((2, 2, FOUR_GATES, TAGGED_WORDS, 8), dict(l2_prefetch_steps=2)),
    ((2, 2, FOUR_GATES, TAGGED_WORDS_PTX, 8), dict(tiles_per_program=2)),
    ((4, 2, FOUR_GATES, STEP_COUNTER, 4), dict()),
    ((4, 2, ROW_SUMS, STEP_COUNTER, 4), dict()),
    ((4, 2, ROW_SUMS, TAGGED_WORDS, 4), dict(fast_math=False)),
    ((2, 16, TENSOR_CORES, STEP_COUNTER, 4), dict()),
    ((4, 16, TENSOR_CORES, TAGGED_WORDS, 4), dict(prefetch_steps=2)),
    ((1, 4, FOUR_GATES, CTA_BARRIER, 4), dict()),
    ((1, 16, TENSOR_CORES, CTA_BARRIER, 4), dict()),
]


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [40, 64])
@pytest.mark.parametrize("config", [
    config_with_gate_default(programs_per_tile=k, rows_per_tile=rows, product=product, wait=wait, num_warps=warps,
                             **options)
    for (k, rows, product, wait, warps), options in HALF_VARIANTS],
    ids=lambda c: f"K{c.programs_per_tile}-rows{c.rows_per_tile}-{c.product.name}-{c.wait.name}"
                  f"-l2{c.l2_prefetch_steps}-tiles{c.tiles_per_program}")
def test_half_cooperative_variants(dtype, hidden, config):
    """Every product and wait with float16 and bfloat16 h words in the exchange, masked units
    (hidden 40), sequences shorter than the look-ahead, under load, run after run."""
    lstm, f32, _ = make_half_lstm(dtype, 13, hidden, 2, True, device="cuda")
    lengths = torch.tensor([30, 17, 1, 9, 5, 2, 11], device="cuda")
    padded = torch.randn(7, 30, 13, device="cuda").to(dtype)
    with torch.no_grad():
        _assert_half_runs(PersistentLSTM.from_torch(lstm, config), f32, dtype, padded, lengths, 3)


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_pyannote_stack_within_1e_2_of_float32(dtype):
    """The segmentation stack (60 inputs, 4 bidirectional layers of 128, 589 frames) at batch
    32: within 1e-2 of nn.LSTM in float32 (cuDNN, TF32 off) with the same rounded weights."""
    lstm, f32, _ = make_half_lstm(dtype, 60, 128, 4, True, device="cuda", seed=32)
    x = torch.randn(32, 589, 60, device="cuda").to(dtype)
    with torch.no_grad():
        y, (h, c) = PersistentLSTM.from_torch(lstm)(x)
        ref, (h_ref, c_ref) = f32(x.float())
    assert y.dtype == dtype
    assert_close("y", y.float(), ref, atol=1e-2, rtol=0)
    assert_close("h_n", h.float(), h_ref, atol=1e-2, rtol=0)
    assert_close("c_n", c.float(), c_ref, atol=2e-2, rtol=0)


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_cuda_graph_capture_replays(dtype):
    lstm, f32, _ = make_half_lstm(dtype, 60, 128, 2, True, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(8, 50, 60, device="cuda").to(dtype)
    with torch.no_grad():
        graph, (y, (h, c)) = _captured(model, x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_outputs_close((y.float(), (h.float(), c.float())), f32(x.float()), atol=HALF_ATOL[dtype], rtol=0)
