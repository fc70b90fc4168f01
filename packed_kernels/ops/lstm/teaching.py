"""The teaching kernel: one LSTM layer, one direction, one program per sequence.

The smallest complete Triton version of the recurrence, before the production kernel
(:mod:`.triton_kernels`) splits the work of a step over several SMs. Sequence ``b`` of
a packed batch is rows ``cu_seqlens[b]`` to ``cu_seqlens[b + 1]``. With PyTorch's gate
order (input, forget, cell, output) and ``h`` and ``c`` starting at zero, each frame
``t`` of it computes::

    xw_t = W_ih x_t + b_ih + b_hh        every frame at once: one matrix product, before
    z_t  = xw_t + W_hh h_{t-1}           (4H,): the sequential part, in the kernel
    i = sigmoid(z_t[0:H])     f = sigmoid(z_t[H:2H])
    g = tanh(z_t[2H:3H])      o = sigmoid(z_t[3H:4H])
    c_t = f * c_{t-1} + i * g
    h_t = o * tanh(c_t)

The reverse direction runs the same cell from the sequence's last frame to its first.
Triton's core language has a sigmoid but no tanh, so the kernel writes
``tanh(z) = 2 sigmoid(2z) - 1``.

The program loads ``W_hh`` once, as four ``(H, H)`` blocks (one per gate), and keeps
them, ``h`` and ``c`` in registers for the whole sequence: a step reads only its ``4H``
projected inputs and writes its ``H`` outputs. One program holds all ``4 H^2`` weights,
which fit in registers up to ``H = 64``; at ``H = 128`` they are 256 KiB, a whole SM's
register file, and spill. The production kernel splits them over several programs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["lstm_layer_teaching"]


@triton.jit
def lstm_layer_teaching_kernel(xw_ptr, w_hh_ptr, cu_seqlens_ptr, y_ptr, h_n_ptr, c_n_ptr,
                               H: tl.constexpr, REVERSE: tl.constexpr):
    """Program ``b`` runs sequence ``b``: ``xw`` (N, 4H) and ``y`` (N, H) are packed rows,
    ``w_hh`` (4H, H) row-major, ``h_n`` and ``c_n`` (B, H)."""
    b = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + b)
    end = tl.load(cu_seqlens_ptr + b + 1)
    units = tl.arange(0, H)  # the hidden units this program computes: all of them
    rows, cols = units[:, None], units[None, :]
    # Loaded once, kept in registers for every step: row j of a gate's block is unit j.
    w_i = tl.load(w_hh_ptr + (0 * H + rows) * H + cols)
    w_f = tl.load(w_hh_ptr + (1 * H + rows) * H + cols)
    w_g = tl.load(w_hh_ptr + (2 * H + rows) * H + cols)
    w_o = tl.load(w_hh_ptr + (3 * H + rows) * H + cols)
    h = tl.zeros([H], dtype=tl.float32)
    c = tl.zeros([H], dtype=tl.float32)
    for step in range(0, end - start):
        t = end - 1 - step if REVERSE else start + step
        xw = xw_ptr + t * 4 * H + units
        h_row = h[None, :]  # W_hh h as a broadcast product summed over the columns
        z_i = tl.load(xw + 0 * H) + tl.sum(w_i * h_row, axis=1)
        z_f = tl.load(xw + 1 * H) + tl.sum(w_f * h_row, axis=1)
        z_g = tl.load(xw + 2 * H) + tl.sum(w_g * h_row, axis=1)
        z_o = tl.load(xw + 3 * H) + tl.sum(w_o * h_row, axis=1)
        g = 2.0 * tl.sigmoid(2.0 * z_g) - 1.0  # tanh(z_g)
        c = tl.sigmoid(z_f) * c + tl.sigmoid(z_i) * g
        h = tl.sigmoid(z_o) * (2.0 * tl.sigmoid(2.0 * c) - 1.0)
        tl.store(y_ptr + t * H + units, h)
    tl.store(h_n_ptr + b * H + units, h)
    tl.store(c_n_ptr + b * H + units, c)


def lstm_layer_teaching(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
    bias_ih: Optional[torch.Tensor] = None,
    bias_hh: Optional[torch.Tensor] = None,
    reverse: bool = False,
) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """One LSTM layer in one direction over a packed batch, with the teaching kernel.

    ``x`` is ``(N, I)`` float32, the frames of ``B`` sequences one after another;
    ``cu_seqlens`` ``(B + 1,)`` integer offsets (sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]``, possibly none); the weights as ``nn.LSTM``
    stores them, ``weight_ih`` ``(4H, I)``, ``weight_hh`` ``(4H, H)`` with ``H`` a power
    of two, biases ``(4H,)`` or ``None``. All on the device the kernels run on.

    Returns ``(y, (h_n, c_n))``: ``y`` ``(N, H)`` holds each frame's hidden state,
    ``h_n`` and ``c_n`` ``(B, H)`` the states after each sequence's last processed frame
    (zero for an empty sequence).
    """
    H = weight_hh.shape[1]
    if H < 1 or H & (H - 1):
        raise ValueError(f"lstm_layer_teaching: hidden size must be a power of two, got {H}")
    xw = x @ weight_ih.T  # the input projection of every frame: one product, outside the loop
    for bias in (bias_ih, bias_hh):
        if bias is not None:
            xw = xw + bias
    B = cu_seqlens.numel() - 1
    y = x.new_empty(x.shape[0], H)
    h_n, c_n = x.new_zeros(B, H), x.new_zeros(B, H)
    # a warp per 512 of the 4 H^2 weights (64 a thread), between 1 and 16 warps
    num_warps = min(16, max(1, H * H // 512))
    lstm_layer_teaching_kernel[(B,)](xw.contiguous(), weight_hh.contiguous(), cu_seqlens, y, h_n, c_n,
                                     H=H, REVERSE=reverse, num_warps=num_warps)
    return y, (h_n, c_n)
