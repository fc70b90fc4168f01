"""PersistentLSTM and its stages against torch.nn.LSTM, on padded and packed batches."""
import enum
import warnings

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from packed_kernels import Packed, PersistentLSTM, pack, runtime, unpack
from packed_kernels.ops.lstm.api import _config_as_ints, lstm_recurrence_op
from packed_kernels.ops.lstm.naive_numpy import lstm_layer_numpy
from packed_kernels.ops.lstm.padded_torch import lstm_padded, lstm_weights
from packed_kernels.ops.lstm.triton_kernels import (
    RecurrenceConfig,
    RecurrentProduct,
    StepWait,
    choose_config,
    input_projection_triton,
)

from assertions import assert_close

ATOL = RTOL = 1e-5

ROW_SUMS, TENSOR_CORES, FOUR_GATES = RecurrentProduct.ROW_SUMS, RecurrentProduct.TENSOR_CORES, RecurrentProduct.FOUR_GATES
CTA_BARRIER, STEP_COUNTER = StepWait.CTA_BARRIER, StepWait.STEP_COUNTER
TAGGED_WORDS, TAGGED_WORDS_PTX = StepWait.TAGGED_WORDS, StepWait.TAGGED_WORDS_PTX


def _param_id(value):
    return value.name if isinstance(value, enum.Enum) else str(value)


def config_with_gate_default(**fields) -> RecurrenceConfig:
    """A configuration with ``fast_math`` where :func:`choose_config` puts it unless given:
    on for the CUDA-core products, off for the tensor cores."""
    fields.setdefault("fast_math", fields["product"] != TENSOR_CORES)
    return RecurrenceConfig(**fields)


def make_lstm(input_size, hidden_size, num_layers=1, bidirectional=False, bias=True, batch_first=True,
              device="cpu", dtype=torch.float32, seed=0, **kwargs):
    torch.manual_seed(seed)
    lstm = torch.nn.LSTM(input_size, hidden_size, num_layers=num_layers, bidirectional=bidirectional, bias=bias,
                         batch_first=batch_first, **kwargs)
    return lstm.to(device=device, dtype=dtype).eval()


