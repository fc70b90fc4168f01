"""Host time per eager call of every public function, at the sizes models call them with.

``python -m packed_kernels.bench.host [--out DIR] [--label NAME]`` (or run as a file with
another ``packed_kernels`` first on ``PYTHONPATH``, to measure that one beside this):
for each call, with the GPU idle, the wall time of 1,000 calls in a row divided by
1,000 (``host_us``, the best of three rounds: the calls' own Python, checks, allocations
and launches, as long as the GPU keeps up) and the same with the final wait for the GPU
(``wall_us``); whether the call synchronises (``syncs``: it raises under
``torch.cuda.set_sync_debug_mode("error")``); and how long it takes to return when
queued behind a kernel that keeps the GPU busy for about a second (``queued_ms``: a call
that waits for the device, an event wait included, takes that second). Uses the public
API only. Writes ``DIR/host.csv``; needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

CALLS = 1000


def _host_time(fn: Callable[[], object], calls: int) -> Tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        rounds.append(((queued - start) / calls * 1e6, (done - start) / calls * 1e6))
    return min(rounds)


def _synchronises(fn: Callable[[], object]) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "no"
    except RuntimeError as error:
        return "yes: " + str(error).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def _queued_ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU spin
    start = time.perf_counter()
    fn()
    returned = time.perf_counter() - start
    torch.cuda.synchronize()
    return returned * 1e3


def calls() -> Dict[str, Tuple[str, Callable[[], object]]]:
    """``name -> (size, call)``: every public function at a model's size, and two
    references (``index_add_``, an empty Triton launch)."""
    import triton
    import triton.language as tl

    import packed_kernels as pk

    device = "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    out: Dict[str, Tuple[str, Callable[[], object]]] = {}
    molecules, atoms = 64, 30
    N = molecules * atoms
    idx = torch.arange(molecules, device=device).repeat_interleave(atoms)
    x = torch.randn(N, device=device, generator=g)
    x3 = torch.randn(N, 3, device=device, generator=g)
    y3 = torch.randn(N, 3, device=device, generator=g)
    per_molecule = torch.randn(molecules, 3, device=device, generator=g)
    cells = torch.randn(molecules, 3, 3, device=device, generator=g)
    x3g = x3.clone().requires_grad_()
    size = f"N={N} S={molecules}"
    out["index_add_ forward"] = (size, lambda: torch.zeros(molecules, device=device).index_add_(0, idx, x))

    @triton.jit
    def _empty(ptr, BLOCK: tl.constexpr):
        pass

    out["empty Triton launch"] = ("1 program", lambda: _empty[(1,)](x, BLOCK=16))
    out["segmented_sum forward"] = (size, lambda: pk.segmented_sum(x, idx, molecules))
    out["segmented_sum (N, 3) forward"] = (size, lambda: pk.segmented_sum(x3, idx, molecules))
    out["segmented_mean forward"] = (size, lambda: pk.segmented_mean(x3, idx, molecules))
    out["segmented_dot forward"] = (size, lambda: pk.segmented_dot(x3, y3, idx, molecules))
    out["segmented_mul forward"] = (size, lambda: pk.segmented_mul(x3, per_molecule, idx, molecules))
    out["segmented_rms_norm forward"] = (size, lambda: pk.segmented_rms_norm(x3, idx, molecules))
    out["segmented_matvec forward"] = (size, lambda: pk.segmented_matvec(x3, cells, idx, molecules))
    out["segmented_sum (N, 3) fwd+bwd"] = (size, lambda: torch.autograd.grad(
        pk.segmented_sum(x3g, idx, molecules).sum(), x3g))
    out["index_add (N, 3) fwd+bwd"] = (size, lambda: torch.autograd.grad(
        torch.zeros(molecules, 3, device=device).index_add(0, idx, x3g).sum(), x3g))

    tokens = 4096
    logits = torch.randn(tokens, 4, 4, device=device, generator=g)
    logits_g = logits.clone().requires_grad_()
    out["sinkhorn forward"] = (f"n=4 tokens={tokens}", lambda: pk.sinkhorn(logits))
    out["sinkhorn fwd+bwd"] = (f"n=4 tokens={tokens}", lambda: torch.autograd.grad(
        pk.sinkhorn(logits_g).sum(), logits_g))
    out["sinkhorn_backward"] = (f"n=4 tokens={tokens}", lambda: pk.sinkhorn_backward(logits, logits))

    B, T, C, U = 8, 200, 128, 40
    cu = pk.cu_seqlens_from_lengths(torch.full((B,), T, device=device))
    targets = torch.randint(1, C, (B, U), device=device, generator=g)
    target_lengths = torch.full((B,), U, device=device)
    log_probs = torch.randn(B * T, C, device=device, generator=g).log_softmax(-1).requires_grad_()
    logits_ctc = torch.randn(B * T, C, device=device, generator=g).requires_grad_()
    hidden = torch.randn(B * T, 64, device=device, generator=g).requires_grad_()
    head = torch.nn.Linear(64, C).to(device)
    ctc = f"B={B} T={T} C={C}"
    out["packed_ctc_loss forward"] = (ctc, lambda: pk.packed_ctc_loss(log_probs.detach(), cu, targets,
                                                                      target_lengths))
    out["packed_ctc_loss fwd+bwd"] = (ctc, lambda: torch.autograd.grad(
        pk.packed_ctc_loss(log_probs, cu, targets, target_lengths), log_probs))
    out["packed_ctc_loss_from_logits fwd+bwd"] = (ctc, lambda: torch.autograd.grad(
        pk.packed_ctc_loss_from_logits(logits_ctc, cu, targets, target_lengths), logits_ctc))
    out["linear_packed_ctc_loss fwd+bwd"] = (ctc + " D=64", lambda: torch.autograd.grad(
        pk.linear_packed_ctc_loss(hidden, head.weight, head.bias, cu, targets, target_lengths), hidden))

    lstm = torch.nn.LSTM(60, 128, num_layers=4, bidirectional=True, batch_first=True).to(device).eval()
    fast = pk.PersistentLSTM.from_torch(lstm)
    frames = torch.randn(2, 50, 60, device=device, generator=g)
    packed = pk.pack(frames, torch.tensor([50, 30], device=device))
    sequence = packed.to_packed_sequence()

    def inference(batch):
        def run():
            with torch.no_grad():
                return fast(batch)
        return run

    out["PersistentLSTM tensor"] = ("B=2 T=50 4x2x128", inference(frames))
    out["PersistentLSTM Packed"] = ("B=2 T<=50 4x2x128", inference(packed))
    out["PersistentLSTM PackedSequence"] = ("B=2 T<=50 4x2x128", inference(sequence))
    return out


def measure(label: str) -> List[dict]:
    import triton

    import packed_kernels as pk

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda or "", "date": time.strftime("%Y-%m-%d")}
    rows = []
    for name, (size, fn) in calls().items():
        row = {"package": label, "call": name, "size": size}
        try:
            row["syncs"] = _synchronises(fn)
            row["queued_ms"] = round(_queued_ms(fn), 3)
            row["host_us"], row["wall_us"] = (round(v, 2) for v in _host_time(fn, 200 if "LSTM" in name else CALLS))
            row["error"] = ""
        except Exception as error:  # a call the package in hand does not have
            row.update(syncs="", queued_ms="", host_us="", wall_us="", error=f"{type(error).__name__}: {error}"[:160])
        row.update(env, package_path=os.path.dirname(pk.__file__))
        print(f"{label:8s} {name:40s} {size:22s} host {row['host_us']!s:>8s} us  wall {row['wall_us']!s:>8s} us  "
              f"queued {row['queued_ms']!s:>8s} ms  syncs {row['syncs']} {row['error']}", flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", default=os.path.join("book", "results"))
    parser.add_argument("--label", default="package")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host times need a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import csv

    rows = measure(args.label)
    path = os.path.join(args.out, "host.csv")
    os.makedirs(args.out, exist_ok=True)
    previous = []
    if os.path.exists(path):
        with open(path, newline="") as fh:
            previous = [r for r in csv.DictReader(fh) if r.get("package") != args.label]
    columns = list(dict.fromkeys(k for r in previous + rows for k in r))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(previous + rows)
    print(f"wrote {len(rows)} rows ({args.label}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
