"""PersistentLSTM's kernels against torch.nn.LSTM on padded and packed batches, and its
traced calls: custom ops, torch.compile, meta tensors and FakeTensorMode."""
import doctest
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pack_sequence

from packed_kernels import Packed, PersistentLSTM, check_errors, pack, runtime, unpack
from packed_kernels.ops.lstm.api import _config_as_ints, _config_from_ints, lstm_recurrence_op
from packed_kernels.ops.lstm.inputs import lstm_checked_lengths_op, lstm_checked_packed_op
from packed_kernels.ops.lstm.naive_numpy import lstm_layer_numpy
from packed_kernels.ops.lstm.padded_torch import lstm_padded, lstm_weights
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig, RecurrentProduct, StepWait, choose_config

from assertions import assert_close
from lstm_cases import (
    ATOL, HALF_ATOL, HALF_DTYPES, RTOL, assert_outputs_close, counting_module_calls, lengths_id, make_half_lstm, make_lstm,
    packed_reference,
)

# ----------------------------------------------------------------------------------------
# Padded input

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
        assert_outputs_close(model(x, hx), lstm(x, hx))


def test_persistent_unbatched_input(device):
    lstm = make_lstm(3, 10, 2, True, batch_first=False, device=device)
    x = torch.randn(6, 3, device=device)
    hx = (torch.randn(4, 10, device=device), torch.randn(4, 10, device=device))
    with torch.inference_mode():
        assert_outputs_close(PersistentLSTM.from_torch(lstm)(x, hx), lstm(x, hx))


@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "tf"])
def test_persistent_padded_with_lengths_matches_packed_sequence(device, batch_first):
    lstm = make_lstm(4, 9, 2, True, batch_first=batch_first, device=device)
    lengths = torch.tensor([2, 6, 1, 4], device=device)
    x_bf = torch.randn(4, 6, 4, device=device)
    lstm_bf = make_lstm(4, 9, 2, True, batch_first=True, device=device)
    with torch.no_grad():
        y, state = PersistentLSTM.from_torch(lstm)(x_bf if batch_first else x_bf.transpose(0, 1), lengths=lengths)
        ref = packed_reference(lstm_bf, x_bf, lengths)
    y_bf = y if batch_first else y.transpose(0, 1)
    assert_outputs_close((pack(y_bf, lengths).data, state), ref)
    assert torch.all(unpack(pack(y_bf, lengths), 6) == y_bf), "frames beyond each length must be zero"


# ----------------------------------------------------------------------------------------
# Packed input


@pytest.mark.parametrize("lengths", [[7], [1, 1, 1], [3, 9, 1, 5, 9, 2], [4, 4, 4, 4], [11, 2]], ids=lengths_id)
def test_persistent_packed_matches_packed_sequence(device, lengths):
    lstm = make_lstm(6, 14, 2, True, device=device, seed=len(lengths))
    lengths = torch.tensor(lengths, device=device)
    B, T = lengths.numel(), int(lengths.max())
    padded = torch.randn(B, T, 6, device=device)
    hx = (torch.randn(4, B, 14, device=device), torch.randn(4, B, 14, device=device))
    with torch.no_grad():
        out, state = PersistentLSTM.from_torch(lstm)(pack(padded, lengths), hx)
        ref = packed_reference(lstm, padded, lengths, hx)
    assert isinstance(out, Packed)
    assert torch.equal(out.cu_seqlens, pack(padded, lengths).cu_seqlens) and torch.equal(out.lengths, lengths)
    assert_outputs_close((out.data, state), ref)


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
    assert_outputs_close((out.data, (h, c)), (pack(ref, lengths).data, (h_ref, c_ref)))
    assert torch.equal(h[:, 1], hx[0][:, 1]) and torch.equal(c[:, 1], hx[1][:, 1]), "empty sequence keeps its state"
    empty = pack(torch.zeros(0, 0, 3, device=device), torch.zeros(0, dtype=torch.int64))
    with torch.no_grad():
        out, (h, c) = model(empty)
    # an empty batch: nothing to compute, every tensor empty of its exact shape and dtype
    for name, t, shape in (("y", out.data, (0, 16)), ("h_n", h, (4, 0, 8)), ("c_n", c, (4, 0, 8))):
        assert (t.shape, t.dtype, t.device.type) == (shape, torch.float32, device), name
    assert out.cu_seqlens.tolist() == [0] and out.lengths.numel() == 0


