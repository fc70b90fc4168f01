"""The public segment operations: checked arguments, then the Triton custom operators.

Rows ``x[i]`` belong to segment ``idx[i]``; ``idx`` is int32, sorted, in
``[0, num_segments)``. A segment with no rows gives 0 (also for ``mean`` and
``rms_norm``, whose gradient there is 0 too). Inputs may be float16, bfloat16
(computed in float32), float32 or float64; outputs and gradients have the input's
dtype. All six are differentiable twice (the second derivative in eager mode), usable
inside ``torch.compile(fullgraph=True)`` (forward and first backward), and
deterministic: no atomics, the same inputs give bitwise the same results.
"""
from __future__ import annotations

import torch

from . import custom_ops as ops
from .validation import check_devices, check_idx, check_num_segments, check_same_dtype, check_tensor


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], 1) if x.dim() == 1 else x


def _index(idx: torch.Tensor) -> torch.Tensor:
    # the kernels read idx as a dense int32 array (a strided view is copied once)
    return idx.contiguous()


# The operations without the argument checks: what runs inside torch.compile and CUDA
# graphs, where the host-reading checks are skipped. The benchmark times these.

def _sum(x, idx, num_segments):
    out = ops.segment_sum_op(_as_rows(x), _index(idx), num_segments)
    return out.reshape(num_segments) if x.dim() == 1 else out


def _mean(x, idx, num_segments):
    out, _ = ops.segment_mean_op(_as_rows(x), _index(idx), num_segments, ops.needs_counts(x))
    return out.reshape(num_segments) if x.dim() == 1 else out


def _dot(x, y, idx, num_segments):
    return ops.segment_dot_op(_as_rows(x), _as_rows(y), _index(idx), num_segments, True).reshape(num_segments)


def _mul(x, y, idx, num_segments):
    return ops.segment_scale_rows_op(_as_rows(x), _as_rows(y), _index(idx)).reshape(x.shape)


def _rms_norm(x, idx, num_segments):
    r, _ = ops.segment_rms_op(_as_rows(x), _index(idx), num_segments)
    return r.reshape(num_segments)


def _matvec(v, m, idx, num_segments):
    return ops.segment_matvec_op(v, m, _index(idx), False)


UNCHECKED = {"sum": _sum, "mean": _mean, "dot": _dot, "mul": _mul, "rms_norm": _rms_norm, "matvec": _matvec}


def segmented_sum(x: torch.Tensor, idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment sum: ``out[s] = sum_{i: idx[i] = s} x[i]``.

    Args:
        x: ``(N,)`` or ``(N, D)``.
        idx: int32 ``(N,)``, sorted, in ``[0, num_segments)``.
        num_segments: ``S``; segments without rows give 0.

    Returns:
        ``(S,)`` for ``(N,)`` input, ``(S, D)`` for ``(N, D)``; ``x``'s dtype.
    """
    num_segments = check_num_segments(num_segments)
    check_tensor("x", x, (1, 2))
    check_devices(x=x, idx=idx)
    check_idx(idx, x.shape[0], num_segments, "x")
    return _sum(x, idx, num_segments)


def segmented_mean(x: torch.Tensor, idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment mean: ``out[s] = sum_{i in s} x[i] / n_s`` (0 for an empty segment).

    Shapes as :func:`segmented_sum`: ``(S,)`` or ``(S, D)``.
    """
    num_segments = check_num_segments(num_segments)
    check_tensor("x", x, (1, 2))
    check_devices(x=x, idx=idx)
    check_idx(idx, x.shape[0], num_segments, "x")
    return _mean(x, idx, num_segments)


def segmented_dot(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment sum of row dot products: ``out[s] = sum_{i in s} <x[i], y[i]>``.

    Args:
        x, y: both ``(N,)`` or both ``(N, D)``, one dtype.

    Returns:
        ``(S,)``.
    """
    num_segments = check_num_segments(num_segments)
    check_tensor("x", x, (1, 2))
    check_tensor("y", y, (1, 2))
    if y.shape != x.shape:
        raise ValueError(f"y must have the shape of x {tuple(x.shape)}; got {tuple(y.shape)}")
    check_same_dtype("y", y, "x", x)
    check_devices(x=x, y=y, idx=idx)
    check_idx(idx, x.shape[0], num_segments, "x")
    return _dot(x, y, idx, num_segments)


def segmented_mul(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Scale each row by its segment's row of ``y``: ``out[i] = x[i] * y[idx[i]]``.

    Args:
        x: ``(N,)`` or ``(N, D)``.
        y: ``(S,) + x.shape[1:]`` (elementwise), or ``(S,)`` with a 2-D ``x`` (one
            factor per segment, broadcast over the row).

    Returns:
        ``x``'s shape and dtype.
    """
    num_segments = check_num_segments(num_segments)
    check_tensor("x", x, (1, 2))
    check_tensor("y", y, (1, 2))
    if y.shape[0] != num_segments:
        raise ValueError(f"y must have num_segments ({num_segments}) rows; got shape {tuple(y.shape)}")
    if y.shape[1:] != x.shape[1:] and y.dim() != 1:
        raise ValueError(f"y must have shape {(num_segments,) + tuple(x.shape[1:])} or ({num_segments},); "
                         f"got {tuple(y.shape)}")
    check_same_dtype("y", y, "x", x)
    check_devices(x=x, y=y, idx=idx)
    check_idx(idx, x.shape[0], num_segments, "x")
    return _mul(x, y, idx, num_segments)


def segmented_rms_norm(x: torch.Tensor, idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment root mean square of the rows' norms: ``r[s] = sqrt(sum_{i in s} |x[i]|^2 / n_s)``.

    An empty segment, or one whose rows are all zero, gives 0 with a zero gradient
    (the true gradient at 0 is undefined).

    Returns:
        ``(S,)``.
    """
    num_segments = check_num_segments(num_segments)
    check_tensor("x", x, (1, 2))
    check_devices(x=x, idx=idx)
    check_idx(idx, x.shape[0], num_segments, "x")
    return _rms_norm(x, idx, num_segments)


def segmented_matvec(v: torch.Tensor, m: torch.Tensor, idx: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Multiply each row by its segment's transposed matrix: ``out[i] = m[idx[i]]^T @ v[i]``.

    Args:
        v: ``(N, D)`` (``D = 3`` for positions and forces).
        m: ``(S, D, K)`` (``(S, 3, 3)`` for a cell or a rotation per molecule).

    Returns:
        ``(N, K)``; ``out[i, k] = sum_j m[idx[i], j, k] v[i, j]``.
    """
    num_segments = check_num_segments(num_segments)
    check_tensor("v", v, (2,))
    check_tensor("m", m, (3,))
    if m.shape[0] != num_segments:
        raise ValueError(f"m must have num_segments ({num_segments}) matrices; got shape {tuple(m.shape)}")
    if m.shape[1] != v.shape[1]:
        raise ValueError(f"m must have shape ({num_segments}, {v.shape[1]}, K) to match v's {v.shape[1]} "
                         f"columns; got {tuple(m.shape)}")
    check_same_dtype("m", m, "v", v)
    check_devices(v=v, m=m, idx=idx)
    check_idx(idx, v.shape[0], num_segments, "v")
    return _matvec(v, m, idx, num_segments)
