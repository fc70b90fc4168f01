"""Where PersistentLSTM runs the wrapped nn.LSTM (autograd, autocast, tensors off the
kernel device), PackedSequence in and out, and weights that change between calls."""
import warnings

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pack_sequence, pad_packed_sequence

import packed_kernels as pk
from packed_kernels import Packed, PersistentLSTM, pack, runtime
from packed_kernels.ops.lstm.padded_torch import lstm_padded, lstm_weights

from lstm_cases import assert_outputs_close, counting_module_calls, lengths_id, make_lstm, packed_reference


def assert_equal_outputs(actual, expected):
    """``(y, (h_n, c_n))`` bitwise equal (``y`` a tensor, a Packed or a PackedSequence)."""
    (y, (h, c)), (y_ref, (h_ref, c_ref)) = actual, expected
    for name, a, e in (("y", y, y_ref), ("h_n", h, h_ref), ("c_n", c, c_ref)):
        a, e = (a.data, e.data) if isinstance(a, (Packed, PackedSequence)) else (a, e)
        assert a.dtype == e.dtype and torch.equal(a, e), f"{name} differs from nn.LSTM's"


def module_under_autograd(lstm, *args):
    """``lstm(*args)`` as PersistentLSTM runs it when a gradient is needed: on a CUDA
    device in eval mode with cuDNN off (cuDNN's RNN backward needs training mode), so a
    bitwise comparison holds on the GPU too."""
    if not lstm.training and next(lstm.parameters()).is_cuda:
        with torch.backends.cudnn.flags(enabled=False):
            return lstm(*args)
    return lstm(*args)


def parameter_grads(lstm):
    grads = [p.grad.clone() for p in lstm.parameters()]
    lstm.zero_grad()
    return grads


def assert_equal_grads(actual, expected, names):
    for name, a, e in zip(names, actual, expected):
        assert torch.equal(a, e), f"{name}.grad differs from nn.LSTM's"


def _loss(output):
    y, (h, c) = output
    y = y.data if isinstance(y, (Packed, PackedSequence)) else y
    return (y * torch.linspace(-1, 1, y.shape[-1], device=y.device)).square().sum() + h.sum() + 2 * c.sum()


# ----------------------------------------------------------------------------------------
# Autograd: the call runs nn.LSTM itself


@pytest.mark.parametrize("batch_first,unbatched,with_state", [(True, False, False), (False, False, True),
                                                               (False, True, True)],
                         ids=["bf", "tf-state", "unbatched-state"])
def test_autograd_runs_nn_lstm_exactly(device, batch_first, unbatched, with_state):
    lstm = make_lstm(4, 6, 2, True, batch_first=batch_first, device=device).train()  # cuDNN differentiates in training mode only (dropout is 0)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn((5, 4) if unbatched else ((2, 5, 4) if batch_first else (5, 2, 4)), device=device,
                    requires_grad=True)
    state_shape = (4, 6) if unbatched else (4, 2, 6)
    hx = (torch.randn(state_shape, device=device, requires_grad=True),
          torch.randn(state_shape, device=device, requires_grad=True)) \
        if with_state else None
    leaves = [x] + (list(hx) if hx else [])
    with counting_module_calls(lstm) as calls, pytest.warns(UserWarning, match=r"torch\.no_grad\(\) or torch\."
                                                                             r"inference_mode\(\)"):
        out = model(x, hx)
    assert calls[0] == 1
    _loss(out).backward()
    grads = [t.grad.clone() for t in leaves] + parameter_grads(lstm)
    for t in leaves:
        t.grad = None
    ref = lstm(x, hx)
    _loss(ref).backward()
    assert_equal_outputs(out, ref)
    names = ["x", "h0", "c0"][:len(leaves)] + [name for name, _ in lstm.named_parameters()]
    assert_equal_grads(grads, [t.grad for t in leaves] + parameter_grads(lstm), names)


