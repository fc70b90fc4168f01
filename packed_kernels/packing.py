"""Packed (token-flat) batches: ``pack``, ``unpack`` and the ``Packed`` container.

A batch of ``B`` sequences of lengths ``l_0 .. l_{B-1}`` is stored as one tensor
``data`` of shape ``(sum(l), ...)``: sequence ``b`` occupies rows
``cu_seqlens[b] : cu_seqlens[b + 1]``, where ``cu_seqlens`` is the exclusive
cumulative sum of the lengths with a leading 0 (int32, shape ``(B + 1,)``).
Nothing is stored for the frames a padded ``(B, T, ...)`` layout would waste.

The same layout is what ``torch.nested`` jagged tensors hold (``values`` and
``offsets``), and what the segment operations read as one segment id per row
(:func:`segment_ids_from_lengths`); :class:`Packed` converts to and from both and to
and from ``torch.nn.utils.rnn.PackedSequence``, whose rows are interleaved by time.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch.nn.utils.rnn import PackedSequence

from .dispatch import is_traced
from .validation import check_index_tensor, check_rank, check_tensor, integer_argument

__all__ = [
    "Packed",
    "pack",
    "unpack",
    "cu_seqlens_from_lengths",
    "segment_ids_from_lengths",
    "segment_ids_from_cu_seqlens",
]

Lengths = Union[torch.Tensor, Sequence[int]]


class Packed(NamedTuple):
    """A packed batch.

    Attributes:
        data: ``(sum(lengths), ...)``, the sequences concatenated along dim 0.
        cu_seqlens: int32 ``(B + 1,)``; ``cu_seqlens[0] == 0``,
            ``cu_seqlens[b + 1] - cu_seqlens[b] == lengths[b]``.
        lengths: int64 ``(B,)``, the length of each sequence.

    Build one with :func:`pack` from a padded batch, or with :meth:`from_nested` or
    :meth:`from_packed_sequence` from the other layouts of the same batch.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> nested = torch.nested.nested_tensor([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])],
        ...                                     layout=torch.jagged)  # lengths 3 and 1
        >>> packed = pk.Packed.from_nested(nested)
        >>> packed
        Packed(data=tensor([1., 2., 3., 4.]), cu_seqlens=tensor([0, 3, 4], dtype=torch.int32), lengths=tensor([3, 1]))
        >>> packed.batch_size, packed.to_packed_sequence().data  # time-major: frame 0 of both first
        (2, tensor([1., 4., 2., 3.]))
    """

    data: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    def to(self, *args, **kwargs) -> "Packed":
        """Move ``data`` (dtype and device, as ``Tensor.to``); the index tensors follow its
        device and keep their integer dtypes."""
        data = self.data.to(*args, **kwargs)
        return Packed(data, self.cu_seqlens.to(data.device), self.lengths.to(data.device))

    # -- other layouts of the same batch ----------------------------------------------

    def to_nested(self) -> torch.Tensor:
        """A ``torch.nested`` jagged tensor ``(B, j, ...)`` that views ``data``."""
        return torch.nested.nested_tensor_from_jagged(self.data, self.cu_seqlens.to(torch.int64))

    @classmethod
    def from_nested(cls, nested: torch.Tensor) -> "Packed":
        """The ``Packed`` batch of a jagged nested tensor (``layout=torch.jagged``)."""
        check_tensor("nested", nested)
        if not nested.is_nested or nested.layout != torch.jagged:
            raise ValueError(f"nested must be a nested tensor with layout torch.jagged; got layout {nested.layout}"
                             f"{'' if nested.is_nested else ' (not nested)'}")
        offsets = nested.offsets()
        lengths = offsets.diff().to(torch.int64)
        values = nested.values()
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.shape[0]:
            # a view into a larger buffer: take the rows this batch covers
            values = values[int(offsets[0]):int(offsets[-1])]
        return cls(values, cu_seqlens_from_lengths(lengths), lengths)

    def to_packed_sequence(self) -> PackedSequence:
        """The same batch as a ``torch.nn.utils.rnn.PackedSequence`` (``enforce_sorted=False``).

        Every sequence must have at least one frame, as ``pack_padded_sequence`` requires.
        """
        lengths = self.lengths
        if lengths.numel() and int(lengths.min()) < 1:
            raise ValueError("a PackedSequence cannot hold empty sequences; got a length of "
                             f"{int(lengths.min())} in packed.lengths")
        rows, batch_sizes, order = _time_major_rows(self.cu_seqlens, lengths)
        return PackedSequence(self.data[rows], batch_sizes, order, torch.argsort(order))

    @classmethod
    def from_packed_sequence(cls, sequence: PackedSequence) -> "Packed":
        """The ``Packed`` batch of a ``PackedSequence``, sequences in their original order."""
        if not isinstance(sequence, PackedSequence):
            raise TypeError(f"sequence must be a torch.nn.utils.rnn.PackedSequence; got {type(sequence).__name__}")
        data, batch_sizes = sequence.data, sequence.batch_sizes
        batch = int(batch_sizes[0]) if batch_sizes.numel() else 0
        # lengths in sorted order: how many time steps each rank is present for
        ranks = torch.arange(batch, dtype=torch.int64)
        sorted_lengths = (batch_sizes[None, :] > ranks[:, None]).sum(1)
        order = sequence.sorted_indices if sequence.sorted_indices is not None else ranks
        lengths = torch.empty_like(sorted_lengths).index_copy_(0, order.cpu(), sorted_lengths)
        lengths = lengths.to(data.device)
        cu_seqlens = cu_seqlens_from_lengths(lengths)
        rows, _, _ = _time_major_rows(cu_seqlens, lengths, order.to(lengths.device))
        packed = data.new_empty(data.shape).index_copy(0, rows, data)
        return cls(packed, cu_seqlens, lengths)


def _time_major_rows(cu_seqlens: torch.Tensor, lengths: torch.Tensor, order: Optional[torch.Tensor] = None):
    """The packed row of each ``PackedSequence`` row, its ``batch_sizes`` (CPU int64) and
    the order of sequences by decreasing length (``order``, or a stable sort): row ``r``
    at time ``t`` and rank ``k`` is frame ``t`` of sequence ``order[k]``. A given order
    matters where lengths tie: ``pack_padded_sequence`` may rank tied sequences either way."""
    if order is None:
        order = torch.argsort(lengths, descending=True, stable=True)
    longest = int(lengths.max()) if lengths.numel() else 0
    steps = torch.arange(longest, device=lengths.device)
    batch_sizes = (lengths[None, :] > steps[:, None]).sum(1)
    step_of_row = torch.repeat_interleave(steps, batch_sizes)
    first_row_of_step = torch.cumsum(batch_sizes, 0) - batch_sizes
    rank = torch.arange(step_of_row.numel(), device=lengths.device) - first_row_of_step[step_of_row]
    rows = cu_seqlens.to(torch.int64)[order[rank]] + step_of_row
    return rows, batch_sizes.cpu(), order


def _lengths_tensor(name: str, lengths: Lengths, device=None) -> torch.Tensor:
    """``lengths`` as an int64 tensor, checked: integers, 1-D, none negative."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor; got {lengths.dtype}")
        check_rank(name, lengths, 1)
        lengths = lengths.to(device=device if device is not None else lengths.device, dtype=torch.int64)
    elif isinstance(lengths, (list, tuple)):
        values = [integer_argument(f"{name}[{i}]", v) for i, v in enumerate(lengths)]
        lengths = torch.tensor(values, dtype=torch.int64, device=device)
    else:
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints; got {type(lengths).__name__}")
    if lengths.numel() and not is_traced(lengths):
        shortest = int(lengths.min())
        if shortest < 0:
            raise ValueError(f"{name} must be >= 0; got a length of {shortest}")
    return lengths