def test_each_layer_drops_the_previous_layers_tensors(monkeypatch):
    # A layer's projected inputs are read by its recurrence only, and its output by the
    # next layer's projection only. Neither may be alive once its reader is done: the
    # next projection would then be made beside the previous projected inputs, and the
    # next output allocated beside the previous one.
    from packed_kernels.ops.lstm import api

    real_projection, real_output = api._input_projection, api._layer_output
    projected, outputs = [], []

    def projection(x, *args):
        assert all(xw() is None for xw in projected), f"layer {len(projected)}'s projection: earlier inputs alive"
        xw = real_projection(x, *args)
        projected.append(weakref.ref(xw))
        return xw

    def output(*args):
        assert all(out() is None for out in outputs), f"layer {len(outputs)}'s output: earlier output alive"
        out = real_output(*args)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(api, "_input_projection", projection)
    monkeypatch.setattr(api, "_layer_output", output)
    lstm = make_lstm(3, 8, 3, True)
    x = torch.randn(2, 5, 3)
    with torch.no_grad():
        y, (h, c) = PersistentLSTM.from_torch(lstm)(x)
        ref, (h_ref, c_ref) = lstm(x)
    assert len(projected) == len(outputs) == 3
    assert_outputs_close((y, (h, c)), (ref, (h_ref, c_ref)))


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
        y, state = traced(padded, lengths)
        ref = packed_reference(lstm, padded, lengths)
    assert_outputs_close((pack(y, lengths).data, state), ref)


def test_traced_call_with_the_transposed_weights(device):
    """The FOUR_GATES product reads each gate's transposed block, which the traced call
    passes to the custom op."""
    lstm = make_lstm(3, 8, 1, True, device=device)
    config = RecurrenceConfig(programs_per_tile=1, rows_per_tile=2, product=RecurrentProduct.FOUR_GATES,
                              wait=StepWait.CTA_BARRIER)
    model = PersistentLSTM.from_torch(lstm, config)
    x = torch.randn(2, 3, 3, device=device)
    with torch.no_grad():
        traced = make_fx(model)(x)
        assert _recurrence_calls(traced.graph) == 1
        assert_outputs_close(traced(x), lstm(x))


def test_recurrence_op_passes_opcheck(device):
    """``torch.library.opcheck`` (schema, fake tensor, AOT dispatch) on the custom op."""
    D, B, H, N = 2, 2, 8, 5
    g = torch.Generator().manual_seed(0)
    xw = torch.randn(N, D * 4 * H, generator=g).to(device)
    w_hh = (torch.randn(D, 4 * H, H, generator=g) * 0.3).to(device)
    w_hh_t = w_hh.view(D, 4, H, H).transpose(2, 3).contiguous()
    h0, c0 = torch.randn(D, B, H, generator=g).to(device), torch.randn(D, B, H, generator=g).to(device)
    row_start = torch.tensor([0, 3], device=device)
    lengths = torch.tensor([3, 2], dtype=torch.int32, device=device)
    config = _config_as_ints(choose_config(B, H, D, xw.device, frames=N))
    torch.library.opcheck(lstm_recurrence_op.custom_op,
                          (xw, w_hh, w_hh_t, h0, c0, row_start, lengths, 1, True, config))



def test_value_check_ops_pass_opcheck(device):
    """``torch.library.opcheck`` on the custom ops that check and clamp the lengths and
    offsets (valid values: nothing to report)."""
    lengths = torch.tensor([4, 0, 2], device=device)
    torch.library.opcheck(lstm_checked_lengths_op.custom_op, (lengths, 4))
    cu_seqlens = torch.tensor([0, 4, 4, 6], dtype=torch.int32, device=device)
    torch.library.opcheck(lstm_checked_packed_op.custom_op, (cu_seqlens, lengths, 6))


def test_traced_calls_check_values_in_the_graph(device):
    """A traced call checks the values where the traced graph runs: the check ops are in
    make_fx's graph, and running it on bad values reports them."""
    model = PersistentLSTM.from_torch(make_lstm(3, 5, 1, True, device=device))
    x = torch.randn(2, 4, 3, device=device)
    with torch.no_grad():
        padded = make_fx(lambda x, lengths: model(x, lengths=lengths))(x, torch.tensor([4, 2], device=device))
        packed = make_fx(lambda *p: model(Packed(*p)))(*pack(x, torch.tensor([4, 2])))
        for graph, op in ((padded.graph, torch.ops.packed_kernels.lstm_checked_lengths.default),
                          (packed.graph, torch.ops.packed_kernels.lstm_checked_packed.default)):
            assert sum(node.target is op for node in graph.nodes) == 1
        with pytest.raises(ValueError, match="^PersistentLSTM: lengths must lie in"):
            padded(x, torch.tensor([5, 2], device=device))
            check_errors()
        data, cu_seqlens, lengths = pack(x, torch.tensor([4, 2]))
        with pytest.raises(ValueError, match="^PersistentLSTM: packed.lengths must be >= 0"):
            packed(data, cu_seqlens, torch.tensor([7, -1], device=device))
            check_errors()


