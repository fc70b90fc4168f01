"""PersistentLSTM's bad inputs: each case the exception and the words its message must
hold, on the kernels' path (no grad) and on nn.LSTM's (a gradient needed)."""
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from packed_kernels import Packed, PersistentLSTM, pack

from lstm_cases import make_lstm

# B = 2, T = 4, I = 3, H = 8, 2 layers, bidirectional: states (4, 2, 8)


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


def _lengths(values, dtype=None):
    return lambda d: {"lengths": torch.tensor(values, dtype=dtype)}


#: (id, arguments from the device, exception, message pattern)
BAD_CALLS = [
    ("input-float64", lambda d: {"input": torch.randn(2, 4, 3, device=d, dtype=torch.float64)},
     TypeError, "input must be float32; got torch.float64"),
    ("input-bfloat16", lambda d: {"input": torch.randn(2, 4, 3, device=d, dtype=torch.bfloat16)},
     TypeError, "input must be float32"),
    ("input-features", lambda d: {"input": torch.randn(2, 4, 5, device=d)}, ValueError, "3 features"),
    ("input-4d", lambda d: {"input": torch.randn(1, 2, 4, 3, device=d)}, ValueError, "input must be 3-D or 2-D"),
    ("input-list", lambda d: {"input": [[0.0] * 3]}, TypeError, "input must be a torch.Tensor"),
    ("input-meta", lambda d: {"input": torch.randn(2, 4, 3, device="meta")}, ValueError,
     r"input must be on the device of the nn.LSTM's parameters"),
    ("h0-float64", _state(h0=lambda d: torch.zeros(4, 2, 8, device=d, dtype=torch.float64)), TypeError,
     "h0 must be float32"),
    ("c0-float64", _state(c0=lambda d: torch.zeros(4, 2, 8, device=d, dtype=torch.float64)), TypeError,
     "c0 must be float32"),
    ("h0-shape", _state(h0=lambda d: torch.zeros(4, 3, 8, device=d)), ValueError, r"h0 must have shape \(4, 2, 8\)"),
    ("c0-shape", _state(c0=lambda d: torch.zeros(2, 2, 8, device=d)), ValueError, r"c0 must have shape \(4, 2, 8\)"),
    ("h0-device", _state(h0=lambda d: torch.zeros(4, 2, 8, device="meta")), ValueError,
     "h0 must be on input's device"),
    ("c0-device", _state(c0=lambda d: torch.zeros(4, 2, 8, device="meta")), ValueError,
     "c0 must be on input's device"),
    ("hx-tensor", lambda d: {"hx": torch.zeros(4, 2, 8, device=d)}, TypeError, r"hx must be a tuple \(h0, c0\)"),
    ("hx-one", lambda d: {"hx": (torch.zeros(4, 2, 8, device=d),)}, TypeError, "hx must be a tuple"),
    ("lengths-above-T", _lengths([5, 2]), ValueError, r"lengths must lie in \[0, T=4\]; got min 2, max 5"),
    ("lengths-negative", _lengths([-1, 2]), ValueError, r"lengths must lie in \[0, T=4\]; got min -1"),
    ("lengths-count", _lengths([4, 2, 1]), ValueError, r"lengths must have shape \(2,\)"),
    ("lengths-float", _lengths([4.0, 2.0]), TypeError, "lengths must be int32 or int64"),
    ("lengths-unbatched", lambda d: {"input": torch.randn(4, 3, device=d), "lengths": torch.tensor([4])},
     ValueError, "lengths needs a batched input"),
    ("packed-cu_seqlens", _packed(cu_seqlens=lambda p: p.cu_seqlens.flip(0)), ValueError,
     r"packed.cu_seqlens must be \[0, cumsum\(packed.lengths\)\]"),
    ("packed-cu_seqlens-shape", _packed(cu_seqlens=lambda p: p.cu_seqlens[:-1]), ValueError,
     r"packed.cu_seqlens must have shape \(B \+ 1,\)"),
    ("packed-rows", _packed(data=lambda p: p.data[:-1]), ValueError, "packed.data has 5 rows but packed.lengths sum"),
    ("packed-negative", _packed(lengths=lambda p: torch.tensor([7, -1], device=p.data.device)), ValueError,
     "packed.lengths must be >= 0"),
    ("packed-float-lengths", _packed(lengths=lambda p: p.lengths.float()), TypeError,
     "packed.lengths must be int32 or int64"),
    ("packed-data-float64", _packed(data=lambda p: p.data.double()), TypeError, "packed.data must be float32"),
    ("packed-data-3d", _packed(data=lambda p: p.data[:, None]), ValueError, "packed.data must be 2-D"),
    ("packed-with-lengths", lambda d: {**_packed()(d), "lengths": torch.tensor([4, 2])}, ValueError,
     "lengths must not be given with a Packed input"),
    ("sequence-float64", lambda d: {"input": pack_padded_sequence(torch.randn(2, 4, 3, device=d).double(), [4, 2],
                                                                  batch_first=True)},
     TypeError, "input.data must be float32"),
    ("sequence-features", lambda d: {"input": pack_padded_sequence(torch.randn(2, 4, 5, device=d), [4, 2],
                                                                   batch_first=True)},
     ValueError, "input.data must have 3 features"),
    ("sequence-h0-batch", lambda d: {"input": pack_padded_sequence(torch.randn(2, 4, 3, device=d), [4, 2],
                                                                   batch_first=True),
                                     **_state(h0=lambda d: torch.zeros(4, 3, 8, device=d))(d)},
     ValueError, r"h0 must have shape \(4, 2, 8\)"),
    ("sequence-with-lengths", lambda d: {"input": pack_padded_sequence(torch.randn(2, 4, 3, device=d), [4, 2],
                                                                       batch_first=True),
                                         "lengths": torch.tensor([4, 2])},
     ValueError, "lengths must not be given with a PackedSequence"),
]


