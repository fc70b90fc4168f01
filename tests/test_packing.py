import re

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


# --- bad input: one table per public function ----------------------------------------
#
# Each row: an id, the call, the exception, the argument its message must name, and a
# pattern for what the message says was expected.


def _refused(call, error, argument, expected):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert argument in message, f"the message does not name {argument!r}: {message}"
    assert re.search(expected, message), f"the message does not say {expected!r}: {message}"


def _table(rows):
    return pytest.mark.parametrize("call,error,argument,expected", [row[1:] for row in rows],
                                   ids=[row[0] for row in rows])


_X = torch.zeros(2, 5)

PACK_BAD = [
    ("padded-list", lambda: pack([[0.0] * 5] * 2, [1, 2]), TypeError, "padded", "must be a torch.Tensor"),
    ("padded-1d", lambda: pack(torch.zeros(5), [5]), ValueError, "padded", r"shape \(B, T, \.\.\.\); got shape \(5,\)"),
    ("lengths-count", lambda: pack(_X, [1, 2, 3]), ValueError, "lengths", "must have B=2 entries"),
    ("lengths-too-few", lambda: pack(_X, [1]), ValueError, "lengths", "must have B=2 entries"),
    ("lengths-above-T", lambda: pack(_X, [6, 1]), ValueError, "lengths", r"lie in \[0, T=5\]"),
    ("lengths-negative", lambda: pack(_X, [-1, 1]), ValueError, "lengths", ">= 0; got a length of -1"),
    ("lengths-negative-tensor", lambda: pack(_X, torch.tensor([2, -3])), ValueError, "lengths", ">= 0"),
    ("lengths-float-tensor", lambda: pack(_X, torch.tensor([1.0, 2.0])), TypeError, "lengths", "integer tensor"),
    ("lengths-bool-tensor", lambda: pack(_X, torch.tensor([True, True])), TypeError, "lengths", "integer tensor"),
    ("lengths-float-entry", lambda: pack(_X, [2, 2.0]), TypeError, "lengths[1]", "must be an int; got float"),
    ("lengths-bool-entry", lambda: pack(_X, [True, 1]), TypeError, "lengths[0]", "must be an int; got bool"),
    ("lengths-2d", lambda: pack(_X, torch.tensor([[1, 2]])), ValueError, "lengths", "must be 1-D"),
    ("lengths-0d", lambda: pack(_X, torch.tensor(2)), ValueError, "lengths", "must be 1-D"),
    ("lengths-string", lambda: pack(_X, "12"), TypeError, "lengths", "1-D integer tensor or a list of ints"),
]


@_table(PACK_BAD)
def test_pack_bad_input(call, error, argument, expected):
    _refused(call, error, argument, expected)


def _good():
    return pack(torch.arange(10.0).reshape(2, 5), [2, 3])


def _with(**fields):
    return lambda: _good()._replace(**{name: make(_good()) for name, make in fields.items()})


UNPACK_BAD = [
    ("packed-tensor", lambda: unpack(_X), TypeError, "packed", "must be a Packed; got Tensor"),
    ("packed-tuple", lambda: unpack(tuple(_good())), TypeError, "packed", "must be a Packed; got tuple"),
    ("cu_seqlens-values", lambda: unpack(_with(cu_seqlens=lambda p: torch.tensor([0, 1, 5], dtype=torch.int32))()),
     ValueError, "packed.cu_seqlens", r"\[0, cumsum\(packed.lengths\)\]"),
    ("cu_seqlens-short", lambda: unpack(_with(cu_seqlens=lambda p: p.cu_seqlens[:-1])()), ValueError,
     "packed.cu_seqlens", "disagree"),
    ("cu_seqlens-float", lambda: unpack(_with(cu_seqlens=lambda p: p.cu_seqlens.float())()), TypeError,
     "packed.cu_seqlens", "int32 or int64"),
    ("cu_seqlens-2d", lambda: unpack(_with(cu_seqlens=lambda p: p.cu_seqlens[None])()), ValueError,
     "packed.cu_seqlens", "1-D"),
    ("lengths-float", lambda: unpack(_with(lengths=lambda p: p.lengths.float())()), TypeError, "packed.lengths",
     "integer tensor"),
    ("lengths-negative", lambda: unpack(Packed(torch.zeros(1), torch.tensor([0, 3, 1]), torch.tensor([3, -2]))),
     ValueError, "packed.lengths", ">= 0"),
    ("data-few-rows", lambda: unpack(_with(data=lambda p: p.data[:4])()), ValueError, "packed.data",
     "sum\\(packed.lengths\\) = 5 rows; got 4"),
    ("data-many-rows", lambda: unpack(_with(data=lambda p: torch.zeros(6))()), ValueError, "packed.data",
     "= 5 rows; got 6"),
    ("total_length-short", lambda: unpack(_good(), total_length=2), ValueError, "total_length",
     r">= the longest sequence \(3\); got 2"),
    ("total_length-float", lambda: unpack(_good(), total_length=4.0), TypeError, "total_length", "None or an int"),
    ("total_length-bool", lambda: unpack(_good(), total_length=True), TypeError, "total_length", "None or an int"),
    ("total_length-tensor", lambda: unpack(_good(), total_length=torch.tensor(4)), TypeError, "total_length",
     "None or an int"),
]


