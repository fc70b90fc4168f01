"""Checks of the plain-number arguments shared by the public functions."""
from __future__ import annotations

import operator

import torch


def integer_argument(name: str, value, what: str = "an int") -> int:
    """``value`` as a Python int: an ``int`` or an integer scalar such as ``numpy.int64``.

    ``bool`` and tensors are refused (a tensor would need a host synchronisation, and a
    bool is almost always a mistake); so is anything without ``__index__`` (floats).
    """
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    return operator.index(value)
