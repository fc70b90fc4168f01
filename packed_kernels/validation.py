"""Argument checks shared by every public function of the package.

The same mistake gives the same exception in every function:

* ``TypeError``: the wrong Python type (a list where a tensor is expected, a float
  where an int is), or the wrong dtype;
* ``ValueError``: the wrong shape, device, range or value.

Every message names the argument, what was expected and what came. The public
functions check their arguments once, here, before any kernel launch; the kernels
trust what reaches them.
"""
from __future__ import annotations

import operator
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch


__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_bool",
    "check_choice",
    "check_dtype",
    "check_float_tensor",
    "check_index_tensor",
    "check_rank",
    "check_same_device",
    "check_tensor",
    "integer_argument",
]

#: Floating dtypes the kernels read; float16 and bfloat16 are computed in float32.
FLOAT_DTYPES: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Integer dtypes accepted for indices, offsets and lengths.
INDEX_DTYPES: Tuple[torch.dtype, ...] = (torch.int32, torch.int64)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64", torch.int32: "int32", torch.int64: "int64"}


def _dtype_list(dtypes: Sequence[torch.dtype]) -> str:
    names = [_DTYPE_NAMES.get(d, str(d)) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def integer_argument(name: str, value, what: str = "an int") -> int:
    """``value`` as a Python int: an ``int`` or an integer scalar such as ``numpy.int64``.

    ``bool`` and tensors are refused (a tensor would need a host synchronisation, and a
    bool is almost always a mistake); so is anything without ``__index__`` (floats).
    """
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    return operator.index(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return value


def check_choice(name: str, value, choices: Iterable):
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")
    return value


def check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def check_rank(name: str, value: torch.Tensor, dims: Union[int, Sequence[int]], layout: Optional[str] = None) -> None:
    """``value.dim()`` must be ``dims`` (or one of them); ``layout`` names the axes."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if value.dim() not in dims:
        wanted = " or ".join(f"{d}-D" for d in dims)
        if layout:
            wanted += f" {layout}"
        raise ValueError(f"{name} must be {wanted}; got shape {tuple(value.shape)}")


def check_dtype(name: str, value, dtypes: Sequence[torch.dtype], dims: Union[int, Sequence[int], None] = None,
                layout: Optional[str] = None) -> torch.Tensor:
    """A tensor of one of ``dtypes`` (``TypeError`` otherwise), of rank ``dims`` if given."""
    check_tensor(name, value)
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_list(dtypes)}; got {value.dtype}")
    if dims is not None:
        check_rank(name, value, dims, layout)
    return value


def check_float_tensor(name: str, value, dims: Union[int, Sequence[int], None] = None,
                       dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, layout: Optional[str] = None) -> torch.Tensor:
    """A tensor of one of ``dtypes`` (default: the floating dtypes the kernels read)."""
    return check_dtype(name, value, dtypes, dims, layout)


def check_index_tensor(name: str, value, dims: Union[int, Sequence[int], None] = None,
                       layout: Optional[str] = None) -> torch.Tensor:
    """An integer tensor (int32 or int64) of offsets, lengths or ids."""
    return check_dtype(name, value, INDEX_DTYPES, dims, layout)


def check_same_device(**tensors: torch.Tensor) -> None:
    """Every tensor on the device of the first one named."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} must be on {first_name}'s device ({first.device}); got {tensor.device}")
