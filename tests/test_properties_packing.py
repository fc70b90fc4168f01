"""Property tests of packing: ``pack``, ``unpack``, ``Packed`` and the offset helpers.

Random lengths (empty batches, zero-length and one-frame sequences, ties), trailing
feature shapes, dtypes and strided inputs. Every result is compared exactly with
values built by plain Python loops over the sequences, and the gradients of ``pack``
and ``unpack`` with the ones such a loop implies (each packed row is one padded frame).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.utils.rnn import pack_sequence

import packed_kernels as pk
from tests.references import LAYOUTS, as_layout, property_settings

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16]
DTYPES = FLOAT_DTYPES + [torch.int64]


@dataclass(frozen=True)
class PackingCase:
    """A padded batch ``(B, T) + trailing`` with ``lengths[b] <= T`` real frames each."""

    lengths: Tuple[int, ...]
    steps: int  # T, at least the longest length
    trailing: Tuple[int, ...]
    dtype: torch.dtype
    layout: str
    lengths_as: str  # "list", "int32", "int64" or "strided" (an int64 view of stride 2)
    seed: int


@st.composite
def packing_cases(draw, shortest: int = 0, min_batch: int = 0, dtypes=DTYPES) -> PackingCase:
    """Up to 5 sequences of ``shortest`` to 5 frames (at least ``min_batch`` of them) of one of ``dtypes``."""
    lengths = tuple(draw(st.lists(st.integers(shortest, 5), min_size=min_batch, max_size=5)))
    steps = max(lengths, default=0) + draw(st.integers(0, 2))
    return PackingCase(
        lengths=lengths, steps=steps, trailing=tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
        dtype=draw(st.sampled_from(dtypes)), layout=draw(st.sampled_from(LAYOUTS)),
        lengths_as=draw(st.sampled_from(["list", "int32", "int64", "strided"])), seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def lengths_argument(case: PackingCase):
    """The lengths in the form the case names."""
    if case.lengths_as == "list":
        return list(case.lengths)
    if case.lengths_as == "strided":
        doubled = torch.tensor([n for n in case.lengths for _ in range(2)], dtype=torch.int64)
        return doubled[::2]
    return torch.tensor(case.lengths, dtype=torch.int32 if case.lengths_as == "int32" else torch.int64)


def padded_batch(case: PackingCase) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed)
    values = torch.randn((len(case.lengths), case.steps) + case.trailing, generator=g, dtype=torch.float64)
    if not case.dtype.is_floating_point:
        values = (values * 10).round()
    return as_layout(values.to(case.dtype), case.layout)


def expected_offsets(lengths):
    """``[0, l_0, l_0 + l_1, ...]`` by a running sum."""
    offsets, total = [0], 0
    for n in lengths:
        total += n
        offsets.append(total)
    return offsets


def expected_segment_ids(lengths):
    return [b for b, n in enumerate(lengths) for _ in range(n)]


def expected_rows(padded: torch.Tensor, lengths) -> torch.Tensor:
    """The packed rows: frames ``0 .. l_b - 1`` of sequence after sequence."""
    rows = [padded[b, t] for b, n in enumerate(lengths) for t in range(n)]
    return torch.stack(rows) if rows else padded.new_empty((0,) + tuple(padded.shape[2:]))


@property_settings(max_examples=25)
@given(case=packing_cases())
def test_offsets_and_segment_ids_are_running_sums(case):
    lengths = lengths_argument(case)
    cu_seqlens = pk.cu_seqlens_from_lengths(lengths)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == expected_offsets(case.lengths)
    for dtype in (torch.int32, torch.int64):
        ids = pk.segment_ids_from_lengths(lengths, dtype=dtype)
        assert ids.dtype == dtype and ids.tolist() == expected_segment_ids(case.lengths)
        for offsets in (cu_seqlens, cu_seqlens.to(torch.int64), cu_seqlens.repeat_interleave(2)[::2]):
            from_offsets = pk.segment_ids_from_cu_seqlens(offsets, dtype=dtype)
            assert from_offsets.dtype == dtype and from_offsets.tolist() == expected_segment_ids(case.lengths)


@property_settings(max_examples=25)
@given(case=packing_cases(), padding_value=st.sampled_from([0.0, -1.0, 7.0]), extra_steps=st.integers(0, 2))
def test_pack_and_unpack_move_exactly_the_real_frames(case, padding_value, extra_steps):
    padded = padded_batch(case)
    packed = pk.pack(padded, lengths_argument(case))
    assert isinstance(packed, pk.Packed) and packed.batch_size == len(case.lengths)
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == expected_offsets(case.lengths)
    assert packed.lengths.dtype == torch.int64 and packed.lengths.tolist() == list(case.lengths)
    assert packed.data.dtype == case.dtype and torch.equal(packed.data, expected_rows(padded, case.lengths))

    longest = max(case.lengths, default=0)
    total_length = longest + extra_steps
    restored = pk.unpack(packed, total_length=total_length, padding_value=padding_value)
    expected = torch.full((len(case.lengths), total_length) + case.trailing, padding_value, dtype=torch.float64)
    for b, n in enumerate(case.lengths):
        expected[b, :n] = padded[b, :n].to(torch.float64)
    assert restored.dtype == case.dtype and torch.equal(restored.to(torch.float64), expected)
    assert pk.unpack(packed).shape == (len(case.lengths), longest) + case.trailing

    again = pk.pack(restored, packed.lengths)  # pack after unpack gives the packed batch back
    assert torch.equal(again.data, packed.data) and torch.equal(again.cu_seqlens, packed.cu_seqlens)


@property_settings(max_examples=20)
@given(case=packing_cases(dtypes=FLOAT_DTYPES))
def test_pack_and_unpack_gradients_route_each_frame(case):
    """``pack``'s gradient puts each packed row's gradient on its padded frame (0 on
    padding); ``unpack``'s takes each real frame's gradient back to its packed row."""
    leaf = padded_batch(PackingCase(**{**case.__dict__, "layout": "contiguous"})).requires_grad_()
    packed = pk.pack(as_layout(leaf, case.layout), lengths_argument(case))
    g = torch.Generator().manual_seed(case.seed + 1)
    weight = torch.randn(packed.data.shape, generator=g, dtype=torch.float64).to(case.dtype)
    (grad,) = torch.autograd.grad((packed.data * weight).sum(), leaf, allow_unused=True)
    expected_view_grad = torch.zeros(leaf.shape, dtype=case.dtype)
    rows = iter(weight)
    for b, n in enumerate(case.lengths):
        for t in range(n):
            expected_view_grad[b, t] = next(rows)
    (expected,) = torch.autograd.grad(as_layout(leaf, case.layout), leaf, expected_view_grad, allow_unused=True)
    zeros = torch.zeros_like(leaf)
    assert torch.equal(zeros if grad is None else grad, zeros if expected is None else expected)

    data = packed.data.detach().requires_grad_()
    restored = pk.unpack(pk.Packed(data, packed.cu_seqlens, packed.lengths))
    frame_weight = torch.randn(restored.shape, generator=g, dtype=torch.float64).to(case.dtype)
    (grad_data,) = torch.autograd.grad((restored * frame_weight).sum(), data, allow_unused=True)
    want = expected_rows(frame_weight, case.lengths)
    assert torch.equal(torch.zeros_like(data) if grad_data is None else grad_data, want)


@property_settings(max_examples=20)
@given(case=packing_cases(min_batch=1, dtypes=FLOAT_DTYPES))
def test_nested_tensor_round_trip(case):
    """``to_nested`` holds each sequence as one component; ``from_nested`` gives the batch back."""
    padded = padded_batch(case)
    packed = pk.pack(padded, lengths_argument(case))
    nested = packed.to_nested()
    pieces = nested.unbind()
    assert [p.shape[0] for p in pieces] == list(case.lengths)
    for b, piece in enumerate(pieces):
        assert torch.equal(piece, padded[b, : case.lengths[b]])
    back = pk.Packed.from_nested(nested)
    assert torch.equal(back.data, packed.data) and torch.equal(back.cu_seqlens, packed.cu_seqlens)
    assert torch.equal(back.lengths, packed.lengths)


@property_settings(max_examples=20)
@given(case=packing_cases(shortest=1, min_batch=1))
def test_packed_sequence_round_trip_matches_torch(case):
    """``to_packed_sequence`` is ``pack_sequence(..., enforce_sorted=False)`` of the same
    sequences (ties ranked as the argsort it returns says), and ``from_packed_sequence``
    of torch's ``PackedSequence`` gives the ``Packed`` batch back (a ``PackedSequence``
    holds at least one sequence, none empty)."""
    padded = padded_batch(case)
    packed = pk.pack(padded, lengths_argument(case))
    sequences = [padded[b, :n] for b, n in enumerate(case.lengths)]
    ours = packed.to_packed_sequence()
    theirs = pack_sequence(sequences, enforce_sorted=False)
    assert torch.equal(ours.batch_sizes, theirs.batch_sizes)
    assert sorted(ours.sorted_indices.tolist()) == list(range(len(case.lengths)))
    ranked = [sequences[int(b)] for b in ours.sorted_indices]  # the rows at each time step, by rank
    expected = [s[t] for t in range(len(ours.batch_sizes)) for s in ranked if s.shape[0] > t]
    assert torch.equal(ours.data, torch.stack(expected))
    assert [case.lengths[int(b)] for b in ours.sorted_indices] == sorted(case.lengths, reverse=True)
    for sequence in (ours, theirs):
        back = pk.Packed.from_packed_sequence(sequence)
        assert torch.equal(back.data, packed.data) and torch.equal(back.cu_seqlens, packed.cu_seqlens)
        assert torch.equal(back.lengths, packed.lengths)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_packed_to_keeps_the_index_dtypes(dtype):
    packed = pk.pack(torch.randn(3, 4, 2), [4, 0, 2]).to(dtype)
    assert packed.data.dtype == dtype
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == [0, 4, 4, 6]
    assert packed.lengths.dtype == torch.int64 and packed.lengths.tolist() == [4, 0, 2]