def test_config_survives_the_custom_op_schema():
    """A traced call passes its RecurrenceConfig to the custom op as a list of ints: every
    field, each mode by its own value, comes back."""
    configs = [
        RecurrenceConfig(programs_per_tile=4, rows_per_tile=16, product=RecurrentProduct.TENSOR_CORES,
                         wait=StepWait.STEP_COUNTER, num_warps=8, prefetch_steps=2, l2_prefetch_steps=3,
                         fast_math=True, tiles_per_program=2),
        RecurrenceConfig(programs_per_tile=2, rows_per_tile=1, product=RecurrentProduct.FOUR_GATES,
                         wait=StepWait.TAGGED_WORDS_PTX, tiles_per_program=3),
        RecurrenceConfig(programs_per_tile=8, rows_per_tile=2, product=RecurrentProduct.ROW_SUMS,
                         wait=StepWait.TAGGED_WORDS, num_warps=2, l2_prefetch_steps=8),
        RecurrenceConfig(programs_per_tile=1, rows_per_tile=4, product=RecurrentProduct.FOUR_GATES,
                         wait=StepWait.CTA_BARRIER),
    ]
    for config in configs:
        ints = _config_as_ints(config)
        assert all(type(v) is int for v in ints), ints
        back = _config_from_ints(ints)
        assert back == config and type(back.product) is RecurrentProduct and type(back.wait) is StepWait, back

def test_recurrence_op_eager_and_custom_op_are_the_numpy_cell(device):
    """The operator's eager twin and its custom op give the same tensors, each sequence
    and direction the NumPy cell's (projected inputs as ``x``, ``W_ih = I``); rows no
    sequence covers stay zero with ``zero_fill``. No gradient, and no ``vmap``."""
    D, H = 2, 8
    g = torch.Generator().manual_seed(1)
    xw = torch.randn(6, D * 4 * H, generator=g)
    w_hh = torch.randn(D, 4 * H, H, generator=g) * 0.3
    h0, c0 = torch.randn(D, 2, H, generator=g), torch.randn(D, 2, H, generator=g)
    row_start, lengths = torch.tensor([0, 3]), torch.tensor([3, 2], dtype=torch.int32)  # row 5: no sequence's
    config = _config_as_ints(choose_config(2, H, D, torch.device(device), frames=6))
    w_hh_t = w_hh.view(D, 4, H, H).transpose(2, 3).contiguous()  # read by the FOUR_GATES product only
    args = [t.to(device) for t in (xw, w_hh, w_hh_t, h0, c0, row_start, lengths)] + [1, True, config]
    eager, op = lstm_recurrence_op(*args), lstm_recurrence_op.custom_op(*args)
    for name, a, e in zip(("out", "h_n", "c_n"), eager, op):
        assert torch.equal(a, e), name
    out, h_n, c_n = (t.cpu() for t in eager)
    assert torch.equal(out[5], torch.zeros(D * H))
    for d in range(D):
        for b in range(2):
            rows = slice(int(row_start[b]), int(row_start[b] + lengths[b]))
            y, (h, c) = lstm_layer_numpy(xw[rows, d * 4 * H:(d + 1) * 4 * H].numpy(), np.eye(4 * H), w_hh[d].numpy(),
                                         h0=h0[d, b].numpy(), c0=c0[d, b].numpy(), reverse=d == 1)
            assert_close(f"out[{b}, {d}]", out[rows, d * H:(d + 1) * H], y, atol=ATOL, rtol=RTOL)
            assert_close(f"h_n[{d}, {b}]", h_n[d, b], h, atol=ATOL, rtol=RTOL)
            assert_close(f"c_n[{d}, {b}]", c_n[d, b], c, atol=ATOL, rtol=RTOL)
    needs_grad = [args[0].clone().requires_grad_()] + args[1:]
    with pytest.raises(RuntimeError, match="packed_kernels::lstm_recurrence has no gradient formula"):
        lstm_recurrence_op(*needs_grad)[0].sum().backward()
    with pytest.raises(NotImplementedError, match="does not support torch.func.vmap"):
        torch.func.vmap(lambda rows: lstm_recurrence_op(rows, *args[1:])[0])(args[0][None])

