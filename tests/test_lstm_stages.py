"""The LSTM's stages on their own: the NumPy cell, the padded PyTorch stack, the Triton
kernels in the configurations the interpreter runs, and the configuration policy."""
import types

import pytest
import torch

from packed_kernels import PersistentLSTM, pack, runtime, unpack
from packed_kernels.ops.lstm.naive_numpy import lstm_layer_numpy
from packed_kernels.ops.lstm.padded_torch import lstm_padded, lstm_weights
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig, choose_config, input_projection_triton

from assertions import assert_close
from lstm_cases import (
    CTA_BARRIER, FOUR_GATES, ROW_SUMS, STEP_COUNTER, TAGGED_WORDS, TAGGED_WORDS_PTX, TENSOR_CORES,
    assert_outputs_close, assert_runs_match, config_with_gate_default, make_lstm, packed_reference, param_id,
)

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


def test_numpy_layer_without_bias_or_state_matches_nn_lstm_saturated():
    """No bias, zero initial state, pre-activations of a few hundred: sigmoid and tanh at
    their limits, against nn.LSTM(bias=False) in float64."""
    lstm = make_lstm(3, 2, bias=False, dtype=torch.float64, seed=4)
    with torch.no_grad():
        lstm.weight_ih_l0.mul_(200.0)
        x = torch.randn(1, 6, 3, dtype=torch.float64)
        ref, (h_ref, c_ref) = lstm(x)
    y, (h, c) = lstm_layer_numpy(x[0].numpy(), lstm.weight_ih_l0.detach().numpy(), lstm.weight_hh_l0.detach().numpy())
    assert_close("y", y, ref[0], atol=1e-12, rtol=1e-12)
    assert_close("h_n", h, h_ref[0, 0], atol=1e-12, rtol=1e-12)
    assert_close("c_n", c, c_ref[0, 0], atol=1e-12, rtol=1e-12)


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
        assert_outputs_close(lstm_padded(x, lstm_weights(lstm), None, *hx), lstm(x, hx), atol=1e-12, rtol=1e-12)


def test_padded_stage_with_lengths_matches_packed_sequence():
    lstm = make_lstm(4, 5, 2, True, dtype=torch.float64)
    lengths = torch.tensor([3, 7, 1, 5])
    x = torch.randn(4, 7, 4, dtype=torch.float64)
    with torch.no_grad():
        ref = packed_reference(lstm, x, lengths)
        y, state = lstm_padded(x, lstm_weights(lstm), lengths)
    assert_outputs_close((pack(y, lengths).data, state), ref, atol=1e-12, rtol=1e-12)
    assert torch.all(unpack(pack(y, lengths), 7) == y), "padding frames must be zero"


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
                         ids=param_id)
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


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's NumPy
@pytest.mark.parametrize("product,rows_per_tile", [(ROW_SUMS, 2), (FOUR_GATES, 1), (TENSOR_CORES, 16)],
                         ids=param_id)
def test_saturated_gates_single_program(device, product, rows_per_tile):
    """Inputs x 300: every gate's e^z overflows or underflows in every step; the gates
    must reach their limits exactly, as nn.LSTM's do (no inf / inf)."""
    lstm = make_lstm(4, 8, 1, True, device=device, seed=3)
    lengths = torch.tensor([5, 2, 4], device=device)
    padded = torch.randn(3, 5, 4, device=device) * 300
    config = config_with_gate_default(programs_per_tile=1, rows_per_tile=rows_per_tile, product=product,
                                      wait=CTA_BARRIER)
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
    with pytest.raises(ValueError, match="programs_per_tile=2 needs wait STEP_COUNTER, TAGGED_WORDS or TAGGED_"):
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


# ----------------------------------------------------------------------------------------
# The configuration policy, on the host: a GPU described by its properties

#: (name, SMs, L2 bytes) of GPUs the policy is held to.
GPUS = [("H200", 132, 50 << 20), ("A100", 108, 40 << 20), ("T4", 40, 4 << 20)]