def cu_seqlens_from_lengths(lengths: Lengths) -> torch.Tensor:
    """``[0, l_0, l_0 + l_1, ...]`` as int32 ``(B + 1,)``, on the device of ``lengths``.

    ``lengths``: a 1-D integer tensor or a list of ints, none negative.

    Example:
        >>> import packed_kernels as pk
        >>> pk.cu_seqlens_from_lengths([3, 0, 2])  # sequence b is rows cu[b]:cu[b + 1]
        tensor([0, 3, 3, 5], dtype=torch.int32)
    """
    lengths = _lengths_tensor("lengths", lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def segment_ids_from_lengths(lengths: Lengths, *, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """The segment of each packed row, ``[0] * l_0 + [1] * l_1 + ...``: the sorted ``idx``
    the segment operations take (``num_segments = len(lengths)``).

    Example:
        >>> import packed_kernels as pk
        >>> pk.segment_ids_from_lengths([2, 0, 3])  # one id per row; segment 1 is empty
        tensor([0, 0, 2, 2, 2], dtype=torch.int32)
    """
    lengths = _lengths_tensor("lengths", lengths)
    if dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dtype must be torch.int32 or torch.int64; got {dtype}")
    segments = torch.arange(lengths.numel(), dtype=dtype, device=lengths.device)
    return torch.repeat_interleave(segments, lengths)


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, *, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """As :func:`segment_ids_from_lengths`, from offsets ``(B + 1,)`` that start at 0 and
    do not decrease.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> pk.segment_ids_from_cu_seqlens(torch.tensor([0, 1, 3]), dtype=torch.int64)  # lengths 1, 2
        tensor([0, 1, 1])
    """
    check_index_tensor("cu_seqlens", cu_seqlens, 1, "(B + 1,)")
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must have B + 1 >= 1 entries; got an empty tensor")
    if not is_traced(cu_seqlens):
        first = int(cu_seqlens[0])
        if first != 0:
            raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0] = {first}")
        if bool((cu_seqlens.diff() < 0).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
    return segment_ids_from_lengths(cu_seqlens.diff(), dtype=dtype)


def pack(padded: torch.Tensor, lengths: Lengths) -> Packed:
    """Pack a padded batch ``(B, T, ...)`` with per-sequence ``lengths`` into a ``Packed``.

    Frames beyond each length are dropped. Zero-length sequences are allowed.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> padded = torch.arange(12.0).view(2, 3, 2)  # (B, T, features) = (2, 3, 2)
        >>> packed = pk.pack(padded, [3, 1])  # the last two frames of sequence 1 are padding
        >>> packed.data  # (3 + 1, 2)
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.],
                [6., 7.]])
        >>> packed.cu_seqlens, packed.lengths
        (tensor([0, 3, 4], dtype=torch.int32), tensor([3, 1]))
    """
    check_tensor("padded", padded)
    if padded.dim() < 2:
        raise ValueError(f"padded must have shape (B, T, ...); got shape {tuple(padded.shape)}")
    B, T = padded.shape[:2]
    lengths_t = _lengths_tensor("lengths", lengths, padded.device)
    if lengths_t.numel() != B:
        raise ValueError(f"lengths must have B={B} entries (padded.shape[0]); got {lengths_t.numel()}")
    if B and int(lengths_t.max()) > T:
        raise ValueError(f"lengths must lie in [0, T={T}] (padded.shape[1]); got a length of {int(lengths_t.max())}")
    mask = torch.arange(T, device=padded.device)[None, :] < lengths_t[:, None]
    data = padded[mask]  # row-major over (b, t): sequence after sequence
    return Packed(data, cu_seqlens_from_lengths(lengths_t), lengths_t)


def unpack(packed: Packed, total_length: Optional[int] = None, padding_value: float = 0.0) -> torch.Tensor:
    """Scatter a ``Packed`` batch back to a padded ``(B, T, ...)`` tensor.

    ``T`` is ``total_length`` if given (it must be at least the longest sequence),
    else the longest length. Padding frames are filled with ``padding_value``.
    ``packed.cu_seqlens`` must agree with ``packed.lengths``.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> packed = pk.pack(torch.arange(8.0).view(2, 4), [3, 1])  # data: 0, 1, 2 and 4
        >>> pk.unpack(packed)  # T = the longest length, 3
        tensor([[0., 1., 2.],
                [4., 0., 0.]])
        >>> pk.unpack(packed, total_length=4, padding_value=-1)
        tensor([[ 0.,  1.,  2., -1.],
                [ 4., -1., -1., -1.]])
    """
    if not isinstance(packed, Packed):
        raise TypeError(f"packed must be a Packed; got {type(packed).__name__}")
    lengths = _lengths_tensor("packed.lengths", packed.lengths)
    check_index_tensor("packed.cu_seqlens", packed.cu_seqlens, 1)
    if packed.cu_seqlens.shape[0] != lengths.numel() + 1 or not torch.equal(
            packed.cu_seqlens.to(device=lengths.device, dtype=torch.int64),
            cu_seqlens_from_lengths(lengths).to(torch.int64)):
        raise ValueError("packed.cu_seqlens must be [0, cumsum(packed.lengths)]; the two disagree")
    longest = int(lengths.max()) if lengths.numel() else 0
    rows = int(lengths.sum())
    if packed.data.shape[0] != rows:
        raise ValueError(f"packed.data must have sum(packed.lengths) = {rows} rows; got {packed.data.shape[0]}")
    T = longest if total_length is None else integer_argument("total_length", total_length, "None or an int")
    if T < longest:
        raise ValueError(f"total_length must be >= the longest sequence ({longest}); got {T}")
    B = lengths.numel()
    out = packed.data.new_full((B, T) + tuple(packed.data.shape[1:]), padding_value)
    mask = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]
    out[mask] = packed.data
    return out