META_CASES = [
    # (batch_first, unbatched, lengths, with_state)
    (True, False, None, False), (False, False, None, True), (False, True, None, True),
    (True, False, [5, 0, 3], True), (False, False, [1, 5, 2], False),
]


def _meta_id(case):
    batch_first, unbatched, lengths, with_state = case
    return ("bf" if batch_first else "tf") + ("-unbatched" if unbatched else "") + (
        f"-{lengths_id(lengths)}" if lengths else "") + ("-state" if with_state else "")


def _shapes(output):
    y, (h, c) = output
    y = y.data if isinstance(y, Packed) else y
    return [(tuple(t.shape), t.dtype) for t in (y, h, c)]


def _padded_call(case, device):
    batch_first, unbatched, lengths, with_state = case
    x = torch.randn(5, 3) if unbatched else torch.randn((3, 5, 3) if batch_first else (5, 3, 3))
    state_shape = (4, 7) if unbatched else (4, 3, 7)
    hx = (torch.randn(state_shape), torch.randn(state_shape)) if with_state else None
    kwargs = {} if lengths is None else {"lengths": torch.tensor(lengths)}
    return make_lstm(3, 7, 2, True, batch_first=batch_first, device=device), x, hx, kwargs


def _expected_shapes(model, x, hx, kwargs):
    """The shapes and dtypes of the real call (by nn.LSTM, which a call that needs a
    gradient runs: the kernels' are the same, as the parity tests hold)."""
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _shapes(model(x, hx, **kwargs))


@pytest.mark.filterwarnings("ignore:PersistentLSTM")
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case", META_CASES, ids=_meta_id)
def test_meta_tensors_give_the_real_shapes(case, grad):
    """A module and inputs on ``meta``: shape inference only (the custom op's fake, or
    nn.LSTM's own under autograd), the shapes and dtypes of the real call."""
    lstm, x, hx, kwargs = _padded_call(case, "cpu")
    expected = _expected_shapes(PersistentLSTM.from_torch(lstm), x, hx, kwargs)
    model = PersistentLSTM.from_torch(lstm.to("meta"))
    meta = (lambda t: t.to("meta"))
    with torch.set_grad_enabled(grad), counting_module_calls(lstm) as calls:
        y, (h, c) = model(meta(x), None if hx is None else tuple(map(meta, hx)),
                          **{k: meta(v) for k, v in kwargs.items()})
    assert _shapes((y, (h, c))) == expected
    assert y.is_meta and h.is_meta and c.is_meta
    # meta tensors are traced: the custom op's fake; nn.LSTM where a gradient is needed, or
    # with lengths the padded PyTorch stage (its lengths cannot become a PackedSequence)
    assert calls[0] == (1 if grad and not kwargs else 0), calls


@pytest.mark.filterwarnings("ignore:PersistentLSTM")
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case", META_CASES, ids=_meta_id)
def test_fake_tensor_mode_gives_the_real_shapes(device, case, grad):
    lstm, x, hx, kwargs = _padded_call(case, device)
    x, hx, kwargs = x.to(device), hx and tuple(t.to(device) for t in hx), {k: v.to(device) for k, v in kwargs.items()}
    model = PersistentLSTM.from_torch(lstm)
    expected = _expected_shapes(model, x, hx, kwargs)
    with torch.set_grad_enabled(grad), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        # The module's parameters fake too, on the same device: on CUDA, nn.LSTM (cuDNN) views
        # its flat weight buffer with set_, which a real device storage cannot take in fake mode.
        params = {name: mode.from_tensor(p) for name, p in model.named_parameters()}
        fake = torch.func.functional_call(
            model, params, (mode.from_tensor(x), None if hx is None else tuple(map(mode.from_tensor, hx))),
            {k: mode.from_tensor(v) for k, v in kwargs.items()})
    assert _shapes(fake) == expected


