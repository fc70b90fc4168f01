"""The NumPy stage: one LSTM layer, one direction, the cell written out step by step.

This is the reference a reader can check by eye against the equations of the
chapter "A persistent LSTM recurrence" of the packed-kernels book (``book/lstm.ipynb``). It computes in float64 and knows nothing about batching tricks: one
sequence, one time step after another.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

__all__ = ["lstm_layer_numpy", "sigmoid"]


def sigmoid(z: np.ndarray) -> np.ndarray:
    """The logistic function, written so that large negative inputs do not overflow."""
    out = np.empty_like(z)
    positive = z >= 0
    out[positive] = 1.0 / (1.0 + np.exp(-z[positive]))
    e = np.exp(z[~positive])
    out[~positive] = e / (1.0 + e)
    return out


def lstm_layer_numpy(
    x: np.ndarray,
    weight_ih: np.ndarray,
    weight_hh: np.ndarray,
    bias_ih: Optional[np.ndarray] = None,
    bias_hh: Optional[np.ndarray] = None,
    h0: Optional[np.ndarray] = None,
    c0: Optional[np.ndarray] = None,
    reverse: bool = False,
) -> Tuple[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """Run one LSTM layer in one direction over one sequence.

    Shapes: ``x`` is ``(T, I)``, ``weight_ih`` is ``(4H, I)``, ``weight_hh`` is
    ``(4H, H)``, the biases ``(4H,)``, ``h0`` and ``c0`` ``(H,)``. The gate rows
    are stacked in PyTorch's order: input, forget, cell candidate, output.

    For each frame ``t`` (from ``T - 1`` down to 0 when ``reverse``)::

        z   = W_ih x_t + b_ih + W_hh h + b_hh          # (4H,)
        i   = sigmoid(z[0:H]);    f = sigmoid(z[H:2H])
        g   = tanh(z[2H:3H]);     o = sigmoid(z[3H:4H])
        c   = f * c + i * g
        h   = o * tanh(c)

    Returns ``(y, (h_T, c_T))``: ``y`` is ``(T, H)`` with ``y[t]`` the hidden state
    after frame ``t``, and the state after the last processed frame.
    """
    x = np.asarray(x, dtype=np.float64)
    weight_ih = np.asarray(weight_ih, dtype=np.float64)
    weight_hh = np.asarray(weight_hh, dtype=np.float64)
    T = x.shape[0]
    H = weight_hh.shape[1]
    bias = np.zeros(4 * H)
    if bias_ih is not None:
        bias = bias + np.asarray(bias_ih, dtype=np.float64)
    if bias_hh is not None:
        bias = bias + np.asarray(bias_hh, dtype=np.float64)
    h = np.zeros(H) if h0 is None else np.array(h0, dtype=np.float64)
    c = np.zeros(H) if c0 is None else np.array(c0, dtype=np.float64)
    y = np.zeros((T, H))
    frames = range(T - 1, -1, -1) if reverse else range(T)
    for t in frames:
        z = weight_ih @ x[t] + weight_hh @ h + bias
        i = sigmoid(z[0:H])
        f = sigmoid(z[H:2 * H])
        g = np.tanh(z[2 * H:3 * H])
        o = sigmoid(z[3 * H:4 * H])
        c = f * c + i * g
        h = o * np.tanh(c)
        y[t] = h
    return y, (h, c)