@pytest.fixture
def described_gpu(monkeypatch):
    """``describe(sms, l2)`` makes :func:`choose_config` plan for a CUDA GPU of those
    properties, here on the host (the policy is plain Python)."""

    def describe(sms, l2_bytes):
        properties = types.SimpleNamespace(multi_processor_count=sms, L2_cache_size=l2_bytes)
        monkeypatch.setattr(runtime, "INTERPRETED", False)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
        return torch.device("cuda")

    return describe


def test_choose_config_interpreted_is_single_program(monkeypatch):
    """Under the interpreter (which runs programs one after another) every device gets
    one program per tile: no cross-program waits."""
    monkeypatch.setattr(runtime, "INTERPRETED", True)
    for device in ("cpu", "cuda"):
        for batch, rows in ((0, 1), (1, 1), (3, 4), (37, 16)):
            config = choose_config(batch, 128, 2, torch.device(device), frames=20 * batch)
            assert config == RecurrenceConfig(programs_per_tile=1, rows_per_tile=rows, product=ROW_SUMS,
                                              wait=CTA_BARRIER, num_warps=4), (device, batch, config)


def test_choose_config_on_h200_shapes(described_gpu):
    """The H200's choices the GPU tests hold: the pyannote stack cooperates and polls in
    PTX; hidden 128 at batch 128 runs two-tile CUDA-core programs, at batch 256 16-row
    tensor-core programs."""
    cuda = described_gpu(132, 50 << 20)
    for batch in (1, 8, 32, 128):
        config = choose_config(batch, 128, 2, cuda, frames=589 * batch)
        assert config.programs_per_tile > 1 and config.wait == TAGGED_WORDS_PTX, (batch, config)
    config = choose_config(128, 128, 2, cuda, frames=40 * 128)
    assert (config.product, config.rows_per_tile, config.programs_per_tile, config.tiles_per_program,
            config.wait) == (FOUR_GATES, 2, 2, 2, TAGGED_WORDS_PTX), config
    config = choose_config(256, 128, 2, cuda, frames=40 * 256)
    assert (config.product, config.rows_per_tile, config.wait) == (TENSOR_CORES, 16, STEP_COUNTER), config


