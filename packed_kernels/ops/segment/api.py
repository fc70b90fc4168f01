"""The public segment operations: checked arguments, then the Triton operators.

Rows ``x[i]`` belong to segment ``idx[i]``; ``idx`` is int32 or int64 (what
``repeat_interleave``, PyG and torch_scatter give; converted to int32 once, so the kernels
are the same either way), sorted, in ``[0, num_segments)``. A segment with no rows gives
0 (also for ``mean`` and ``rms_norm``, whose gradient there is 0 too). Inputs may be
float16, bfloat16 (computed in float32), float32 or float64; outputs and gradients have
the input's dtype, and two inputs of different dtypes are promoted to
``torch.promote_types`` of them. All six are differentiable twice (the second
derivative in eager mode), usable inside ``torch.compile(fullgraph=True)`` (forward and
first backward), and deterministic: no atomics, the same inputs give bitwise the same
results.

Where they run:

* ``torch.autocast`` leaves them alone, as it leaves ``index_add`` and ``scatter_add``:
  they compute in the dtype of their (promoted) inputs (run the backward outside
  autocast, as PyTorch advises: the padded stage's is made of PyTorch ops).
* ``torch.func`` works, to second order: ``grad``, ``vjp``, ``jvp``, ``vmap`` and the
  transforms made of them, nested in any order (``vmap(grad(f))`` for per-example
  gradients, ``jacrev(grad(f))``, ``hessian(f)``, ``jacfwd(jacfwd(f))``). Under ``vmap``
  each operator still launches its kernel once for the whole batch (its vmap rule): the
  mapped dimension folds into the kernel's columns, ``(B, N, D)`` rows read as
  ``(N, B*D)`` (an unbatched operand expanded to match; a rowwise ``dot`` runs column by
  column and sums each example's columns after), or, where a per-segment scalar mixes
  the columns (``rms`` and its backwards, ``matvec`` and ``outer`` with both operands
  batched), into the rows, the examples one after another in segments of their own
  (``matvec`` with only ``v`` batched repeats each row's segment instead). Only a fold
  into the rows that would count ``2**31`` or more rows or segments loops over the
  examples (one launch each). ``idx`` is not mapped: one set of segments per call, and a
  batched ``idx`` is refused with a clear error. Forward mode (``jvp``, ``jacfwd``) has
  its own rules, made of the same operators.
* ``meta`` tensors and ``FakeTensorMode`` infer the output shapes and dtypes without
  running a kernel.
* ``idx``'s values are checked on the device, never read by the host: one kernel
  (:func:`~.triton_kernels.idx_check_triton`) reports a value out of range or out of
  order as :mod:`packed_kernels.validation` says (within the call for CPU tensors and in
  strict mode, otherwise by a later call or :func:`packed_kernels.check_errors`), and
  writes the int32 ``idx`` the other kernels read, clamped to ``[0, num_segments)``, so
  that no value can make a kernel read or write out of bounds. Traced and captured calls
  run the same check.
* Tensors the kernels do not take (CPU tensors on a machine whose kernels are compiled
  for a GPU) are computed by the padded PyTorch stage (:mod:`.padded_torch`), with the
  same results, dtypes and gradients of both orders (through autograd).

The Triton kernels are :class:`~packed_kernels.dispatch.Operator` s (custom ops under
``packed_kernels::segment_*`` and their eager twins). Each takes and returns 2-D tensors
(rows ``(N, C)``, segment rows ``(S, C)``) and has a fake (shape-only) implementation and
a registered autograd formula whose backward is itself made of these operators.
Differentiating twice therefore runs Triton kernels again, never a composition of
PyTorch ops:

=====================  =========================================  ==================================
operator               forward                                    backward (its adjoint)
=====================  =========================================  ==================================
``sum``                ``out[s] = sum_{i in s} x[i]``              ``gather``: ``dx[i] = g[s]``
``gather``             ``out[i] = b[s]``                           ``sum`` of the upstream gradient
``mean``               ``out[s] = sum_{i in s} x[i] / n_s``        ``gather_over_count``
``gather_over_count``  ``out[i] = b[s] / n_s``                     ``mean`` of the upstream gradient
``dot``                ``out[s] = sum_{i in s} a[i] * b[i]``       ``scale_rows`` (twice)
                       (summed over columns when ``rowwise``)
``scale_rows``         ``out[i] = a[i] * b[s]``                    ``scale_rows`` and ``dot``
``rms``                ``r_s = sqrt(sum_{i in s} |x_i|^2 / n_s)``  ``rms_backward``
``rms_backward``       ``dx_i = x_i g_s / (n_s r_s)``              itself, ``dot`` and a per-segment kernel
``matvec``             ``out[i] = m_s^T v_i`` (or ``m_s v_i``)     ``matvec`` (other side) and ``outer``
``outer``              ``out[s] = sum_{i in s} a_i b_i^T``         ``matvec`` (both sides)
=====================  =========================================  ==================================

Here ``s = idx[i]`` and ``n_s`` is the number of rows of segment ``s``. Every operator's
last argument is the launch configuration as text (:func:`config_text` of a
:class:`~.triton_kernels.SegmentConfig`; ``None``: the default), so that a test can run
a whole chain of derivatives with a small one; the public functions pass ``None``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional

import torch
from torch import Tensor

from ... import runtime, validation
from ...dispatch import TRACED, call_mode, operator
from ...validation import (
    check_float_tensor,
    check_index_tensor,
    check_rank,
    check_same_device,
    check_tensor,
    integer_argument,
)
from . import padded_torch
from . import triton_kernels as tk

__all__ = [
    "segmented_sum",
    "segmented_mean",
    "segmented_dot",
    "segmented_mul",
    "segmented_rms_norm",
    "segmented_matvec",
]


# --- argument checks ------------------------------------------------------------------------

#: ``idx`` of int64 is converted to the int32 the kernels read: its rows and segments
#: must be counted in int32.
_INT32_LIMIT = 2 ** 31


def _check_rows(name: str, value, dims) -> None:
    """A floating tensor of one of ``dims`` ranks, without empty trailing dimensions."""
    check_float_tensor(name, value, dims)
    if value.dim() >= 2 and any(size == 0 for size in value.shape[1:]):
        raise ValueError(f"{name} must have non-empty trailing dimensions; got shape {tuple(value.shape)}")


def _check_num_segments(num_segments) -> int:
    num_segments = integer_argument("num_segments", num_segments, "a Python int")
    if num_segments < 0:
        raise ValueError(f"num_segments must be >= 0; got {num_segments}")
    return num_segments


def _batched_error(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"{name} is batched by torch.func.vmap, which the segment operations do not support for {name}: "
        "they take one set of segments per call; vmap over the rows (and segment rows) with one "
        f"unbatched {name}, or concatenate the examples along the rows instead")


def _check_not_batched(**tensors) -> None:
    """``torch.func.vmap`` maps over rows and segment rows (the operators' vmap rules fold
    the mapped dimension into the kernels' columns), not over the segments themselves:
    a batched ``idx`` (one set of segments per example) is refused, with what to do instead."""
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return
    functorch = torch._C._functorch
    for name, value in tensors.items():
        while functorch.is_functorch_wrapped_tensor(value):
            if functorch.is_batchedtensor(value):
                raise _batched_error(name)
            value = functorch.get_unwrapped(value)


@functools.lru_cache(maxsize=None)
def _idx_checks(function: str) -> tuple:
    """The two value checks of ``function``'s ``idx``: in range, and sorted."""
    return (validation.value_check(function, "idx", "must lie in [0, num_segments)"),
            validation.value_check(function, "idx", "must be sorted in non-decreasing order"))


@operator("segment_check_idx")
def segment_check_idx_op(idx: Tensor, num_segments: int, range_code: int, order_code: int) -> Tensor:
    """The int32 ``idx`` the kernels read, clamped to ``[0, num_segments)``, with its
    values checked on the device (:func:`~.triton_kernels.idx_check_triton`)."""
    if idx.shape[0] == 0:
        return idx.new_empty((0,), dtype=torch.int32)
    return tk.idx_check_triton(idx.contiguous(), num_segments, range_code, order_code)


@segment_check_idx_op.register_fake
def _(idx, num_segments, range_code, order_code):
    return idx.new_empty(idx.shape, dtype=torch.int32)


def _check_idx_on_host(idx: Tensor, num_segments: int, function: str) -> None:
    """The value checks of a CPU ``idx`` that the padded stage computes (no kernel runs)."""
    in_range, in_order = _idx_checks(function)
    validation.raise_flags(in_range, (idx < 0) | (idx >= num_segments))
    validation.raise_flags(in_order, idx[1:] < idx[:-1], offset=1)


def _check_idx(idx, n_rows: int, num_segments: int, rows_name: str, function: str, mode: str) -> Tensor:
    """``idx``: int32 or int64, 1-D, one entry per row, sorted, each in ``[0, num_segments)``.

    Its dtype and shape are checked here, at once; its values on the device, by
    :func:`segment_check_idx_op`, which returns the int32 copy the kernels read, clamped
    to ``[0, num_segments)`` so that no value can make a kernel read or write out of
    bounds. A violation is reported as :mod:`~packed_kernels.validation` says (at once for
    CPU tensors and in strict mode; otherwise by a later call), also for traced calls.
    Tensors the kernels do not take are checked on the host (they are CPU tensors). Rows
    with no segment to belong to (``num_segments = 0``) are refused from the shapes alone.
    """
    check_index_tensor("idx", idx)
    check_rank("idx", idx, 1)
    if idx.shape[0] != n_rows:
        raise ValueError(f"idx must have one entry per row of {rows_name} ({n_rows}); got {idx.shape[0]} entries")
    if idx.dtype == torch.int64:
        if n_rows >= _INT32_LIMIT:
            raise ValueError(f"idx of int64 must have fewer than 2**31 entries (the kernels count rows in int32); "
                             f"got {n_rows}")
        if num_segments >= _INT32_LIMIT:
            raise ValueError(f"num_segments must be < 2**31 for an int64 idx (the kernels read int32 segment ids); "
                             f"got {num_segments}")
    if n_rows > 0 and num_segments == 0:
        raise ValueError(f"idx must be < num_segments (0), which no row can meet; got {n_rows} rows")
    if not runtime.on_kernel_device(idx):
        _check_idx_on_host(idx, num_segments, function)
        return idx.to(torch.int32)
    in_range, in_order = _idx_checks(function)
    checked = segment_check_idx_op.run(mode, idx, num_segments, in_range.code, in_order.code)
    if mode is not TRACED:
        validation.values_checked(idx.device)
    return checked


def _check_segments(idx, num_segments: int, rows_name: str, function: str, **tensors) -> tuple[Tensor, str]:
    """The checks every operation shares once its tensors' own are done: every argument on
    one device, ``idx`` not batched by ``vmap``, and ``idx`` indexing the rows of
    ``tensors[rows_name]``. Returns the checked int32 ``idx`` and the call's mode
    (:func:`~packed_kernels.dispatch.call_mode`), decided here once for the whole call."""
    check_tensor("idx", idx)
    check_same_device(**tensors, idx=idx)
    mode = call_mode(*tensors.values(), idx)
    if mode is not TRACED:
        _check_not_batched(idx=idx)
    return _check_idx(idx, tensors[rows_name].shape[0], num_segments, rows_name, function, mode), mode


def _promoted(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Both operands in ``torch.promote_types`` of their dtypes (bfloat16 with float32 is
    float32), as PyTorch's binary operations promote; the cast is differentiable."""
    if x.dtype == y.dtype:
        return x, y
    dtype = torch.promote_types(x.dtype, y.dtype)
    return x.to(dtype), y.to(dtype)


# --- the launch configuration, as the operators take it -------------------------------------

def config_text(config: Optional[tk.SegmentConfig]) -> Optional[str]:
    """``config`` as the operators take it: its fields as JSON text (``None`` stays ``None``)."""
    return None if config is None else json.dumps(dataclasses.asdict(config), sort_keys=True)


@functools.lru_cache(maxsize=32)
def _config(text: Optional[str]) -> Optional[tk.SegmentConfig]:
    return None if text is None else tk.SegmentConfig(**json.loads(text))


# --- the operators: sum and its adjoint, gather ---------------------------------------------

def _operator(name: str):
    return operator(f"segment_{name}")


@_operator("sum")
def segment_sum_op(x: Tensor, idx: Tensor, num_segments: int, config: Optional[str]) -> Tensor:
    """``(S,)`` for an ``(N,)`` ``x``, ``(S, D)`` for ``(N, D)``. Taking both shapes (as
    ``gather``, ``mean`` and ``gather_over_count`` do), the operator needs no reshaped
    views around it, each of which would be one more node for autograd."""
    return tk.segment_reduce_triton(x.contiguous(), None, idx, num_segments, tk.ROW_VALUE, tk.TOTAL, False,
                                    config=_config(config))[0]


@segment_sum_op.register_fake
def _(x, idx, num_segments, config):
    return x.new_empty((num_segments,) + x.shape[1:])


@_operator("gather")
def segment_gather_op(b: Tensor, idx: Tensor, config: Optional[str]) -> Tensor:
    return tk.segment_rowwise_triton(tk.GATHER, None, b.contiguous(), idx, config=_config(config))


@segment_gather_op.register_fake
def _(b, idx, config):
    return b.new_empty((idx.shape[0],) + b.shape[1:])


def _save_idx_and_segments(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.num_segments = inputs[0].shape[0]
    ctx.config = inputs[-1]


def _save_idx(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.config = inputs[-1]


def _sum_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    return segment_gather_op.within(ctx)(grad, idx, ctx.config), None, None, None


def _gather_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    return segment_sum_op.within(ctx)(grad, idx, ctx.num_segments, ctx.config), None, None


segment_sum_op.register_autograd(_sum_backward, setup_context=_save_idx)
segment_gather_op.register_autograd(_gather_backward, setup_context=_save_idx_and_segments)


# --- mean and its adjoint, gather_over_count ------------------------------------------------

def needs_counts(x: Tensor) -> bool:
    """Whether autograd will need the row counts of a ``mean`` of ``x`` (its backward
    divides by them). Without a gradient the forward skips writing them; a backward that
    finds them missing counts the rows itself, so this choice only saves work."""
    return torch.is_grad_enabled() and x.requires_grad


@_operator("mean")
def segment_mean_op(x: Tensor, idx: Tensor, num_segments: int, with_counts: bool,
                    config: Optional[str]) -> tuple[Tensor, Tensor]:
    """``(mean, counts)``; ``counts`` (what the gradient needs) is empty unless ``with_counts``."""
    mean, counts = tk.segment_reduce_triton(x.contiguous(), None, idx, num_segments, tk.ROW_VALUE,
                                            tk.DIVIDE_BY_COUNT, with_counts, config=_config(config))
    return mean, idx.new_empty((0,)) if counts is None else counts


@segment_mean_op.register_fake
def _(x, idx, num_segments, with_counts, config):
    return x.new_empty((num_segments,) + x.shape[1:]), idx.new_empty((num_segments if with_counts else 0,))


@_operator("gather_over_count")
def segment_gather_over_count_op(b: Tensor, idx: Tensor, counts: Tensor, config: Optional[str]) -> Tensor:
    return tk.segment_rowwise_triton(tk.GATHER_OVER_COUNT, None, b.contiguous(), idx, counts=counts,
                                     config=_config(config))


@segment_gather_over_count_op.register_fake
def _(b, idx, counts, config):
    return b.new_empty((idx.shape[0],) + b.shape[1:])


def _mean_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(inputs[1], output[1])
    ctx.config = inputs[-1]


def _mean_backward(ctx, grad, _grad_counts):
    idx, counts = ctx.saved_tensors
    if counts.shape[0] != grad.shape[0]:
        # The forward skipped the counts (autograd looked unneeded: a call without
        # with_counts, as a tracer or opcheck may make): count the rows now.
        rows = grad.new_zeros((idx.shape[0], 1))
        counts = segment_mean_op.within(ctx)(rows, idx, grad.shape[0], True, ctx.config)[1]
    return segment_gather_over_count_op.within(ctx)(grad, idx, counts, ctx.config), None, None, None, None


def _gather_over_count_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    mean = segment_mean_op.within(ctx)(grad, idx, ctx.num_segments, needs_counts(grad), ctx.config)[0]
    return mean, None, None, None


segment_mean_op.register_autograd(_mean_backward, setup_context=_mean_setup)
segment_gather_over_count_op.register_autograd(_gather_over_count_backward, setup_context=_save_idx_and_segments)


# --- dot and scale_rows (mul) ----------------------------------------------------------------

@_operator("dot")
def segment_dot_op(a: Tensor, b: Tensor, idx: Tensor, num_segments: int, rowwise: bool,
                   config: Optional[str]) -> Tensor:
    prologue = tk.ROW_DOT if rowwise else tk.ROW_PRODUCT
    return tk.segment_reduce_triton(a.contiguous(), b.contiguous(), idx, num_segments, prologue, tk.TOTAL, False,
                                    config=_config(config))[0]


@segment_dot_op.register_fake
def _(a, b, idx, num_segments, rowwise, config):
    return a.new_empty((num_segments, 1 if rowwise else a.shape[1]))


@_operator("scale_rows")
def segment_scale_rows_op(a: Tensor, b: Tensor, idx: Tensor, config: Optional[str]) -> Tensor:
    return tk.segment_rowwise_triton(tk.SCALE_ROWS, a.contiguous(), b.contiguous(), idx, config=_config(config))


@segment_scale_rows_op.register_fake
def _(a, b, idx, config):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _save_two_and_idx(ctx, inputs, output):
    """Setup of ``dot``, ``scale_rows`` and ``outer``: the two operands and ``idx``."""
    a, b, idx = inputs[:3]
    ctx.save_for_backward(a, b, idx)
    ctx.config = inputs[-1]


def _dot_backward(ctx, grad):
    a, b, idx = ctx.saved_tensors
    scale_rows = segment_scale_rows_op.within(ctx)
    grad_a = scale_rows(b, grad, idx, ctx.config) if ctx.needs_input_grad[0] else None
    grad_b = scale_rows(a, grad, idx, ctx.config) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None, None, None


def _scale_rows_backward(ctx, grad):
    a, b, idx = ctx.saved_tensors
    grad_a = segment_scale_rows_op.within(ctx)(grad, b, idx, ctx.config) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.needs_input_grad[1]:
        # A one-column b is broadcast over the row: its gradient sums the row's products.
        grad_b = segment_dot_op.within(ctx)(grad, a, idx, b.shape[0], b.shape[1] == 1 and a.shape[1] != 1,
                                            ctx.config)
    return grad_a, grad_b, None, None


segment_dot_op.register_autograd(_dot_backward, setup_context=_save_two_and_idx)
segment_scale_rows_op.register_autograd(_scale_rows_backward, setup_context=_save_two_and_idx)


# --- rms_norm ----------------------------------------------------------------------------

@_operator("rms")
def segment_rms_op(x: Tensor, idx: Tensor, num_segments: int, config: Optional[str]) -> tuple[Tensor, Tensor]:
    return tk.segment_reduce_triton(x.contiguous(), None, idx, num_segments, tk.ROW_SQUARED_NORM, tk.SQRT_OF_MEAN,
                                    True, config=_config(config))


@segment_rms_op.register_fake
def _(x, idx, num_segments, config):
    return x.new_empty((num_segments, 1)), idx.new_empty((num_segments,))


@_operator("rms_backward")
def segment_rms_backward_op(g: Tensor, x: Tensor, r: Tensor, counts: Tensor, idx: Tensor,
                            config: Optional[str]) -> Tensor:
    return tk.segment_rowwise_triton(tk.RMS_BACKWARD, x.contiguous(), g.contiguous(), idx, counts=counts,
                                     r=r.contiguous(), config=_config(config))


@segment_rms_backward_op.register_fake
def _(g, x, r, counts, idx, config):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_operator("rms_double_backward")
def segment_rms_double_backward_op(p: Tensor, g: Tensor, r: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    return tk.rms_norm_double_backward_triton(p.contiguous(), g.contiguous(), r.contiguous(), counts)


@segment_rms_double_backward_op.register_fake
def _(p, g, r, counts):
    return torch.empty_like(g, memory_format=torch.contiguous_format), torch.empty_like(r, memory_format=torch.contiguous_format)


def _rms_setup(ctx, inputs, output):
    x, idx, _, config = inputs
    r, counts = output
    ctx.mark_non_differentiable(counts)
    ctx.save_for_backward(x, idx, r, counts)
    ctx.config = config


def _rms_backward(ctx, grad, _grad_counts):
    x, idx, r, counts = ctx.saved_tensors
    return segment_rms_backward_op.within(ctx)(grad, x, r, counts, idx, ctx.config), None, None, None


def _rms_backward_setup(ctx, inputs, output):
    g, x, r, counts, idx, config = inputs
    ctx.save_for_backward(g, x, r, counts, idx)
    ctx.config = config


def _rms_backward_backward(ctx, grad):
    g, x, r, counts, idx = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[1]:
        grad_x = segment_rms_backward_op.within(ctx)(g, grad, r, counts, idx, ctx.config)
    grad_g = grad_r = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
        p = segment_dot_op.within(ctx)(grad, x, idx, g.shape[0], True, ctx.config)
        grad_g, grad_r = segment_rms_double_backward_op.within(ctx)(p, g, r, counts)
    return grad_g, grad_x, grad_r, None, None, None


segment_rms_op.register_autograd(_rms_backward, setup_context=_rms_setup)
segment_rms_backward_op.register_autograd(_rms_backward_backward, setup_context=_rms_backward_setup)


# --- matvec and its companion, outer ----------------------------------------------------

@_operator("matvec")
def segment_matvec_op(v: Tensor, m: Tensor, idx: Tensor, transpose: bool, config: Optional[str]) -> Tensor:
    return tk.segment_matvec_triton(v.contiguous(), m.contiguous(), idx, transpose, config=_config(config))


@segment_matvec_op.register_fake
def _(v, m, idx, transpose, config):
    return v.new_empty((v.shape[0], m.shape[1] if transpose else m.shape[2]))


@_operator("outer")
def segment_outer_op(a: Tensor, b: Tensor, idx: Tensor, num_segments: int, config: Optional[str]) -> Tensor:
    flat, _ = tk.segment_reduce_triton(a.contiguous(), b.contiguous(), idx, num_segments, tk.ROW_OUTER, tk.TOTAL,
                                       False, K=b.shape[1], config=_config(config))
    return flat.view(num_segments, a.shape[1], b.shape[1])


@segment_outer_op.register_fake
def _(a, b, idx, num_segments, config):
    return a.new_empty((num_segments, a.shape[1], b.shape[1]))


def _matvec_setup(ctx, inputs, output):
    v, m, idx, transpose, config = inputs
    ctx.transpose = transpose
    ctx.save_for_backward(v, m, idx)
    ctx.config = config


def _matvec_backward(ctx, grad):
    v, m, idx = ctx.saved_tensors
    grad_v = None
    if ctx.needs_input_grad[0]:
        grad_v = segment_matvec_op.within(ctx)(grad, m, idx, not ctx.transpose, ctx.config)
    grad_m = None
    if ctx.needs_input_grad[1]:
        # out = m^T v: dm = sum v g^T;  out = m v: dm = sum g v^T.
        outer = segment_outer_op.within(ctx)
        grad_m = (outer(grad, v, idx, m.shape[0], ctx.config) if ctx.transpose
                  else outer(v, grad, idx, m.shape[0], ctx.config))
    return grad_v, grad_m, None, None, None


def _outer_backward(ctx, grad):
    a, b, idx = ctx.saved_tensors
    matvec = segment_matvec_op.within(ctx)
    grad_a = matvec(b, grad, idx, True, ctx.config) if ctx.needs_input_grad[0] else None
    grad_b = matvec(a, grad, idx, False, ctx.config) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None, None


segment_matvec_op.register_autograd(_matvec_backward, setup_context=_matvec_setup)
segment_outer_op.register_autograd(_outer_backward, setup_context=_save_two_and_idx)


# --- torch.func: vmap rules -------------------------------------------------------------------
# Each rule runs one level below the vmap, on the tensors without the mapped level, and
# calls the operators as usual (``op(...)``), so that the transforms below it (grad,
# jvp) and plain autograd see them. A mapped dimension of size B folds into the one
# launch of the kernel:
#
# * into the columns, where the operator's maths is column by column: ``(B, R, C)``
#   becomes ``(R, B*C)`` (an unbatched operand is expanded first), the kernel runs on
#   that and its ``(R', B*C')`` output is viewed as ``(R', B, C')`` (``out_dims`` 1);
# * into the rows, where a per-segment scalar mixes the columns (``rms`` and its
#   backwards, ``matvec`` and ``outer`` with both operands batched): example ``b``'s rows
#   follow example ``b - 1``'s, in segments ``b * S + s`` (``B * S`` segments; ``counts``
#   repeated), and the output is viewed as ``(B, S', ...)`` (``out_dims`` 0);
# * ``matvec`` with only ``v`` batched interleaves the rows, each row ``B`` times in a row
#   with its own segment (``idx`` repeated), which keeps one matrix per segment.
#
# ``idx`` and ``counts`` batched (segments that differ by example) are refused. Where the
# rows fold would need ``2**31`` or more rows or segments (int32 ids), the rule loops
# over the mapped dimension instead (one call per example, stacked).

#: Row and segment counts from which a fold into the rows loops instead (int32 ids).
_FOLD_LIMIT = _INT32_LIMIT


def _refuse_batched(in_dims, **positions) -> None:
    """A batched ``idx`` or ``counts``: segments that differ by example, which the kernels
    do not take (one set of segments per launch)."""
    for name, position in positions.items():
        if in_dims[position] is not None:
            raise _batched_error(name)


def _example_shape(t: Tensor, dim) -> tuple:
    """``t``'s shape as each example sees it (without the mapped dimension)."""
    shape = list(t.shape)
    if dim is not None:
        del shape[dim]
    return tuple(shape)


def _examples(t: Tensor, dim, batch: int) -> Tensor:
    """``(B, ...)``: the mapped dimension first; an unbatched ``t`` expanded (no copy)."""
    return t.expand(batch, *t.shape) if dim is None else t.movedim(dim, 0)


def _columns(t: Tensor, dim, batch: int) -> Tensor:
    """``(R, B*C)`` (``(R, B)`` for ``(R,)`` examples): the mapped dimension next to the
    columns, folded into them; an unbatched ``t`` expanded first."""
    t = t.unsqueeze(1).expand(t.shape[0], batch, *t.shape[1:]) if dim is None else t.movedim(dim, 1)
    return t.flatten(1)


def _rows(t: Tensor, dim, batch: int) -> Tensor:
    """``(B*R, ...)``: the examples one after another along the rows."""
    return _examples(t, dim, batch).flatten(0, 1)


def _block_idx(idx: Tensor, batch: int, num_segments: int) -> Tensor:
    """The segment of each row of :func:`_rows`: example ``b``'s row ``i`` in ``b * S + idx[i]``
    (sorted, as ``idx``)."""
    offsets = torch.arange(batch, dtype=idx.dtype, device=idx.device) * num_segments
    return (idx.unsqueeze(0) + offsets.unsqueeze(1)).reshape(-1)


def _rows_fit(batch: int, *counts: int) -> bool:
    return all(batch * count < _FOLD_LIMIT for count in counts)


def _loop(op, info, in_dims, args, unbatched=()):
    """The fallback: ``op`` once per example, its outputs stacked (``out_dims`` 0); the
    outputs at positions ``unbatched`` (``counts``) are the same for every example."""
    results = [op(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims)))
               for b in range(info.batch_size)]
    if not isinstance(results[0], tuple):
        return torch.stack(results), 0
    outputs = tuple(results[0][k] if k in unbatched else torch.stack([r[k] for r in results])
                    for k in range(len(results[0])))
    return outputs, tuple(None if k in unbatched else 0 for k in range(len(outputs)))


@segment_check_idx_op.register_vmap
def _check_idx_vmap(info, in_dims, idx, num_segments, range_code, order_code):
    raise _batched_error("idx")


@segment_sum_op.register_vmap
def _sum_vmap(info, in_dims, x, idx, num_segments, config):
    _refuse_batched(in_dims, idx=1)
    B, shape = info.batch_size, _example_shape(x, in_dims[0])
    out = segment_sum_op(_columns(x, in_dims[0], B), idx, num_segments, config)
    return out.reshape(num_segments, B, *shape[1:]), 1


@segment_gather_op.register_vmap
def _gather_vmap(info, in_dims, b, idx, config):
    _refuse_batched(in_dims, idx=1)
    B, shape = info.batch_size, _example_shape(b, in_dims[0])
    out = segment_gather_op(_columns(b, in_dims[0], B), idx, config)
    return out.reshape(idx.shape[0], B, *shape[1:]), 1


@segment_mean_op.register_vmap
def _mean_vmap(info, in_dims, x, idx, num_segments, with_counts, config):
    _refuse_batched(in_dims, idx=1)
    B, shape = info.batch_size, _example_shape(x, in_dims[0])
    mean, counts = segment_mean_op(_columns(x, in_dims[0], B), idx, num_segments, with_counts, config)
    return (mean.reshape(num_segments, B, *shape[1:]), counts), (1, None)


@segment_gather_over_count_op.register_vmap
def _gather_over_count_vmap(info, in_dims, b, idx, counts, config):
    _refuse_batched(in_dims, idx=1, counts=2)
    B, shape = info.batch_size, _example_shape(b, in_dims[0])
    out = segment_gather_over_count_op(_columns(b, in_dims[0], B), idx, counts, config)
    return out.reshape(idx.shape[0], B, *shape[1:]), 1


@segment_dot_op.register_vmap
def _dot_vmap(info, in_dims, a, b, idx, num_segments, rowwise, config):
    # column by column (rowwise=False) on the folded operands; a rowwise dot then sums
    # each example's columns
    _refuse_batched(in_dims, idx=2)
    B, shape = info.batch_size, _example_shape(a, in_dims[0])
    out = segment_dot_op(_columns(a, in_dims[0], B), _columns(b, in_dims[1], B), idx, num_segments, False, config)
    out = out.reshape(num_segments, B, *shape[1:])
    return (out.sum(-1, keepdim=True) if rowwise else out), 1


@segment_scale_rows_op.register_vmap
def _scale_rows_vmap(info, in_dims, a, b, idx, config):
    _refuse_batched(in_dims, idx=2)
    B, shape = info.batch_size, _example_shape(a, in_dims[0])
    b_shape = _example_shape(b, in_dims[1])
    if b_shape[1:] == (1,) and shape[1:] != (1,) and in_dims[1] is not None:
        # one factor per segment and example, for every column of that example's rows
        b = b.movedim(in_dims[1], 1).expand(b_shape[0], B, *shape[1:]).flatten(1)
    elif not (b_shape[1:] == (1,) and shape[1:] != (1,)):
        b = _columns(b, in_dims[1], B)
    # else an unbatched (S, 1) b: one factor per segment, for all B*C columns as it is
    out = segment_scale_rows_op(_columns(a, in_dims[0], B), b, idx, config)
    return out.reshape(shape[0], B, *shape[1:]), 1


@segment_rms_op.register_vmap
def _rms_vmap(info, in_dims, x, idx, num_segments, config):
    # the sum of squares mixes the columns: the examples fold into the rows
    _refuse_batched(in_dims, idx=1)
    B, n_rows = info.batch_size, _example_shape(x, in_dims[0])[0]
    if not _rows_fit(B, n_rows, num_segments):
        return _loop(segment_rms_op, info, in_dims, (x, idx, num_segments, config), unbatched=(1,))
    r, counts = segment_rms_op(_rows(x, in_dims[0], B), _block_idx(idx, B, num_segments), B * num_segments, config)
    return (r.reshape(B, num_segments, *r.shape[1:]), counts[:num_segments]), (0, None)


@segment_rms_backward_op.register_vmap
def _rms_backward_vmap(info, in_dims, g, x, r, counts, idx, config):
    _refuse_batched(in_dims, counts=3, idx=4)
    g_dim, x_dim, r_dim = in_dims[:3]
    B, shape = info.batch_size, _example_shape(x, x_dim)
    if g_dim is None and r_dim is None:
        # one weight g_s / (n_s r_s) per segment for every example: the columns fold
        out = segment_rms_backward_op(g, _columns(x, x_dim, B), r, counts, idx, config)
        return out.reshape(shape[0], B, *shape[1:]), 1
    S = counts.shape[0]
    if not _rows_fit(B, shape[0], S):
        return _loop(segment_rms_backward_op, info, in_dims, (g, x, r, counts, idx, config))
    out = segment_rms_backward_op(_rows(g, g_dim, B), _rows(x, x_dim, B), _rows(r, r_dim, B), counts.repeat(B),
                                  _block_idx(idx, B, S), config)
    return out.reshape(B, *shape), 0


@segment_rms_double_backward_op.register_vmap
def _rms_double_backward_vmap(info, in_dims, p, g, r, counts):
    # per segment: the examples' segments one after another, counts repeated
    _refuse_batched(in_dims, counts=3)
    B, S = info.batch_size, counts.shape[0]
    if not _rows_fit(B, S):
        return _loop(segment_rms_double_backward_op, info, in_dims, (p, g, r, counts))
    grad_g, grad_r = segment_rms_double_backward_op(_rows(p, in_dims[0], B), _rows(g, in_dims[1], B),
                                                    _rows(r, in_dims[2], B), counts.repeat(B))
    grad_g = grad_g.reshape(B, *_example_shape(g, in_dims[1]))
    return (grad_g, grad_r.reshape(B, *_example_shape(r, in_dims[2]))), (0, 0)


@segment_matvec_op.register_vmap
def _matvec_vmap(info, in_dims, v, m, idx, transpose, config):
    _refuse_batched(in_dims, idx=2)
    v_dim, m_dim = in_dims[:2]
    B, n_rows = info.batch_size, _example_shape(v, v_dim)[0]
    S, D, K = _example_shape(m, m_dim)
    n_out = D if transpose else K
    if v_dim is None:
        # the examples' matrices side by side along the output dimension:
        # (S, D, B*K) for m^T v, (S, B*D, K) for m v
        m = m.movedim(m_dim, 1).flatten(1, 2) if transpose else m.movedim(m_dim, 2).flatten(2, 3)
        return segment_matvec_op(v, m, idx, transpose, config).reshape(n_rows, B, n_out), 1
    if not _rows_fit(B, n_rows, S):
        return _loop(segment_matvec_op, info, in_dims, (v, m, idx, transpose, config))
    if m_dim is None:
        # each row B times in a row, with its own segment's matrix
        out = segment_matvec_op(v.movedim(v_dim, 1).flatten(0, 1), m, idx.repeat_interleave(B), transpose, config)
        return out.reshape(n_rows, B, n_out), 1
    out = segment_matvec_op(_rows(v, v_dim, B), _rows(m, m_dim, B), _block_idx(idx, B, S), transpose, config)
    return out.reshape(B, n_rows, n_out), 0


@segment_outer_op.register_vmap
def _outer_vmap(info, in_dims, a, b, idx, num_segments, config):
    _refuse_batched(in_dims, idx=2)
    a_dim, b_dim = in_dims[:2]
    B = info.batch_size
    (n_rows, Da), (_, Db) = _example_shape(a, a_dim), _example_shape(b, b_dim)
    if b_dim is None:
        out = segment_outer_op(_columns(a, a_dim, B), b, idx, num_segments, config)
        return out.reshape(num_segments, B, Da, Db), 1
    if a_dim is None:
        out = segment_outer_op(a, _columns(b, b_dim, B), idx, num_segments, config)
        return out.reshape(num_segments, Da, B, Db), 2
    if not _rows_fit(B, n_rows, num_segments):
        return _loop(segment_outer_op, info, in_dims, (a, b, idx, num_segments, config))
    out = segment_outer_op(_rows(a, a_dim, B), _rows(b, b_dim, B), _block_idx(idx, B, num_segments),
                           B * num_segments, config)
    return out.reshape(B, num_segments, Da, Db), 0


# --- torch.func: forward-mode rules (jvp, jacfwd, hessian) ------------------------------------
# Every operator but rms is linear in each operand, so its tangent is the operator again
# on the tangents; each rule calls operators, so that it is differentiable and vmappable.

def _add(*terms):
    terms = [t for t in terms if t is not None]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _bilinear_jvp(op, first: int = 0, second: int = 1):
    """The tangent of an operator linear in its arguments ``first`` and ``second``."""
    def jvp(inputs, output, *tangents):
        t_a, t_b = tangents[first], tangents[second]
        with_a = None if t_a is None else op(*inputs[:first], t_a, *inputs[first + 1:])
        with_b = None if t_b is None else op(*inputs[:second], t_b, *inputs[second + 1:])
        return _add(with_a, with_b)
    return jvp


def _linear_jvp(op):
    def jvp(inputs, output, tangent, *_):
        return op(tangent, *inputs[1:])
    return jvp


segment_sum_op.register_jvp(_linear_jvp(segment_sum_op))
segment_gather_op.register_jvp(_linear_jvp(segment_gather_op))
segment_gather_over_count_op.register_jvp(_linear_jvp(segment_gather_over_count_op))
segment_dot_op.register_jvp(_bilinear_jvp(segment_dot_op))
segment_scale_rows_op.register_jvp(_bilinear_jvp(segment_scale_rows_op))
segment_matvec_op.register_jvp(_bilinear_jvp(segment_matvec_op))
segment_outer_op.register_jvp(_bilinear_jvp(segment_outer_op))


@segment_mean_op.register_jvp
def _mean_jvp(inputs, output, t_x, *_):
    x, idx, num_segments, _, config = inputs
    return segment_mean_op(t_x, idx, num_segments, needs_counts(t_x), config)[0], None


@segment_rms_op.register_jvp
def _rms_jvp(inputs, output, t_x, *_):
    # dr_s = sum_{i in s} t_i . x_i / (n_s r_s): rms_backward of a unit g gives the
    # weighted rows x_i / (n_s r_s) (0 where r_s = 0), and a rowwise dot sums them with t
    x, idx, num_segments, config = inputs
    r, counts = output
    weighted = segment_rms_backward_op(torch.ones_like(r), x, r, counts, idx, config)
    return segment_dot_op(t_x, weighted, idx, num_segments, True, config), None


@segment_rms_backward_op.register_jvp
def _rms_backward_jvp(inputs, output, t_g, t_x, t_r, *_):
    # out_i = x_i g_s / (n_s r_s): linear in g and x; d/dr_s = x_i (-g_s / r_s) / (n_s r_s)
    g, x, r, counts, idx, config = inputs
    terms = [None if t_g is None else segment_rms_backward_op(t_g, x, r, counts, idx, config),
             None if t_x is None else segment_rms_backward_op(g, t_x, r, counts, idx, config)]
    if t_r is not None:
        safe_r = torch.where(r > 0, r, torch.ones_like(r))
        terms.append(segment_rms_backward_op(-g * t_r / safe_r, x, r, counts, idx, config))
    return _add(*terms)


# --- the operations without the argument checks ---------------------------------------------
# What runs inside torch.compile and CUDA graphs, where the host-reading checks are
# skipped; the benchmark times these, and a test passes them a small ``config``.

def _as_rows(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], 1) if x.dim() == 1 else x


def _index(idx: Tensor) -> Tensor:
    # the kernels read idx as a dense int32 array (a strided view is copied once)
    return idx.contiguous()


def _run_operator(op, mode, *args):
    """``op`` in the call's ``mode``, or deciding its own (``None``: the unchecked calls)."""
    return op(*args) if mode is None else op.run(mode, *args)


def _sum(x, idx, num_segments, config=None, mode=None):
    return _run_operator(segment_sum_op, mode, x, _index(idx), num_segments, config_text(config))


def _mean(x, idx, num_segments, config=None, mode=None):
    return _run_operator(segment_mean_op, mode, x, _index(idx), num_segments, needs_counts(x),
                         config_text(config))[0]


def _dot(x, y, idx, num_segments, config=None, mode=None):
    out = _run_operator(segment_dot_op, mode, _as_rows(x), _as_rows(y), _index(idx), num_segments, True,
                        config_text(config))
    return out.reshape(num_segments)


def _mul(x, y, idx, num_segments, config=None, mode=None):
    return _run_operator(segment_scale_rows_op, mode, _as_rows(x), _as_rows(y), _index(idx),
                         config_text(config)).reshape(x.shape)


def _rms_norm(x, idx, num_segments, config=None, mode=None):
    r, _ = _run_operator(segment_rms_op, mode, _as_rows(x), _index(idx), num_segments, config_text(config))
    return r.reshape(num_segments)


def _matvec(v, m, idx, num_segments, config=None, mode=None):
    return _run_operator(segment_matvec_op, mode, v, m, _index(idx), False, config_text(config))


#: The six operations without the argument checks, by name; each also takes ``config``
#: (a :class:`~.triton_kernels.SegmentConfig`, ``None``: the default) and ``mode``
#: (:func:`~packed_kernels.dispatch.call_mode`; ``None``: each operator decides).
UNCHECKED = {"sum": _sum, "mean": _mean, "dot": _dot, "mul": _mul, "rms_norm": _rms_norm, "matvec": _matvec}


# --- the public functions ---------------------------------------------------------------------

def _padded_stage(stage, *tensors, idx: Tensor, num_segments: int) -> Tensor:
    """``stage`` (a function of :mod:`.padded_torch`) for tensors the kernels do not take:
    the same result and dtype as the kernels (float16 and bfloat16 computed in float32),
    differentiable to any order by autograd, and, as the kernels, left alone by autocast."""
    dtype = tensors[0].dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    device_type = tensors[0].device.type
    with runtime.without_autocast(device_type):
        return stage(*(t.to(compute) for t in tensors), idx, num_segments).to(dtype)


#: The padded stage of each operation, for :func:`_run`.
_PADDED_STAGES = {
    "sum": padded_torch.segmented_sum_padded, "mean": padded_torch.segmented_mean_padded,
    "dot": padded_torch.segmented_dot_padded, "mul": padded_torch.segmented_mul_padded,
    "rms_norm": padded_torch.segmented_rms_norm_padded, "matvec": padded_torch.segmented_matvec_padded,
}


def _run(operation: str, *tensors, idx: Tensor, num_segments: int, mode: str) -> Tensor:
    """The checked ``operation`` on the kernels, in the call's ``mode``, or on the padded
    stage for tensors the kernels do not take."""
    if runtime.on_kernel_device(tensors[0]):
        return UNCHECKED[operation](*tensors, idx, num_segments, None, mode)
    return _padded_stage(_PADDED_STAGES[operation], *tensors, idx=idx, num_segments=num_segments)


def _one_input(operation: str, x, idx, num_segments) -> Tensor:
    """``sum``, ``mean`` and ``rms_norm``: their checks, then :func:`_run`."""
    validation.raise_reported()
    num_segments = _check_num_segments(num_segments)
    _check_rows("x", x, (1, 2))
    idx, mode = _check_segments(idx, num_segments, "x", f"segmented_{operation}", x=x)
    return _run(operation, x, idx=idx, num_segments=num_segments, mode=mode)


def segmented_sum(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """Per-segment sum: ``out[s] = sum_{i: idx[i] = s} x[i]``.

    Args:
        x: ``(N,)`` or ``(N, D)``; float16, bfloat16, float32 or float64.
        idx: int32 or int64 ``(N,)``, sorted, in ``[0, num_segments)``: the segment of
            each row (:func:`~packed_kernels.segment_ids_from_lengths` builds it from
            segment lengths). An int64 ``idx`` is converted to int32 once (``N`` and
            ``num_segments`` must then be below ``2**31``).
        num_segments: ``S``; segments without rows give 0.

    Returns:
        ``(S,)`` for ``(N,)`` input, ``(S, D)`` for ``(N, D)``; ``x``'s dtype.

    As all six segment operations: differentiable twice, ``torch.func`` included
    (``grad``, ``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``, to second order; under
    ``vmap`` one launch per operator for the whole batch, the mapped dimension folded into
    the kernel's columns, and ``idx`` shared by every example, never batched itself);
    on ``meta`` tensors and under ``FakeTensorMode``, the output's shape and dtype
    without a kernel; ``torch.autocast`` leaves it alone, as it leaves ``index_add``
    (it computes in the input's dtype); CPU tensors on a machine whose kernels are
    compiled for a GPU are computed by the padded PyTorch stage, with the same results,
    dtypes and gradients.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> idx = pk.segment_ids_from_lengths([2, 0, 3])  # rows 0-1, none, rows 2-4
        >>> pk.segmented_sum(torch.arange(5.0), idx, 3)
        tensor([1., 0., 9.])
    """
    return _one_input("sum", x, idx, num_segments)


def segmented_mean(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """Per-segment mean: ``out[s] = sum_{i in s} x[i] / n_s`` (0 for an empty segment).

    Arguments and shapes as :func:`segmented_sum`: ``(S,)`` or ``(S, D)``.

    Autograd, ``torch.func`` (``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``, to second
    order), meta tensors, autocast and CPU tensors: as :func:`segmented_sum`.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> idx = torch.tensor([0, 0, 2, 2, 2])  # int64, as repeat_interleave gives it
        >>> pk.segmented_mean(torch.arange(5.0), idx, 3)
        tensor([0.5000, 0.0000, 3.0000])
    """
    return _one_input("mean", x, idx, num_segments)


def segmented_dot(x: Tensor, y: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """Per-segment sum of row dot products: ``out[s] = sum_{i in s} <x[i], y[i]>``.

    Args:
        x, y: both ``(N,)`` or both ``(N, D)``. Of two dtypes, both are promoted to
            ``torch.promote_types`` of them (bfloat16 with float32 computes in float32).
        idx, num_segments: as :func:`segmented_sum`.

    Returns:
        ``(S,)``, in the promoted dtype.

    Autograd, ``torch.func`` (``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``, to second
    order; under ``vmap`` the folded rows' products are summed per column in one
    launch, then each example's columns), meta tensors, autocast and CPU tensors: as
    :func:`segmented_sum`.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> pk.segmented_dot(x, x, pk.segment_ids_from_lengths([2, 1]), 2)
        tensor([30., 61.])
    """
    validation.raise_reported()
    num_segments = _check_num_segments(num_segments)
    _check_rows("x", x, (1, 2))
    _check_rows("y", y, (1, 2))
    if y.shape != x.shape:
        raise ValueError(f"y must have the shape of x {tuple(x.shape)}; got {tuple(y.shape)}")
    idx, mode = _check_segments(idx, num_segments, "x", "segmented_dot", x=x, y=y)
    return _run("dot", *_promoted(x, y), idx=idx, num_segments=num_segments, mode=mode)


def segmented_mul(x: Tensor, y: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """Scale each row by its segment's row of ``y``: ``out[i] = x[i] * y[idx[i]]``.

    Args:
        x: ``(N,)`` or ``(N, D)``.
        y: ``(S,) + x.shape[1:]`` (elementwise), or ``(S,)`` with a 2-D ``x`` (one
            factor per segment, broadcast over the row). Of two dtypes, both are
            promoted to ``torch.promote_types`` of them.
        idx, num_segments: as :func:`segmented_sum`.

    Returns:
        ``x``'s shape, in the promoted dtype.

    Autograd, ``torch.func`` (``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``, to second
    order), meta tensors, autocast and CPU tensors: as :func:`segmented_sum`.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> scale = torch.tensor([10.0, -1.0])  # one factor per segment
        >>> pk.segmented_mul(torch.ones(3, 2), scale, pk.segment_ids_from_lengths([1, 2]), 2)
        tensor([[10., 10.],
                [-1., -1.],
                [-1., -1.]])
    """
    validation.raise_reported()
    num_segments = _check_num_segments(num_segments)
    _check_rows("x", x, (1, 2))
    _check_rows("y", y, (1, 2))
    if y.shape[0] != num_segments:
        raise ValueError(f"y must have num_segments ({num_segments}) rows; got shape {tuple(y.shape)}")
    if y.shape[1:] != x.shape[1:] and y.dim() != 1:
        raise ValueError(f"y must have shape {(num_segments,) + tuple(x.shape[1:])} or ({num_segments},); "
                         f"got {tuple(y.shape)}")
    idx, mode = _check_segments(idx, num_segments, "x", "segmented_mul", x=x, y=y)
    return _run("mul", *_promoted(x, y), idx=idx, num_segments=num_segments, mode=mode)


def segmented_rms_norm(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """Per-segment root mean square of the rows' norms: ``r[s] = sqrt(sum_{i in s} |x[i]|^2 / n_s)``.

    An empty segment, or one whose rows are all zero, gives 0 with a zero gradient
    (the true gradient at 0 is undefined). Arguments as :func:`segmented_sum`.

    The squares are summed as they are, without rescaling: float16, bfloat16 and float32
    rows (summed in float32) whose squared norms pass float32's largest value, about
    ``3.4e38`` (entries of about ``1.8e19`` and up), give ``inf``, where a float64
    reference gives a finite RMS. Pass such rows in float64 (finite up to about
    ``1e154``).

    Returns:
        ``(S,)``; ``x``'s dtype.

    Autograd, ``torch.func`` (``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``, to second
    order; under ``vmap`` the examples fold into the rows, each in segments of its own,
    one launch per operator), meta tensors, autocast and CPU tensors: as
    :func:`segmented_sum`.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 1.0]])  # norms 5, 0, sqrt(2)
        >>> pk.segmented_rms_norm(x, pk.segment_ids_from_lengths([2, 1]), 2)  # sqrt(25 / 2), sqrt(2)
        tensor([3.5355, 1.4142])
    """
    return _one_input("rms_norm", x, idx, num_segments)


def segmented_matvec(v: Tensor, m: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """Multiply each row by its segment's transposed matrix: ``out[i] = m[idx[i]]^T @ v[i]``.

    Args:
        v: ``(N, D)`` (``D = 3`` for positions and forces).
        m: ``(S, D, K)`` (``(S, 3, 3)`` for a cell or a rotation per molecule). Of two
            dtypes, both are promoted to ``torch.promote_types`` of them.
        idx, num_segments: as :func:`segmented_sum`.

    Returns:
        ``(N, K)``, in the promoted dtype; ``out[i, k] = sum_j m[idx[i], j, k] v[i, j]``.

    Autograd, ``torch.func`` (``vmap``, ``jacrev``, ``jacfwd`` and ``hessian``, to second
    order; under ``vmap`` one launch per operator: a batched ``m`` folds into its output
    columns, a batched ``v`` into the rows), meta tensors, autocast and CPU tensors: as
    :func:`segmented_sum`.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
        >>> m = torch.stack([torch.eye(2), swap])  # one matrix per segment
        >>> v = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
        >>> pk.segmented_matvec(v, m, pk.segment_ids_from_lengths([1, 1]), 2)
        tensor([[1., 2.],
                [2., 1.]])
    """
    validation.raise_reported()
    num_segments = _check_num_segments(num_segments)
    _check_rows("v", v, (2,))
    _check_rows("m", m, (3,))
    if m.shape[0] != num_segments:
        raise ValueError(f"m must have num_segments ({num_segments}) matrices; got shape {tuple(m.shape)}")
    if m.shape[1] != v.shape[1]:
        raise ValueError(f"m must have shape ({num_segments}, {v.shape[1]}, K) to match v's {v.shape[1]} "
                         f"columns; got {tuple(m.shape)}")
    idx, mode = _check_segments(idx, num_segments, "v", "segmented_matvec", v=v, m=m)
    return _run("matvec", *_promoted(v, m), idx=idx, num_segments=num_segments, mode=mode)
