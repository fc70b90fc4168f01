"""Comparison helpers whose failures say what differs and by how much, and a context in
which output memory that no kernel writes reads as NaN."""
from __future__ import annotations

import contextlib

import numpy as np
import torch


def _as_float64(value) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return torch.as_tensor(value).detach().to("cpu", torch.float64)


def assert_close(name: str, actual, expected, *, atol: float, rtol: float) -> None:
    """Elementwise ``|a - e| <= atol + rtol * |e|`` (infinities must match exactly).

    On failure the message gives the tensor's name, the shapes, the worst element,
    the max abs difference and the RMS relative error.
    """
    a, e = _as_float64(actual), _as_float64(expected)
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN in {int(nan_a.sum())} places, expected {int(nan_e.sum())}"
    inf_e = torch.isinf(e) | torch.isinf(a)
    assert torch.equal(a[inf_e], e[inf_e]), f"{name}: infinities differ: {a[inf_e][:8]} vs {e[inf_e][:8]}"
    finite = ~(nan_e | inf_e)
    a, e = a[finite], e[finite]
    if a.numel() == 0:
        return
    diff = (a - e).abs()
    bad = diff > atol + rtol * e.abs()
    if bool(bad.any()):
        worst = int(torch.argmax(diff - rtol * e.abs()))
        rms_rel = float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e).clamp_min(1e-300))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"max abs diff {float(diff.max()):.3e}; RMS relative error {rms_rel:.3e}; "
            f"worst flat index {worst}: got {float(a[worst]):.6e}, expected {float(e[worst]):.6e}"
        )


@contextlib.contextmanager
def unwritten_memory_is_nan():
    """Inside, every new uninitialised tensor (``torch.empty``, ``new_empty``) is filled
    with NaN (the largest value for integer dtypes): an output entry that no kernel writes
    shows up as NaN instead of whatever the allocator held. (PyTorch does this under its
    deterministic-algorithms mode, which is switched on here and restored after.)"""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
