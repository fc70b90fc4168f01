"""PersistentLSTM's bad inputs, one table for building it, one for calling it with wrong
types, shapes or devices and one for values checked on the device: each row the
exception, the argument its message must name and what the message says was expected,
on the kernels' path (no grad) and on nn.LSTM's (a gradient needed)."""
import re

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import packed_kernels as pk
from packed_kernels import Packed, PersistentLSTM, pack
from packed_kernels.ops.lstm.inputs import lstm_checked_lengths_op, lstm_checked_packed_op
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig, RecurrentProduct, StepWait

from lstm_cases import make_lstm


def assert_refused(error, argument, expected, call):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert argument in message, f"the message does not name {argument!r}: {message}"
    assert re.search(expected, message), f"the message does not say {expected!r}: {message}"


# ----------------------------------------------------------------------------------------
# Building it: from_torch (and the constructor), and a module changed after wrapping


def _changed_after_wrapping(change, device):
    """A call of a model whose nn.LSTM ``change`` alters after wrapping: refused at the call."""
    lstm = torch.nn.LSTM(3, 8, num_layers=2).to(device)
    model = PersistentLSTM.from_torch(lstm)
    change(lstm)
    with torch.no_grad():
        model(torch.randn(4, 2, 3, device=device, dtype=lstm.weight_ih_l0.dtype))


def _call_with_config(fields, device, hidden=16):
    model = PersistentLSTM.from_torch(torch.nn.LSTM(3, hidden).to(device), RecurrenceConfig(**fields))
    with torch.no_grad():
        model(torch.randn(2, 1, 3, device=device))


def _one_parameter_float64(lstm):
    lstm.bias_hh_l0.data = lstm.bias_hh_l0.data.double()
    return lstm


def _one_parameter_float32(lstm):
    lstm.bias_hh_l0.data = lstm.bias_hh_l0.data.float()
    return lstm


_SINGLE = dict(programs_per_tile=1, rows_per_tile=2, product=RecurrentProduct.ROW_SUMS, wait=StepWait.CTA_BARRIER)

#: (id, the call on a device, exception, argument named, the expectation as a pattern)
BAD_MODULES = [
    ("gru", lambda d: PersistentLSTM.from_torch(torch.nn.GRU(3, 8)), TypeError, "lstm",
     "must be a torch.nn.LSTM; got GRU"),
    ("none", lambda d: PersistentLSTM.from_torch(None), TypeError, "lstm", "got NoneType"),
    ("constructor-gru", lambda d: PersistentLSTM(torch.nn.GRU(3, 8)), TypeError, "lstm", "got GRU"),
    ("proj_size-4", lambda d: PersistentLSTM.from_torch(torch.nn.LSTM(3, 8, proj_size=4)), ValueError, "proj_size",
     "proj_size=4 .* need proj_size=0"),
    ("proj_size-1", lambda d: PersistentLSTM.from_torch(torch.nn.LSTM(3, 8, proj_size=1)), ValueError, "proj_size",
     "proj_size=1"),
    ("hidden_size-513", lambda d: PersistentLSTM.from_torch(torch.nn.LSTM(3, 513)), ValueError, "hidden_size",
     "hidden_size=513 is not supported.* up to 512"),
    ("float64", lambda d: PersistentLSTM.from_torch(torch.nn.LSTM(3, 8).double()), TypeError, "weight_ih_l0",
     "must be float32, float16 or bfloat16; got weight_ih_l0 of dtype torch.float64"),
    ("one-parameter-float64", lambda d: PersistentLSTM.from_torch(_one_parameter_float64(torch.nn.LSTM(3, 8))),
     TypeError, "bias_hh_l0", "must be float32, float16 or bfloat16; got bias_hh_l0 of dtype torch.float64"),
    ("float16-with-one-float32",
     lambda d: PersistentLSTM.from_torch(_one_parameter_float32(torch.nn.LSTM(3, 8).half())), TypeError,
     "bias_hh_l0", "must all have one dtype; got weight_ih_l0 of dtype torch.float16 and bias_hh_l0 of dtype "
     "torch.float32"),
    ("changed-to-mixed", lambda d: _changed_after_wrapping(
        lambda m: setattr(m.weight_hh_l1, "data", m.weight_hh_l1.data.bfloat16()), d), TypeError,
     "weight_hh_l1", "must all have one dtype; got weight_ih_l0 of dtype torch.float32 and weight_hh_l1 of dtype "
     "torch.bfloat16"),
    ("config-dict", lambda d: PersistentLSTM.from_torch(torch.nn.LSTM(3, 8), dict(_SINGLE)), TypeError, "config",
     "must be a RecurrenceConfig or None; got dict"),
    ("config-name", lambda d: PersistentLSTM(torch.nn.LSTM(3, 8), "ROW_SUMS"), TypeError, "config", "got str"),
    ("changed-to-float64", lambda d: _changed_after_wrapping(lambda m: m.double(), d), TypeError, "weight_ih_l0",
     "parameters must be float32"),
    ("changed-proj_size", lambda d: _changed_after_wrapping(lambda m: setattr(m, "proj_size", 2), d), ValueError,
     "proj_size", "proj_size=2"),
    ("dropout-training", lambda d: _changed_after_wrapping(lambda m: setattr(m, "dropout", 0.5), d), ValueError,
     "dropout", r"dropout=0.5 between layers, which only acts in training mode; call .eval\(\)"),
    ("config-divides", lambda d: _call_with_config(dict(_SINGLE, programs_per_tile=3, wait=StepWait.STEP_COUNTER), d),
     ValueError, "programs_per_tile", "programs_per_tile=3 must divide the padded hidden size 16"),
    # hidden sizes are padded to a power of two of at least 16 (the tensor cores' smallest product)
    ("config-divides-hidden-8",
     lambda d: _call_with_config(dict(_SINGLE, programs_per_tile=3, wait=StepWait.STEP_COUNTER), d, hidden=8),
     ValueError, "programs_per_tile", "programs_per_tile=3 must divide the padded hidden size 16"),
]


