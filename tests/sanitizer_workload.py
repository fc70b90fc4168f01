"""Every kernel of the package, called through the public API at several shapes (empty
and one-element cases included), forward and backward: the workload that
``compute-sanitizer`` checks on a GPU (see ``tests/gpu_check.sh``). Each call is also
compared with a reference, so a run reports wrong results as well as bad accesses.

``python tests/sanitizer_workload.py [--quick] [ctc sinkhorn segment lstm]`` (default:
all; ``--quick`` keeps the smallest shapes, to try the script under the interpreter).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import packed_kernels as pk

DEVICE = pk.runtime.KERNEL_DEVICE
QUICK = "--quick" in sys.argv


def _shapes(shapes, quick=2):
    return shapes[:quick] if QUICK else shapes


def _check(name, actual, expected, tol):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def ctc():
    for B, T, C, U in _shapes([(1, 1, 2, 1), (3, 0, 5, 2), (4, 37, 29, 6), (16, 300, 1025, 40)], 3):
        torch.manual_seed(B * 1000 + T)
        lengths = torch.randint(max(T // 2, 0), T + 1, (B,)) if T else torch.zeros(B, dtype=torch.int64)
        lengths[0] = T
        logits = torch.randn(int(lengths.sum()), C, device=DEVICE, requires_grad=True)
        targets = torch.randint(1, C, (B, U), device=DEVICE)
        target_lengths = torch.randint(0, U + 1, (B,), device=DEVICE)
        cu = pk.cu_seqlens_from_lengths(lengths.to(DEVICE))
        for reduction in ("none", "sum", "mean"):
            loss = pk.packed_ctc_loss(logits.log_softmax(-1), cu, targets, target_lengths, reduction=reduction,
                                      zero_infinity=True)
            (grad,) = torch.autograd.grad(loss.sum(), logits)
            padded = pk.unpack(pk.Packed(logits.log_softmax(-1), cu, lengths.to(DEVICE))).transpose(0, 1)
            if T:
                reference = F.ctc_loss(padded, targets, lengths, target_lengths, reduction=reduction,
                                       zero_infinity=True)
                _check(f"ctc B{B}-T{T}-C{C} {reduction}", loss, reference, 1e-3)
            assert torch.isfinite(grad).all()
    print("ctc ok")


def sinkhorn():
    for n in (1, 2, 3, 4, 5, 8, 16, 32):
        for tokens in _shapes((0, 1, 1000, 70000 if n <= 8 else 5000)):
            logits = torch.randn(tokens, n, n, device=DEVICE, requires_grad=True)
            for backward in ("implicit", "unrolled"):
                R = pk.sinkhorn(logits, 20, backward=backward)
                (grad,) = torch.autograd.grad(R, logits, torch.randn_like(R)) if tokens else (None,)
                if tokens:
                    _check(f"sinkhorn n{n} rows", R.sum(-1), torch.ones_like(R.sum(-1)), 1e-4)
                    assert torch.isfinite(grad).all()
            if tokens:
                pk.sinkhorn(logits.detach(), 20, cg_iters=2 * n).sum()
    print("sinkhorn ok")


def segment():
    for N, S, D in _shapes([(0, 3, 3), (1, 1, 1), (1000, 37, 3), (200000, 20, 3), (50000, 4000, 64), (300000, 30, 1)], 3):
        torch.manual_seed(N + S)
        idx = torch.sort(torch.randint(0, S, (N,), device=DEVICE)).values.to(torch.int32)
        x = torch.randn(N, D, device=DEVICE, dtype=torch.float64, requires_grad=True)
        y = torch.randn(N, D, device=DEVICE, dtype=torch.float64, requires_grad=True)
        scale = torch.randn(S, D, device=DEVICE, dtype=torch.float64, requires_grad=True)
        sums = torch.zeros(S, D, device=DEVICE, dtype=torch.float64).index_add(0, idx.long(), x)
        _check(f"segment sum N{N}-S{S}-D{D}", pk.segmented_sum(x, idx, S), sums, 1e-9)
        outputs = [pk.segmented_sum(x, idx, S), pk.segmented_mean(x, idx, S), pk.segmented_dot(x, y, idx, S),
                   pk.segmented_mul(x, scale, idx, S), pk.segmented_rms_norm(x, idx, S)]
        if D == 3:
            m = torch.randn(S, 3, 3, device=DEVICE, dtype=torch.float64, requires_grad=True)
            outputs.append(pk.segmented_matvec(x, m, idx, S))
        total = sum(o.square().sum() for o in outputs)
        grads = torch.autograd.grad(total, [x, y, scale], create_graph=True)
        sum(g.square().sum() for g in grads).backward()
    print("segment ok")


def lstm():
    for hidden, batch, layers in _shapes([(32, 1, 1), (64, 8, 2), (128, 32, 2), (128, 256, 1), (256, 16, 1)], 1):
        torch.manual_seed(hidden + batch)
        module = torch.nn.LSTM(24, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        module = module.to(DEVICE).eval()
        fast = pk.PersistentLSTM.from_torch(module)
        x = torch.randn(batch, 50, 24, device=DEVICE)
        lengths = torch.randint(0, 51, (batch,), device=DEVICE)
        lengths[0] = 50
        with torch.no_grad():
            _check(f"lstm H{hidden}-B{batch}", fast(x)[0], module(x)[0], 1e-4)
            fast(pk.pack(x, lengths))
    print("lstm ok")


if __name__ == "__main__":
    chosen = [a for a in sys.argv[1:] if a != "--quick"] or ["ctc", "sinkhorn", "segment", "lstm"]
    for name in chosen:
        globals()[name]()
