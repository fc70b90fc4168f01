"""The Triton kernels registered as ``torch.library`` custom operators, with their gradients.

Each operator takes and returns 2-D tensors (rows ``(N, C)``, segment rows ``(S, C)``)
and has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces it
without running it, and a registered autograd formula whose backward is itself made
of these operators. Differentiating twice therefore runs Triton kernels again, never
a composition of PyTorch ops:

==================  =========================================  ==================================
operator            forward                                    backward (its adjoint)
==================  =========================================  ==================================
``sum``             ``out[s] = sum_{i in s} x[i]``              ``gather``: ``dx[i] = g[s]``
``gather``          ``out[i] = b[s]``                           ``sum`` of the upstream gradient
``mean``            ``out[s] = sum_{i in s} x[i] / n_s``        ``gather_over_count``
``gather_over_count``  ``out[i] = b[s] / n_s``                  ``mean`` of the upstream gradient
``dot``             ``out[s] = sum_{i in s} a[i] * b[i]``       ``scale_rows`` (twice)
                    (summed over columns when ``rowwise``)
``scale_rows``      ``out[i] = a[i] * b[s]``                    ``scale_rows`` and ``dot``
``rms``             ``r_s = sqrt(sum_{i in s} |x_i|^2 / n_s)``  ``rms_backward``
``rms_backward``    ``dx_i = x_i g_s / (n_s r_s)``              itself, ``dot`` and a per-segment kernel
``matvec``          ``out[i] = m_s^T v_i`` (or ``m_s v_i``)     ``matvec`` (other side) and ``outer``
``outer``           ``out[s] = sum_{i in s} a_i b_i^T``         ``matvec`` (both sides)
==================  =========================================  ==================================

Here ``s = idx[i]`` and ``n_s`` is the number of rows of segment ``s``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...dispatch import operator
from . import triton_kernels as tk



def _operator(name: str):
    return operator(f"segment_{name}")


# --- sum and its adjoint, gather -------------------------------------------------------

@_operator("sum")
def segment_sum_op(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    return tk.segment_reduce(x.contiguous(), None, idx, num_segments, tk.ROW_VALUE, tk.TOTAL, False)[0]


@segment_sum_op.register_fake
def _(x, idx, num_segments):
    return x.new_empty((num_segments, x.shape[1]))


@_operator("gather")
def segment_gather_op(b: Tensor, idx: Tensor) -> Tensor:
    return tk.segment_rowwise(tk.GATHER, None, b.contiguous(), idx)


@segment_gather_op.register_fake
def _(b, idx):
    return b.new_empty((idx.shape[0], b.shape[1]))


def _save_idx_and_segments(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.num_segments = inputs[0].shape[0]


def _save_idx(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _sum_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    return segment_gather_op.within(ctx)(grad, idx), None, None


def _gather_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    return segment_sum_op.within(ctx)(grad, idx, ctx.num_segments), None


segment_sum_op.register_autograd(_sum_backward, setup_context=_save_idx)
segment_gather_op.register_autograd(_gather_backward, setup_context=_save_idx_and_segments)


# --- mean and its adjoint, gather_over_count ------------------------------------------------

def needs_counts(x: Tensor) -> bool:
    """Whether autograd will need the row counts of a ``mean`` of ``x`` (its backward
    divides by them). Without a gradient the forward skips writing them."""
    return torch.is_grad_enabled() and x.requires_grad


@_operator("mean")
def segment_mean_op(x: Tensor, idx: Tensor, num_segments: int, with_counts: bool) -> tuple[Tensor, Tensor]:
    """``(mean, counts)``; ``counts`` (what the gradient needs) is empty unless ``with_counts``."""
    return tk.segment_reduce(x.contiguous(), None, idx, num_segments, tk.ROW_VALUE, tk.DIVIDE_BY_COUNT, with_counts)


@segment_mean_op.register_fake
def _(x, idx, num_segments, with_counts):
    return x.new_empty((num_segments, x.shape[1])), idx.new_empty((num_segments if with_counts else 0,))


@_operator("gather_over_count")
def segment_gather_over_count_op(b: Tensor, idx: Tensor, counts: Tensor) -> Tensor:
    return tk.segment_rowwise(tk.GATHER_OVER_COUNT, None, b.contiguous(), idx, counts=counts)


@segment_gather_over_count_op.register_fake
def _(b, idx, counts):
    return b.new_empty((idx.shape[0], b.shape[1]))


def _mean_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(inputs[1], output[1])


def _mean_backward(ctx, grad, _grad_counts):
    idx, counts = ctx.saved_tensors
    if counts.shape[0] != grad.shape[0]:
        raise RuntimeError("segment mean: the row counts its gradient needs were not written "
                           "(segment_mean_op was called with with_counts=False)")
    return segment_gather_over_count_op.within(ctx)(grad, idx, counts), None, None, None


def _gather_over_count_backward(ctx, grad):
    (idx,) = ctx.saved_tensors
    return segment_mean_op.within(ctx)(grad, idx, ctx.num_segments, needs_counts(grad))[0], None, None


segment_mean_op.register_autograd(_mean_backward, setup_context=_mean_setup)
segment_gather_over_count_op.register_autograd(_gather_over_count_backward, setup_context=_save_idx_and_segments)


# --- dot and scale_rows (mul) ----------------------------------------------------------------

@_operator("dot")
def segment_dot_op(a: Tensor, b: Tensor, idx: Tensor, num_segments: int, rowwise: bool) -> Tensor:
    prologue = tk.ROW_DOT if rowwise else tk.ROW_PRODUCT
    return tk.segment_reduce(a.contiguous(), b.contiguous(), idx, num_segments, prologue, tk.TOTAL, False)[0]


@segment_dot_op.register_fake
def _(a, b, idx, num_segments, rowwise):
    return a.new_empty((num_segments, 1 if rowwise else a.shape[1]))


@_operator("scale_rows")
def segment_scale_rows_op(a: Tensor, b: Tensor, idx: Tensor) -> Tensor:
    return tk.segment_rowwise(tk.SCALE_ROWS, a.contiguous(), b.contiguous(), idx)


@segment_scale_rows_op.register_fake
def _(a, b, idx):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _dot_setup(ctx, inputs, output):
    a, b, idx, _, _ = inputs
    ctx.save_for_backward(a, b, idx)


def _dot_backward(ctx, grad):
    a, b, idx = ctx.saved_tensors
    grad_a = segment_scale_rows_op.within(ctx)(b, grad, idx) if ctx.needs_input_grad[0] else None
    grad_b = segment_scale_rows_op.within(ctx)(a, grad, idx) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None, None


def _scale_rows_setup(ctx, inputs, output):
    a, b, idx = inputs
    ctx.save_for_backward(a, b, idx)


def _scale_rows_backward(ctx, grad):
    a, b, idx = ctx.saved_tensors
    grad_a = segment_scale_rows_op.within(ctx)(grad, b, idx) if ctx.needs_input_grad[0] else None
    grad_b = None
    if ctx.needs_input_grad[1]:
        # A one-column b is broadcast over the row: its gradient sums the row's products.
        grad_b = segment_dot_op.within(ctx)(grad, a, idx, b.shape[0], b.shape[1] == 1 and a.shape[1] != 1)
    return grad_a, grad_b, None


segment_dot_op.register_autograd(_dot_backward, setup_context=_dot_setup)
segment_scale_rows_op.register_autograd(_scale_rows_backward, setup_context=_scale_rows_setup)


# --- rms_norm ----------------------------------------------------------------------------

@_operator("rms")
def segment_rms_op(x: Tensor, idx: Tensor, num_segments: int) -> tuple[Tensor, Tensor]:
    return tk.segment_reduce(x.contiguous(), None, idx, num_segments, tk.ROW_SQUARED_NORM, tk.SQRT_OF_MEAN, True)


@segment_rms_op.register_fake
def _(x, idx, num_segments):
    return x.new_empty((num_segments, 1)), idx.new_empty((num_segments,))


@_operator("rms_backward")
def segment_rms_backward_op(g: Tensor, x: Tensor, r: Tensor, counts: Tensor, idx: Tensor) -> Tensor:
    return tk.segment_rowwise(tk.RMS_BACKWARD, x.contiguous(), g.contiguous(), idx, counts=counts,
                              r=r.contiguous())


@segment_rms_backward_op.register_fake
def _(g, x, r, counts, idx):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_operator("rms_double_backward")
def segment_rms_double_backward_op(p: Tensor, g: Tensor, r: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    return tk.rms_norm_double_backward(p.contiguous(), g.contiguous(), r.contiguous(), counts)


@segment_rms_double_backward_op.register_fake
def _(p, g, r, counts):
    return torch.empty_like(g, memory_format=torch.contiguous_format), torch.empty_like(r, memory_format=torch.contiguous_format)


def _rms_setup(ctx, inputs, output):
    x, idx, _ = inputs
    r, counts = output
    ctx.mark_non_differentiable(counts)
    ctx.save_for_backward(x, idx, r, counts)


def _rms_backward(ctx, grad, _grad_counts):
    x, idx, r, counts = ctx.saved_tensors
    return segment_rms_backward_op.within(ctx)(grad, x, r, counts, idx), None, None


def _rms_backward_setup(ctx, inputs, output):
    g, x, r, counts, idx = inputs
    ctx.save_for_backward(g, x, r, counts, idx)


def _rms_backward_backward(ctx, grad):
    g, x, r, counts, idx = ctx.saved_tensors
    grad_x = segment_rms_backward_op.within(ctx)(g, grad, r, counts, idx) if ctx.needs_input_grad[1] else None
    grad_g = grad_r = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
        p = segment_dot_op.within(ctx)(grad, x, idx, g.shape[0], True)
        grad_g, grad_r = segment_rms_double_backward_op.within(ctx)(p, g, r, counts)
    return grad_g, grad_x, grad_r, None, None


segment_rms_op.register_autograd(_rms_backward, setup_context=_rms_setup)
segment_rms_backward_op.register_autograd(_rms_backward_backward, setup_context=_rms_backward_setup)


# --- matvec and its companion, outer ----------------------------------------------------

@_operator("matvec")
def segment_matvec_op(v: Tensor, m: Tensor, idx: Tensor, transpose: bool) -> Tensor:
    return tk.segment_matvec(v.contiguous(), m.contiguous(), idx, transpose)


@segment_matvec_op.register_fake
def _(v, m, idx, transpose):
    return v.new_empty((v.shape[0], m.shape[1] if transpose else m.shape[2]))


@_operator("outer")
def segment_outer_op(a: Tensor, b: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    flat, _ = tk.segment_reduce(a.contiguous(), b.contiguous(), idx, num_segments, tk.ROW_OUTER, tk.TOTAL,
                                False, K=b.shape[1])
    return flat.view(num_segments, a.shape[1], b.shape[1])


@segment_outer_op.register_fake
def _(a, b, idx, num_segments):
    return a.new_empty((num_segments, a.shape[1], b.shape[1]))


def _matvec_setup(ctx, inputs, output):
    v, m, idx, transpose = inputs
    ctx.transpose = transpose
    ctx.save_for_backward(v, m, idx)


def _matvec_backward(ctx, grad):
    v, m, idx = ctx.saved_tensors
    grad_v = segment_matvec_op.within(ctx)(grad, m, idx, not ctx.transpose) if ctx.needs_input_grad[0] else None
    grad_m = None
    if ctx.needs_input_grad[1]:
        # out = m^T v: dm = sum v g^T;  out = m v: dm = sum g v^T.
        grad_m = (segment_outer_op.within(ctx)(grad, v, idx, m.shape[0]) if ctx.transpose
                  else segment_outer_op.within(ctx)(v, grad, idx, m.shape[0]))
    return grad_v, grad_m, None, None


def _outer_setup(ctx, inputs, output):
    a, b, idx, _ = inputs
    ctx.save_for_backward(a, b, idx)


def _outer_backward(ctx, grad):
    a, b, idx = ctx.saved_tensors
    grad_a = segment_matvec_op.within(ctx)(b, grad, idx, True) if ctx.needs_input_grad[0] else None
    grad_b = segment_matvec_op.within(ctx)(a, grad, idx, False) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


segment_matvec_op.register_autograd(_matvec_backward, setup_context=_matvec_setup)
segment_outer_op.register_autograd(_outer_backward, setup_context=_outer_setup)
