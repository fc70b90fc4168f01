"""The LSTM chapter's teaching kernel (one layer, one direction, one program per
sequence) against the NumPy stage, run one sequence at a time, on fresh random inputs
and on the edges: empty and one-frame sequences, no bias, saturated gates."""
import numpy as np
import pytest
import torch

from packed_kernels.ops.lstm.naive_numpy import lstm_layer_numpy
from packed_kernels.ops.lstm.teaching import lstm_layer_teaching

from assertions import assert_close


def _weights(I, H, generator, scale=0.4, bias=True):
    def draw(*shape):
        return torch.randn(*shape, generator=generator) * scale

    weight_ih, weight_hh = draw(4 * H, I), draw(4 * H, H)
    biases = (draw(4 * H), draw(4 * H)) if bias else (None, None)
    return weight_ih, weight_hh, *biases


def _check_against_numpy(lengths, I, H, reverse, device, seed, scale=0.4, bias=True):
    generator = torch.Generator().manual_seed(seed)
    weights = _weights(I, H, generator, scale, bias)
    cu_seqlens = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    x = torch.randn(int(cu_seqlens[-1]), I, generator=generator)
    y, (h_n, c_n) = lstm_layer_teaching(x.to(device), cu_seqlens.to(device), *(
        None if w is None else w.to(device) for w in weights), reverse=reverse)
    assert y.shape == (x.shape[0], H) and h_n.shape == c_n.shape == (len(lengths), H)
    numpy_weights = [None if w is None else w.numpy() for w in weights]
    for b in range(len(lengths)):
        rows = slice(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
        y_ref, (h_ref, c_ref) = lstm_layer_numpy(x[rows].numpy(), *numpy_weights, reverse=reverse)
        name = f"sequence {b} (length {lengths[b]}, reverse={reverse})"
        assert_close(f"y of {name}", y[rows], y_ref, atol=2e-6, rtol=1e-5)
        assert_close(f"h_n of {name}", h_n[b], h_ref, atol=2e-6, rtol=1e-5)
        assert_close(f"c_n of {name}", c_n[b], c_ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("lengths,I,H", [
    ((9, 4, 13), 5, 16),
    ((1, 30, 2, 7), 3, 32),
    ((6,), 1, 1),
    ((5, 5), 8, 2),
    ((17, 3, 11, 1, 8), 12, 8),
], ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_matches_the_numpy_stage_per_sequence(lengths, I, H, reverse, device):
    for seed in range(2):  # fresh inputs and weights each time
        _check_against_numpy(lengths, I, H, reverse, device, seed=1000 * H + 10 * len(lengths) + seed)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_empty_sequences_write_nothing_and_keep_a_zero_state(reverse, device):
    """Length-0 sequences (first, middle and last) own no rows and end in the zero state;
    their neighbours are unaffected."""
    _check_against_numpy((0, 4, 0, 0, 3, 0), 3, 8, reverse, device, seed=5)
    y, (h_n, c_n) = lstm_layer_teaching(
        torch.zeros(0, 3, device=device), torch.zeros(3, dtype=torch.int32, device=device),
        torch.randn(32, 3, device=device), torch.randn(32, 8, device=device))
    assert y.shape == (0, 8)
    assert h_n.abs().max() == 0 and c_n.abs().max() == 0


def test_without_bias_and_with_saturated_gates(device):
    """No bias, and weights large enough that sigmoid and tanh sit at their limits (the
    tanh written through the sigmoid must stay finite and exact there)."""
    _check_against_numpy((7, 2), 4, 16, False, device, seed=7, bias=False)
    with np.errstate(over="ignore"):  # the interpreter's exp of -80 overflows to inf: 1 / inf is 0
        _check_against_numpy((7, 2), 4, 16, True, device, seed=8, scale=40.0)


def test_a_packed_batch_gives_what_nn_lstm_gives(device):
    """One direction of a bidirectional ``nn.LSTM`` layer on a ``PackedSequence``, against
    the teaching kernel run on the same rows, forward and reverse."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(3)
    lstm = torch.nn.LSTM(6, 16, bidirectional=True, batch_first=True).eval()
    lengths = torch.tensor([5, 1, 8])
    padded = torch.randn(3, 8, 6)
    with torch.no_grad():
        sequence = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
        out, (h_ref, c_ref) = lstm(sequence)
        out, _ = pad_packed_sequence(out, batch_first=True)
    rows = torch.cat([padded[b, :n] for b, n in enumerate(lengths.tolist())])
    cu_seqlens = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    expected_rows = [torch.cat([out[b, :n, d * 16:(d + 1) * 16] for b, n in enumerate(lengths.tolist())])
                     for d in range(2)]
    for direction, suffix in enumerate(["", "_reverse"]):
        weights = [getattr(lstm, f"{name}_l0{suffix}").detach().to(device)
                   for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        y, (h_n, c_n) = lstm_layer_teaching(rows.to(device), cu_seqlens.to(device), *weights,
                                            reverse=direction == 1)
        assert_close(f"y[{direction}]", y, expected_rows[direction], atol=1e-5, rtol=1e-5)
        assert_close(f"h_n[{direction}]", h_n, h_ref[direction], atol=1e-5, rtol=1e-5)
        assert_close(f"c_n[{direction}]", c_n, c_ref[direction], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H", [0, 3, 12])
def test_a_hidden_size_that_is_not_a_power_of_two_is_refused(H):
    with pytest.raises(ValueError, match="power of two"):
        lstm_layer_teaching(torch.zeros(2, 3), torch.tensor([0, 2]), torch.zeros(4 * H, 3), torch.zeros(4 * H, H))
