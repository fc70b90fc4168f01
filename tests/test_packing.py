import pytest
import torch

from packed_kernels import (
    Packed,
    cu_seqlens_from_lengths,
    pack,
    segment_ids_from_cu_seqlens,
    segment_ids_from_lengths,
    unpack,
)


def _padded_batch(lengths, trailing, generator):
    T = max(lengths, default=0)
    return torch.randn((len(lengths), T) + trailing, generator=generator)


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)], ids=lambda t: "feat" + "x".join(map(str, t)) if t else "scalar")
@pytest.mark.parametrize(
    "lengths",
    [[5], [1, 1, 1], [0, 4, 0, 2], [7, 1, 3, 0], [1]],
    ids=lambda l: "L" + "-".join(map(str, l)),
)
def test_pack_roundtrip_and_layout(lengths, trailing):
    g = torch.Generator().manual_seed(sum(lengths) * 31 + len(trailing))
    padded = _padded_batch(lengths, trailing, g)
    packed = pack(padded, lengths)
    assert isinstance(packed, Packed)
    assert packed.data.shape == (sum(lengths),) + trailing
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist()[0] == 0
    assert packed.lengths.tolist() == lengths
    for b, n in enumerate(lengths):
        start, end = packed.cu_seqlens[b].item(), packed.cu_seqlens[b + 1].item()
        assert end - start == n
        assert torch.equal(packed.data[start:end], padded[b, :n])
    restored = unpack(packed)
    mask = torch.arange(padded.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    assert torch.equal(restored[mask], padded[mask])
    assert bool((restored[~mask] == 0).all())


def test_unpack_total_length_and_padding_value():
    packed = pack(torch.arange(12.0).reshape(2, 6), [2, 4])
    out = unpack(packed, total_length=8, padding_value=-1.0)
    assert out.shape == (2, 8)
    assert out[0].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert out[1].tolist() == [6, 7, 8, 9, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="total_length"):
        unpack(packed, total_length=3)


def test_empty_batch_and_all_empty_sequences():
    packed = pack(torch.zeros(3, 4, 2), [0, 0, 0])
    assert packed.data.shape == (0, 2) and packed.cu_seqlens.tolist() == [0, 0, 0, 0]
    assert unpack(packed).shape == (3, 0, 2)


def test_pack_bad_input():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="lengths"):
        pack(x, [1, 2, 3])
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=5\]"):
        pack(x, [6, 1])
    with pytest.raises(ValueError, match="lengths"):
        pack(x, [-1, 1])
    with pytest.raises(TypeError, match="lengths"):
        pack(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="padded"):
        pack(torch.zeros(5), [5])
    with pytest.raises(TypeError, match="packed"):
        unpack(x)


# --- value checks of the packing helpers -------------------------------------------------

@pytest.mark.parametrize("lengths, error, match", [
    ([3.5, 2], TypeError, r"lengths\[0\]"),
    ("abc", TypeError, "lengths must be a 1-D integer tensor or a list of ints"),
    ([3, -1], ValueError, "lengths must be >= 0"),
    (torch.tensor([1.0, 2.0]), TypeError, "lengths must be an integer tensor"),
    (torch.tensor([[1, 2]]), ValueError, "lengths must be 1-D"),
    (torch.tensor([True, False]), TypeError, "lengths must be an integer tensor"),
], ids=["float-in-list", "string", "negative", "float-tensor", "2-D", "bool-tensor"])
def test_cu_seqlens_from_lengths_bad_input(lengths, error, match):
    with pytest.raises(error, match=match):
        cu_seqlens_from_lengths(lengths)


def test_cu_seqlens_from_lengths_list_and_tensor():
    assert cu_seqlens_from_lengths([3, 0, 2]).tolist() == [0, 3, 3, 5]
    cu = cu_seqlens_from_lengths(torch.tensor([4, 1], dtype=torch.int32))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 5]
    assert cu_seqlens_from_lengths([]).tolist() == [0]


def test_pack_refuses_float_lengths():
    with pytest.raises(TypeError, match=r"lengths\[1\]"):
        pack(torch.zeros(2, 5), [2, 2.0])