@pytest.mark.parametrize("gpu", GPUS, ids=lambda gpu: gpu[0])
def test_choose_config_fills_but_never_exceeds_the_sm_count(described_gpu, gpu):
    """Every program of a cooperative launch must be resident at once: at most one per SM.
    The wait and the gate arithmetic follow from the split. Hidden 512 splits W_hh over
    32 programs per direction: a GPU with fewer SMs is refused, naming them."""
    _, sms, l2 = gpu
    cuda = described_gpu(sms, l2)
    for batch in (0, 1, 7, 32, 100, 128, 1000):
        for hidden in (16, 100, 128, 256, 512):
            for directions in (1, 2):
                if hidden == 512 and 32 * directions > sms:
                    with pytest.raises(ValueError, match=f"needs more SMs than the GPU's {sms}"):
                        choose_config(batch, hidden, directions, cuda, frames=96 * batch)
                    continue
                config = choose_config(batch, hidden, directions, cuda, frames=96 * batch)
                case = (batch, hidden, directions, config)
                words = config.rows_per_tile * max(runtime.next_power_of_2(hidden), 16)  # of a tile
                ptx = hidden <= 128 and words <= 32 * config.num_warps and config.tiles_per_program <= 3
                cooperative = TAGGED_WORDS_PTX if ptx else TAGGED_WORDS
                expected = (CTA_BARRIER if config.programs_per_tile == 1 else
                            STEP_COUNTER if config.product == TENSOR_CORES else cooperative)
                assert config.wait == expected, case
                assert config.product in (TENSOR_CORES, FOUR_GATES), case
                assert config.fast_math == (config.product == FOUR_GATES), case
                per_launch = min(-(-max(batch, 1) // (config.rows_per_tile * config.tiles_per_program)),
                                 sms // (directions * config.programs_per_tile))
                assert 1 <= config.programs_per_tile * per_launch * directions <= sms, case


@pytest.mark.parametrize("batch,product", [(4, FOUR_GATES), (256, TENSOR_CORES)], ids=param_id)
def test_choose_config_prefetches_into_l2_when_inputs_spill(described_gpu, batch, product):
    """Projected inputs (frames x D 4H float32) beyond half the L2: the CUDA-core
    programs prefetch them 8 steps ahead; the tensor-core ones never."""
    cuda = described_gpu(132, 50 << 20)
    hidden, directions = 128, 2
    frames_in_half_l2 = (25 << 20) // (directions * 4 * hidden * 4)
    config = choose_config(batch, hidden, directions, cuda, frames=frames_in_half_l2)
    assert config.product == product and config.l2_prefetch_steps == 0, config
    config = choose_config(batch, hidden, directions, cuda, frames=frames_in_half_l2 + 1)
    assert config.product == product, config
    assert config.l2_prefetch_steps == (8 if product == FOUR_GATES else 0), config


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_choose_config_counts_two_bytes_an_input_in_half(described_gpu, dtype):
    """Float16 and bfloat16 inputs take half the bytes: twice the frames fit in half the L2."""
    cuda = described_gpu(132, 50 << 20)
    frames_in_half_l2 = (25 << 20) // (2 * 4 * 128 * 2)
    assert choose_config(4, 128, 2, cuda, frames=frames_in_half_l2, dtype=dtype).l2_prefetch_steps == 0
    assert choose_config(4, 128, 2, cuda, frames=frames_in_half_l2 + 1, dtype=dtype).l2_prefetch_steps == 8
    assert choose_config(4, 128, 2, cuda, frames=frames_in_half_l2).l2_prefetch_steps == 8, "float32: 4 bytes"


def test_choose_config_refuses_hidden_beyond_the_chip(described_gpu):
    with pytest.raises(ValueError, match="hidden_size=1024 is too large"):
        choose_config(1, 1024, 1, described_gpu(132, 50 << 20), frames=10)


def _expected(k, rows, product, wait, warps, prefetch, tiles=1, l2=0):
    return RecurrenceConfig(programs_per_tile=k, rows_per_tile=rows, product=product, wait=wait, num_warps=warps,
                            prefetch_steps=prefetch, l2_prefetch_steps=l2, fast_math=product != TENSOR_CORES,
                            tiles_per_program=tiles)


#: (SMs, L2 bytes, batch, hidden, directions, frames, the configuration), worked out by hand
#: from the rules of choose_config's docstring.
EXACT_CHOICES = [
    # one row: 16-unit slices (the least work a thread), one word a thread -> PTX poll, 2 steps ahead
    (132, 50 << 20, 1, 128, 2, 589, _expected(8, 1, FOUR_GATES, TAGGED_WORDS_PTX, 4, 2)),
    # 32 rows: 64-unit slices fit them in one launch with one row a program
    (132, 50 << 20, 32, 128, 2, 40 * 32, _expected(2, 1, FOUR_GATES, TAGGED_WORDS_PTX, 8, 2)),
    # ... whose projected inputs outgrow half the L2: prefetched 8 steps ahead
    (132, 50 << 20, 32, 128, 2, 589 * 32, _expected(2, 1, FOUR_GATES, TAGGED_WORDS_PTX, 8, 2, l2=8)),
    # two or three launches' worth: one launch of programs running 2 or 3 tiles
    (132, 50 << 20, 128, 128, 2, 40 * 128, _expected(2, 2, FOUR_GATES, TAGGED_WORDS_PTX, 8, 1, tiles=2)),
    (132, 50 << 20, 160, 128, 2, 30 * 160, _expected(2, 2, FOUR_GATES, TAGGED_WORDS_PTX, 8, 1, tiles=3)),
    # four launches' worth: 16-row tensor-core programs over 32-unit slices
    (132, 50 << 20, 256, 128, 2, 40 * 256, _expected(4, 16, TENSOR_CORES, STEP_COUNTER, 4, 1)),
    # hidden 256: the smaller weight slice; a thread holds several words -> Triton's poll loop
    (132, 50 << 20, 1, 256, 2, 100, _expected(16, 1, FOUR_GATES, TAGGED_WORDS, 8, 2)),
    # hidden 16: one program a tile, no waits, 8 rows a tile
    (132, 50 << 20, 7, 16, 1, 70, _expected(1, 8, FOUR_GATES, CTA_BARRIER, 4, 1)),
    # hidden 512: 32 programs a direction, on 40 SMs and on exactly 2 x 32
    (40, 4 << 20, 1, 512, 1, 10, _expected(32, 1, FOUR_GATES, TAGGED_WORDS, 8, 2)),
    (64, 8 << 20, 1, 512, 2, 10, _expected(32, 1, FOUR_GATES, TAGGED_WORDS, 8, 2)),
]


@pytest.mark.parametrize("sms,l2,batch,hidden,directions,frames,expected", EXACT_CHOICES,
                         ids=[f"SM{c[0]}-B{c[2]}-H{c[3]}-D{c[4]}-F{c[5]}" for c in EXACT_CHOICES])
def test_choose_config_exact_choices(described_gpu, sms, l2, batch, hidden, directions, frames, expected):
    assert choose_config(batch, hidden, directions, described_gpu(sms, l2), frames=frames) == expected


#: The same for float16 and bfloat16 parameters: (batch, hidden, frames, the configuration).
HALF_EXACT_CHOICES = [
    # one row: as for float32
    (1, 128, 589, _expected(8, 1, FOUR_GATES, TAGGED_WORDS_PTX, 4, 2)),
    # 32 rows of 589 frames: as for float32, the inputs prefetched into L2
    (32, 128, 589 * 32, _expected(2, 1, FOUR_GATES, TAGGED_WORDS_PTX, 8, 2, l2=8)),
    # 128 weights a thread: two rows a tile at most (their widened copies take the registers)
    (64, 128, 40 * 64, _expected(2, 2, FOUR_GATES, TAGGED_WORDS_PTX, 8, 1)),
    # two launches' worth: the tensor cores in one launch, not two tiles a program
    (128, 128, 40 * 128, _expected(4, 16, TENSOR_CORES, STEP_COUNTER, 4, 1)),
    # hidden 256: 64 weights a thread, 8 rows a tile as for float32
    (32, 256, 589 * 32, _expected(16, 8, FOUR_GATES, TAGGED_WORDS, 8, 1, l2=8)),
    # hidden 512: 128 weights a thread, 2 rows a tile (float32: 4), inputs beyond half the L2
    (32, 512, 589 * 32, _expected(32, 2, FOUR_GATES, TAGGED_WORDS, 8, 1, l2=8)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch,hidden,frames,expected", HALF_EXACT_CHOICES,
                         ids=[f"B{c[0]}-H{c[1]}-F{c[2]}" for c in HALF_EXACT_CHOICES])
def test_choose_config_exact_choices_half(described_gpu, dtype, batch, hidden, frames, expected):
    cuda = described_gpu(132, 50 << 20)
    assert choose_config(batch, hidden, 2, cuda, frames=frames, dtype=dtype) == expected


@pytest.mark.skipif(not runtime.INTERPRETED, reason="a refusal of the interpreter's")
def test_interpreter_refuses_cooperating_programs(device):
    """Programs that wait for each other would wait forever where programs run one after
    another: refused before any launch."""
    lstm = make_lstm(3, 16, 1, True, device=device)
    config = RecurrenceConfig(programs_per_tile=2, rows_per_tile=1, product=FOUR_GATES, wait=TAGGED_WORDS)
    with torch.no_grad(), pytest.raises(ValueError, match="interpreter runs programs one at a time: programs_per_tile"):
        PersistentLSTM.from_torch(lstm, config)(torch.randn(2, 3, 3, device=device))
