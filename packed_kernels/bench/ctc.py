"""CTC loss benchmark: forward plus backward, reduction ``"mean"``.

Providers, each timed on the same problem in its own layout:

* ``torch``: ``torch.nn.functional.ctc_loss`` on the padded ``(T, B, C)`` log-probabilities,
  as a model's CTC head calls it;
* ``triton_packed``: :func:`packed_kernels.packed_ctc_loss` on the packed ``(T_total, C)`` rows;
* ``padded_torch``: the chapter's padded PyTorch stage (autograd through the recursion),
  at the shorter shapes only.

Utterance lengths are uniform in ``[T/3, T]`` (fixed seed); each target has about
``length / ratio`` labels drawn from the non-blank classes. Each provider computes the
gradient with ``torch.autograd.grad``, so no ``.grad`` accumulates between calls.
The floor is the packed log-probabilities read once plus the gradient written once.
"""
from __future__ import annotations

from typing import Iterator, List

import torch

from .harness import Case

#: (B, longest T, C, frames per target label)
SHAPES = [
    (32, 1000, 1025, 6),
    (64, 500, 1025, 6),
    (32, 1000, 29, 3),
    (8, 2000, 257, 8),
    (128, 300, 1025, 4),
]


def utterance_lengths(B: int, T: int, ratio: int, seed: int):
    """Frame counts uniform in [T/3, T] and target lengths of about one label per `ratio` frames."""
    g = torch.Generator().manual_seed(seed)
    input_lengths = torch.randint((T + 2) // 3, T + 1, (B,), generator=g)
    target_lengths = (input_lengths // ratio).clamp_min(1)
    return input_lengths, target_lengths


def _inputs(layout, B: int, C: int, input_lengths, target_lengths, seed: int):
    """On the GPU: log-probabilities of shape ``layout`` that require a gradient, the
    targets, the frame counts and the target lengths."""
    device = "cuda"
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(layout, generator=g, device=device).log_softmax(-1).requires_grad_()
    g = torch.Generator(device=device).manual_seed(seed)
    targets = torch.randint(1, C, (B, int(target_lengths.max())), generator=g, device=device)
    return x, targets, input_lengths.to(device), target_lengths.to(device)


def _step(loss_of, x):
    """One timed call: the loss of ``x`` and its gradient (no ``.grad`` accumulates)."""

    def step():
        return torch.autograd.grad(loss_of(x), x)

    return step


def _torch_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        import torch.nn.functional as F

        x, targets, il, tl = _inputs((T, B, C), B, C, input_lengths, target_lengths, seed)
        return _step(lambda x: F.ctc_loss(x, targets, il, tl, blank=0, reduction="mean"), x)

    return factory


def _packed_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        from .. import cu_seqlens_from_lengths, packed_ctc_loss

        T_total = int(input_lengths.sum())
        x, targets, il, tl = _inputs((T_total, C), B, C, input_lengths, target_lengths, seed)
        cu = cu_seqlens_from_lengths(il)
        return _step(lambda x: packed_ctc_loss(x, cu, targets, tl, blank=0, reduction="mean"), x)

    return factory


def _padded_stage_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        from ..ops.ctc.padded_torch import ctc_loss_padded

        x, targets, il, tl = _inputs((B, T, C), B, C, input_lengths, target_lengths, seed)
        return _step(lambda x: ctc_loss_padded(x, il, targets, tl, blank=0, reduction="mean"), x)

    return factory


def cases() -> Iterator[Case]:
    for index, (B, T, C, ratio) in enumerate(SHAPES):
        seed = 1000 + index
        input_lengths, target_lengths = utterance_lengths(B, T, ratio, seed)
        T_total = int(input_lengths.sum())
        U = int(target_lengths.max())
        args = (B, T, C, input_lengths, target_lengths, seed)
        providers = {
            "torch": _torch_provider(*args),
            "triton_packed": _packed_provider(*args),
        }
        if T <= 500:  # a Python loop over frames, one step per frame: the short shapes only
            providers["padded_torch"] = _padded_stage_provider(*args)
        yield Case(
            workload="fwd+bwd",
            params={"shape": f"B{B} T{T} C{C} U{U}", "B": B, "T": T, "C": C, "ratio": ratio},
            providers=providers,
            floor_bytes=2.0 * T_total * C * 4,  # read the float32 log-probs once, write the gradient once
            notes={"T_total": T_total, "U": U, "packed_fraction": T_total / (B * T)},
        )


def describe() -> List[str]:
    """The shapes, one line each (for the notebook)."""
    return [f"B={B}, T<={T}, C={C}, about T/{ratio} labels per target" for B, T, C, ratio in SHAPES]
