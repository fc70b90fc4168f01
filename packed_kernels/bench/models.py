"""Model-shaped workloads: each chapter's functions called the way a model calls them.

A model calls these functions eagerly, many times a step, at sizes far below the
chapters' largest. Each workload is one training (or inference) step of the model that
uses the chapter, and every provider is timed twice: ``eager`` (the step as Python runs
it, host work included) and ``graph`` (the same step captured once into a CUDA graph and
replayed: the GPU's time alone). Beside the package, the plain PyTorch version of the
same step, eager, replayed and under ``torch.compile``, is what a user would otherwise
write.

* ``potential``: an interatomic potential's training step. Per-atom energies from a
  small MLP of the positions, summed per molecule (``segmented_sum``); forces
  ``F = -dE/dx`` by ``autograd.grad(create_graph=True)``; a loss on the energies and on
  each molecule's mean squared force error (``segmented_mean``); the gradients of the
  MLP's weights (a double backward through both segment operations). 64, 256 and 1,024
  molecules of 10 to 50 atoms. The PyTorch version uses ``index_add``;
  ``torch.compile`` refuses its double backward (AOTAutograd), which its row records.
* ``mhc``: the mHC mixing step, ``sinkhorn`` of ``(tokens, 4, 4)`` logits (20
  iterations) and its implicit gradient through autograd, 4K to 64K tokens, against
  autograd through the 20-step PyTorch loop.
* ``ctc_head``: a CTC head at small batches, ``packed_ctc_loss`` forward and backward,
  B = 8 and 16, T = 200 and 400 frames, 128 classes, targets of T / 5, against
  ``F.ctc_loss`` on the padded batch.
* ``segmentation``: pyannote's segmentation model at inference, a 4-layer bidirectional
  LSTM of 128 units over 589 frames of 60 features (10 s chunks), 1, 8 and 32 chunks,
  ``PersistentLSTM`` against ``nn.LSTM`` (cuDNN), under ``no_grad``.
"""
from __future__ import annotations

from typing import Callable, Iterable, List

import torch

from .harness import Case, captured

DEVICE = "cuda"
_MOLECULES = (64, 256, 1024)
_TOKENS = (1 << 12, 1 << 14, 1 << 16)
_CTC_SHAPES = ((8, 200), (16, 200), (8, 400), (16, 400))
_CTC_CLASSES = 128
_SINKHORN_ITERS = 20
_CHUNKS = (1, 8, 32)
_SEGMENTATION = dict(frames=589, features=60, hidden=128, layers=4)


def _timed(step: Callable[[], object], mode: str) -> Callable[[], object]:
    if mode == "graph":
        return captured(step)
    if mode == "compiled":
        raise ValueError("compile the step's function, not the step")
    return step


# --- the interatomic potential ------------------------------------------------------------------