@pytest.mark.parametrize("call,error,argument,expected", [row[1:] for row in BAD_MODULES],
                         ids=[row[0] for row in BAD_MODULES])
def test_unsupported_modules_and_configs_are_refused(device, call, error, argument, expected):
    with torch.no_grad():
        assert_refused(error, argument, expected, lambda: call(device))


def test_the_largest_supported_module_is_accepted():
    """The limits themselves are allowed: hidden_size 512 (float32 and float16), proj_size
    0, float16 and bfloat16 parameters, a one-layer module with dropout (nn.LSTM applies
    dropout between layers only)."""
    for lstm in (torch.nn.LSTM(3, 512), torch.nn.LSTM(3, 512).half(), torch.nn.LSTM(3, 8, proj_size=0),
                 torch.nn.LSTM(3, 8, bias=False), torch.nn.LSTM(3, 8).bfloat16()):
        assert PersistentLSTM.from_torch(lstm).lstm is lstm
    with pytest.warns(UserWarning, match="dropout"):
        one_layer = torch.nn.LSTM(3, 8, dropout=0.5)
    assert PersistentLSTM.from_torch(one_layer.train()).lstm is one_layer


# ----------------------------------------------------------------------------------------
# Calling it: B = 2, T = 4, I = 3, H = 8, 2 layers, bidirectional: states (4, 2, 8)


def _state(**changes):
    h0 = changes.get("h0", lambda d: torch.zeros(4, 2, 8, device=d))
    c0 = changes.get("c0", lambda d: torch.zeros(4, 2, 8, device=d))
    return lambda d: {"hx": (h0(d), c0(d))}


def _packed(**changes):
    def build(d):
        packed = pack(torch.randn(2, 4, 3, device=d), [4, 2])
        return {"input": Packed(*(changes.get(name, lambda p: getattr(p, name))(packed)
                                  for name in ("data", "cu_seqlens", "lengths")))}
    return build


def _sequence(features=3):
    return lambda d: pack_padded_sequence(torch.randn(2, 4, features, device=d), [4, 2], batch_first=True)


def _lengths(values, dtype=None):
    return lambda d: {"lengths": torch.tensor(values, dtype=dtype)}