@pytest.mark.parametrize("lengths", [[4, 0, 2], [1], []], ids=lengths_id)
def test_packed_meta_and_fake_give_the_real_shapes(device, lengths):
    lstm = make_lstm(3, 7, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    packed = pack(torch.randn(len(lengths), max(lengths, default=0), 3, device=device),
                  torch.tensor(lengths, dtype=torch.int64))
    expected = _expected_shapes(model, packed, None, {})
    with torch.no_grad():
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = model(Packed(*(mode.from_tensor(t) for t in packed)))
        meta_lstm = make_lstm(3, 7, 2, True, device="meta")
        with counting_module_calls(meta_lstm) as calls:
            meta = PersistentLSTM.from_torch(meta_lstm)(packed.to("meta"))
    assert _shapes(fake) == expected and _shapes(meta) == expected
    assert calls[0] == 0, "the custom op's fake, not nn.LSTM"


# ----------------------------------------------------------------------------------------
# torch.compile: the kernels' path is one graph of custom ops; the nn.LSTM is never traced

#: The compiler of the tests: Inductor where the kernels are compiled, its AOT tracing
#: alone under the interpreter (Inductor's CPU code needs a C++ toolchain).
COMPILE_BACKEND = "aot_eager" if runtime.INTERPRETED else "inductor"


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied around a test: every compiled call here shares the code
    of ``forward``, whose recompilations Dynamo caps."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording(backend):
    """A backend that keeps each graph Dynamo hands it (``graphs``) and compiles it with ``backend``."""
    graphs = []

    def compile_graph(graph_module, example_inputs):
        graphs.append(graph_module)
        return torch._dynamo.lookup_backend(backend)(graph_module, example_inputs)

    return compile_graph, graphs


def _traces_no_nn_lstm(graph) -> bool:
    """No node of ``graph`` runs ``nn.LSTM`` (a call of the module, ``_VF.lstm``, ``aten.lstm``)."""
    return all("lstm" not in str(node.target) or "packed_kernels" in str(node.target)
               for node in graph.nodes if node.op in ("call_function", "call_method", "call_module"))


def _data(output):
    y, (h, c) = output
    return (y.data if isinstance(y, (Packed, PackedSequence)) else y), (h, c)


#: (id, batch_first, the call's arguments from a (3, 5, 4) batch-first x, lengths [5, 2, 4] and the device)
COMPILED_CALLS = [
    ("padded", True, lambda x, lengths, d: ((x,), {})),
    ("time-major-state", False,
     lambda x, lengths, d: ((x.transpose(0, 1), (torch.randn(4, 3, 8, device=d), torch.randn(4, 3, 8, device=d))),
                            {})),
    ("unbatched", True, lambda x, lengths, d: ((x[0],), {})),
    ("padded-lengths", True, lambda x, lengths, d: ((x,), {"lengths": lengths.to(d)})),
    ("time-major-host-lengths", False, lambda x, lengths, d: ((x.transpose(0, 1),), {"lengths": lengths})),
    ("packed", True, lambda x, lengths, d: ((pack(x, torch.tensor([5, 0, 4], device=d)),), {})),
    ("packed-sequence", True,
     lambda x, lengths, d: ((pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False),), {})),
]


@pytest.mark.parametrize("batch_first,make", [case[1:] for case in COMPILED_CALLS],
                         ids=[case[0] for case in COMPILED_CALLS])
def test_compiled_call_is_one_graph(device, fresh_dynamo, batch_first, make):
    """``torch.compile(fullgraph=True)`` under ``no_grad`` traces the whole call, on every
    input form, as one graph whose recurrences are custom ops (one per layer), without
    ``allow_rnn``: the wrapped ``nn.LSTM`` is neither traced nor called. The compiled call
    gives the eager call's outputs, in the same form."""
    lstm = make_lstm(4, 8, 2, True, batch_first=batch_first, device=device)
    model = PersistentLSTM.from_torch(lstm)
    args, kwargs = make(torch.randn(3, 5, 4, device=device), torch.tensor([5, 2, 4]), device)
    backend, graphs = _recording(COMPILE_BACKEND)
    with torch.no_grad(), counting_module_calls(lstm) as calls:
        compiled = torch.compile(model, backend=backend, fullgraph=True)(*args, **kwargs)
        eager = model(*args, **kwargs)
    assert calls[0] == 0, "the kernels, not nn.LSTM"
    assert len(graphs) == 1 and _recurrence_calls(graphs[0].graph) == 2
    assert _traces_no_nn_lstm(graphs[0].graph)
    assert type(compiled[0]) is type(eager[0])
    assert_outputs_close(_data(compiled), _data(eager))


