"""NumPy stage: one Python loop over segments, in float64, with the derivatives written out.

This is the reference the other stages are checked against. Every operation has
three functions:

* ``segmented_<op>_numpy(...)``: the forward;
* ``segmented_<op>_backward_numpy(..., grad)``: the vector-Jacobian product, the
  gradient of ``sum(grad * out)`` with respect to each input, derived by hand;
* ``segmented_<op>_double_backward_numpy(..., grad, cotangents)``: the second derivative as autograd
  needs it: the gradient of ``sum_k <cotangent_k, backward_k>`` with respect to every
  input of the backward (the forward's inputs and ``grad``).

Rows ``x[i]`` belong to segment ``s = idx[i]``; ``rows(idx, s)`` are the rows of ``s``
and ``n_s`` their number. Arrays are ``(N, D)`` here (the public functions reshape
``(N,)`` to ``(N, 1)``).
"""
from __future__ import annotations

import numpy as np


def segment_rows(idx: np.ndarray, num_segments: int):
    """The row indices of each segment, a list of ``num_segments`` arrays."""
    idx = np.asarray(idx)
    return [np.flatnonzero(idx == s) for s in range(num_segments)]


# --- sum: out_s = sum_{i in s} x_i ----------------------------------------------------------

def segmented_sum_numpy(x, idx, num_segments):
    out = np.zeros((num_segments,) + x.shape[1:])
    for s, rows in enumerate(segment_rows(idx, num_segments)):
        for i in rows:
            out[s] += x[i]
    return out


def segmented_sum_backward_numpy(x, idx, num_segments, grad):
    """d out_s / d x_i = I for i in s, so dx_i = grad_{idx[i]}."""
    dx = np.zeros_like(x)
    for i, s in enumerate(idx):
        dx[i] = grad[s]
    return dx


def segmented_sum_double_backward_numpy(x, idx, num_segments, grad, cotangent_dx):
    """The backward is linear in grad and free of x: d/dgrad_s = sum_{i in s} u_i; d/dx = 0."""
    return np.zeros_like(x), segmented_sum_numpy(cotangent_dx, idx, num_segments)


# --- mean: out_s = sum_{i in s} x_i / n_s -----------------------------------------------

def segmented_mean_numpy(x, idx, num_segments):
    out = np.zeros((num_segments,) + x.shape[1:])
    for s, rows in enumerate(segment_rows(idx, num_segments)):
        if len(rows):
            out[s] = sum(x[i] for i in rows) / len(rows)
    return out


def segmented_mean_backward_numpy(x, idx, num_segments, grad):
    """dx_i = grad_s / n_s."""
    counts = np.bincount(idx, minlength=num_segments)
    dx = np.zeros_like(x)
    for i, s in enumerate(idx):
        dx[i] = grad[s] / counts[s]
    return dx


def segmented_mean_double_backward_numpy(x, idx, num_segments, grad, cotangent_dx):
    """d/dgrad_s = sum_{i in s} u_i / n_s (a mean again); d/dx = 0."""
    return np.zeros_like(x), segmented_mean_numpy(cotangent_dx, idx, num_segments)


# --- dot: out_s = sum_{i in s} <x_i, y_i> -------------------------------------------------

def segmented_dot_numpy(x, y, idx, num_segments):
    out = np.zeros(num_segments)
    for s, rows in enumerate(segment_rows(idx, num_segments)):
        for i in rows:
            out[s] += np.dot(x[i], y[i])
    return out


def segmented_dot_backward_numpy(x, y, idx, num_segments, grad):
    """dx_i = grad_s y_i, dy_i = grad_s x_i."""
    dx, dy = np.zeros_like(x), np.zeros_like(y)
    for i, s in enumerate(idx):
        dx[i] = grad[s] * y[i]
        dy[i] = grad[s] * x[i]
    return dx, dy


def segmented_dot_double_backward_numpy(x, y, idx, num_segments, grad, cotangent_dx, cotangent_dy):
    """With cotangents u (of dx) and w (of dy) of L = sum_i g_s (<u_i, y_i> + <w_i, x_i>):
    dL/dx_i = g_s w_i, dL/dy_i = g_s u_i, dL/dg_s = sum_{i in s} <u_i, y_i> + <w_i, x_i>."""
    dx, dy = np.zeros_like(x), np.zeros_like(y)
    dgrad = np.zeros(num_segments)
    for i, s in enumerate(idx):
        dx[i] = grad[s] * cotangent_dy[i]
        dy[i] = grad[s] * cotangent_dx[i]
        dgrad[s] += np.dot(cotangent_dx[i], y[i]) + np.dot(cotangent_dy[i], x[i])
    return dx, dy, dgrad


# --- mul: out_i = x_i * y_s (y_s a row like x_i, or one factor) -----------------------------

def segmented_mul_numpy(x, y, idx, num_segments):
    out = np.zeros_like(x)
    for i, s in enumerate(idx):
        out[i] = x[i] * y[s]
    return out


def _sum_to(value, shape):
    """Sum a row of x's width down to y's row shape (one factor: the row's sum)."""
    return value if value.shape == shape else np.sum(value).reshape(shape)