#: (id, arguments from the device, exception, argument named, the expectation as a pattern)
BAD_CALLS = [
    ("input-float64", lambda d: {"input": torch.randn(2, 4, 3, device=d, dtype=torch.float64)},
     TypeError, "input", "must be float32; got torch.float64"),
    ("input-bfloat16", lambda d: {"input": torch.randn(2, 4, 3, device=d, dtype=torch.bfloat16)},
     TypeError, "input", "must be float32; got torch.bfloat16"),
    ("input-int64", lambda d: {"input": torch.zeros(2, 4, 3, device=d, dtype=torch.int64)},
     TypeError, "input", "must be float32; got torch.int64"),
    ("input-features", lambda d: {"input": torch.randn(2, 4, 5, device=d)}, ValueError, "input",
     r"must have 3 features \(the nn.LSTM's input_size\)"),
    ("input-4d", lambda d: {"input": torch.randn(1, 2, 4, 3, device=d)}, ValueError, "input",
     r"must be 3-D or 2-D \(B, T, I\) or \(T, I\) unbatched"),
    ("input-1d", lambda d: {"input": torch.randn(3, device=d)}, ValueError, "input", "must be 3-D or 2-D"),
    ("input-list", lambda d: {"input": [[0.0] * 3]}, TypeError, "input",
     "must be a torch.Tensor, a packed_kernels.Packed or a PackedSequence; got list"),
    ("input-meta", lambda d: {"input": torch.randn(2, 4, 3, device="meta")}, ValueError, "input",
     r"must be on the device of the nn.LSTM's parameters"),
    ("h0-float64", _state(h0=lambda d: torch.zeros(4, 2, 8, device=d, dtype=torch.float64)), TypeError, "h0",
     "must be float32"),
    ("c0-float64", _state(c0=lambda d: torch.zeros(4, 2, 8, device=d, dtype=torch.float64)), TypeError, "c0",
     "must be float32"),
    ("h0-list", _state(h0=lambda d: [[0.0] * 8] * 2), TypeError, "h0", "must be a torch.Tensor; got list"),
    ("h0-shape", _state(h0=lambda d: torch.zeros(4, 3, 8, device=d)), ValueError, "h0",
     r"must have shape \(4, 2, 8\); got \(4, 3, 8\)"),
    ("c0-shape", _state(c0=lambda d: torch.zeros(2, 2, 8, device=d)), ValueError, "c0", r"must have shape \(4, 2, 8\)"),
    ("h0-unbatched-shape", lambda d: {"input": torch.randn(4, 3, device=d), **_state()(d)}, ValueError, "h0",
     r"must have shape \(4, 8\); got \(4, 2, 8\)"),
    ("h0-device", _state(h0=lambda d: torch.zeros(4, 2, 8, device="meta")), ValueError, "h0",
     "must be on input's device"),
    ("c0-device", _state(c0=lambda d: torch.zeros(4, 2, 8, device="meta")), ValueError, "c0",
     "must be on input's device"),
    ("hx-tensor", lambda d: {"hx": torch.zeros(4, 2, 8, device=d)}, TypeError, "hx", r"must be a tuple \(h0, c0\)"),
    ("hx-one", lambda d: {"hx": (torch.zeros(4, 2, 8, device=d),)}, TypeError, "hx", "must be a tuple"),
    ("hx-three", lambda d: {"hx": (torch.zeros(4, 2, 8, device=d),) * 3}, TypeError, "hx", "got tuple"),
    ("lengths-count", _lengths([4, 2, 1]), ValueError, "lengths", r"must have shape \(2,\)"),
    ("lengths-2d", _lengths([[4, 2]]), ValueError, "lengths", r"must have shape \(2,\) .*; got \(1, 2\)"),
    ("lengths-float", _lengths([4.0, 2.0]), TypeError, "lengths", "must be int32 or int64"),
    ("lengths-unbatched", lambda d: {"input": torch.randn(4, 3, device=d), "lengths": torch.tensor([4])},
     ValueError, "lengths", "needs a batched input"),
    ("packed-cu_seqlens-shape", _packed(cu_seqlens=lambda p: p.cu_seqlens[:-1]), ValueError, "packed.cu_seqlens",
     r"must have shape \(B \+ 1,\) = \(3,\)"),
    ("packed-cu_seqlens-float", _packed(cu_seqlens=lambda p: p.cu_seqlens.float()), TypeError, "packed.cu_seqlens",
     "must be int32 or int64"),
    ("packed-cu_seqlens-device", _packed(cu_seqlens=lambda p: p.cu_seqlens.to("meta")), ValueError,
     "packed.cu_seqlens", "must be on packed.data's device"),
    ("packed-lengths-device", _packed(lengths=lambda p: p.lengths.to("meta")), ValueError, "packed.lengths",
     "must be on packed.data's device"),
    ("packed-float-lengths", _packed(lengths=lambda p: p.lengths.float()), TypeError, "packed.lengths",
     "must be int32 or int64"),
    ("packed-data-float64", _packed(data=lambda p: p.data.double()), TypeError, "packed.data", "must be float32"),
    ("packed-data-3d", _packed(data=lambda p: p.data[:, None]), ValueError, "packed.data", "must be 2-D"),
    ("packed-data-list", _packed(data=lambda p: p.data.tolist()), TypeError, "packed.data", "must be a torch.Tensor"),
    ("packed-h0-device", lambda d: {**_packed()(d), **_state(h0=lambda d: torch.zeros(4, 2, 8, device="meta"))(d)},
     ValueError, "h0", "must be on packed.data's device"),
    ("packed-with-lengths", lambda d: {**_packed()(d), "lengths": torch.tensor([4, 2])}, ValueError, "lengths",
     "must not be given with a Packed input"),
    ("packed-rows-without-sequences", _packed(cu_seqlens=lambda p: p.cu_seqlens[:1], lengths=lambda p: p.lengths[:0]),
     ValueError, "packed.data", "has 6 rows but packed.lengths is empty"),
    ("sequence-float64", lambda d: {"input": pack_padded_sequence(torch.randn(2, 4, 3, device=d).double(), [4, 2],
                                                                  batch_first=True)},
     TypeError, "input.data", "must be float32"),
    ("sequence-features", lambda d: {"input": _sequence(5)(d)}, ValueError, "input.data", "must have 3 features"),
    ("sequence-h0-batch", lambda d: {"input": _sequence()(d), **_state(h0=lambda d: torch.zeros(4, 3, 8, device=d))(d)},
     ValueError, "h0", r"must have shape \(4, 2, 8\)"),
    ("sequence-h0-device", lambda d: {"input": _sequence()(d),
                                      **_state(c0=lambda d: torch.zeros(4, 2, 8, device="meta"))(d)},
     ValueError, "c0", "must be on input.data's device"),
    ("sequence-with-lengths", lambda d: {"input": _sequence()(d), "lengths": torch.tensor([4, 2])}, ValueError,
     "lengths", "must not be given with a PackedSequence"),
]


