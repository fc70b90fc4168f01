"""Data-parallel training over packed batches with ``DistributedDataParallel``, checked.

A tiny speech recogniser trains on packed (padding-free) utterances: a bidirectional
``nn.LSTM`` encoder, per-utterance RMS normalisation and a gate computed from each
utterance's mean frame (``segmented_rms_norm``, ``segmented_mean``, ``segmented_mul``),
a classifier, and ``packed_ctc_loss``. Each rank trains on its own shard of the batch;
DDP averages the gradients over the ranks. After every step rank 0 checks that the
averaged gradients equal the gradients of one process on the whole batch, then the
trained encoder runs inference through ``PersistentLSTM`` (eval, no grad) and is checked
against ``nn.LSTM``. A short table is printed and the exit status is 1 on any mismatch.

Run (two processes; on a machine with two GPUs one GPU per process and NCCL; with one
GPU both processes on it and gloo; without a GPU on the CPU with gloo, the Triton kernels
interpreted)::

    torchrun --standalone --nproc_per_node 2 examples/ddp_training.py [--steps N]

Why the all-reduced gradient is the full-batch gradient. The full-batch loss is

    L = (1 / B) sum_b nll_b,

``nll_b`` the CTC loss of utterance ``b`` (``reduction="sum"`` over a shard gives
``sum_{b in shard} nll_b``) and ``B`` the global batch size. DDP averages the ranks'
gradients: ``g = (1 / W) sum_r grad L_r`` over ``W`` ranks. With each rank's loss

    L_r = (W / B) sum_{b in shard r} nll_b,

``g = (1 / B) sum_r sum_{b in shard r} grad nll_b = grad L`` for shards of any sizes
(here they differ by one utterance). Nothing else in the model mixes utterances: the
segment operations reduce within each utterance, so every ``nll_b`` depends on its own
utterance only. (``reduction="mean"``, per shard, would agree only for equal shards:
a mean of shard means is the batch mean only when every shard has as many utterances.)
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import packed_kernels as pk

FEATURES, HIDDEN, CLASSES = 5, 8, 6
#: utterances in the global batch (an odd number: the two shards differ in size)
GLOBAL_BATCH = 5
MAX_FRAMES, MAX_LABELS = 9, 3
#: ``|ddp - full| <= ATOL_SCALE * max|full| + RTOL * |full|`` per tensor: float32
#: rounding of sums taken in another order, with a wide margin
RTOL, ATOL_SCALE = 1e-4, 1e-5
#: ``PersistentLSTM`` against ``nn.LSTM`` in float32 (TF32 off)
LSTM_TOL = 1e-5


class Batch(NamedTuple):
    """A packed batch of utterances: frames ``(N, FEATURES)`` with their offsets, and
    padded CTC targets ``(B, U)`` with their lengths."""

    frames: pk.Packed
    targets: torch.Tensor
    target_lengths: torch.Tensor

    @property
    def size(self) -> int:
        return self.frames.batch_size


def make_batch(seed: int, device: torch.device) -> Batch:
    """The same random global batch on every rank (a seeded generator on the host)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, MAX_FRAMES + 1, (GLOBAL_BATCH,), generator=generator)
    # 2U + 1 frames always suffice for U labels, so no utterance is impossible
    target_lengths = torch.minimum(torch.randint(0, MAX_LABELS + 1, (GLOBAL_BATCH,), generator=generator),
                                   (lengths - 1) // 2)
    targets = torch.randint(1, CLASSES, (GLOBAL_BATCH, MAX_LABELS), generator=generator)
    padded = torch.randn(GLOBAL_BATCH, MAX_FRAMES, FEATURES, generator=generator)
    frames = pk.pack(padded, lengths).to(device)
    return Batch(frames, targets.to(device), target_lengths.to(device))


def shard(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank ``rank``'s contiguous share of the utterances (sizes differ by at most one)."""
    per, extra = divmod(batch.size, world_size)
    start = rank * per + min(rank, extra)
    stop = start + per + (rank < extra)
    cu = batch.frames.cu_seqlens
    first, last = int(cu[start]), int(cu[stop])
    lengths = batch.frames.lengths[start:stop]
    frames = pk.Packed(batch.frames.data[first:last], pk.cu_seqlens_from_lengths(lengths), lengths)
    return Batch(frames, batch.targets[start:stop], batch.target_lengths[start:stop])


class Recogniser(nn.Module):
    """Packed frames ``(N, FEATURES)`` -> per-frame log-probabilities ``(N, CLASSES)``."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.LSTM(FEATURES, HIDDEN, bidirectional=True, batch_first=True)
        self.gate = nn.Linear(2 * HIDDEN, 2 * HIDDEN)
        self.classifier = nn.Linear(2 * HIDDEN, CLASSES)

    def encode(self, frames: pk.Packed) -> torch.Tensor:
        """The encoder's packed output ``(N, 2 HIDDEN)``, through ``nn.LSTM`` (differentiable)."""
        out, _ = self.encoder(frames.to_packed_sequence())
        return pk.Packed.from_packed_sequence(out).data

    def head(self, encoded: torch.Tensor, frames: pk.Packed) -> torch.Tensor:
        """Everything after the encoder. With ``s = idx[i]`` the utterance of frame ``i``:
        ``h_i = e_i / rms_s``, ``gate_s = sigmoid(W mean_{j in s} h_j + b)``,
        ``out_i = log_softmax(classifier(h_i * gate_s))``."""
        idx = pk.segment_ids_from_lengths(frames.lengths)
        B = frames.batch_size
        rms = pk.segmented_rms_norm(encoded, idx, B)
        normalised = encoded / (rms[idx.long()] + 1e-6)[:, None]
        gate = torch.sigmoid(self.gate(pk.segmented_mean(normalised, idx, B)))
        return self.classifier(pk.segmented_mul(normalised, gate, idx, B)).log_softmax(-1)

    def forward(self, frames: pk.Packed) -> torch.Tensor:
        return self.head(self.encode(frames), frames)


def ctc_sum(log_probs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``sum_b nll_b`` over the utterances of ``batch``."""
    return pk.packed_ctc_loss(log_probs, batch.frames.cu_seqlens, batch.targets, batch.target_lengths,
                              blank=0, reduction="sum")


def within_tolerance(actual: torch.Tensor, expected: torch.Tensor) -> Tuple[float, float]:
    """``(max |actual - expected|, max excess over the bound)``; the excess is <= 0 when
    every element is within ``ATOL_SCALE * max|expected| + RTOL * |expected|``."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    diff = (actual - expected).abs()
    if diff.numel() == 0:
        return 0.0, -1.0
    bound = ATOL_SCALE * float(expected.abs().max()) + RTOL * expected.abs()
    if not torch.isfinite(diff).all():
        return math.inf, math.inf
    return float(diff.max()), float((diff - bound).max())


def flat_gradients(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def setup() -> Tuple[int, int, torch.device, str]:
    """The process group from torchrun's environment: NCCL with one GPU per rank
    (``LOCAL_RANK``) where there are as many GPUs as ranks; gloo with the ranks sharing
    the GPUs where there are fewer (NCCL refuses two ranks on one GPU); gloo on the CPU
    where CUDA is not available."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(local_rank % gpus)
        device = torch.device("cuda", local_rank % gpus)
        backend = "nccl" if gpus >= local_ranks else "gloo"
        # float32 references: no TF32 in the LSTM or the linear layers
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    if device.type == "cpu":
        # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return dist.get_rank(), dist.get_world_size(), device, backend


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps, each checked (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")

    rank, world_size, device, backend = setup()
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = Recogniser().to(device)
    reference = copy.deepcopy(model) if rank == 0 else None
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1) if rank == 0 else None

    names = [name for name, _ in model.named_parameters()]
    # worst (max abs difference, excess over the bound) per row of the table
    worst: Dict[str, List[float]] = {}

    def record(row: str, diff: float, excess: float) -> None:
        old = worst.setdefault(row, [0.0, -math.inf])
        worst[row] = [max(old[0], diff), max(old[1], excess)]

    for step in range(args.steps):
        batch = make_batch(args.seed * 1000 + step, device)
        local = shard(batch, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        local_sum = ctc_sum(ddp(local.frames), local)
        (local_sum * (world_size / batch.size)).backward()  # see the module docstring
        total = local_sum.detach().clone()
        dist.all_reduce(total)

        # every rank holds the same all-reduced gradients: compare each with rank 0's
        grads = flat_gradients(model)
        from_rank0 = grads.clone()
        dist.broadcast(from_rank0, src=0)
        spread = (grads - from_rank0).abs().max().reshape(1)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        record("gradients equal on every rank", float(spread), float(spread))

        if rank == 0:
            reference_optimizer.zero_grad(set_to_none=True)
            full_sum = ctc_sum(reference(batch.frames), batch)
            (full_sum / batch.size).backward()
            record("CTC loss (sum over ranks)", *within_tolerance(total, full_sum))
            for name, p, q in zip(names, model.parameters(), reference.parameters()):
                record(name, *within_tolerance(p.grad, q.grad))
            reference_optimizer.step()
        optimizer.step()

    # inference: the trained encoder through the persistent kernels, on every rank's shard
    model.eval()
    fast_encoder = pk.PersistentLSTM.from_torch(model.encoder)
    local = shard(make_batch(args.seed * 1000 + args.steps, device), rank, world_size)
    with torch.no_grad():
        encoded, _ = fast_encoder(local.frames)
        expected = model.encode(local.frames)
        log_probs = model.head(encoded.data, local.frames)
        expected_log_probs = model.head(expected, local.frames)
    errors = torch.tensor([(encoded.data - expected).abs().max().item(),
                           (log_probs - expected_log_probs).abs().max().item()], device=device, dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    record("PersistentLSTM encoder vs nn.LSTM", float(errors[0]), float(errors[0]) - LSTM_TOL)
    record("PersistentLSTM log-probs vs nn.LSTM", float(errors[1]), float(errors[1]) - LSTM_TOL)

    ok = torch.tensor([int(rank != 0 or all(excess <= 0 for _, excess in worst.values()))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{world_size} ranks, {backend} on {device.type}; global batch {GLOBAL_BATCH} utterances "
              f"(shards of {[shard(batch, r, world_size).size for r in range(world_size)]}); {args.steps} steps; "
              f"Triton kernels {'interpreted' if pk.runtime.INTERPRETED else 'compiled'}")
        print(f"{'checked against one process on the whole batch':48s} {'max |diff|':>10s}  result")
        for row, (diff, excess) in worst.items():
            print(f"{row:48s} {diff:10.2e}  {'ok' if excess <= 0 else 'MISMATCH'}")
        print("all match" if ok.item() else "MISMATCH", flush=True)
    dist.barrier()  # no rank exits (which makes torchrun stop the others) before the table is out
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
