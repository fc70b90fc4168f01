"""Padded PyTorch stage: scatter the rows into a dense ``(S, L, ...)`` block, then reduce.

``L`` is the longest segment. Padding slots hold zeros and a mask says which slots
are rows, so every reduction is an ordinary dense one and autograd differentiates
it to any order. The price is memory and traffic proportional to ``S * L`` instead of
``N``: one segment of 10,000 rows among short ones makes every segment 10,000 long.
These functions take the public shapes (``(N,)`` or ``(N, D)``) and return the same
shapes as :mod:`packed_kernels.ops.segment`.
"""
from __future__ import annotations

import torch


def padded_layout(idx: torch.Tensor, num_segments: int):
    """``(slot, counts, longest)``: row ``i`` goes to ``[idx[i], slot[i]]`` of the padded block."""
    idx = idx.long()
    counts = torch.bincount(idx, minlength=num_segments)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(idx.shape[0], device=idx.device) - starts[idx]
    longest = int(counts.max()) if num_segments > 0 and idx.numel() else 0
    return slot, counts, longest


def pad(x: torch.Tensor, idx: torch.Tensor, num_segments: int):
    """``(padded (S, L) + x.shape[1:], mask (S, L), counts (S,))``; differentiable in ``x``."""
    slot, counts, longest = padded_layout(idx, num_segments)
    padded = x.new_zeros((num_segments, longest) + x.shape[1:])
    padded = padded.index_put((idx.long(), slot), x)
    mask = torch.zeros((num_segments, longest), dtype=torch.bool, device=x.device)
    mask[idx.long(), slot] = True
    return padded, mask, counts


def segmented_sum_padded(x, idx, num_segments):
    padded, _, _ = pad(x, idx, num_segments)
    return padded.sum(dim=1)


def segmented_mean_padded(x, idx, num_segments):
    padded, _, counts = pad(x, idx, num_segments)
    counts = counts.clamp(min=1).to(x.dtype)
    return padded.sum(dim=1) / (counts if x.dim() == 1 else counts[:, None])


def segmented_dot_padded(x, y, idx, num_segments):
    products = x * y if x.dim() == 1 else (x * y).sum(dim=1)
    padded, _, _ = pad(products, idx, num_segments)
    return padded.sum(dim=1)


def segmented_mul_padded(x, y, idx, num_segments):
    # The padded way: broadcast y over each segment's slots, multiply, read the rows back.
    padded, _, _ = pad(x, idx, num_segments)
    slot, _, _ = padded_layout(idx, num_segments)
    factor = y[:, None] if (y.dim() == x.dim()) else y[:, None, None]
    return (padded * factor)[idx.long(), slot]


def segmented_rms_norm_padded(x, idx, num_segments):
    squared = x * x if x.dim() == 1 else (x * x).sum(dim=1)
    padded, _, counts = pad(squared, idx, num_segments)
    mean = padded.sum(dim=1) / counts.clamp(min=1).to(x.dtype)
    # sqrt has an infinite slope at 0; route zeros around it so their gradient is 0.
    positive = mean > 0
    safe = torch.where(positive, mean, torch.ones_like(mean))
    return torch.where(positive, safe.sqrt(), torch.zeros_like(mean))


def segmented_matvec_padded(v, m, idx, num_segments):
    padded, _, _ = pad(v, idx, num_segments)  # (S, L, D)
    slot, _, _ = padded_layout(idx, num_segments)
    products = torch.einsum("sld,sdk->slk", padded, m)
    return products[idx.long(), slot]
