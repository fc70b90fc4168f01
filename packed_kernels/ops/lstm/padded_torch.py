"""The padded PyTorch stage: a multi-layer, bidirectional LSTM as a loop over time.

Each layer and direction does what the Triton path does, in plain PyTorch: the
input projection of all frames as one matrix product, then a Python loop over time
with one small matrix product per step. Sequences of different lengths share one
padded ``(B, T, ...)`` tensor; a sequence stops updating its state after its last
frame, and its reverse direction starts at its own last frame (as ``nn.LSTM`` does
on a ``PackedSequence``). Being ordinary PyTorch, it is differentiable: it is also
the path :class:`~packed_kernels.ops.lstm.PersistentLSTM` falls back to when autograd
is needed.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

__all__ = ["DirectionWeights", "lstm_weights", "lstm_padded", "reverse_within_lengths"]


class DirectionWeights(NamedTuple):
    """The weights of one layer in one direction, as ``nn.LSTM`` stores them.

    ``weight_ih`` ``(4H, I)``, ``weight_hh`` ``(4H, H)``, ``bias_ih`` and ``bias_hh``
    ``(4H,)`` or ``None``; gate rows in the order input, forget, cell, output.
    """

    weight_ih: torch.Tensor
    weight_hh: torch.Tensor
    bias_ih: Optional[torch.Tensor]
    bias_hh: Optional[torch.Tensor]


def lstm_weights(lstm: torch.nn.LSTM) -> List[List[DirectionWeights]]:
    """``weights[layer][direction]`` of an ``nn.LSTM`` (the very parameter tensors, not copies)."""
    weights = []
    for layer in range(lstm.num_layers):
        per_direction = []
        for suffix in ["", "_reverse"][: 2 if lstm.bidirectional else 1]:
            name = f"l{layer}{suffix}"
            per_direction.append(DirectionWeights(
                getattr(lstm, f"weight_ih_{name}"),
                getattr(lstm, f"weight_hh_{name}"),
                getattr(lstm, f"bias_ih_{name}") if lstm.bias else None,
                getattr(lstm, f"bias_hh_{name}") if lstm.bias else None,
            ))
        weights.append(per_direction)
    return weights


def reverse_within_lengths(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """``(B, T)`` frame indices that reverse each sequence's first ``lengths[b]`` frames.

    Entry ``[b, t]`` is ``lengths[b] - 1 - t`` for ``t < lengths[b]`` and ``t`` beyond:
    gathering with it twice gives back the original order.
    """
    t = torch.arange(T, device=lengths.device)[None, :]
    lengths = lengths.to(torch.int64)[:, None]
    return torch.where(t < lengths, lengths - 1 - t, t)


def lstm_padded(
    x: torch.Tensor,
    weights: List[List[DirectionWeights]],
    lengths: Optional[torch.Tensor] = None,
    h0: Optional[torch.Tensor] = None,
    c0: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """A stacked LSTM over a padded batch.

    Args:
        x: ``(B, T, I)`` (batch first), padding frames arbitrary.
        weights: ``weights[layer][direction]`` (see :func:`lstm_weights`); one or
            two directions per layer.
        lengths: ``(B,)`` integer lengths, each in ``[0, T]``; ``None`` means all ``T``.
        h0, c0: ``(num_layers * D, B, H)`` initial states, zeros when ``None``.

    Returns:
        ``(y, (h_n, c_n))``: ``y`` is ``(B, T, D * H)`` with zeros beyond each
        length; ``h_n`` and ``c_n`` are ``(num_layers * D, B, H)``, each
        direction's state after its last processed frame (the frame at
        ``lengths[b] - 1`` forward, frame 0 in reverse).
    """
    B, T, _ = x.shape
    num_directions = len(weights[0])
    H = weights[0][0].weight_hh.shape[1]
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.int64, device=x.device)
    lengths = lengths.to(device=x.device, dtype=torch.int64)
    steps = torch.arange(T, device=x.device)
    active = (steps[None, :] < lengths[:, None])[:, :, None]  # (B, T, 1)
    reverse_index = reverse_within_lengths(lengths, T)[:, :, None]
    h_n, c_n = [], []
    layer_input = x
    for layer, layer_weights in enumerate(weights):
        outputs = []
        for direction, w in enumerate(layer_weights):
            state = layer * num_directions + direction
            h = x.new_zeros(B, H) if h0 is None else h0[state]
            c = x.new_zeros(B, H) if c0 is None else c0[state]
            gates_x = layer_input @ w.weight_ih.T  # (B, T, 4H): every frame in one product
            if w.bias_ih is not None:
                gates_x = gates_x + (w.bias_ih + w.bias_hh)
            if direction == 1:
                gates_x = torch.gather(gates_x, 1, reverse_index.expand(B, T, 4 * H))
            ys = []
            for t in range(T):
                z = gates_x[:, t] + h @ w.weight_hh.T
                i, f, g, o = z.chunk(4, dim=1)
                c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h_new = torch.sigmoid(o) * torch.tanh(c_new)
                keep = active[:, t]
                c = torch.where(keep, c_new, c)
                h = torch.where(keep, h_new, h)
                ys.append(torch.where(keep, h_new, torch.zeros_like(h_new)))
            y = torch.stack(ys, dim=1) if ys else x.new_zeros(B, 0, H)
            if direction == 1:
                y = torch.gather(y, 1, reverse_index.expand(B, T, H))
            outputs.append(y)
            h_n.append(h)
            c_n.append(c)
        layer_input = torch.cat(outputs, dim=2) if num_directions == 2 else outputs[0]
    return layer_input, (torch.stack(h_n), torch.stack(c_n))
