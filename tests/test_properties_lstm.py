"""Property tests of ``PersistentLSTM`` against a float64 cell-by-cell loop over the weights.

Random modules (input and hidden sizes, one or two layers, one or two directions, with
or without bias, ``batch_first`` or not) on every input form ``PersistentLSTM`` takes:
a padded batch (with or without ``lengths``), an unbatched sequence, a ``Packed`` batch
(zero-length sequences included) and a ``PackedSequence``; with or without an initial
state, on contiguous and strided inputs. :func:`tests.references.lstm_reference` runs
each sequence at its own length, reading the weights by ``nn.LSTM``'s parameter names.
The kernels run inference; a call that needs a gradient runs the wrapped ``nn.LSTM``,
whose gradients are checked against autograd through the same reference.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Tuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

import packed_kernels as pk
from tests.assertions import assert_close
from tests.references import LAYOUTS, as_layout, lstm_reference, property_settings

#: float32 kernels against the float64 loop (the design's bound against cuDNN is 1e-5).
TOLERANCE = 1e-5

#: The input forms of a call.
MODES = ("padded", "padded_with_lengths", "unbatched", "packed", "packed_sequence")


@dataclass(frozen=True)
class LSTMCase:
    """A module and one call of it."""

    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    bias: bool
    batch_first: bool
    mode: str
    lengths: Tuple[int, ...]  # per sequence; padded batches have max(lengths) frames (at least steps)
    steps: int
    with_state: bool
    layout: str  # of the input tensor (padded) or of the packed data
    seed: int

    @property
    def num_states(self) -> int:
        return self.num_layers * (2 if self.bidirectional else 1)


@st.composite
def lstm_cases(draw, mode: str) -> LSTMCase:
    """A random module and a call of it with input form ``mode``."""
    steps = draw(st.integers(1, 4))
    if mode == "padded":
        lengths = (steps,) * draw(st.integers(1, 3))
    elif mode == "unbatched":
        lengths = (steps,)
    else:
        shortest = 1 if mode == "packed_sequence" else 0  # a PackedSequence holds no empty sequence
        lengths = tuple(draw(st.lists(st.integers(shortest, 4), min_size=1, max_size=3)))
        steps = max(max(lengths), steps) if mode == "padded_with_lengths" else max(lengths)
    return LSTMCase(
        input_size=draw(st.integers(1, 3)), hidden_size=draw(st.integers(1, 6)), num_layers=draw(st.integers(1, 2)),
        bidirectional=draw(st.booleans()), bias=draw(st.booleans()), batch_first=draw(st.booleans()), mode=mode,
        lengths=lengths, steps=steps, with_state=draw(st.booleans()), layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def make_module(case: LSTMCase, device) -> torch.nn.LSTM:
    """An ``nn.LSTM`` in eval mode whose parameters come from the case's seed."""
    lstm = torch.nn.LSTM(case.input_size, case.hidden_size, num_layers=case.num_layers,
                         bidirectional=case.bidirectional, bias=case.bias, batch_first=case.batch_first)
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in lstm.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return lstm.to(device).eval()


def on_cpu(lstm: torch.nn.LSTM) -> torch.nn.LSTM:
    """A CPU copy of ``lstm`` for the reference (the module itself stays where the call ran)."""
    return copy.deepcopy(lstm).cpu()