@_table(UNPACK_BAD)
def test_unpack_bad_input(call, error, argument, expected):
    _refused(call, error, argument, expected)


PACKED_METHODS_BAD = [
    ("to_packed_sequence-empty", lambda: pack(torch.zeros(2, 3), [3, 0]).to_packed_sequence(), ValueError,
     "packed.lengths", "cannot hold empty sequences; got a length of 0"),
    ("from_packed_sequence-tensor", lambda: Packed.from_packed_sequence(torch.zeros(3, 2)), TypeError, "sequence",
     "must be a torch.nn.utils.rnn.PackedSequence; got Tensor"),
    ("from_packed_sequence-packed", lambda: Packed.from_packed_sequence(_good()), TypeError, "sequence",
     "PackedSequence; got Packed"),
    ("from_nested-tensor", lambda: Packed.from_nested(torch.zeros(2, 3)), ValueError, "nested",
     "layout torch.jagged; got layout torch.strided \\(not nested\\)"),
    ("from_nested-strided",
     lambda: Packed.from_nested(torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])), ValueError, "nested", "layout torch.jagged; got layout torch.strided$"),
    ("from_nested-list", lambda: Packed.from_nested([torch.ones(2)]), TypeError, "nested", "must be a torch.Tensor"),
]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@_table(PACKED_METHODS_BAD)
def test_packed_methods_bad_input(call, error, argument, expected):
    _refused(call, error, argument, expected)


CU_SEQLENS_FROM_LENGTHS_BAD = [
    ("float-in-list", lambda: cu_seqlens_from_lengths([3.5, 2]), TypeError, "lengths[0]", "must be an int"),
    ("string", lambda: cu_seqlens_from_lengths("abc"), TypeError, "lengths", "1-D integer tensor or a list of ints"),
    ("none", lambda: cu_seqlens_from_lengths(None), TypeError, "lengths", "got NoneType"),
    ("negative", lambda: cu_seqlens_from_lengths([3, -1]), ValueError, "lengths", ">= 0; got a length of -1"),
    ("float-tensor", lambda: cu_seqlens_from_lengths(torch.tensor([1.0, 2.0])), TypeError, "lengths",
     "integer tensor; got torch.float32"),
    ("2-D", lambda: cu_seqlens_from_lengths(torch.tensor([[1, 2]])), ValueError, "lengths", "must be 1-D"),
    ("bool-tensor", lambda: cu_seqlens_from_lengths(torch.tensor([True, False])), TypeError, "lengths",
     "integer tensor; got torch.bool"),
]


@_table(CU_SEQLENS_FROM_LENGTHS_BAD)
def test_cu_seqlens_from_lengths_bad_input(call, error, argument, expected):
    _refused(call, error, argument, expected)


SEGMENT_IDS_FROM_LENGTHS_BAD = [
    ("from_lengths-dtype-float", lambda: segment_ids_from_lengths([1, 2], dtype=torch.float32), TypeError, "dtype",
     "torch.int32 or torch.int64; got torch.float32"),
    ("from_lengths-dtype-int16", lambda: segment_ids_from_lengths([1, 2], dtype=torch.int16), TypeError, "dtype",
     "got torch.int16"),
    ("from_lengths-negative", lambda: segment_ids_from_lengths([1, -2]), ValueError, "lengths", ">= 0"),
    ("from_lengths-float", lambda: segment_ids_from_lengths([1, 2.5]), TypeError, "lengths[1]", "must be an int"),
]


@_table(SEGMENT_IDS_FROM_LENGTHS_BAD)
def test_segment_ids_from_lengths_bad_input(call, error, argument, expected):
    _refused(call, error, argument, expected)