@pytest.mark.parametrize("needs", ["input", "state", "parameter"])
def test_any_tensor_that_requires_grad_takes_nn_lstm_and_warns_once(device, needs):
    lstm = make_lstm(3, 5, 1, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    lstm.requires_grad_(needs == "parameter")
    x = torch.randn(2, 4, 3, device=device, requires_grad=needs == "input")
    hx = (torch.zeros(2, 2, 5, device=device, requires_grad=needs == "state"), torch.zeros(2, 2, 5, device=device))
    with counting_module_calls(lstm) as calls:
        with pytest.warns(UserWarning, match="a gradient is needed"):
            first = model(x, hx)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            second = model(x, hx)
            with torch.no_grad():
                model(x, hx)  # the kernels, silently
    assert calls[0] == 2
    assert_equal_outputs(first, module_under_autograd(lstm, x, hx))
    assert_equal_outputs(second, first)
    assert first[0].requires_grad and second[0].requires_grad, "nn.LSTM's graph, for the backward"


def _packed_leaves(lengths, features, seed, device):
    """A padded leaf ``x`` that requires grad, its Packed batch (differentiable) and
    ``(h0, c0)`` leaves for 2 layers x 2 directions of hidden 5."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(max(lengths, default=0), 1)
    x = torch.randn(B, T, features, generator=g).to(device).requires_grad_()
    hx = tuple(torch.randn(4, B, 5, generator=g).to(device).requires_grad_() for _ in range(2))
    return x, pack(x, lengths), hx


def _grads(leaves, lstm):
    grads = [t.grad.clone() for t in leaves] + parameter_grads(lstm)
    for t in leaves:
        t.grad = None
    return grads


@pytest.mark.parametrize("lengths", [[3, 5, 1], [2, 2, 6, 1]], ids=lengths_id)
def test_autograd_packed_runs_nn_lstm_on_its_packed_sequence(device, lengths):
    """A Packed batch under autograd: nn.LSTM on ``packed.to_packed_sequence()``, bitwise,
    gradients included."""
    lstm = make_lstm(3, 5, 2, True, seed=len(lengths), device=device).train()  # cuDNN differentiates in training mode only (dropout is 0)
    model = PersistentLSTM.from_torch(lstm)
    _, packed, hx = _packed_leaves(lengths, 3, seed=1, device=device)
    data = packed.data.detach().requires_grad_()
    packed = Packed(data, packed.cu_seqlens, packed.lengths)
    with pytest.warns(UserWarning, match="a gradient is needed"), counting_module_calls(lstm) as calls:
        out, state = model(packed, hx)
    assert calls[0] == 1 and torch.equal(out.cu_seqlens, packed.cu_seqlens) and out.lengths is packed.lengths
    _loss((out, state)).backward()
    grads = _grads([data, *hx], lstm)
    seq_out, ref_state = lstm(packed.to_packed_sequence(), hx)
    ref = pack(pad_packed_sequence(seq_out, batch_first=True)[0], packed.lengths).data
    _loss((ref, ref_state)).backward()
    assert_equal_outputs((out.data, state), (ref, ref_state))
    assert_equal_grads(grads, _grads([data, *hx], lstm), ["data", "h0", "c0"] + [n for n, _ in lstm.named_parameters()])


def test_autograd_packed_zero_length_sequences(device):
    """A PackedSequence cannot hold an empty sequence: nn.LSTM runs the others; an empty
    one has no output rows and its final state is its initial one (gradient 1 through it)."""
    lstm = make_lstm(3, 5, 2, True, seed=2, device=device).train()  # cuDNN differentiates in training mode only (dropout is 0)
    model = PersistentLSTM.from_torch(lstm)
    lengths = [4, 0, 2, 0]
    x, packed, hx = _packed_leaves(lengths, 3, seed=2, device=device)
    with pytest.warns(UserWarning):
        out, (h, c) = model(packed, hx)
    _loss((out, (h, c))).backward()
    grads = _grads([x, *hx], lstm)
    kept, empty = torch.tensor([0, 2], device=device), torch.tensor([1, 3], device=device)
    seq = pack_padded_sequence(x[kept], torch.tensor([4, 2]), batch_first=True)
    seq_out, (h_kept, c_kept) = lstm(seq, (hx[0][:, kept], hx[1][:, kept]))
    ref = pack(pad_packed_sequence(seq_out, batch_first=True)[0], [4, 2]).data
    _loss((ref, (h_kept, c_kept))).backward()
    ref_grads = _grads([x, *hx], lstm)
    assert_equal_outputs((out.data, (h[:, kept], c[:, kept])), (ref, (h_kept, c_kept)))
    assert torch.equal(h[:, empty], hx[0][:, empty]) and torch.equal(c[:, empty], hx[1][:, empty])
    assert torch.equal(grads[0], ref_grads[0]), "x.grad"
    for name, grad, ref_grad, upstream in (("h0", grads[1], ref_grads[1], 1.0), ("c0", grads[2], ref_grads[2], 2.0)):
        assert torch.equal(grad[:, kept], ref_grad[:, kept]), name
        assert torch.equal(grad[:, empty], torch.full_like(grad[:, empty], upstream)), name
    assert_equal_grads(grads[3:], ref_grads[3:], [n for n, _ in lstm.named_parameters()])
    with torch.no_grad():  # and against the independent padded stage
        y_padded, state = lstm_padded(x, lstm_weights(lstm), torch.tensor(lengths, device=device), *hx)
    assert_outputs_close((out.data, (h, c)), (pack(y_padded, lengths).data, state), atol=1e-6, rtol=1e-6)


def test_autograd_packed_all_empty(device):
    lstm = make_lstm(3, 5, 2, True, device=device)
    x, packed, hx = _packed_leaves([0, 0], 3, seed=3, device=device)
    with pytest.warns(UserWarning):
        out, (h, c) = PersistentLSTM.from_torch(lstm)(packed, hx)
    assert out.data.shape == (0, 10)
    assert torch.equal(h, hx[0]) and torch.equal(c, hx[1]) and h is not hx[0]
    (h.sum() + 2 * c.sum()).backward()
    assert torch.equal(hx[0].grad, torch.ones_like(hx[0])) and torch.equal(hx[1].grad, torch.full_like(hx[1], 2.0))


@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "tf"])
def test_autograd_padded_with_lengths_is_nn_lstm_on_packed_sequence(device, batch_first):
    lstm = make_lstm(3, 4, 1, True, batch_first=batch_first, device=device).train()  # cuDNN differentiates in training mode only (dropout is 0)
    model = PersistentLSTM.from_torch(lstm)
    lengths = torch.tensor([2, 5, 0, 3])
    x_bf = torch.randn(4, 5, 3, device=device, requires_grad=True)
    with pytest.warns(UserWarning):
        y, (h, c) = model(x_bf if batch_first else x_bf.transpose(0, 1), lengths=lengths)
    y_bf = y if batch_first else y.transpose(0, 1)
    nonempty = (lengths > 0).to(device)
    seq = pack_padded_sequence(x_bf[nonempty], lengths[lengths > 0], batch_first=True, enforce_sorted=False)
    ref_seq, (h_kept, c_kept) = lstm(seq)
    ref, _ = pad_packed_sequence(ref_seq, batch_first=True, total_length=5)
    assert torch.equal(y_bf[nonempty], ref) and torch.equal(y_bf[~nonempty], torch.zeros_like(y_bf[~nonempty]))
    assert torch.equal(h[:, nonempty], h_kept) and torch.equal(c[:, nonempty], c_kept)
    assert torch.equal(h[:, ~nonempty], torch.zeros(2, 1, 4, device=device)), "an empty sequence keeps the zero state"
    y_bf.sum().backward()
    grad = x_bf.grad.clone()
    x_bf.grad = None
    ref.sum().backward()
    assert torch.equal(grad, x_bf.grad)


def test_training_with_dropout_runs_nn_lstm_with_its_dropout(device):
    lstm = make_lstm(3, 6, 3, True, dropout=0.5, device=device).train()
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    with pytest.warns(UserWarning, match="a gradient is needed"):
        torch.manual_seed(7)
        out = model(x)
    torch.manual_seed(7)
    assert_equal_outputs(out, lstm(x))
    with torch.no_grad(), pytest.raises(ValueError, match=r"dropout=0.5 .* call \.eval\(\)"):
        model(x)  # the kernels have no dropout


def test_the_wrapped_module_s_own_mode_decides(device):
    """Dropout acts by the nn.LSTM's own mode, which can be set on it alone: set to eval
    there, the kernels compute nn.LSTM's eval output; set back to training (the wrapper
    in eval mode), they refuse."""
    lstm = make_lstm(3, 6, 2, True, dropout=0.5, device=device).train()
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    lstm.eval()
    with torch.no_grad(), counting_module_calls(lstm) as calls:
        out = model(x)
        assert calls[0] == 0, "the kernels run it"
        assert_outputs_close(out, lstm(x))
    model.eval()
    lstm.train()
    with torch.no_grad(), pytest.raises(ValueError, match=r"dropout=0.5 between layers.*call \.eval\(\)"):
        model(x)


def test_one_layer_with_dropout_in_training_mode_runs_the_kernels(device):
    """nn.LSTM applies dropout between layers only: a one-layer module with dropout, in
    training mode, computes as in eval mode, so the kernels take it."""
    with pytest.warns(UserWarning, match="dropout"):
        lstm = torch.nn.LSTM(3, 6, dropout=0.5, batch_first=True, bidirectional=True).to(device).train()
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    with torch.no_grad(), counting_module_calls(lstm) as calls:
        out = model(x)
    assert calls[0] == 0, "the kernels run it"
    with torch.no_grad():
        assert_outputs_close(out, lstm(x))


# ----------------------------------------------------------------------------------------
# PackedSequence in, PackedSequence out


def _packed_sequence(lengths, enforce_sorted, features=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    padded = torch.randn(len(lengths), max(lengths), features, generator=g)
    return pack_padded_sequence(padded, torch.tensor(lengths), batch_first=True, enforce_sorted=enforce_sorted)


# Twenty tied lengths: torch.sort (which pack_padded_sequence uses) orders ties unstably there.
SEQUENCE_CASES = [([5, 3, 3, 1], True), ([2, 6, 1, 4, 4], False), ([3, 1, 2, 3, 1, 2, 3, 1, 2, 3] * 2, False)]


@pytest.mark.parametrize("lengths,enforce_sorted", SEQUENCE_CASES,
                         ids=lambda v: f"sorted-{v}" if isinstance(v, bool) else f"B{len(v)}")
def test_packed_sequence_through_the_kernels(device, lengths, enforce_sorted):
    lstm = make_lstm(3, 7, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    sequence = _packed_sequence(lengths, enforce_sorted).to(device)
    B = len(lengths)
    hx = (torch.randn(4, B, 7, device=device), torch.randn(4, B, 7, device=device))
    with torch.no_grad(), counting_module_calls(lstm) as calls:
        out, state = model(sequence, hx)
    assert calls[0] == 0, "the kernels run it"
    ref, ref_state = lstm(sequence, hx)
    assert isinstance(out, PackedSequence)
    assert torch.equal(out.batch_sizes, ref.batch_sizes)
    for name in ("sorted_indices", "unsorted_indices"):
        a, e = getattr(out, name), getattr(ref, name)
        assert (a is None and e is None) or torch.equal(a, e), name
    assert_outputs_close((out.data, state), (ref.data.detach(), tuple(t.detach() for t in ref_state)))


@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
def test_packed_sequence_under_autograd_is_nn_lstm_exactly(device, enforce_sorted):
    lstm = make_lstm(3, 5, 1, True, device=device).train()  # cuDNN differentiates in training mode only (dropout is 0)
    model = PersistentLSTM.from_torch(lstm)
    sequence = _packed_sequence([4, 2, 2] if enforce_sorted else [2, 4, 3], enforce_sorted).to(device)
    with pytest.warns(UserWarning, match="a gradient is needed"), counting_module_calls(lstm) as calls:
        out = model(sequence)
    assert calls[0] == 1
    _loss(out).backward()
    grads = parameter_grads(lstm)
    ref = lstm(sequence)
    _loss(ref).backward()
    assert_equal_outputs(out, ref)
    assert_equal_grads(grads, parameter_grads(lstm), [n for n, _ in lstm.named_parameters()])


def test_packed_sequence_from_pack_sequence(device):
    lstm = make_lstm(2, 4, 1, False, device=device)
    sequence = pack_sequence([torch.randn(n, 2, device=device) for n in (1, 4, 2)], enforce_sorted=False)
    with torch.no_grad():
        out, state = PersistentLSTM.from_torch(lstm)(sequence)
        ref, ref_state = lstm(sequence)
    assert_outputs_close((out.data, state), (ref.data, ref_state))


# ----------------------------------------------------------------------------------------
# Weights that change between calls


def _assert_follows_module(model, lstm, x, update, calls=2):
    for call in range(calls):
        update(call)
        with torch.no_grad():
            assert_outputs_close(model(x), lstm(x), suffix=f" (after update {call})")


def test_weights_changed_in_place_through_data_are_seen(device):
    """``.data`` updates leave no trace a cache could check (no version bump)."""
    lstm = make_lstm(3, 6, 1, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    _assert_follows_module(model, lstm, x, lambda call: call and lstm.weight_hh_l0.data.mul_(2))


def test_ema_updates_through_data_are_seen(device):
    lstm = make_lstm(3, 6, 1, True, device=device)
    target = make_lstm(3, 6, 1, True, device=device, seed=9)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(3, 5, 3, device=device)

    def ema(call):
        for p, q in zip(lstm.parameters(), target.parameters()):
            if call:
                p.data.copy_(0.5 * p.data + 0.5 * q.data)

    _assert_follows_module(model, lstm, x, ema)


def test_loaded_and_replaced_parameters_are_seen(device):
    lstm = make_lstm(3, 6, 1, False, device=device)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 4, 3, device=device)
    other = make_lstm(3, 6, 1, False, device=device, seed=5)

    def update(call):
        if call == 1:
            lstm.load_state_dict(other.state_dict())
        elif call == 2:
            lstm.weight_ih_l0 = torch.nn.Parameter(torch.randn_like(lstm.weight_ih_l0))

    _assert_follows_module(model, lstm, x, update, calls=3)


# ----------------------------------------------------------------------------------------
# Tensors off the kernel device: a CPU tensor where the kernels are compiled for the GPU


def test_cpu_tensors_on_a_gpu_machine_run_nn_lstm(monkeypatch):
    """Where the kernels are compiled for the GPU, a CPU tensor runs the wrapped nn.LSTM
    (silently), with nn.LSTM's own results."""
    lstm = make_lstm(3, 6, 2, True)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(3, 5, 3)
    lengths = torch.tensor([5, 2, 4])
    sequence = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    monkeypatch.setattr(runtime, "KERNEL_DEVICE", "cuda")
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    with torch.no_grad():
        with counting_module_calls(lstm) as module_calls, warnings.catch_warnings():
            warnings.simplefilter("error")
            padded, with_lengths, packed, sequence_out = (
                model(x), model(x, lengths=lengths), model(pack(x, lengths)), model(sequence))
        assert module_calls[0] == 4
        assert_equal_outputs(padded, lstm(x))
        assert_equal_outputs(sequence_out, lstm(sequence))
        ref_y, ref_state = packed_reference(lstm, x, lengths)
    assert_equal_outputs((packed[0].data, packed[1]), (ref_y, ref_state))
    assert_equal_outputs((pack(with_lengths[0], lengths).data, with_lengths[1]), (ref_y, ref_state))
    assert torch.equal(with_lengths[0][1, 2:], torch.zeros(3, 12)), "zeros beyond each length"


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", ["lengths", "packed-lengths", "packed-cu_seqlens", "packed-rows"])
def test_cpu_tensors_on_a_gpu_machine_check_values_within_the_call(monkeypatch, case, strict):
    """CPU tensors where the kernels are compiled for the GPU: nothing is launched, the
    values are read on the host (which costs no wait) and a violation raised within the
    call in either mode, before nn.LSTM runs, with the message of the device checks."""
    lstm = make_lstm(3, 6, 2, True)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(3, 5, 3)
    packed = pack(x, [5, 2, 4])
    call, message = {
        "lengths": (lambda: model(x, lengths=torch.tensor([5, 6, 4])),
                    r"^PersistentLSTM: lengths must lie in \[0, T\] .*, which fails at sequence 1$"),
        "packed-lengths": (lambda: model(Packed(packed.data, packed.cu_seqlens, torch.tensor([5, -2, 8]))),
                           "^PersistentLSTM: packed.lengths must be >= 0, which fails at sequence 1$"),
        "packed-cu_seqlens": (lambda: model(Packed(packed.data, packed.cu_seqlens.flip(0), packed.lengths)),
                              r"^PersistentLSTM: packed.cu_seqlens must be .*, which fails at entry 0$"),
        "packed-rows": (lambda: model(Packed(packed.data[:-2], packed.cu_seqlens, packed.lengths)),
                        "^PersistentLSTM: packed.lengths must sum to the rows of packed.data, which fails at "
                        "sequence 2$"),
    }[case]
    monkeypatch.setattr(runtime, "KERNEL_DEVICE", "cuda")
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    with torch.no_grad(), counting_module_calls(lstm) as module_calls, pk.strict_checks(strict):
        with pytest.raises(ValueError, match=message):
            call()
    assert module_calls[0] == 0