def potential_layout(molecules: int, seed: int = 0):
    """``(idx, lengths)`` of ``molecules`` molecules of 10 to 50 atoms (int64 ``idx``, as
    ``repeat_interleave`` gives it), on the benchmark's device."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 51, (molecules,), generator=g)
    idx = torch.repeat_interleave(torch.arange(molecules), lengths)
    return idx.to(DEVICE), lengths.to(DEVICE)


def _scatter_sum(values, idx, num_segments):
    return values.new_zeros((num_segments,) + values.shape[1:]).index_add(0, idx, values)


def potential_step(provider: str, molecules: int, hidden: int = 64):
    """The training step of the ``potential`` workload for ``provider`` (``triton``: the
    package's ``segmented_sum`` and ``segmented_mean``; ``index_add``: PyTorch's
    ``index_add`` and a division by the atom counts); returns ``(step, parameters)``."""
    import packed_kernels as pk

    idx, lengths = potential_layout(molecules)
    N = idx.shape[0]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    positions = torch.randn(N, 3, device=DEVICE, generator=g).requires_grad_()
    energy_ref = torch.randn(molecules, device=DEVICE, generator=g)
    force_ref = torch.randn(N, 3, device=DEVICE, generator=g)
    with torch.random.fork_rng(devices=[]):  # the same weights for every provider
        torch.manual_seed(4)
        mlp = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden),
                                  torch.nn.SiLU(), torch.nn.Linear(hidden, 1)).to(DEVICE)
    parameters = list(mlp.parameters())
    counts = lengths.to(torch.float32)

    if provider == "triton":
        def per_molecule_sum(values):
            return pk.segmented_sum(values, idx, molecules)

        def per_molecule_mean(values):
            return pk.segmented_mean(values, idx, molecules)
    elif provider == "index_add":
        def per_molecule_sum(values):
            return _scatter_sum(values, idx, molecules)

        def per_molecule_mean(values):
            return _scatter_sum(values, idx, molecules) / counts
    else:
        raise ValueError(provider)

    def step():
        atom_energy = mlp(positions).squeeze(-1)
        energy = per_molecule_sum(atom_energy)
        (gradient,) = torch.autograd.grad(energy.sum(), positions, create_graph=True)
        force_error = (-gradient - force_ref).square().sum(-1)
        loss = (energy - energy_ref).square().mean() + per_molecule_mean(force_error).mean()
        return torch.autograd.grad(loss, parameters)

    return step, parameters


def _potential_provider(provider: str, mode: str, molecules: int):
    def factory():
        if mode == "compiled":
            step, _ = potential_step(provider, molecules)
            return torch.compile(step)
        step, _ = potential_step(provider, molecules)
        return _timed(step, mode)
    return factory


# --- the mHC mixing step -------------------------------------------------------------------------

def _mhc_provider(provider: str, mode: str, tokens: int):
    def factory():
        import packed_kernels as pk
        from ..ops.sinkhorn.padded_torch import sinkhorn_padded

        g = torch.Generator(device=DEVICE).manual_seed(2)
        logits = torch.randn(tokens, 4, 4, device=DEVICE, generator=g).requires_grad_()
        weight = torch.randn(tokens, 4, 4, device=DEVICE, generator=g)
        project = (lambda x: pk.sinkhorn(x, _SINKHORN_ITERS)) if provider == "triton" else (
            lambda x: sinkhorn_padded(x, _SINKHORN_ITERS))

        def step():
            return torch.autograd.grad((project(logits) * weight).sum(), logits)

        if mode == "compiled":
            return torch.compile(step)
        return _timed(step, mode)
    return factory


# --- the CTC head ----------------------------------------------------------------------------------

def _ctc_provider(provider: str, mode: str, B: int, T: int):
    def factory():
        import torch.nn.functional as F

        import packed_kernels as pk

        g = torch.Generator(device=DEVICE).manual_seed(3)
        U = T // 5
        frames = torch.full((B,), T, dtype=torch.int64, device=DEVICE)
        target_lengths = torch.full((B,), U, dtype=torch.int64, device=DEVICE)
        targets = torch.randint(1, _CTC_CLASSES, (B, U), device=DEVICE, generator=g)
        if provider == "triton":
            log_probs = torch.randn(B * T, _CTC_CLASSES, device=DEVICE, generator=g).log_softmax(-1)
            cu_seqlens = pk.cu_seqlens_from_lengths(frames)

            def loss_of(x):
                return pk.packed_ctc_loss(x, cu_seqlens, targets, target_lengths)
        else:
            log_probs = torch.randn(T, B, _CTC_CLASSES, device=DEVICE, generator=g).log_softmax(-1)

            def loss_of(x):
                return F.ctc_loss(x, targets, frames, target_lengths)
        log_probs.requires_grad_()

        def step():
            return torch.autograd.grad(loss_of(log_probs), log_probs)

        if mode == "compiled":
            return torch.compile(step)
        return _timed(step, mode)
    return factory


# --- pyannote's segmentation model ---------------------------------------------------------------

def _segmentation_provider(provider: str, mode: str, chunks: int):
    def factory():
        import packed_kernels as pk

        shape = _SEGMENTATION
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            lstm = torch.nn.LSTM(shape["features"], shape["hidden"], num_layers=shape["layers"],
                                 bidirectional=True, batch_first=True).to(DEVICE).eval()
        g = torch.Generator(device=DEVICE).manual_seed(5)
        frames = torch.randn(chunks, shape["frames"], shape["features"], device=DEVICE, generator=g)
        model = pk.PersistentLSTM.from_torch(lstm) if provider == "triton" else lstm

        def step():
            with torch.no_grad():
                return model(frames)

        if mode == "compiled":
            return torch.compile(step)
        return _timed(step, mode)
    return factory


def cases() -> Iterable[Case]:
    modes = ("eager", "graph")
    for molecules in _MOLECULES:
        providers = {f"{p}_{m}": _potential_provider(p, m, molecules) for p in ("triton", "index_add") for m in modes}
        providers["index_add_compiled"] = _potential_provider("index_add", "compiled", molecules)
        yield Case("potential", {"size": molecules}, providers)
    for tokens in _TOKENS:
        providers = {f"{p}_{m}": _mhc_provider(p, m, tokens) for p in ("triton", "torch_loop") for m in modes}
        providers["torch_loop_compiled"] = _mhc_provider("torch_loop", "compiled", tokens)
        yield Case("mhc", {"size": tokens}, providers)
    for B, T in _CTC_SHAPES:
        providers = {f"{p}_{m}": _ctc_provider(p, m, B, T) for p in ("triton", "torch") for m in modes}
        providers["torch_compiled"] = _ctc_provider("torch", "compiled", B, T)
        yield Case("ctc_head", {"size": B * T, "B": B, "T": T}, providers)
    for chunks in _CHUNKS:
        providers = {f"{p}_{m}": _segmentation_provider(p, m, chunks) for p in ("triton", "cudnn") for m in modes}
        providers["cudnn_compiled"] = _segmentation_provider("cudnn", "compiled", chunks)
        yield Case("segmentation", {"size": chunks}, providers)


def provider_names() -> List[str]:
    return sorted({name for case in cases() for name in case.providers})
