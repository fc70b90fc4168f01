"""PersistentLSTM's bad inputs, one table for building it and one for calling it: each row
the exception, the argument its message must name and what the message says was
expected, on the kernels' path (no grad) and on nn.LSTM's (a gradient needed)."""
import re

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from packed_kernels import Packed, PersistentLSTM, pack
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
    ("lengths-above-T", _lengths([5, 2]), ValueError, "lengths", r"must lie in \[0, T=4\]; got min 2, max 5"),
    ("lengths-negative", _lengths([-1, 2]), ValueError, "lengths", r"must lie in \[0, T=4\]; got min -1"),
    ("lengths-count", _lengths([4, 2, 1]), ValueError, "lengths", r"must have shape \(2,\)"),
    ("lengths-2d", _lengths([[4, 2]]), ValueError, "lengths", r"must have shape \(2,\) .*; got \(1, 2\)"),
    ("lengths-float", _lengths([4.0, 2.0]), TypeError, "lengths", "must be int32 or int64"),
    ("lengths-unbatched", lambda d: {"input": torch.randn(4, 3, device=d), "lengths": torch.tensor([4])},
     ValueError, "lengths", "needs a batched input"),
    ("packed-cu_seqlens", _packed(cu_seqlens=lambda p: p.cu_seqlens.flip(0)), ValueError, "packed.cu_seqlens",
     r"must be \[0, cumsum\(packed.lengths\)\]"),
    ("packed-cu_seqlens-shape", _packed(cu_seqlens=lambda p: p.cu_seqlens[:-1]), ValueError, "packed.cu_seqlens",
     r"must have shape \(B \+ 1,\) = \(3,\)"),
    ("packed-cu_seqlens-float", _packed(cu_seqlens=lambda p: p.cu_seqlens.float()), TypeError, "packed.cu_seqlens",
     "must be int32 or int64"),
    ("packed-cu_seqlens-device", _packed(cu_seqlens=lambda p: p.cu_seqlens.to("meta")), ValueError,
     "packed.cu_seqlens", "must be on packed.data's device"),
    ("packed-lengths-device", _packed(lengths=lambda p: p.lengths.to("meta")), ValueError, "packed.lengths",
     "must be on packed.data's device"),
    ("packed-rows", _packed(data=lambda p: p.data[:-1]), ValueError, "packed.data",
     "has 5 rows but packed.lengths sum to 6"),
    ("packed-extra-rows", _packed(data=lambda p: torch.cat([p.data, p.data[:1]])), ValueError, "packed.data",
     "has 7 rows but packed.lengths sum to 6"),
    ("packed-negative", _packed(lengths=lambda p: torch.tensor([7, -1], device=p.data.device)), ValueError,
     "packed.lengths", "must be >= 0; got min -1"),
    ("packed-float-lengths", _packed(lengths=lambda p: p.lengths.float()), TypeError, "packed.lengths",
     "must be int32 or int64"),
    ("packed-data-float64", _packed(data=lambda p: p.data.double()), TypeError, "packed.data", "must be float32"),
    ("packed-data-3d", _packed(data=lambda p: p.data[:, None]), ValueError, "packed.data", "must be 2-D"),
    ("packed-data-list", _packed(data=lambda p: p.data.tolist()), TypeError, "packed.data", "must be a torch.Tensor"),
    ("packed-h0-device", lambda d: {**_packed()(d), **_state(h0=lambda d: torch.zeros(4, 2, 8, device="meta"))(d)},
     ValueError, "h0", "must be on packed.data's device"),
    ("packed-with-lengths", lambda d: {**_packed()(d), "lengths": torch.tensor([4, 2])}, ValueError, "lengths",
     "must not be given with a Packed input"),
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