def segmented_mul_backward_numpy(x, y, idx, num_segments, grad):
    """dx_i = grad_i * y_s; dy_s = sum_{i in s} grad_i * x_i (summed over the row for one factor)."""
    dx, dy = np.zeros_like(x), np.zeros_like(y)
    for i, s in enumerate(idx):
        dx[i] = grad[i] * y[s]
        dy[s] += _sum_to(grad[i] * x[i], y[s].shape)
    return dx, dy


def segmented_mul_double_backward_numpy(x, y, idx, num_segments, grad, cotangent_dx, cotangent_dy):
    """L = sum_i <u_i, g_i * y_s> + <w_s, sum_{i in s} g_i * x_i>:
    dL/dx_i = w_s * g_i, dL/dy_s = sum_{i in s} u_i * g_i, dL/dg_i = u_i * y_s + w_s * x_i."""
    dx, dy, dgrad = np.zeros_like(x), np.zeros_like(y), np.zeros_like(grad)
    for i, s in enumerate(idx):
        dx[i] = cotangent_dy[s] * grad[i]
        dy[s] += _sum_to(cotangent_dx[i] * grad[i], y[s].shape)
        dgrad[i] = cotangent_dx[i] * y[s] + cotangent_dy[s] * x[i]
    return dx, dy, dgrad


# --- rms_norm: r_s = sqrt(sum_{i in s} |x_i|^2 / n_s) ----------------------------------------

def segmented_rms_norm_numpy(x, idx, num_segments):
    out = np.zeros(num_segments)
    for s, rows in enumerate(segment_rows(idx, num_segments)):
        if len(rows):
            out[s] = np.sqrt(sum(np.sum(x[i] ** 2) for i in rows) / len(rows))
    return out


def segmented_rms_norm_backward_numpy(x, idx, num_segments, grad):
    """dr_s/dx_i = x_i / (n_s r_s), so dx_i = grad_s x_i / (n_s r_s); 0 where r_s = 0."""
    r = segmented_rms_norm_numpy(x, idx, num_segments)
    counts = np.bincount(idx, minlength=num_segments)
    dx = np.zeros_like(x)
    for i, s in enumerate(idx):
        if r[s] > 0:
            dx[i] = grad[s] * x[i] / (counts[s] * r[s])
    return dx


def segmented_rms_norm_double_backward_numpy(x, idx, num_segments, grad, cotangent_dx):
    """L = sum_i g_s <u_i, x_i> / (n_s r_s), with p_s = sum_{i in s} <u_i, x_i>:
    dL/dg_s = p_s / (n_s r_s);
    dL/dx_i = g_s u_i / (n_s r_s) - g_s p_s x_i / (n_s^2 r_s^3)   (since dr_s/dx_i = x_i / (n_s r_s))."""
    r = segmented_rms_norm_numpy(x, idx, num_segments)
    counts = np.bincount(idx, minlength=num_segments)
    p = np.zeros(num_segments)
    for i, s in enumerate(idx):
        p[s] += np.sum(cotangent_dx[i] * x[i])
    dx, dgrad = np.zeros_like(x), np.zeros(num_segments)
    for s in range(num_segments):
        if r[s] > 0:
            dgrad[s] = p[s] / (counts[s] * r[s])
    for i, s in enumerate(idx):
        if r[s] > 0:
            n = counts[s]
            dx[i] = grad[s] * cotangent_dx[i] / (n * r[s]) - grad[s] * p[s] * x[i] / (n ** 2 * r[s] ** 3)
    return dx, dgrad


# --- matvec: out_i = m_s^T v_i ---------------------------------------------------------------

def segmented_matvec_numpy(v, m, idx, num_segments):
    out = np.zeros((v.shape[0], m.shape[2]))
    for i, s in enumerate(idx):
        out[i] = m[s].T @ v[i]
    return out


def segmented_matvec_backward_numpy(v, m, idx, num_segments, grad):
    """dv_i = m_s g_i; dm_s = sum_{i in s} v_i g_i^T."""
    dv, dm = np.zeros_like(v), np.zeros_like(m)
    for i, s in enumerate(idx):
        dv[i] = m[s] @ grad[i]
        dm[s] += np.outer(v[i], grad[i])
    return dv, dm


def segmented_matvec_double_backward_numpy(v, m, idx, num_segments, grad, cotangent_dv, cotangent_dm):
    """L = sum_i <a_i, m_s g_i> + sum_s <B_s, sum_{i in s} v_i g_i^T> (a, B the cotangents):
    dL/dv_i = B_s g_i; dL/dm_s = sum_{i in s} a_i g_i^T; dL/dg_i = m_s^T a_i + B_s^T v_i."""
    dv, dm, dgrad = np.zeros_like(v), np.zeros_like(m), np.zeros_like(grad)
    for i, s in enumerate(idx):
        dv[i] = cotangent_dm[s] @ grad[i]
        dm[s] += np.outer(cotangent_dv[i], grad[i])
        dgrad[i] = m[s].T @ cotangent_dv[i] + cotangent_dm[s].T @ v[i]
    return dv, dm, dgrad