def test_compiled_call_under_inference_mode(device, fresh_dynamo):
    lstm = make_lstm(3, 8, 1, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    packed = pack(torch.randn(3, 4, 3, device=device), torch.tensor([4, 1, 3], device=device))
    with torch.inference_mode():
        compiled = torch.compile(model, backend=COMPILE_BACKEND, fullgraph=True)(packed)
        assert_outputs_close(_data(compiled), _data(model(packed)))


def test_compiled_call_follows_the_module(device, fresh_dynamo):
    """What the compiled call reads of the module is read at each call: parameters changed
    through ``.data``, replaced or loaded, and the module's own mode (here a two-layer
    module with dropout, which the kernels refuse in training mode)."""
    lstm = make_lstm(3, 8, 2, True, dropout=0.5, device=device)
    other = make_lstm(3, 8, 2, True, dropout=0.5, device=device, seed=5)
    model = PersistentLSTM.from_torch(lstm)
    compiled = torch.compile(model, backend=COMPILE_BACKEND)
    x = torch.randn(2, 4, 3, device=device)
    updates = [lambda: None, lambda: lstm.weight_hh_l0.data.mul_(0.5),
               lambda: setattr(lstm, "weight_ih_l1", torch.nn.Parameter(torch.randn_like(lstm.weight_ih_l1))),
               lambda: lstm.load_state_dict(other.state_dict())]
    with torch.no_grad():
        for step, update in enumerate(updates):
            update()
            assert_outputs_close(compiled(x), lstm(x), suffix=f" (after update {step})")
        lstm.train()
        with pytest.raises(ValueError, match=r"dropout=0.5 between layers.*call \.eval\(\)"):
            compiled(x)
        lstm.eval()
        assert_outputs_close(compiled(x), lstm(x), suffix=" (eval again)")


def test_compiled_packed_sequence_without_sorted_indices(device, fresh_dynamo):
    """A ``PackedSequence`` built with ``enforce_sorted=True`` has no ``sorted_indices``: its
    number of sequences is a value of ``batch_sizes``, which Dynamo cannot trace. With
    ``fullgraph=True`` Dynamo raises; without it the graph breaks at that read and the call
    gives the eager one's outputs."""
    lstm = make_lstm(3, 8, 1, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    sequence = pack_sequence([torch.randn(n, 3, device=device) for n in (4, 3, 1)])
    assert sequence.sorted_indices is None
    with torch.no_grad():
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            torch.compile(model, backend=COMPILE_BACKEND, fullgraph=True)(sequence)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=COMPILE_BACKEND)(sequence)
        eager = model(sequence)
    assert isinstance(compiled[0], PackedSequence)
    assert_outputs_close(_data(compiled), _data(eager))


def test_compiled_call_that_needs_a_gradient_runs_nn_lstm(device, fresh_dynamo):
    """With a gradient needed the call runs the wrapped ``nn.LSTM``, which Dynamo does not
    trace (nor the warning that says why): ``fullgraph=True`` raises ``Unsupported`` before
    anything runs; without it the graph breaks there and the call is the eager one: it
    warns once, and its outputs and gradients are ``nn.LSTM``'s."""
    lstm = make_lstm(3, 6, 2, True, device=device).train()  # cuDNN differentiates in training mode only
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device, requires_grad=True)
    with counting_module_calls(lstm) as calls:
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(model, backend=COMPILE_BACKEND, fullgraph=True)(x)
        assert calls[0] == 0
        compiled = torch.compile(model, backend=COMPILE_BACKEND)
        with pytest.warns(UserWarning, match="a gradient is needed"):
            y, (h, c) = compiled(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            compiled(x)
    assert calls[0] == 2
    (y.sum() + h.sum()).backward()
    grad = x.grad.clone()
    x.grad = None
    ref, (h_ref, c_ref) = lstm(x)
    (ref.sum() + h_ref.sum()).backward()
    assert torch.equal(y, ref) and torch.equal(h, h_ref) and torch.equal(c, c_ref)
    assert torch.equal(grad, x.grad)


# ----------------------------------------------------------------------------------------
# The documentation's examples


@pytest.mark.parametrize("obj", [PersistentLSTM, PersistentLSTM.from_torch], ids=["PersistentLSTM", "from_torch"])
def test_docstring_examples_run(obj):
    tests = doctest.DocTestFinder(recurse=False).find(obj, globs={})
    assert tests and tests[0].examples, "an Example section"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0


@pytest.mark.filterwarnings("ignore:PersistentLSTM")
def test_traced_call_that_needs_a_gradient_with_lengths_runs_the_padded_stage():
    """Traced, lengths cannot become a PackedSequence (its batch sizes live on the host):
    the padded PyTorch stage runs instead, differentiable and dropout-free."""
    lstm = make_lstm(3, 5, 2, True)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([4, 1, 3])
    x = torch.randn(3, 4, 3)
    traced = make_fx(lambda x, lengths: model(x, lengths=lengths))(x, lengths)
    assert _recurrence_calls(traced.graph) == 0
    y, state = traced(x, lengths)
    with torch.no_grad():
        assert_outputs_close((pack(y, lengths).data, state), packed_reference(lstm, x, lengths))
    lstm.dropout = 0.5
    model.train()
    with pytest.raises(ValueError, match="padded PyTorch stage, which has no dropout"):
        make_fx(lambda x, lengths: model(x, lengths=lengths))(x, lengths)


# ----------------------------------------------------------------------------------------
# Float16 and bfloat16: W_hh and h in the dtype, the gates and c in float32


def _upcast(output, dtype):
    y, (h, c) = output
    y = y.data if isinstance(y, (Packed, torch.nn.utils.rnn.PackedSequence)) else y
    return y.to(dtype), (h.to(dtype), c.to(dtype))


def _assert_half_outputs(output, dtype, f32, f64, suffix=""):
    """Outputs of ``dtype``, within :data:`HALF_ATOL` of the float32 and float64 modules' ``(y, (h_n, c_n))``."""
    y, (h, c) = output
    y = y.data if isinstance(y, (Packed, torch.nn.utils.rnn.PackedSequence)) else y
    assert y.dtype == h.dtype == c.dtype == dtype, (y.dtype, h.dtype, c.dtype)
    atol = HALF_ATOL[dtype]
    assert_outputs_close(_upcast(output, torch.float32), f32, atol=atol, rtol=0, suffix=f" vs float32{suffix}")
    assert_outputs_close(_upcast(output, torch.float64), f64, atol=atol, rtol=0, suffix=f" vs float64{suffix}")


#: (a padded case, with a given initial state)
HALF_PADDED_CASES = [((3, 5, 5, 12, 2, True, True, True), True), ((2, 4, 4, 16, 1, True, False, False), False),
                     ((2, 4, 3, 8, 3, False, True, True), True)]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case,with_state", HALF_PADDED_CASES,
                         ids=[_case_id(c) + ("-state" if s else "") for c, s in HALF_PADDED_CASES])