def test_unpack_checks_its_offsets_and_rows():
    packed = pack(torch.arange(10.0).reshape(2, 5), [2, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        unpack(Packed(packed.data, torch.tensor([0, 1, 5], dtype=torch.int32), packed.lengths))
    with pytest.raises(ValueError, match="cu_seqlens"):
        unpack(Packed(packed.data, torch.tensor([0, 2], dtype=torch.int32), packed.lengths))
    with pytest.raises(ValueError, match="rows"):
        unpack(Packed(packed.data[:4], packed.cu_seqlens, packed.lengths))
    with pytest.raises(TypeError, match="packed.cu_seqlens"):
        unpack(Packed(packed.data, packed.cu_seqlens.float(), packed.lengths))


def test_packed_to_keeps_index_dtypes():
    packed = pack(torch.randn(2, 4, 3), [4, 1])
    moved = packed.to(torch.float64)
    assert moved.data.dtype == torch.float64
    assert moved.cu_seqlens.dtype == torch.int32 and moved.lengths.dtype == torch.int64
    assert torch.equal(moved.cu_seqlens, packed.cu_seqlens) and torch.equal(moved.lengths, packed.lengths)


# --- segment ids -----------------------------------------------------------------------

@pytest.mark.parametrize("lengths", [[3, 0, 2], [0], [], [1, 1, 4, 0, 0]], ids=lambda l: "L" + "-".join(map(str, l)))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_segment_ids(lengths, dtype):
    expected = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    ids = segment_ids_from_lengths(lengths, dtype=dtype)
    assert ids.dtype == dtype and ids.tolist() == expected.tolist()
    from_offsets = segment_ids_from_cu_seqlens(cu_seqlens_from_lengths(lengths), dtype=dtype)
    assert from_offsets.dtype == dtype and from_offsets.tolist() == expected.tolist()


def test_segment_ids_bad_input():
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        segment_ids_from_cu_seqlens(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        segment_ids_from_cu_seqlens(torch.tensor([0, 3, 2]))
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        segment_ids_from_cu_seqlens(torch.tensor([0.0, 2.0]))
    with pytest.raises(TypeError, match="dtype"):
        segment_ids_from_lengths([1, 2], dtype=torch.float32)


# --- PackedSequence and nested tensors ----------------------------------------------------

@pytest.mark.parametrize("lengths", [[5, 3, 3, 1], [1, 4, 2], [2], [3, 3]], ids=lambda l: "L" + "-".join(map(str, l)))
def test_packed_sequence_round_trip(lengths):
    from torch.nn.utils.rnn import pack_padded_sequence

    g = torch.Generator().manual_seed(len(lengths) * 7 + sum(lengths))
    padded = torch.randn(len(lengths), max(lengths), 3, generator=g)
    packed = pack(padded, lengths)
    reference = pack_padded_sequence(padded, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    sequence = packed.to_packed_sequence()
    assert torch.equal(sequence.data, reference.data)
    assert torch.equal(sequence.batch_sizes, reference.batch_sizes)
    assert torch.equal(sequence.sorted_indices, reference.sorted_indices)
    assert torch.equal(sequence.unsorted_indices, reference.unsorted_indices)
    back = Packed.from_packed_sequence(reference)
    assert torch.equal(back.data, packed.data)
    assert torch.equal(back.cu_seqlens, packed.cu_seqlens) and torch.equal(back.lengths, packed.lengths)


def test_packed_sequence_sorted_and_gradients():
    from torch.nn.utils.rnn import pack_padded_sequence

    padded = torch.randn(3, 4, 2, requires_grad=True)
    reference = pack_padded_sequence(padded, torch.tensor([4, 2, 1]), batch_first=True, enforce_sorted=True)
    back = Packed.from_packed_sequence(reference)
    assert torch.equal(back.data, pack(padded.detach(), [4, 2, 1]).data)
    (grad,) = torch.autograd.grad((back.data * torch.arange(14.0).view(7, 2)).sum(), padded)
    expected = torch.zeros(3, 4, 2)
    expected[torch.arange(4)[None, :] < torch.tensor([4, 2, 1])[:, None]] = torch.arange(14.0).view(7, 2)
    assert torch.equal(grad, expected)
    with pytest.raises(ValueError, match="empty sequences"):
        pack(torch.zeros(2, 3), [3, 0]).to_packed_sequence()
    with pytest.raises(TypeError, match="PackedSequence"):
        Packed.from_packed_sequence(padded)


def test_nested_round_trip():
    padded = torch.randn(3, 5, 2)
    packed = pack(padded, [5, 0, 2])
    nested = packed.to_nested()
    assert nested.is_nested and nested.layout == torch.jagged
    for b, n in enumerate([5, 0, 2]):
        assert torch.equal(nested[b], padded[b, :n])
    back = Packed.from_nested(nested)
    assert torch.equal(back.data, packed.data) and torch.equal(back.cu_seqlens, packed.cu_seqlens)
    assert torch.equal(back.lengths, packed.lengths)
    built = torch.nested.nested_tensor([padded[0, :3], padded[1, :1]], layout=torch.jagged)
    assert Packed.from_nested(built).lengths.tolist() == [3, 1]
    with pytest.raises(ValueError, match="jagged"):
        Packed.from_nested(padded)


def test_packed_sequence_with_tied_lengths_follows_its_sorted_indices():
    from torch.nn.utils.rnn import PackedSequence

    # two sequences of length 3, ranked (1, 0): time-major rows are seq1[t], seq0[t]
    data = torch.tensor([3.0, 0.0, 4.0, 1.0, 5.0, 2.0])
    sequence = PackedSequence(data, torch.tensor([2, 2, 2]), torch.tensor([1, 0]), torch.tensor([1, 0]))
    packed = Packed.from_packed_sequence(sequence)
    assert packed.data.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert packed.lengths.tolist() == [3, 3]
    from torch.nn.utils.rnn import pad_packed_sequence

    padded, lengths = pad_packed_sequence(sequence, batch_first=True)
    assert torch.equal(pack(padded, lengths).data, packed.data)


def test_docstring_examples():
    import doctest

    import packed_kernels.packing as packing

    result = doctest.testmod(packing, extraglobs={"torch": torch}, raise_on_error=False)
    assert result.attempted >= 6 and result.failed == 0, result