@pytest.mark.parametrize("grad", [False, True], ids=["kernels", "nn.LSTM"])
@pytest.mark.parametrize("make,error,argument,expected", [case[1:] for case in BAD_CALLS],
                         ids=[case[0] for case in BAD_CALLS])
def test_bad_calls_are_refused_naming_the_argument(device, grad, make, error, argument, expected):
    """Refused before the kernels or nn.LSTM see them (nn.LSTM's own messages name no
    argument), on either path; lengths on the host are checked on both."""
    model = PersistentLSTM.from_torch(make_lstm(3, 8, 2, True, device=device))
    arguments = {"input": torch.randn(2, 4, 3, device=device), **make(device)}
    kwargs = {"lengths": arguments.pop("lengths")} if "lengths" in arguments else {}
    with torch.set_grad_enabled(grad):
        assert_refused(error, argument, expected, lambda: model(arguments["input"], arguments.get("hx"), **kwargs))


# ----------------------------------------------------------------------------------------
# Values checked on the device: reported within the call for CPU tensors and in strict
# mode, else by the next call or check_errors()

_IN_RANGE = r"must lie in \[0, T\] \(T: the input's time steps\), which fails at sequence "
_OFFSETS = r"must be \[0, cumsum\(packed.lengths\)\] \(a Packed from pack\(\)\), which fails at entry "
_ROWS = "must sum to the rows of packed.data, which fails at sequence "


def _cu_seqlens(values):
    return lambda p: torch.tensor(values, dtype=p.cu_seqlens.dtype, device=p.data.device)


def _packed_lengths(values):
    return lambda p: torch.tensor(values, dtype=p.lengths.dtype, device=p.data.device)