# ----------------------------------------------------------------------------------------
# Autocast: as nn.LSTM under autocast


def test_autocast_runs_nn_lstm_with_its_dtypes(device):
    lstm = make_lstm(3, 6, 2, True, device=device)
    model = PersistentLSTM.from_torch(lstm)
    x = torch.randn(2, 5, 3, device=device)
    lengths = torch.tensor([5, 3])
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=f"autocast is enabled for {device}"):
            out = model(x)
        ref = lstm(x)
        # nn.LSTM's own autocast dtype (bfloat16 on the CPU; cuDNN's LSTM may differ on CUDA)
        assert out[0].dtype == (torch.bfloat16 if device == "cpu" else ref[0].dtype)
        assert_equal_outputs(out, ref)
        assert_equal_outputs(model(x.bfloat16()), lstm(x.bfloat16()))  # what a previous autocast layer gives
        sequence = pack_padded_sequence(x, lengths, batch_first=True)
        assert_equal_outputs(model(sequence), lstm(sequence))
        packed, _ = model(pack(x, lengths))
        assert torch.equal(packed.data, pack(pad_packed_sequence(lstm(sequence)[0], batch_first=True)[0],
                                             lengths).data)
    with torch.no_grad(), pytest.raises(TypeError, match="input must be float32"):
        model(x.bfloat16())  # outside autocast, as nn.LSTM refuses it
