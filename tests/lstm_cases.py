"""Shared inputs and references of the LSTM tests: modules, ``nn.LSTM`` on a
``PackedSequence`` as the packed reference, configurations by name, and a count of the
wrapped module's calls."""
import contextlib
import copy
import enum

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from packed_kernels import pack
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig, RecurrentProduct, StepWait

from assertions import assert_close

ATOL = RTOL = 1e-5


@contextlib.contextmanager
def counting_module_calls(lstm):
    """Counts the calls of the wrapped ``nn.LSTM`` (a forward hook) in ``calls[0]``."""
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1

    handle = lstm.register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


ROW_SUMS, TENSOR_CORES = RecurrentProduct.ROW_SUMS, RecurrentProduct.TENSOR_CORES
FOUR_GATES = RecurrentProduct.FOUR_GATES
CTA_BARRIER, STEP_COUNTER = StepWait.CTA_BARRIER, StepWait.STEP_COUNTER
TAGGED_WORDS, TAGGED_WORDS_PTX = StepWait.TAGGED_WORDS, StepWait.TAGGED_WORDS_PTX


def param_id(value):
    return value.name if isinstance(value, enum.Enum) else str(value)


def lengths_id(lengths):
    return "L" + "-".join(map(str, lengths))


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


#: The float16 and bfloat16 modules the kernels run.
HALF_DTYPES = (torch.float16, torch.bfloat16)

#: How far a float16 or bfloat16 PersistentLSTM may be from nn.LSTM in float32 or float64
#: with the same weights on the small cases of the tests: a few units in the last place of
#: outputs of size at most 1 (h is rounded to the dtype at every step; 2^-11 and 2^-8 of
#: relative rounding).
HALF_ATOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_half_lstm(dtype, *args, **kwargs):
    """``(module, float32 copy, float64 copy)``: an :func:`make_lstm` module in ``dtype``
    (its float32 weights rounded to it) and copies of those very weights, upcast."""
    lstm = make_lstm(*args, dtype=dtype, **kwargs)
    return lstm, copy.deepcopy(lstm).float(), copy.deepcopy(lstm).double()


def packed_reference(lstm, padded, lengths, hx=None):
    """nn.LSTM on a PackedSequence (any order of lengths, none zero), the output packed like ``pack``."""
    seq = pack_padded_sequence(padded, lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, state = lstm(seq, hx)
    out_padded, _ = pad_packed_sequence(out, batch_first=True, total_length=padded.shape[1])
    return pack(out_padded, lengths).data, state


def assert_outputs_close(actual, expected, atol=ATOL, rtol=RTOL, suffix=""):
    """``(y, (h_n, c_n))`` against the same of a reference."""
    (y, (h, c)), (y_ref, (h_ref, c_ref)) = actual, expected
    assert_close(f"y{suffix}", y, y_ref, atol=atol, rtol=rtol)
    assert_close(f"h_n{suffix}", h, h_ref, atol=atol, rtol=rtol)
    assert_close(f"c_n{suffix}", c, c_ref, atol=atol, rtol=rtol)


def assert_runs_match(model, lstm, padded, lengths, runs, before_run=None):
    """``runs`` calls of ``model`` on the packed batch, every output against ``nn.LSTM``."""
    ref = packed_reference(lstm, padded, lengths)
    packed = pack(padded, lengths)
    for run in range(runs):
        if before_run is not None:
            before_run()
        out, state = model(packed)
        assert_outputs_close((out.data, state), ref, suffix=f" (run {run})")