def test_half_matches_float32_and_float64_padded(device, dtype, case, with_state):
    """Against nn.LSTM in float32 and in float64 with the same (rounded) weights and inputs."""
    B, T, I, H, L, bi, bias, bf = case
    lstm, f32, f64 = make_half_lstm(dtype, I, H, L, bi, bias, bf, device=device, seed=B * 100 + T)
    D = 2 if bi else 1
    x = torch.randn((B, T, I) if bf else (T, B, I), device=device).to(dtype)
    hx = tuple(torch.randn(L * D, B, H, device=device).to(dtype) for _ in range(2)) if with_state else None
    with torch.no_grad():
        out = PersistentLSTM.from_torch(lstm)(x, hx)
        ref32 = f32(x.float(), None if hx is None else tuple(t.float() for t in hx))
        ref64 = f64.cpu()(x.double().cpu(), None if hx is None else tuple(t.double().cpu() for t in hx))
    _assert_half_outputs(out, dtype, ref32, tuple_to(ref64, device))


def tuple_to(output, device):
    y, (h, c) = output
    return y.to(device), (h.to(device), c.to(device))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [[3, 6, 1, 5, 2]], ids=lengths_id)
def test_half_packed_matches_packed_sequence(device, dtype, lengths):
    """A Packed batch with a given state against nn.LSTM on the PackedSequence, in float32
    and float64; and the same as a padded batch with lengths."""
    lstm, f32, f64 = make_half_lstm(dtype, 6, 10, 2, True, device=device, seed=len(lengths))
    B, T = len(lengths), max(lengths)
    padded = torch.randn(B, T, 6, device=device).to(dtype)
    hx = tuple(torch.randn(4, B, 10, device=device).to(dtype) for _ in range(2))
    lengths_t = torch.tensor(lengths, device=device)
    model = PersistentLSTM.from_torch(lstm)
    with torch.no_grad():
        out, state = model(pack(padded, lengths_t), hx)
        y, padded_state = model(padded, hx, lengths=lengths_t)
        ref32 = packed_reference(f32, padded.float(), lengths_t, tuple(t.float() for t in hx))
        ref64 = packed_reference(f64.cpu(), padded.double().cpu(), lengths_t.cpu(), tuple(t.double().cpu() for t in hx))
    ref64 = tuple_to(ref64, device)
    _assert_half_outputs((out.data, state), dtype, ref32, ref64)
    _assert_half_outputs((pack(y, lengths_t).data, padded_state), dtype, ref32, ref64, suffix=" (padded, lengths)")
    assert torch.equal(pack(y, lengths_t).data, out.data), "the same kernels on the same frames"


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_packed_sequence_in_and_out(device, dtype):
    lstm, f32, _ = make_half_lstm(dtype, 3, 8, 2, True, device=device)
    padded = torch.randn(3, 5, 3, device=device)
    sequence = torch.nn.utils.rnn.pack_padded_sequence(padded.to(dtype), torch.tensor([2, 5, 4]), batch_first=True,
                                                       enforce_sorted=False)
    with torch.no_grad():
        out, state = PersistentLSTM.from_torch(lstm)(sequence)
        ref, ref_state = f32(torch.nn.utils.rnn.pack_padded_sequence(
            padded.to(dtype).float(), torch.tensor([2, 5, 4]), batch_first=True, enforce_sorted=False))
    assert isinstance(out, torch.nn.utils.rnn.PackedSequence) and out.data.dtype == dtype
    assert torch.equal(out.batch_sizes, ref.batch_sizes) and torch.equal(out.unsorted_indices, ref.unsorted_indices)
    assert_outputs_close((out.data.float(), tuple(t.float() for t in state)), (ref.data, ref_state),
                         atol=HALF_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_keeps_the_cell_state_in_float32(device, dtype):
    """``c`` grows by ``i g = 0.0004`` a step from 1 (the forget gate saturated open): below
    half a unit in the last place of 1 in float16 (2^-11) and bfloat16 (2^-8), so a cell
    state rounded to the dtype at every step would stay at 1. Kept in float32 and rounded
    once, ``c_n`` is 1 + 40 x 0.0004 to the dtype's rounding."""
    steps, delta = 40, 4e-4
    lstm = make_lstm(2, 4, device=device, dtype=dtype)
    with torch.no_grad():
        for p in lstm.parameters():
            p.zero_()
        # gate rows i, f, g, o: i = 1/2, f = sigmoid(30) = 1 in float32, g = tanh(z) = 2 delta
        g_bias = torch.atanh(torch.tensor(2 * delta, dtype=dtype).double()).to(dtype)
        lstm.bias_ih_l0[4:8] = 30.0
        lstm.bias_ih_l0[8:12] = g_bias
    i_times_g = 0.5 * torch.tanh(g_bias.double())  # what the kernels compute, from the rounded bias
    x = torch.randn(1, steps, 2, device=device).to(dtype)
    hx = (torch.zeros(1, 1, 4, device=device, dtype=dtype), torch.ones(1, 1, 4, device=device, dtype=dtype))
    with torch.no_grad():
        _, (h, c) = PersistentLSTM.from_torch(lstm)(x, hx)
    expected = float(1 + steps * i_times_g)
    # rounded once: within half a unit in the last place of c_n (and well away from 1)
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    assert torch.all((c.double() - expected).abs() <= ulp / 2 + 1e-6), (c, expected)
    assert torch.all(c.double() > 1), "the cell state must have grown"
    assert torch.allclose(h.double(), 0.5 * torch.tanh(torch.tensor(expected)).double(), atol=ulp), h


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_traced_call_runs_the_custom_op_in_the_dtype(device, dtype):
    """A traced call of a float16 or bfloat16 module (each layer the custom op) computes what
    the eager call does, bitwise; a FakeTensorMode call gives outputs of the dtype."""
    lstm, _, _ = make_half_lstm(dtype, 4, 9, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([5, 2, 4], device=device)
    padded = torch.randn(3, 5, 4, device=device).to(dtype)
    with torch.no_grad():
        traced = make_fx(lambda x, lengths: model(x, lengths=lengths))(padded, lengths)
        assert _recurrence_calls(traced.graph) == 2
        y, (h, c) = traced(padded, lengths)
        y_eager, (h_eager, c_eager) = model(padded, lengths=lengths)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_y, (fake_h, fake_c) = model(torch.empty(3, 5, 4, dtype=dtype, device=device))
    assert y.dtype == h.dtype == c.dtype == dtype
    assert torch.equal(y, y_eager) and torch.equal(h, h_eager) and torch.equal(c, c_eager)
    assert (fake_y.dtype, fake_h.dtype, fake_c.dtype) == (dtype,) * 3 and fake_y.shape == (3, 5, 18)