#: (id, arguments from the device, argument named, the rest of the message as a pattern);
#: the batch of _packed() has lengths [4, 2], cu_seqlens [0, 4, 6] and 6 rows
BAD_VALUES = [
    ("lengths-above-T", _lengths([5, 2]), "lengths", _IN_RANGE + "0$"),
    ("lengths-negative", _lengths([4, -1]), "lengths", _IN_RANGE + "1$"),
    ("lengths-huge", _lengths([2, 2 ** 40]), "lengths", _IN_RANGE + "1$"),
    ("lengths-int32-on-device", lambda d: {"lengths": torch.tensor([3, 9], dtype=torch.int32, device=d)}, "lengths",
     _IN_RANGE + "1$"),
    ("lengths-list", lambda d: {"lengths": [4, 5]}, "lengths", _IN_RANGE + "1$"),
    ("packed-cu_seqlens-reversed", _packed(cu_seqlens=lambda p: p.cu_seqlens.flip(0)), "packed.cu_seqlens",
     _OFFSETS + "0$"),
    ("packed-cu_seqlens-shifted", _packed(cu_seqlens=_cu_seqlens([0, 3, 6])), "packed.cu_seqlens", _OFFSETS + "1$"),
    ("packed-cu_seqlens-past-rows", _packed(cu_seqlens=_cu_seqlens([0, 100, 6])), "packed.cu_seqlens",
     _OFFSETS + "1$"),
    ("packed-cu_seqlens-negative", _packed(cu_seqlens=_cu_seqlens([-5, 4, 6])), "packed.cu_seqlens", _OFFSETS + "0$"),
    ("packed-cu_seqlens-end", _packed(cu_seqlens=_cu_seqlens([0, 4, 7])), "packed.cu_seqlens", _OFFSETS + "2$"),
    ("packed-rows", _packed(data=lambda p: p.data[:-1]), "packed.lengths", _ROWS + "1$"),
    ("packed-rows-first", _packed(data=lambda p: p.data[:3]), "packed.lengths", _ROWS + "0$"),
    ("packed-extra-rows", _packed(data=lambda p: torch.cat([p.data, p.data[:1]])), "packed.lengths", _ROWS + "1$"),
    ("packed-negative", _packed(lengths=_packed_lengths([7, -1])), "packed.lengths",
     "must be >= 0, which fails at sequence 1$"),
    # negative, and cu_seqlens and the sum wrong too: the lengths themselves are named
    ("packed-negative-first", _packed(lengths=_packed_lengths([-4, 2])), "packed.lengths",
     "must be >= 0, which fails at sequence 0$"),
    ("packed-huge", _packed(lengths=_packed_lengths([2 ** 40, 2])), "packed.cu_seqlens", _OFFSETS + "1$"),
]


@pytest.mark.filterwarnings("ignore:PersistentLSTM")
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("grad", [False, True], ids=["kernels", "nn.LSTM"])
@pytest.mark.parametrize("make,argument,expected", [case[1:] for case in BAD_VALUES],
                         ids=[case[0] for case in BAD_VALUES])
def test_bad_values_are_reported_naming_the_argument(device, strict, grad, make, argument, expected):
    """A ValueError naming the function, the argument, the requirement and the first place
    where it fails, in either mode, on either path; the next call runs."""
    model = PersistentLSTM.from_torch(make_lstm(3, 8, 2, True, device=device))
    arguments = {"input": torch.randn(2, 4, 3, device=device), **make(device)}
    kwargs = {"lengths": arguments.pop("lengths")} if "lengths" in arguments else {}
    with torch.set_grad_enabled(grad):
        with pytest.raises(ValueError) as info, pk.strict_checks(strict):
            model(arguments["input"], arguments.get("hx"), **kwargs)
            if not strict:
                pk.check_errors()
        message = str(info.value)
        assert message.startswith(f"PersistentLSTM: {argument} "), message
        assert re.search(expected, message), f"the message does not say {expected!r}: {message}"
        y, _ = model(torch.randn(2, 4, 3, device=device))
    assert y.shape == (2, 4, 16)


def test_good_values_report_nothing(device):
    """The limits themselves pass: lengths 0 and T, empty sequences anywhere, no sequence at all."""
    model = PersistentLSTM.from_torch(make_lstm(3, 8, 2, True, device=device))
    x = torch.randn(3, 4, 3, device=device)
    with torch.no_grad(), pk.strict_checks(True):
        model(x, lengths=torch.tensor([0, 4, 4], device=device))
        model(pack(x, torch.tensor([0, 4, 0])))
        model(pack(x[:0], torch.tensor([], dtype=torch.int64)))
    pk.check_errors()