SEGMENT_IDS_FROM_CU_SEQLENS_BAD = [
    ("from_cu_seqlens-start", lambda: segment_ids_from_cu_seqlens(torch.tensor([1, 2])), ValueError, "cu_seqlens",
     r"start at 0; got cu_seqlens\[0\] = 1"),
    ("from_cu_seqlens-decreasing", lambda: segment_ids_from_cu_seqlens(torch.tensor([0, 3, 2])), ValueError,
     "cu_seqlens", "non-decreasing"),
    ("from_cu_seqlens-float", lambda: segment_ids_from_cu_seqlens(torch.tensor([0.0, 2.0])), TypeError,
     "cu_seqlens", "int32 or int64"),
    ("from_cu_seqlens-empty", lambda: segment_ids_from_cu_seqlens(torch.zeros(0, dtype=torch.int64)), ValueError,
     "cu_seqlens", "B \\+ 1 >= 1 entries"),
    ("from_cu_seqlens-2d", lambda: segment_ids_from_cu_seqlens(torch.tensor([[0, 2]])), ValueError, "cu_seqlens",
     "1-D"),
    ("from_cu_seqlens-list", lambda: segment_ids_from_cu_seqlens([0, 2]), TypeError, "cu_seqlens",
     "must be a torch.Tensor"),
    ("from_cu_seqlens-dtype", lambda: segment_ids_from_cu_seqlens(torch.tensor([0, 2]), dtype=torch.float64),
     TypeError, "dtype", "torch.int32 or torch.int64"),
]


@_table(SEGMENT_IDS_FROM_CU_SEQLENS_BAD)
def test_segment_ids_from_cu_seqlens_bad_input(call, error, argument, expected):
    _refused(call, error, argument, expected)


def test_cu_seqlens_from_lengths_list_and_tensor():
    assert cu_seqlens_from_lengths([3, 0, 2]).tolist() == [0, 3, 3, 5]
    cu = cu_seqlens_from_lengths(torch.tensor([4, 1], dtype=torch.int32))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 5]
    assert cu_seqlens_from_lengths([]).tolist() == [0]


def test_packed_to_keeps_index_dtypes():
    packed = pack(torch.randn(2, 4, 3), [4, 1])
    moved = packed.to(torch.float64)
    assert moved.data.dtype == torch.float64
    assert moved.cu_seqlens.dtype == torch.int32 and moved.lengths.dtype == torch.int64
    assert torch.equal(moved.cu_seqlens, packed.cu_seqlens) and torch.equal(moved.lengths, packed.lengths)
    meta = packed.to("meta")  # a device move takes the index tensors along, dtypes kept
    assert [(t.device.type, t.dtype) for t in meta] == [("meta", torch.float32), ("meta", torch.int32),
                                                         ("meta", torch.int64)]


# --- segment ids -----------------------------------------------------------------------

@pytest.mark.parametrize("lengths", [[3, 0, 2], [0], [], [1, 1, 4, 0, 0]], ids=lambda l: "L" + "-".join(map(str, l)))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_segment_ids(lengths, dtype):
    expected = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    ids = segment_ids_from_lengths(lengths, dtype=dtype)
    assert ids.dtype == dtype and ids.tolist() == expected.tolist()
    from_offsets = segment_ids_from_cu_seqlens(cu_seqlens_from_lengths(lengths), dtype=dtype)
    assert from_offsets.dtype == dtype and from_offsets.tolist() == expected.tolist()


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


def test_to_packed_sequence_ranks_tied_lengths_in_batch_order():
    """Sequences by decreasing length, ties in batch order (a stable sort), as the rows
    of time step after time step; the inverse permutation in unsorted_indices."""
    lengths = [3, 1, 2, 3, 1, 2, 3, 1, 2, 3] * 4  # forty sequences, three lengths: many ties
    padded = 100.0 * torch.arange(40.0)[:, None] + torch.arange(3.0)[None, :]  # entry [b, t] = 100 b + t
    sequence = pack(padded, lengths).to_packed_sequence()
    order = sorted(range(40), key=lambda b: -lengths[b])  # Python's sort is stable
    assert sequence.sorted_indices.tolist() == order
    assert sequence.unsorted_indices.tolist() == [order.index(b) for b in range(40)]  # the rank of each
    assert sequence.batch_sizes.tolist() == [40, 28, 16]
    assert sequence.data.tolist() == [100.0 * b + t for t in range(3) for b in order if lengths[b] > t]
    back = Packed.from_packed_sequence(sequence)
    assert torch.equal(back.data, pack(padded, lengths).data) and back.lengths.tolist() == lengths


def test_from_nested_takes_the_rows_its_offsets_cover():
    """A jagged tensor whose offsets start inside a larger values buffer: the Packed batch
    holds only the rows between its first and last offset."""
    values = torch.arange(20.0).view(10, 2)
    nested = torch.nested.nested_tensor_from_jagged(values, torch.tensor([2, 5, 7]))
    packed = Packed.from_nested(nested)
    assert torch.equal(packed.data, values[2:7])
    assert packed.cu_seqlens.tolist() == [0, 3, 5] and packed.cu_seqlens.dtype == torch.int32
    assert packed.lengths.tolist() == [3, 2]


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
