"""Packed (token-flat) batches: ``pack``, ``unpack`` and the ``Packed`` container.

A batch of ``B`` sequences of lengths ``l_0 .. l_{B-1}`` is stored as one tensor
``data`` of shape ``(sum(l), ...)``: sequence ``b`` occupies rows
``cu_seqlens[b] : cu_seqlens[b + 1]``, where ``cu_seqlens`` is the exclusive
cumulative sum of the lengths with a leading 0 (int32, shape ``(B + 1,)``).
Nothing is stored for the frames a padded ``(B, T, ...)`` layout would waste.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

__all__ = ["Packed", "pack", "unpack", "cu_seqlens_from_lengths"]


class Packed(NamedTuple):
    """A packed batch.

    Attributes:
        data: ``(sum(lengths), ...)``, the sequences concatenated along dim 0.
        cu_seqlens: int32 ``(B + 1,)``; ``cu_seqlens[0] == 0``,
            ``cu_seqlens[b + 1] - cu_seqlens[b] == lengths[b]``.
        lengths: int64 ``(B,)``, the length of each sequence.
    """

    data: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    def to(self, *args, **kwargs) -> "Packed":
        """Move ``data`` (dtype and device) and the index tensors (device only)."""
        data = self.data.to(*args, **kwargs)
        return Packed(data, self.cu_seqlens.to(data.device), self.lengths.to(data.device))


def _lengths_tensor(lengths: Union[torch.Tensor, Sequence[int]], device) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
        return lengths.to(device=device, dtype=torch.int64)
    try:
        values = [int(v) for v in lengths]
    except (TypeError, ValueError) as err:
        raise TypeError(f"lengths must be a 1-D integer tensor or a sequence of ints: {err}") from None
    return torch.tensor(values, dtype=torch.int64, device=device)


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l_0, l_0 + l_1, ...]`` as int32."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def pack(padded: torch.Tensor, lengths: Union[torch.Tensor, Sequence[int]]) -> Packed:
    """Pack a padded batch ``(B, T, ...)`` with per-sequence ``lengths`` into a ``Packed``.

    Frames beyond each length are dropped. Zero-length sequences are allowed.
    """
    if not isinstance(padded, torch.Tensor):
        raise TypeError(f"padded must be a torch.Tensor, got {type(padded).__name__}")
    if padded.dim() < 2:
        raise ValueError(f"padded must have shape (B, T, ...), got shape {tuple(padded.shape)}")
    B, T = padded.shape[:2]
    lengths_t = _lengths_tensor(lengths, padded.device)
    if lengths_t.numel() != B:
        raise ValueError(f"lengths must have B={B} entries (padded.shape[0]), got {lengths_t.numel()}")
    if B and (int(lengths_t.min()) < 0 or int(lengths_t.max()) > T):
        raise ValueError(
            f"lengths must lie in [0, T={T}] (padded.shape[1]), got min {int(lengths_t.min())}, "
            f"max {int(lengths_t.max())}"
        )
    mask = torch.arange(T, device=padded.device)[None, :] < lengths_t[:, None]
    data = padded[mask]  # row-major over (b, t): sequence after sequence
    return Packed(data, cu_seqlens_from_lengths(lengths_t), lengths_t)


def unpack(
    packed: Packed, total_length: Optional[int] = None, padding_value: float = 0.0
) -> torch.Tensor:
    """Scatter a ``Packed`` batch back to a padded ``(B, T, ...)`` tensor.

    ``T`` is ``total_length`` if given (it must be at least the longest sequence),
    else the longest length. Padding frames are filled with ``padding_value``.
    """
    if not isinstance(packed, Packed):
        raise TypeError(f"packed must be a Packed, got {type(packed).__name__}")
    lengths = packed.lengths
    longest = int(lengths.max()) if lengths.numel() else 0
    if packed.data.shape[0] != int(lengths.sum()):
        raise ValueError(
            f"packed.data has {packed.data.shape[0]} rows but lengths sum to {int(lengths.sum())}"
        )
    T = longest if total_length is None else int(total_length)
    if T < longest:
        raise ValueError(f"total_length={T} is shorter than the longest sequence ({longest})")
    B = lengths.numel()
    out = packed.data.new_full((B, T) + tuple(packed.data.shape[1:]), padding_value)
    mask = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]
    out[mask] = packed.data
    return out