@pytest.mark.parametrize("seed", range(4))
def test_checked_values_stay_inside_the_rows(device, seed):
    """Whatever the offsets and lengths, the rows the kernels reach (row_start[b] up to
    row_start[b] + length[b]) lie inside the data, and valid ones come back unchanged; the
    padded lengths are clamped to [0, T]."""
    g = torch.Generator().manual_seed(seed)
    for batch in (1, 3, 8):
        rows = int(torch.randint(0, 20, (), generator=g))
        cu_seqlens = torch.randint(-30, 30, (batch + 1,), generator=g).to(device)
        lengths = torch.randint(-30, 30, (batch,), generator=g).to(device)
        lengths[0] = 2 ** 40
        with pytest.raises(ValueError, match="^PersistentLSTM: packed"):
            row_start, length = lstm_checked_packed_op(cu_seqlens, lengths, rows)
            pk.check_errors()
        assert bool((row_start >= 0).all()) and bool((length >= 0).all()), (row_start, length)
        assert bool((row_start + length <= rows).all()), (row_start, length, rows)
        padded = lstm_checked_lengths_op(lengths, 7)
        with pytest.raises(ValueError, match="^PersistentLSTM: lengths"):
            pk.check_errors()
        assert bool(((padded >= 0) & (padded <= 7)).all()), padded
    valid = torch.tensor([3, 0, 5], device=device)
    cu_seqlens = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    row_start, length = lstm_checked_packed_op(cu_seqlens, valid, 8)
    assert row_start.tolist() == [0, 3, 3] and length.tolist() == [3, 0, 5]
    assert lstm_checked_lengths_op(valid, 5).tolist() == [3, 0, 5]
    pk.check_errors()


# ----------------------------------------------------------------------------------------
# A float16 or bfloat16 module: inputs and states of its own dtype (outside autocast)


#: (id, arguments from the device and the module's dtype, argument named, what the message says)
BAD_HALF_CALLS = [
    ("input-float32", lambda d, m: {"input": torch.randn(2, 4, 3, device=d)}, "input", "must be {m}; got torch.float32"),
    ("input-other-half", lambda d, m: {"input": torch.randn(2, 4, 3, device=d).to(
        torch.bfloat16 if m == "float16" else torch.float16)}, "input", "must be {m}; got torch.(b?float16)"),
    ("h0-float32", lambda d, m: {"hx": (torch.zeros(4, 2, 8, device=d),
                                         torch.zeros(4, 2, 8, device=d, dtype=getattr(torch, m)))},
     "h0", "must be {m}; got torch.float32"),
    ("c0-float32", lambda d, m: {"hx": (torch.zeros(4, 2, 8, device=d, dtype=getattr(torch, m)),
                                         torch.zeros(4, 2, 8, device=d))},
     "c0", "must be {m}; got torch.float32"),
    ("packed-data-float32", lambda d, m: {"input": pack(torch.randn(2, 4, 3, device=d), [4, 2])}, "packed.data",
     "must be {m}; got torch.float32"),
    ("sequence-float32", lambda d, m: {"input": pack_padded_sequence(torch.randn(2, 4, 3, device=d), [4, 2],
                                                                     batch_first=True)},
     "input.data", "must be {m}; got torch.float32"),
]


@pytest.mark.parametrize("grad", [False, True], ids=["kernels", "nn.LSTM"])
@pytest.mark.parametrize("module_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("make,argument,expected", [case[1:] for case in BAD_HALF_CALLS],
                         ids=[case[0] for case in BAD_HALF_CALLS])
def test_mixed_dtypes_are_refused_naming_the_argument(device, grad, module_dtype, make, argument, expected):
    """A float16 or bfloat16 module takes only its own dtype (nn.LSTM itself would run some
    of these mixes, or fail inside): a TypeError naming the argument, on either path."""
    model = PersistentLSTM.from_torch(make_lstm(3, 8, 2, True, device=device, dtype=getattr(torch, module_dtype)))
    arguments = {"input": torch.randn(2, 4, 3, device=device, dtype=getattr(torch, module_dtype)),
                 **make(device, module_dtype)}
    with torch.set_grad_enabled(grad):
        assert_refused(TypeError, argument, expected.format(m=module_dtype),
                       lambda: model(arguments["input"], arguments.get("hx")))


def test_a_module_made_float16_after_wrapping_takes_float16():
    """The dtype is the module's at each call: made float16 after wrapping, a float32
    input is refused and a float16 one runs."""
    lstm = make_lstm(3, 8, 1, True)
    model = PersistentLSTM.from_torch(lstm)
    lstm.half()
    with torch.no_grad():
        assert_refused(TypeError, "input", "must be float16; got torch.float32",
                       lambda: model(torch.randn(2, 4, 3)))
        y, (h, c) = model(torch.randn(2, 4, 3).half())
    assert y.dtype == h.dtype == c.dtype == torch.float16