@pytest.mark.parametrize("grad", [False, True], ids=["kernels", "nn.LSTM"])
@pytest.mark.parametrize("make,error,message", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS])
def test_bad_calls_are_refused_naming_the_argument(device, grad, make, error, message):
    """Refused before the kernels or nn.LSTM see them (nn.LSTM's own messages name no
    argument), on either path; lengths on the host are checked on both."""
    model = PersistentLSTM.from_torch(make_lstm(3, 8, 2, True, device=device))
    arguments = {"input": torch.randn(2, 4, 3, device=device), **make(device)}
    kwargs = {"lengths": arguments.pop("lengths")} if "lengths" in arguments else {}
    with torch.set_grad_enabled(grad), pytest.raises(error, match=message):
        model(arguments["input"], arguments.get("hx"), **kwargs)


def test_unsupported_modules(device):
    with pytest.raises(ValueError, match="proj_size"):
        PersistentLSTM.from_torch(torch.nn.LSTM(3, 8, proj_size=4))
    with pytest.raises(TypeError, match="float32"):
        PersistentLSTM.from_torch(torch.nn.LSTM(3, 8).double())
    with pytest.raises(TypeError, match="nn.LSTM"):
        PersistentLSTM.from_torch(torch.nn.GRU(3, 8))
    with pytest.raises(ValueError, match="hidden_size=600"):
        PersistentLSTM.from_torch(torch.nn.LSTM(3, 600))
    model = PersistentLSTM.from_torch(torch.nn.LSTM(3, 8, num_layers=2, dropout=0.5).to(device).train())
    with pytest.raises(ValueError, match="dropout"):
        with torch.no_grad():
            model(torch.randn(4, 2, 3, device=device))
    lstm = torch.nn.LSTM(3, 8).to(device)
    model = PersistentLSTM.from_torch(lstm)
    lstm.double()  # changed after wrapping: refused at the call
    with torch.no_grad(), pytest.raises(TypeError, match="parameters must be float32"):
        model(torch.randn(4, 2, 3, dtype=torch.float64, device=device))