def make_sequences(case: LSTMCase):
    """One float32 ``(T_b, I)`` sequence per length and ``(h0, c0)`` (or ``None``)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    sequences = [torch.randn(n, case.input_size, generator=g) for n in case.lengths]
    shape = (case.num_states, len(case.lengths), case.hidden_size)
    state = (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) if case.with_state else None
    return sequences, state


def padded_batch(case: LSTMCase, sequences):
    """``(B, T, I)``: the sequences, then frames that ``lengths`` must keep out (random values)."""
    g = torch.Generator().manual_seed(case.seed + 2)
    batch = torch.randn(len(sequences), case.steps, case.input_size, generator=g)
    for b, s in enumerate(sequences):
        batch[b, : s.shape[0]] = s
    return batch


def call_module(model, case: LSTMCase, sequences, state, device):
    """Run ``model`` on the case's input form; returns ``(outputs per sequence, h_n, c_n)``
    and the input sequences as the module saw them (an expanded layout repeats a row)."""
    hx = None if state is None else tuple(s.to(device) for s in state)
    if case.mode in ("padded", "padded_with_lengths", "unbatched"):
        batch = padded_batch(case, sequences)  # (B, T, I)
        if case.mode == "unbatched":
            x = batch[0]
            hx = None if hx is None else (hx[0][:, 0], hx[1][:, 0])
        else:
            x = batch if case.batch_first else batch.transpose(0, 1).contiguous()
        x = as_layout(x.to(device), case.layout)
        seen = x if case.mode == "unbatched" else (x if case.batch_first else x.transpose(0, 1))
        seen = seen.cpu().reshape(-1, case.steps, case.input_size)
        lengths = torch.tensor(case.lengths) if case.mode == "padded_with_lengths" else None
        y, (h_n, c_n) = model(x, hx, lengths=lengths.to(device) if lengths is not None else None)
        if case.mode == "unbatched":
            y, h_n, c_n = y[None], h_n[:, None], c_n[:, None]
        elif not case.batch_first:
            y = y.transpose(0, 1)
        if case.mode == "padded_with_lengths":
            for b, n in enumerate(case.lengths):
                assert bool((y[b, n:] == 0).all()), f"sequence {b}: output beyond its length {n} is not zero"
        return [y[b, :n] for b, n in enumerate(case.lengths)], h_n, c_n, [seen[b, :n] for b, n in
                                                                        enumerate(case.lengths)]
    if case.mode == "packed":
        packed = pk.pack(padded_batch(case, sequences), list(case.lengths))
        data = as_layout(packed.data.to(device), case.layout)
        out, (h_n, c_n) = model(pk.Packed(data, packed.cu_seqlens.to(device), packed.lengths.to(device)), hx)
        assert torch.equal(out.cu_seqlens.cpu(), packed.cu_seqlens) and torch.equal(out.lengths.cpu(), packed.lengths)
        cu = packed.cu_seqlens.tolist()
        seen = data.cpu()
        return ([out.data[cu[b]:cu[b + 1]] for b in range(len(case.lengths))], h_n, c_n,
                [seen[cu[b]:cu[b + 1]] for b in range(len(case.lengths))])
    sequence = pack_sequence([s.to(device) for s in sequences], enforce_sorted=False)
    out, (h_n, c_n) = model(sequence, hx)
    padded, lengths = pad_packed_sequence(out, batch_first=True)
    assert lengths.tolist() == list(case.lengths)
    return [padded[b, :n] for b, n in enumerate(case.lengths)], h_n, c_n, sequences


def check_outputs(case: LSTMCase, outputs, h_n, c_n, want_outputs, want_h, want_c, tol=TOLERANCE):
    for b, (got, want) in enumerate(zip(outputs, want_outputs)):
        assert_close(f"output of sequence {b} (length {case.lengths[b]})", got, want, atol=tol, rtol=tol)
    assert_close("h_n", h_n, want_h, atol=tol, rtol=tol)
    assert_close("c_n", c_n, want_c, atol=tol, rtol=tol)


def _case(**fields) -> LSTMCase:
    base = dict(input_size=2, hidden_size=3, num_layers=2, bidirectional=True, bias=True, batch_first=True,
                mode="packed", lengths=(0, 3, 1, 0), steps=3, with_state=True, layout="contiguous", seed=7)
    return LSTMCase(**{**base, **fields})


#: Zero-length and one-frame sequences in a Packed batch, a batch of only empty
#: sequences, an empty batch, a padded batch whose lengths start at 0 and 1.
EDGE_CASES = {
    "packed-with-empty-sequences": _case(),
    "packed-all-empty": _case(lengths=(0, 0), steps=0, bias=False),
    "packed-empty-batch": _case(lengths=(), steps=0),
    "padded-lengths-0-1-3": _case(mode="padded_with_lengths", lengths=(0, 1, 3), steps=4, batch_first=False),
}


@pytest.mark.parametrize("mode", MODES)
@property_settings(max_examples=4)
@given(data=st.data())
def test_persistent_lstm_matches_the_cell_loop(device, mode, data):
    check_against_reference(data.draw(lstm_cases(mode), label="case"), device)


@pytest.mark.parametrize("edge", sorted(EDGE_CASES))
def test_persistent_lstm_on_edge_cases(device, edge):
    check_against_reference(EDGE_CASES[edge], device)


def check_against_reference(case: LSTMCase, device) -> None:
    lstm = make_module(case, device)
    model = pk.PersistentLSTM.from_torch(lstm)
    sequences, state = make_sequences(case)
    with torch.no_grad():
        outputs, h_n, c_n, seen = call_module(model, case, sequences, state, device)
    assert h_n.shape == (case.num_states, len(case.lengths), case.hidden_size)
    want_outputs, want_h, want_c = lstm_reference(on_cpu(lstm), seen, *(state or (None, None)))
    check_outputs(case, outputs, h_n, c_n, want_outputs, want_h, want_c)


@pytest.mark.parametrize("mode", ["packed", "padded_with_lengths"])
@property_settings(max_examples=4)
@given(data=st.data())
def test_persistent_lstm_gradients_where_it_runs_the_module(device, mode, data):
    """With a gradient needed, the call runs the wrapped ``nn.LSTM`` (and says so): its
    outputs and the gradients of a random projection of them with respect to the input
    and the initial state are the float64 loop's. (Training mode, as cuDNN's backward
    needs on a GPU; without dropout it computes what eval mode does.)"""
    case = data.draw(lstm_cases(mode), label="case")
    lstm = make_module(case, device).train()
    model = pk.PersistentLSTM.from_torch(lstm)
    sequences, state = make_sequences(case)
    leaves = [s.clone().requires_grad_() for s in sequences]
    state_leaves = None if state is None else tuple(s.clone().requires_grad_() for s in state)
    if case.mode == "packed":
        data = torch.cat(leaves) if leaves else torch.zeros(0, case.input_size, requires_grad=True)
        lengths = torch.tensor(case.lengths, dtype=torch.int64)
        packed = pk.Packed(as_layout(data, case.layout).to(device), pk.cu_seqlens_from_lengths(lengths).to(device),
                           lengths.to(device))
        with pytest.warns(UserWarning, match="a gradient is needed"):
            out, (h_n, c_n) = model(packed, None if state_leaves is None else tuple(s.to(device) for s in state_leaves))
        cu = packed.cu_seqlens.tolist()
        outputs = [out.data[cu[b]:cu[b + 1]] for b in range(len(case.lengths))]
        seen_rows = as_layout(data, case.layout)
        seen = [seen_rows[cu[b]:cu[b + 1]] for b in range(len(case.lengths))]
    else:
        batch = padded_batch(case, sequences)
        rows = torch.stack([torch.cat([leaf, batch[b, leaf.shape[0]:]]) for b, leaf in enumerate(leaves)])
        x = rows if case.batch_first else rows.transpose(0, 1)
        with pytest.warns(UserWarning, match="a gradient is needed"):
            y, (h_n, c_n) = model(x.to(device), None if state_leaves is None else
                                  tuple(s.to(device) for s in state_leaves), lengths=torch.tensor(case.lengths))
        y = y if case.batch_first else y.transpose(0, 1)
        outputs = [y[b, :n] for b, n in enumerate(case.lengths)]
        seen = leaves
    want_outputs, want_h, want_c = lstm_reference(on_cpu(lstm), seen, *(state_leaves or (None, None)))
    check_outputs(case, [o.detach() for o in outputs], h_n.detach(), c_n.detach(),
                  [o.detach() for o in want_outputs], want_h.detach(), want_c.detach())

    g = torch.Generator().manual_seed(case.seed + 3)
    projections = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in want_outputs + [want_h, want_c]]
    differentiable = leaves + list(state_leaves or ())

    def gradients(results):
        total = sum((r.double().cpu() * p).sum() for r, p in zip(results, projections))
        if not total.requires_grad:
            return [torch.zeros_like(leaf, dtype=torch.float64) for leaf in differentiable]
        found = torch.autograd.grad(total, differentiable, allow_unused=True)
        return [torch.zeros_like(leaf, dtype=torch.float64) if f is None else f for leaf, f in zip(differentiable, found)]

    for k, (got, want) in enumerate(zip(gradients(outputs + [h_n, c_n]), gradients(want_outputs + [want_h, want_c]))):
        assert_close(f"gradient of differentiable input {k}", got, want, atol=TOLERANCE, rtol=TOLERANCE)
