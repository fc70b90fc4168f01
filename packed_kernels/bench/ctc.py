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


def _targets(B: int, U: int, C: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(1, C, (B, U), generator=g, device=device)


def _log_probs(shape, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).log_softmax(-1)


def _torch_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        import torch.nn.functional as F

        device = "cuda"
        x = _log_probs((T, B, C), seed, device).requires_grad_()
        targets = _targets(B, int(target_lengths.max()), C, seed, device)
        il, tl = input_lengths.to(device), target_lengths.to(device)

        def step():
            loss = F.ctc_loss(x, targets, il, tl, blank=0, reduction="mean")
            return torch.autograd.grad(loss, x)

        return step

    return factory


def _packed_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        from .. import cu_seqlens_from_lengths, packed_ctc_loss

        device = "cuda"
        T_total = int(input_lengths.sum())
        x = _log_probs((T_total, C), seed, device).requires_grad_()
        targets = _targets(B, int(target_lengths.max()), C, seed, device)
        cu = cu_seqlens_from_lengths(input_lengths.to(device))
        tl = target_lengths.to(device)

        def step():
            loss = packed_ctc_loss(x, cu, targets, tl, blank=0, reduction="mean")
            return torch.autograd.grad(loss, x)

        return step

    return factory


def _padded_stage_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        from ..ops.ctc.padded_torch import ctc_loss_padded

        device = "cuda"
        x = _log_probs((B, T, C), seed, device).requires_grad_()
        targets = _targets(B, int(target_lengths.max()), C, seed, device)
        il, tl = input_lengths.to(device), target_lengths.to(device)

        def step():
            loss = ctc_loss_padded(x, il, targets, tl, blank=0, reduction="mean")
            return torch.autograd.grad(loss, x)

        return step

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
        if T <= 500:  # a Python loop over frames: about a second per call beyond that
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