def packed_reference(lstm, padded, lengths, hx=None):
    """nn.LSTM on a PackedSequence (any order of lengths), the output packed like ``pack``."""
    seq = pack_padded_sequence(padded, lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, state = lstm(seq, hx)
    out_padded, _ = pad_packed_sequence(out, batch_first=True, total_length=padded.shape[1])
    return pack(out_padded, lengths).data, state


def assert_runs_match(model, lstm, padded, lengths, runs, before_run=None):
    """``runs`` calls of ``model`` on the packed batch, every output against ``nn.LSTM``."""
    ref, (h_ref, c_ref) = packed_reference(lstm, padded, lengths)
    packed = pack(padded, lengths)
    for run in range(runs):
        if before_run is not None:
            before_run()
        out, (h, c) = model(packed)
        assert_close(f"y (run {run})", out.data, ref, atol=ATOL, rtol=RTOL)
        assert_close(f"h_n (run {run})", h, h_ref, atol=ATOL, rtol=RTOL)
        assert_close(f"c_n (run {run})", c, c_ref, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------
# The NumPy stage


@pytest.mark.parametrize("T,I,H", [(1, 3, 2), (9, 5, 7), (13, 1, 4)], ids=lambda v: str(v))
def test_numpy_layer_matches_nn_lstm_both_directions(T, I, H):
    lstm = make_lstm(I, H, bidirectional=True, dtype=torch.float64, seed=T)
    x = torch.randn(1, T, I, dtype=torch.float64)
    h0 = torch.randn(2, 1, H, dtype=torch.float64)
    c0 = torch.randn(2, 1, H, dtype=torch.float64)
    with torch.no_grad():
        ref, (h_n, c_n) = lstm(x, (h0, c0))
    for direction, suffix in enumerate(["", "_reverse"]):
        p = {name: getattr(lstm, f"{name}_l0{suffix}").detach().numpy()
             for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        y, (h, c) = lstm_layer_numpy(x[0].numpy(), p["weight_ih"], p["weight_hh"], p["bias_ih"], p["bias_hh"],
                                     h0[direction, 0].numpy(), c0[direction, 0].numpy(), reverse=direction == 1)
        assert_close(f"y[{direction}]", y, ref[0, :, direction * H:(direction + 1) * H], atol=1e-12, rtol=1e-12)
        assert_close(f"h_n[{direction}]", h, h_n[direction, 0], atol=1e-12, rtol=1e-12)
        assert_close(f"c_n[{direction}]", c, c_n[direction, 0], atol=1e-12, rtol=1e-12)


def test_numpy_layer_without_bias_and_state_saturates_cleanly():
    rng = np.random.default_rng(0)
    w_ih = rng.normal(size=(8, 3)) * 200.0  # huge pre-activations: sigmoid and tanh at their limits
    w_hh = rng.normal(size=(8, 2))
    y, (h, c) = lstm_layer_numpy(rng.normal(size=(4, 3)), w_ih, w_hh)
    assert np.all(np.isfinite(y)) and np.all(np.abs(y) <= 1.0)


# ----------------------------------------------------------------------------------------
# The padded PyTorch stage


@pytest.mark.parametrize("num_layers,bidirectional,bias", [(1, False, True), (2, True, True), (3, True, False)],
                         ids=["L1-uni", "L2-bi", "L3-bi-nobias"])
def test_padded_stage_matches_nn_lstm(num_layers, bidirectional, bias):
    lstm = make_lstm(5, 6, num_layers, bidirectional, bias, dtype=torch.float64)
    D = 2 if bidirectional else 1
    x = torch.randn(3, 8, 5, dtype=torch.float64)
    state_shape = (num_layers * D, 3, 6)
    hx = (torch.randn(state_shape, dtype=torch.float64), torch.randn(state_shape, dtype=torch.float64))
    with torch.no_grad():
        ref, (h_ref, c_ref) = lstm(x, hx)
        y, (h, c) = lstm_padded(x, lstm_weights(lstm), None, *hx)
    assert_close("y", y, ref, atol=1e-12, rtol=1e-12)
    assert_close("h_n", h, h_ref, atol=1e-12, rtol=1e-12)
    assert_close("c_n", c, c_ref, atol=1e-12, rtol=1e-12)


def test_padded_stage_with_lengths_matches_packed_sequence():
    lstm = make_lstm(4, 5, 2, True, dtype=torch.float64)
    lengths = torch.tensor([3, 7, 1, 5])
    x = torch.randn(4, 7, 4, dtype=torch.float64)
    with torch.no_grad():
        ref, (h_ref, c_ref) = packed_reference(lstm, x, lengths)
        y, (h, c) = lstm_padded(x, lstm_weights(lstm), lengths)
    assert_close("y", pack(y, lengths).data, ref, atol=1e-12, rtol=1e-12)
    assert torch.all(unpack(pack(y, lengths), 7) == y), "padding frames must be zero"
    assert_close("h_n", h, h_ref, atol=1e-12, rtol=1e-12)
    assert_close("c_n", c, c_ref, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------------------
# PersistentLSTM on padded input

PADDED_CASES = [
    # (B, T, I, H, num_layers, bidirectional, bias, batch_first)
    (1, 5, 3, 8, 1, False, True, True),
    (3, 7, 5, 12, 2, True, True, True),
    (2, 6, 4, 16, 1, True, False, False),
    (5, 4, 9, 20, 2, False, True, False),
    (4, 3, 2, 32, 1, True, True, True),
]


def _case_id(case):
    B, T, I, H, L, bi, bias, bf = case
    return f"B{B}-T{T}-I{I}-H{H}-L{L}" + ("-bi" if bi else "") + ("" if bias else "-nobias") + ("-bf" if bf else "-tf")


@pytest.mark.parametrize("case", PADDED_CASES, ids=_case_id)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
def test_persistent_matches_nn_lstm_padded(device, case, with_state):
    B, T, I, H, L, bi, bias, bf = case
    lstm = make_lstm(I, H, L, bi, bias, bf, device=device, seed=B * 100 + T)
    D = 2 if bi else 1
    x = torch.randn((B, T, I) if bf else (T, B, I), device=device)
    hx = (torch.randn(L * D, B, H, device=device), torch.randn(L * D, B, H, device=device)) if with_state else None
    model = PersistentLSTM.from_torch(lstm)
    with torch.no_grad():
        y, (h, c) = model(x, hx)
        ref, (h_ref, c_ref) = lstm(x, hx)
    assert_close("y", y, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


def test_persistent_unbatched_input(device):
    lstm = make_lstm(3, 10, 2, True, batch_first=False, device=device)
    x = torch.randn(6, 3, device=device)
    hx = (torch.randn(4, 10, device=device), torch.randn(4, 10, device=device))
    with torch.inference_mode():
        y, (h, c) = PersistentLSTM.from_torch(lstm)(x, hx)
        ref, (h_ref, c_ref) = lstm(x, hx)
    assert_close("y", y, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "tf"])
def test_persistent_padded_with_lengths_matches_packed_sequence(device, batch_first):
    lstm = make_lstm(4, 9, 2, True, batch_first=batch_first, device=device)
    lengths = torch.tensor([2, 6, 1, 4], device=device)
    x_bf = torch.randn(4, 6, 4, device=device)
    lstm_bf = make_lstm(4, 9, 2, True, batch_first=True, device=device)
    with torch.no_grad():
        y, (h, c) = PersistentLSTM.from_torch(lstm)(x_bf if batch_first else x_bf.transpose(0, 1), lengths=lengths)
        ref, (h_ref, c_ref) = packed_reference(lstm_bf, x_bf, lengths)
    y_bf = y if batch_first else y.transpose(0, 1)
    assert_close("y", pack(y_bf, lengths).data, ref, atol=ATOL, rtol=RTOL)
    assert torch.all(unpack(pack(y_bf, lengths), 6) == y_bf), "frames beyond each length must be zero"
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------
# PersistentLSTM on packed input


@pytest.mark.parametrize(
    "lengths", [[7], [1, 1, 1], [3, 9, 1, 5, 9, 2], [4, 4, 4, 4], [11, 2]], ids=lambda l: "L" + "-".join(map(str, l))
)
def test_persistent_packed_matches_packed_sequence(device, lengths):
    lstm = make_lstm(6, 14, 2, True, device=device, seed=len(lengths))
    lengths = torch.tensor(lengths, device=device)
    B, T = lengths.numel(), int(lengths.max())
    padded = torch.randn(B, T, 6, device=device)
    hx = (torch.randn(4, B, 14, device=device), torch.randn(4, B, 14, device=device))
    with torch.no_grad():
        out, (h, c) = PersistentLSTM.from_torch(lstm)(pack(padded, lengths), hx)
        ref, (h_ref, c_ref) = packed_reference(lstm, padded, lengths, hx)
    assert isinstance(out, Packed)
    assert torch.equal(out.cu_seqlens, pack(padded, lengths).cu_seqlens) and torch.equal(out.lengths, lengths)
    assert_close("y", out.data, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


def test_persistent_packed_each_sequence_alone(device):
    """A packed batch equals each sequence run on its own (no leak between sequences)."""
    lstm = make_lstm(3, 8, 1, True, device=device)
    lengths = [5, 1, 3]
    padded = torch.randn(3, 5, 3, device=device)
    model = PersistentLSTM.from_torch(lstm)
    with torch.no_grad():
        out, (h, c) = model(pack(padded, lengths))
        for b, n in enumerate(lengths):
            ref, (h_ref, c_ref) = lstm(padded[b:b + 1, :n])
            start = sum(lengths[:b])
            assert_close(f"y[{b}]", out.data[start:start + n], ref[0], atol=ATOL, rtol=RTOL)
            assert_close(f"h_n[{b}]", h[:, b], h_ref[:, 0], atol=ATOL, rtol=RTOL)
            assert_close(f"c_n[{b}]", c[:, b], c_ref[:, 0], atol=ATOL, rtol=RTOL)


def test_persistent_packed_zero_length_and_empty(device):
    lstm = make_lstm(3, 8, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([4, 0, 2], device=device)
    padded = torch.randn(3, 4, 3, device=device)
    hx = (torch.randn(4, 3, 8, device=device), torch.randn(4, 3, 8, device=device))
    with torch.no_grad():
        out, (h, c) = model(pack(padded, lengths), hx)
        ref, (h_ref, c_ref) = lstm_padded(padded, lstm_weights(lstm), lengths, *hx)
    assert_close("y", out.data, pack(ref, lengths).data, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(h[:, 1], hx[0][:, 1]) and torch.equal(c[:, 1], hx[1][:, 1]), "empty sequence keeps its state"
    empty = pack(torch.zeros(0, 0, 3, device=device), torch.zeros(0, dtype=torch.int64))
    with torch.no_grad():
        out, (h, c) = model(empty)
    assert out.data.shape == (0, 16) and h.shape == (4, 0, 8) and c.shape == (4, 0, 8)


# ----------------------------------------------------------------------------------------
# The kernel's configurations that the interpreter can run


@pytest.mark.parametrize("product,rows_per_tile,prefetch_steps,l2_prefetch_steps,tiles_per_program",
                         [(ROW_SUMS, 2, 1, 0, 1), (TENSOR_CORES, 16, 2, 0, 1), (FOUR_GATES, 1, 2, 0, 1),
                          (FOUR_GATES, 4, 1, 0, 1),
                          # L2 prefetch of later steps' inputs (GPU only: ignored by the interpreter)
                          (FOUR_GATES, 1, 2, 8, 1), (ROW_SUMS, 2, 1, 3, 1),
                          # several tiles per program, one after another
                          (FOUR_GATES, 1, 2, 0, 2), (FOUR_GATES, 1, 1, 0, 4), (ROW_SUMS, 2, 2, 0, 3),
                          (TENSOR_CORES, 16, 1, 0, 2)],
                         ids=_param_id)
def test_single_program_configurations(device, product, rows_per_tile, prefetch_steps, l2_prefetch_steps,
                                       tiles_per_program):
    lstm = make_lstm(5, 24, 1, True, device=device)
    lengths = torch.tensor([6, 2, 5], device=device)
    padded = torch.randn(3, 6, 5, device=device)
    config = config_with_gate_default(
        programs_per_tile=1, rows_per_tile=rows_per_tile, product=product, wait=CTA_BARRIER, num_warps=4,
        prefetch_steps=prefetch_steps, l2_prefetch_steps=l2_prefetch_steps, tiles_per_program=tiles_per_program)
    with torch.no_grad():
        assert_runs_match(PersistentLSTM.from_torch(lstm, config), lstm, padded, lengths, 1)


@pytest.mark.parametrize("M,K,N,bias,row_stride", [(7, 60, 1024, True, 60), (300, 256, 512, False, 256),
                                                     (129, 33, 130, True, 40), (1, 1, 16, True, 1),
                                                     (0, 8, 16, True, 8), (3, 0, 16, True, 0), (3, 0, 16, False, 0)],
                         ids=lambda v: str(v))
def test_input_projection_matches_float64(device, M, K, N, bias, row_stride):
    """tf32x3 on tensor cores: as accurate as a float32 product (against float64)."""
    g = torch.Generator().manual_seed(M * 7 + K)
    x = torch.randn(M, max(row_stride, K), generator=g).to(device)[:, :K]  # row stride >= K, unit columns
    w = torch.randn(N, K, generator=g).to(device)
    b = torch.randn(N, generator=g).to(device) if bias else None
    y = input_projection_triton(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    fp32 = x @ w.T + (b if bias else 0)
    assert y.shape == (M, N) and y.dtype == torch.float32
    if M and N:
        err, err_fp32 = (y.double() - ref).abs().max().item(), (fp32.double() - ref).abs().max().item()
        assert err <= 4 * err_fp32 + 1e-6, (err, err_fp32)


def test_configuration_checks(device):
    lstm = make_lstm(3, 16, 1, False, device=device)
    x = torch.randn(2, 3, 3, device=device)
    single = dict(programs_per_tile=1, rows_per_tile=2, product=ROW_SUMS, wait=CTA_BARRIER)
    with pytest.raises(TypeError):
        RecurrenceConfig(1, 2, ROW_SUMS, CTA_BARRIER)  # keyword-only
    with pytest.raises(ValueError, match="FOUR_GATES needs rows_per_tile < 16"):
        RecurrenceConfig(**dict(single, rows_per_tile=16, product=FOUR_GATES))
    with pytest.raises(ValueError, match="programs_per_tile=2 needs wait STEP_COUNTER, TAGGED_WORDS or TAGGED_WORDS_PTX"):
        RecurrenceConfig(**dict(single, programs_per_tile=2))
    with pytest.raises(ValueError, match="programs_per_tile=1 needs wait CTA_BARRIER"):
        RecurrenceConfig(**dict(single, wait=TAGGED_WORDS))
    with pytest.raises(TypeError, match="wait must be a StepWait"):
        RecurrenceConfig(**dict(single, programs_per_tile=2, wait=4))
    with pytest.raises(TypeError, match="product must be a RecurrentProduct"):
        RecurrenceConfig(**dict(single, product=0))
    with pytest.raises(ValueError, match="TAGGED_WORDS_PTX takes at most 3 tiles_per_program"):
        RecurrenceConfig(**dict(single, programs_per_tile=2, product=FOUR_GATES, wait=TAGGED_WORDS_PTX,
                                tiles_per_program=4))
    with pytest.raises(ValueError, match="l2_prefetch_steps"):
        RecurrenceConfig(**single, l2_prefetch_steps=-1)
    with pytest.raises(ValueError, match="tiles_per_program"):
        RecurrenceConfig(**single, tiles_per_program=0)
    with pytest.raises(ValueError, match="rows_per_tile must be a power of two"):
        RecurrenceConfig(**dict(single, rows_per_tile=3))
    with pytest.raises(ValueError, match="prefetch_steps"):
        RecurrenceConfig(**single, prefetch_steps=3)
    with pytest.raises(TypeError, match="fast_math"):
        RecurrenceConfig(**single, fast_math=1)
    with pytest.raises(TypeError, match="config must be a RecurrenceConfig"):
        PersistentLSTM.from_torch(lstm, dict(single))
    with torch.no_grad(), pytest.raises(ValueError, match="must divide"):
        PersistentLSTM.from_torch(lstm, RecurrenceConfig(**dict(single, programs_per_tile=3, wait=STEP_COUNTER)))(x)
    config = choose_config(37, 128, 2, torch.device(device), frames=37 * 20)
    if runtime.INTERPRETED:
        assert config.programs_per_tile == 1 and config.wait == CTA_BARRIER and config.product == ROW_SUMS


# ----------------------------------------------------------------------------------------
# Autograd: the documented fallback


def test_autograd_falls_back_to_padded_stage_with_exact_gradients(device):
    lstm = make_lstm(4, 6, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 5, 4, device=device, requires_grad=True)
    with pytest.warns(UserWarning, match="padded PyTorch stage"):
        y, (h, c) = model(x)
    (y.square().sum() + h.sum() + c.sum()).backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in lstm.parameters()]
    x.grad = None
    lstm.zero_grad()
    lstm.train()  # cuDNN's RNN backward runs only in training mode (dropout is 0: same function)
    ref, (h_ref, c_ref) = lstm(x)
    (ref.square().sum() + h_ref.sum() + c_ref.sum()).backward()
    assert_close("y", y, ref, atol=ATOL, rtol=RTOL)
    assert_close("x.grad", grads[0], x.grad, atol=1e-5, rtol=1e-4)
    for (name, p), g in zip(lstm.named_parameters(), grads[1:]):
        assert_close(f"{name}.grad", g, p.grad, atol=1e-5, rtol=1e-4)


def test_autograd_fallback_packed_and_no_warning_under_no_grad(device):
    lstm = make_lstm(3, 5, 1, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([3, 1], device=device)
    padded = torch.randn(2, 3, 3, device=device)
    with pytest.warns(UserWarning):
        out, _ = model(pack(padded, lengths))  # the parameters require grad
    assert out.data.requires_grad
    out.data.sum().backward()
    assert lstm.weight_hh_l0_reverse.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(pack(padded, lengths))


# ----------------------------------------------------------------------------------------
# Traced calls: each layer's recurrence is one opaque custom op


def _recurrence_calls(graph) -> int:
    return sum(node.target is torch.ops.packed_kernels.lstm_recurrence.default for node in graph.nodes)


def test_traced_call_runs_the_custom_op(device):
    """Under a dispatch mode (here make_fx's tracing) each layer is one
    ``packed_kernels::lstm_recurrence``, and the traced graph computes the same."""
    lstm = make_lstm(4, 9, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([5, 2, 4], device=device)
    padded = torch.randn(3, 5, 4, device=device)
    with torch.no_grad():
        traced = make_fx(lambda x, lengths: model(x, lengths=lengths))(padded, lengths)
        assert _recurrence_calls(traced.graph) == 2
        y, (h, c) = traced(padded, lengths)
        ref, (h_ref, c_ref) = packed_reference(lstm, padded, lengths)
    assert_close("y", pack(y, lengths).data, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


def test_compiled_call_is_one_graph(device):
    """``torch.compile(fullgraph=True)`` traces the whole call, the recurrences as custom ops
    (Dynamo steps into a module holding an ``nn.LSTM`` only with ``allow_rnn``)."""
    lstm = make_lstm(3, 8, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        y, (h, c) = torch.compile(model, backend=backend, fullgraph=True)(x)
        ref, (h_ref, c_ref) = lstm(x)
    assert len(graphs) == 1 and _recurrence_calls(graphs[0].graph) == 2
    assert_close("y", y, ref, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert_close("c_n", c, c_ref, atol=ATOL, rtol=RTOL)


def test_recurrence_op_schema_and_fake(device):
    D, B, H, N = 2, 3, 8, 12
    g = torch.Generator().manual_seed(0)
    xw = torch.randn(N, D * 4 * H, generator=g).to(device)
    w_hh = (torch.randn(D, 4 * H, H, generator=g) * 0.3).to(device)
    w_hh_t = w_hh.view(D, 4, H, H).transpose(2, 3).contiguous()
    h0, c0 = torch.randn(D, B, H, generator=g).to(device), torch.randn(D, B, H, generator=g).to(device)
    row_start = torch.tensor([0, 4, 8], device=device)
    lengths = torch.tensor([4, 2, 3], dtype=torch.int32, device=device)
    config = _config_as_ints(choose_config(B, H, D, xw.device, frames=N))
    torch.library.opcheck(lstm_recurrence_op.custom_op,
                          (xw, w_hh, w_hh_t, h0, c0, row_start, lengths, 1, True, config))


# ----------------------------------------------------------------------------------------
# Bad input


def test_unsupported_modules():
    with pytest.raises(ValueError, match="proj_size"):
        PersistentLSTM.from_torch(torch.nn.LSTM(3, 8, proj_size=4))
    with pytest.raises(TypeError, match="float32"):
        PersistentLSTM.from_torch(torch.nn.LSTM(3, 8).double())
    with pytest.raises(TypeError, match="nn.LSTM"):
        PersistentLSTM.from_torch(torch.nn.GRU(3, 8))
    with pytest.raises(ValueError, match="hidden_size=600"):
        PersistentLSTM.from_torch(torch.nn.LSTM(3, 600))
    model = PersistentLSTM.from_torch(torch.nn.LSTM(3, 8, num_layers=2, dropout=0.5).train())
    with pytest.raises(ValueError, match="dropout"):
        with torch.no_grad():
            model(torch.randn(4, 2, 3))


def test_bad_inputs(device):
    lstm = make_lstm(3, 8, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    with torch.no_grad():
        with pytest.raises(ValueError, match="3 features"):
            model(torch.randn(2, 4, 5, device=device))
        with pytest.raises(TypeError, match="float32"):
            model(x.double())
        with pytest.raises(ValueError, match="3-D"):
            model(x[None])
        with pytest.raises(ValueError, match="device|meta"):
            model(x.to("meta"))
        with pytest.raises(TypeError, match="Packed"):
            model(pack_padded_sequence(x, [4, 2], batch_first=True))
        with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=4\]"):
            model(x, lengths=torch.tensor([5, 2]))
        with pytest.raises(ValueError, match=r"lengths must lie"):
            model(x, lengths=torch.tensor([-1, 2]))
        with pytest.raises(ValueError, match="shape"):
            model(x, lengths=torch.tensor([4, 2, 1]))
        with pytest.raises(TypeError, match="lengths must be int32 or int64"):
            model(x, lengths=torch.tensor([4.0, 2.0]))
        with pytest.raises(ValueError, match="h0 must have shape"):
            model(x, (torch.zeros(4, 3, 8, device=device), torch.zeros(4, 2, 8, device=device)))
        with pytest.raises(TypeError, match="c0 must be float32"):
            model(x, (torch.zeros(4, 2, 8, device=device), torch.zeros(4, 2, 8, device=device, dtype=torch.float64)))
        with pytest.raises(TypeError, match="tuple"):
            model(x, torch.zeros(4, 2, 8, device=device))
        packed = pack(x, [4, 2])
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(Packed(packed.data, packed.cu_seqlens.flip(0), packed.lengths))
        with pytest.raises(ValueError, match="rows"):
            model(Packed(packed.data[:-1], packed.cu_seqlens, packed.lengths))
        with pytest.raises(ValueError, match=">= 0"):
            model(Packed(packed.data, packed.cu_seqlens, torch.tensor([7, -1], device=device)))
        with pytest.raises(ValueError, match="lengths must not be given"):
            model(packed, lengths=packed.lengths)


# ----------------------------------------------------------------------------------------
# The cooperative configuration: only compiled on a GPU (its programs wait for each other)

gpu_only = pytest.mark.skipif(runtime.INTERPRETED, reason="programs that wait on each other deadlock "
                              "under the interpreter, which runs them one at a time")


@gpu_only
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


@gpu_only
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
    ids=_param_id)
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


@gpu_only
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


@gpu_only
def test_cooperative_grid_never_exceeds_the_sm_count():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B in (1, 8, 32, 128):
        cfg = choose_config(B, 128, 2, torch.device("cuda"), frames=589 * B)
        assert cfg.programs_per_tile > 1 and cfg.wait == TAGGED_WORDS_PTX, ("pyannote shapes cooperate, polling in PTX",
                                                                            cfg)
    for B in (1, 7, 32, 100, 128, 1000):
        for H in (16, 100, 128, 256, 512):
            for D in (1, 2):
                cfg = choose_config(B, H, D, torch.device("cuda"), frames=96 * B)
                words = cfg.rows_per_tile * max(runtime.next_power_of_2(H), 16)  # of a tile
                ptx = H <= 128 and words <= 32 * cfg.num_warps and cfg.tiles_per_program <= 3
                cooperative = TAGGED_WORDS_PTX if ptx else TAGGED_WORDS
                expected = (CTA_BARRIER if cfg.programs_per_tile == 1 else
                            STEP_COUNTER if cfg.product == TENSOR_CORES else cooperative)
                assert cfg.wait == expected, cfg
                assert cfg.product in (TENSOR_CORES, FOUR_GATES), cfg
                assert cfg.fast_math == (cfg.product == FOUR_GATES), cfg
                per_launch = min(-(-B // (cfg.rows_per_tile * cfg.tiles_per_program)),
                                 sms // (D * cfg.programs_per_tile))
                assert cfg.programs_per_tile * per_launch * D <= sms, (B, H, D, cfg)
    lstm = make_lstm(3, 128, 1, True, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match="resident"):
        too_many = RecurrenceConfig(programs_per_tile=128, rows_per_tile=1, product=ROW_SUMS, wait=STEP_COUNTER)
        PersistentLSTM.from_torch(lstm, too_many)(torch.randn(2, 2, 3, device="cuda"))


@gpu_only
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


@gpu_only
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


@gpu_only
@pytest.mark.parametrize("batch", [128, 256])
def test_large_batch_defaults(batch):
    """Hidden 128: batch 128 runs one launch of CUDA-core programs with two tiles each,
    batch 256 one launch of 16-row tensor-core programs (tf32x3); both must match cuDNN
    in float32 to the same tolerance, run after run."""
    cfg = choose_config(batch, 128, 2, torch.device("cuda"), frames=40 * batch)
    if batch == 256:
        assert cfg.product == TENSOR_CORES and cfg.rows_per_tile == 16, cfg
    else:
        assert cfg.product == FOUR_GATES and cfg.rows_per_tile == 2 and cfg.programs_per_tile == 2, cfg
        assert cfg.tiles_per_program == 2 and cfg.wait == TAGGED_WORDS_PTX, cfg
    lstm = make_lstm(60, 128, 2, True, device="cuda")
    lengths = torch.randint(1, 41, (batch,), generator=torch.Generator().manual_seed(5)).cuda()
    lengths[0] = 40
    padded = torch.randn(batch, 40, 60, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    with torch.no_grad():
        assert_runs_match(model, lstm, padded, lengths, 5)
        y = model(padded)[0]
        assert_close("padded y", y, lstm(padded)[0], atol=ATOL, rtol=RTOL)
