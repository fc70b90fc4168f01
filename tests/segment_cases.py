"""Shared inputs and independent references of the segment-operation tests.

References: the float64 NumPy loops with their hand-derived first and second
derivatives, and the padded PyTorch stage (autograd to any order).
"""
import numpy as np
import torch

import packed_kernels as pk
from packed_kernels.ops.segment import naive_numpy, padded_torch

OPS = ["sum", "mean", "dot", "mul", "mul_broadcast", "rms_norm", "matvec"]

PUBLIC = {
    "sum": pk.segmented_sum, "mean": pk.segmented_mean, "dot": pk.segmented_dot,
    "mul": pk.segmented_mul, "mul_broadcast": pk.segmented_mul,
    "rms_norm": pk.segmented_rms_norm, "matvec": pk.segmented_matvec,
}
PADDED = {
    "sum": padded_torch.segmented_sum_padded, "mean": padded_torch.segmented_mean_padded,
    "dot": padded_torch.segmented_dot_padded, "mul": padded_torch.segmented_mul_padded,
    "mul_broadcast": padded_torch.segmented_mul_padded, "rms_norm": padded_torch.segmented_rms_norm_padded,
    "matvec": padded_torch.segmented_matvec_padded,
}

#: The launchers of the segment kernels (a test replaces them to watch or refuse launches).
LAUNCHERS = ["segment_reduce_triton", "segment_rowwise_triton", "segment_matvec_triton",
             "rms_norm_double_backward_triton"]


def make_idx(lengths, device):
    idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return idx.to(device=device, dtype=torch.int32)


def applicable(op, width):
    if op == "matvec" and width is None:
        return False
    if op == "mul_broadcast" and width is None:
        return False
    return True


def make_inputs(op, n_rows, num_segments, width, dtype, device, seed):
    """The differentiable inputs of ``op`` (x first), on fresh random values."""
    g = torch.Generator().manual_seed(seed)
    row_shape = (n_rows,) if width is None else (n_rows, width)
    seg_shape = (num_segments,) if width is None else (num_segments, width)

    def rand(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    x = rand(*row_shape)
    if op in ("sum", "mean", "rms_norm"):
        return (x,)
    if op == "dot":
        return (x, rand(*row_shape))
    if op == "mul":
        return (x, rand(*seg_shape))
    if op == "mul_broadcast":
        return (x, rand(num_segments))
    if op == "matvec":
        return (x, rand(num_segments, width, 4))  # a non-square m: (S, D, K = 4)
    raise AssertionError(op)


def as_rows(a):
    a = a.detach().cpu().double().numpy()
    return a.reshape(a.shape[0], 1) if a.ndim == 1 else a


def numpy_forward(op, inputs, idx, num_segments):
    arrays = [as_rows(t) if t.dim() <= 2 else t.detach().cpu().double().numpy() for t in inputs]
    idx = idx.cpu().numpy()
    if op == "sum":
        out = naive_numpy.segmented_sum_numpy(arrays[0], idx, num_segments)
    elif op == "mean":
        out = naive_numpy.segmented_mean_numpy(arrays[0], idx, num_segments)
    elif op == "dot":
        return naive_numpy.segmented_dot_numpy(arrays[0], arrays[1], idx, num_segments)
    elif op == "mul":
        out = naive_numpy.segmented_mul_numpy(arrays[0], arrays[1], idx, num_segments)
    elif op == "mul_broadcast":
        out = naive_numpy.segmented_mul_numpy(arrays[0], arrays[1], idx, num_segments)
    elif op == "rms_norm":
        return naive_numpy.segmented_rms_norm_numpy(arrays[0], idx, num_segments)
    else:
        return naive_numpy.segmented_matvec_numpy(arrays[0], arrays[1], idx, num_segments)
    return out.reshape((out.shape[0],) + tuple(inputs[0].shape[1:]))


def numpy_backward(op, inputs, idx, num_segments, grad):
    """Hand-derived first derivatives, shaped like the inputs."""
    x = as_rows(inputs[0])
    idx = idx.cpu().numpy()
    g = grad.detach().cpu().double().numpy()
    if op in ("sum", "mean"):
        g = g.reshape(g.shape[0], -1)
        f = naive_numpy.segmented_sum_backward_numpy if op == "sum" else naive_numpy.segmented_mean_backward_numpy
        grads = (f(x, idx, num_segments, g),)
    elif op == "rms_norm":
        grads = (naive_numpy.segmented_rms_norm_backward_numpy(x, idx, num_segments, g),)
    elif op == "dot":
        grads = naive_numpy.segmented_dot_backward_numpy(x, as_rows(inputs[1]), idx, num_segments, g)
    elif op in ("mul", "mul_broadcast"):
        y = inputs[1].detach().cpu().double().numpy()
        y = y.reshape(y.shape[0], 1) if (op == "mul" and y.ndim == 1) else y
        grads = naive_numpy.segmented_mul_backward_numpy(x, y, idx, num_segments, g.reshape(x.shape))
    else:
        grads = naive_numpy.segmented_matvec_backward_numpy(
            x, inputs[1].detach().cpu().double().numpy(), idx, num_segments, g)
    return [np.asarray(a).reshape(t.shape) for a, t in zip(grads, inputs)]


def numpy_double_backward(op, inputs, idx, num_segments, grad, cotangents):
    """Hand-derived second derivatives: (d/d inputs..., d/d grad)."""
    x = as_rows(inputs[0])
    idx = idx.cpu().numpy()
    g = grad.detach().cpu().double().numpy()
    u = [c.detach().cpu().double().numpy() for c in cotangents]
    if op in ("sum", "mean"):
        f = (naive_numpy.segmented_sum_double_backward_numpy if op == "sum"
             else naive_numpy.segmented_mean_double_backward_numpy)
        result = f(x, idx, num_segments, g.reshape(g.shape[0], -1), u[0].reshape(x.shape))
    elif op == "rms_norm":
        result = naive_numpy.segmented_rms_norm_double_backward_numpy(x, idx, num_segments, g, u[0].reshape(x.shape))
    elif op == "dot":
        result = naive_numpy.segmented_dot_double_backward_numpy(
            x, as_rows(inputs[1]), idx, num_segments, g, u[0].reshape(x.shape), u[1].reshape(x.shape))
    elif op in ("mul", "mul_broadcast"):
        y = inputs[1].detach().cpu().double().numpy()
        y = y.reshape(y.shape[0], 1) if (op == "mul" and y.ndim == 1) else y
        result = naive_numpy.segmented_mul_double_backward_numpy(
            x, y, idx, num_segments, g.reshape(x.shape), u[0].reshape(x.shape), u[1].reshape(y.shape))
    else:
        result = naive_numpy.segmented_matvec_double_backward_numpy(
            x, inputs[1].detach().cpu().double().numpy(), idx, num_segments, g, u[0], u[1])
    shapes = [t.shape for t in inputs] + [grad.shape]
    return [np.asarray(a).reshape(shape) for a, shape in zip(result, shapes)]


