"""Argument checks of the public segment operations, run once before any kernel launch."""
from __future__ import annotations

import torch

from ... import runtime, validation
from ...dispatch import is_traced
from ...validation import integer_argument

#: dtypes the kernels read; float16 and bfloat16 are computed in float32.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, value, dims, trailing=None) -> None:
    """``value`` must be a floating tensor of one of ``dims`` ranks (and the given trailing shape)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    if value.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must have dtype float16, bfloat16, float32 or float64; got {value.dtype}")
    if value.dim() not in dims:
        wanted = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {wanted}; got shape {tuple(value.shape)}")
    if value.dim() >= 2 and any(size == 0 for size in value.shape[1:]):
        raise ValueError(f"{name} must have non-empty trailing dimensions; got shape {tuple(value.shape)}")


def check_num_segments(num_segments) -> int:
    num_segments = integer_argument("num_segments", num_segments, "a Python int")
    if num_segments < 0:
        raise ValueError(f"num_segments must be >= 0; got {num_segments}")
    return num_segments


def check_idx(idx, n_rows: int, num_segments: int, rows_name: str) -> None:
    """``idx``: int32, 1-D, one entry per row, sorted, each in ``[0, num_segments)``.

    The value checks read ``idx`` on the host (one synchronisation); they are skipped
    while ``torch.compile`` traces or a CUDA graph is captured.
    """
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor; got {type(idx).__name__}")
    if idx.dtype != torch.int32:
        raise ValueError(f"idx must have dtype torch.int32; got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"idx must be 1-D; got shape {tuple(idx.shape)}")
    if idx.shape[0] != n_rows:
        raise ValueError(f"idx must have one entry per row of {rows_name} ({n_rows}); got {idx.shape[0]} entries")
    if n_rows == 0 or is_traced():
        return
    descending = (idx[1:] < idx[:-1]).sum() if n_rows > 1 else idx.new_zeros(())
    low, high = torch.aminmax(idx)
    low, high, unsorted = torch.stack([low, high, descending.to(torch.int32)]).tolist()
    if low < 0:
        raise ValueError(f"idx must be >= 0; got a minimum of {low}")
    if high >= num_segments:
        raise ValueError(f"idx must be < num_segments ({num_segments}); got a maximum of {high}")
    if unsorted:
        raise ValueError(f"idx must be sorted in non-decreasing order; {unsorted} entries are smaller than the one before")


def check_devices(**tensors: torch.Tensor) -> None:
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    validation.check_same_device(**tensors)
    name, first = next(iter(tensors.items()))
    validation.check_kernel_device(name, first)


def check_same_dtype(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if value.dtype != other.dtype:
        raise ValueError(f"{name} must have the dtype of {other_name} ({other.dtype}); got {value.dtype}")
