"""PersistentLSTM and its stages against torch.nn.LSTM, on padded and packed batches."""
import warnings

import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from packed_kernels import Packed, PersistentLSTM, pack, runtime, unpack
from packed_kernels.ops.lstm.naive_numpy import lstm_layer_numpy
from packed_kernels.ops.lstm.padded_torch import lstm_weights, padded_lstm
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig, choose_config, input_projection

from assertions import assert_close

ATOL = RTOL = 1e-5


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
        y, (h, c) = padded_lstm(x, lstm_weights(lstm), None, *hx)
    assert_close("y", y, ref, atol=1e-12, rtol=1e-12)
    assert_close("h_n", h, h_ref, atol=1e-12, rtol=1e-12)
    assert_close("c_n", c, c_ref, atol=1e-12, rtol=1e-12)


def test_padded_stage_with_lengths_matches_packed_sequence():
    lstm = make_lstm(4, 5, 2, True, dtype=torch.float64)
    lengths = torch.tensor([3, 7, 1, 5])
    x = torch.randn(4, 7, 4, dtype=torch.float64)
    with torch.no_grad():
        ref, (h_ref, c_ref) = packed_reference(lstm, x, lengths)
        y, (h, c) = padded_lstm(x, lstm_weights(lstm), lengths)
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
        ref, (h_ref, c_ref) = padded_lstm(padded, lstm_weights(lstm), lengths, *hx)
    assert_close("y", out.data, pack(ref, lengths).data, atol=ATOL, rtol=RTOL)
    assert_close("h_n", h, h_ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(h[:, 1], hx[0][:, 1]) and torch.equal(c[:, 1], hx[1][:, 1]), "empty sequence keeps its state"
    empty = pack(torch.zeros(0, 0, 3, device=device), torch.zeros(0, dtype=torch.int64))
    with torch.no_grad():
        out, (h, c) = model(empty)
    assert out.data.shape == (0, 16) and h.shape == (4, 0, 8) and c.shape == (4, 0, 8)


# ----------------------------------------------------------------------------------------
# The kernel's configurations that the interpreter can run


@pytest.mark.parametrize("matvec,block_b,prefetch,l2_prefetch,sub_tiles",
                         [(0, 2, 1, None, 1), (1, 4, 2, None, 1), (2, 1, 1, None, 1), (2, 8, 2, None, 1),
                          (3, 16, 2, None, 1), (4, 1, 2, None, 1), (4, 4, 1, None, 1),
                          # L2 prefetch of later steps' inputs (GPU only: ignored by the interpreter)
                          (4, 1, 2, 8, 1), (0, 2, 1, 3, 1),
                          # several tiles per program, one after another
                          (4, 1, 2, None, 2), (4, 1, 1, None, 4), (0, 2, 2, None, 3), (3, 16, 1, None, 2)],
                         ids=lambda v: str(v))
def test_single_program_configurations(device, matvec, block_b, prefetch, l2_prefetch, sub_tiles):
    lstm = make_lstm(5, 24, 1, True, device=device)
    lengths = torch.tensor([6, 2, 5], device=device)
    padded = torch.randn(3, 6, 5, device=device)
    config = RecurrenceConfig(1, block_b, matvec, 0, 4, prefetch=prefetch, l2_prefetch=l2_prefetch,
                              sub_tiles=sub_tiles)
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
    y = input_projection(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    fp32 = x @ w.T + (b if bias else 0)
    assert y.shape == (M, N) and y.dtype == torch.float32
    if M and N:
        err, err_fp32 = (y.double() - ref).abs().max().item(), (fp32.double() - ref).abs().max().item()
        assert err <= 4 * err_fp32 + 1e-6, (err, err_fp32)


def test_configuration_checks(device):
    lstm = make_lstm(3, 16, 1, False, device=device)
    x = torch.randn(2, 3, 3, device=device)
    with torch.no_grad():
        with pytest.raises(ValueError, match="block_b < 16"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(1, 16, 2, 0))(x)
        with pytest.raises(ValueError, match="matvec=4 needs block_b < 16"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(1, 16, 4, 0))(x)
        with pytest.raises(ValueError, match="needs sync 1"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(2, 2, 0, 0))(x)
        with pytest.raises(ValueError, match="needs sync 0 or 1"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(1, 2, 0, 2))(x)
        with pytest.raises(ValueError, match="needs sync 1, 2 or 3"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(2, 2, 0, 4))(x)
        with pytest.raises(ValueError, match="sync 3 takes at most 3 sub_tiles"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(2, 2, 4, 3, sub_tiles=4))(x)
        with pytest.raises(ValueError, match="must divide"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(3, 2, 0, 1))(x)
        with pytest.raises(ValueError, match="l2_prefetch"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(1, 2, 0, 0, l2_prefetch=-1))(x)
        with pytest.raises(ValueError, match="sub_tiles"):
            PersistentLSTM.from_torch(lstm, RecurrenceConfig(1, 2, 0, 0, sub_tiles=0))(x)
    config = choose_config(37, 128, 2, torch.device(device))
    if runtime.INTERPRETED:
        assert config.programs_per_tile == 1 and config.sync == 0


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
        with pytest.raises(TypeError, match="integer"):
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
    "units,matvec,num_warps,prefetch,sync,block_b",
    [(16, 0, 4, 1, 1, 2), (16, 1, 4, 1, 1, 16), (16, 2, 4, 2, 1, 2), (32, 2, 4, 1, 1, 2), (8, 2, 2, 2, 1, 2),
     (16, 3, 4, 2, 1, 16),
     # step-tagged words; one row of 64 units over 4 or 8 warps holds every word in several threads
     (16, 0, 4, 1, 2, 2), (16, 1, 4, 1, 2, 16), (16, 2, 4, 2, 2, 1), (32, 2, 8, 2, 2, 1), (32, 2, 4, 1, 2, 4),
     (8, 2, 2, 2, 2, 2), (16, 3, 4, 2, 2, 16),
     # the four gates as one product, with either wait
     (16, 4, 4, 2, 2, 1), (32, 4, 8, 2, 2, 1), (32, 4, 8, 1, 2, 2), (8, 4, 2, 2, 2, 2), (16, 4, 4, 1, 1, 4),
     # the poll loop in PTX: one word a thread, words held twice, several words a thread
     (16, 4, 4, 2, 3, 1), (32, 4, 8, 2, 3, 1), (32, 4, 8, 1, 3, 2), (8, 4, 2, 2, 3, 2), (32, 4, 4, 1, 3, 4),
     (16, 2, 4, 2, 3, 1), (16, 0, 4, 1, 3, 2)],
    ids=lambda v: str(v))
def test_cooperative_variants(units, matvec, num_warps, prefetch, sync, block_b):
    lstm = make_lstm(13, 64, 2, True, device="cuda")
    lengths = torch.tensor([30, 17, 1, 9, 5, 2, 11], device="cuda")
    padded = torch.randn(7, 30, 13, device="cuda")
    config = RecurrenceConfig(64 // units, block_b, matvec, sync, num_warps, prefetch=prefetch)
    with torch.no_grad():
        assert_runs_match(PersistentLSTM.from_torch(lstm, config), lstm, padded, lengths, 5)


@gpu_only
@pytest.mark.parametrize("config", [RecurrenceConfig(2, 1, 4, 2, 8, prefetch=2, l2_prefetch=8),
                                    RecurrenceConfig(2, 2, 4, 2, 8, l2_prefetch=1, fast_math=False),
                                    RecurrenceConfig(4, 2, 0, 1, 4, l2_prefetch=3),
                                    RecurrenceConfig(4, 16, 3, 1, 4, l2_prefetch=8, fast_math=True),
                                    RecurrenceConfig(1, 4, 4, 0, 4, l2_prefetch=2, fast_math=True),
                                    RecurrenceConfig(2, 1, 4, 2, 8, prefetch=2, l2_prefetch=8, sub_tiles=4),
                                    RecurrenceConfig(2, 2, 4, 2, 8, sub_tiles=3),
                                    RecurrenceConfig(4, 2, 0, 1, 4, sub_tiles=2),
                                    RecurrenceConfig(4, 16, 3, 1, 4, sub_tiles=2),
                                    RecurrenceConfig(2, 2, 4, 3, 8, sub_tiles=3),
                                    RecurrenceConfig(2, 1, 4, 3, 8, prefetch=2, l2_prefetch=8, sub_tiles=2),
                                    RecurrenceConfig(2, 2, 4, 3, 8, l2_prefetch=1, fast_math=False, sub_tiles=2)],
                         ids=lambda c: f"K{c.programs_per_tile}-b{c.block_b}-mv{c.matvec}-s{c.sync}-l2{c.l2_prefetch}"
                                       f"-fast{c.fast_math}-sub{c.sub_tiles}")
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
        cfg = choose_config(B, 128, 2, torch.device("cuda"))
        assert cfg.programs_per_tile > 1 and cfg.sync == 3, ("pyannote shapes cooperate, polling in PTX", cfg)
    for B in (1, 7, 32, 100, 128, 1000):
        for H in (16, 100, 128, 256, 512):
            for D in (1, 2):
                cfg = choose_config(B, H, D, torch.device("cuda"))
                words = cfg.block_b * max(runtime.next_power_of_2(H), 16)  # of a tile
                cooperative = 3 if H <= 128 and words <= 32 * cfg.num_warps and cfg.sub_tiles <= 3 else 2
                assert cfg.sync == (0 if cfg.programs_per_tile == 1 else 1 if cfg.matvec == 3 else cooperative), cfg
                assert cfg.matvec in (3, 4), cfg
                per_launch = min(-(-B // (cfg.block_b * cfg.sub_tiles)), sms // (D * cfg.programs_per_tile))
                assert cfg.programs_per_tile * per_launch * D <= sms, (B, H, D, cfg)
    lstm = make_lstm(3, 128, 1, True, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match="resident"):
        PersistentLSTM.from_torch(lstm, RecurrenceConfig(128, 1, 0, 1))(torch.randn(2, 2, 3, device="cuda"))


@gpu_only
@pytest.mark.parametrize("sub_tiles", [1, 3])
def test_batch_larger_than_one_launch_runs_in_several(sub_tiles):
    """More rows than the GPU can hold cooperating at once: consecutive launches, same result."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lstm = make_lstm(5, 16, 2, True, device="cuda")
    config = RecurrenceConfig(2, 1, 2, 1, sub_tiles=sub_tiles)  # sub_tiles * sms // 4 rows per launch
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
@pytest.mark.parametrize("batch", [128, 256])
def test_large_batch_defaults(batch):
    """Hidden 128: batch 128 runs one launch of CUDA-core programs with two tiles each,
    batch 256 one launch of 16-row tensor-core programs (tf32x3); both must match cuDNN
    in float32 to the same tolerance, run after run."""
    cfg = choose_config(batch, 128, 2, torch.device("cuda"))
    if batch == 256:
        assert cfg.matvec == 3 and cfg.block_b == 16, cfg
    else:
        assert cfg.matvec == 4 and cfg.block_b == 2 and cfg.programs_per_tile == 2 and cfg.sub_tiles == 2, cfg
        assert cfg.sync == 3, cfg
    lstm = make_lstm(60, 128, 2, True, device="cuda")
    lengths = torch.randint(1, 41, (batch,), generator=torch.Generator().manual_seed(5)).cuda()
    lengths[0] = 40
    padded = torch.randn(batch, 40, 60, device="cuda")
    model = PersistentLSTM.from_torch(lstm)
    with torch.no_grad():
        assert_runs_match(model, lstm, padded, lengths, 5)
        y = model(padded)[0]
        assert_close("padded y", y, lstm(padded)[0], atol=ATOL, rtol=RTOL)
