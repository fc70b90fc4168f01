"""Every public function of the package and every kernel configuration its choosers
select, called at several shapes (empty and one-element cases included), forward and
backward: the workload that ``compute-sanitizer`` checks on a GPU (see
``tests/gpu_check.sh``). Each call is also compared with an independent reference
(float64 PyTorch, ``nn.LSTM``, exact expectations), so a run reports wrong results as
well as bad accesses; the exit status is 1 when any comparison fails.

``python tests/sanitizer_workload.py [--quick | --small] [--progress] [SECTION ...]``

Sections (default: all but ``sinkhorn_tile``, which ``sinkhorn`` contains):

* ``packing``: ``pack``, ``unpack``, offsets and segment ids, the other layouts.
* ``ctc``: ``packed_ctc_loss`` (and ``packed_ctc_loss_from_logits`` and
  ``linear_packed_ctc_loss`` where the package has them) over every reduction,
  ``zero_infinity``, dtype, index dtype and stride, zero-frame utterances, impossible
  alignments, targets wider than one warp and vocabularies wider than one class tile.
* ``sinkhorn``: ``sinkhorn`` (both backwards) and ``sinkhorn_backward`` at every ``n``
  path (the one-matrix-per-thread kernels at ``n`` = 2, 4, 8; the tile kernels at the
  others, padded and unpadded), the direct solve and conjugate gradient, the unrolled
  backward from registers, from its scratch buffer and through checkpoint segments,
  inputs in slices; ``sinkhorn_tile``: the tile kernels only.
* ``segment``: the six ``segmented_*`` functions, their first and second derivatives,
  on the in-order and the scan first pass, several column blocks, empty segments, at
  the default launch configuration and at a small one that drives many chunks and
  combine blocks through small inputs.
* ``lstm``: ``PersistentLSTM`` on padded, ``Packed``, ``PackedSequence`` and unbatched
  inputs, with the chooser's configuration and, on a GPU, the cooperative ones (programs
  exchanging ``h`` through tagged words, a step counter, tensor cores, several tiles a
  program, batches over several launches) as well as the single-program ones.

Sizes: the default is every case (on a GPU, for ``memcheck``); ``--small`` keeps every
configuration at small shapes (for the slower ``racecheck`` and ``synccheck``);
``--quick`` keeps the smallest shapes and fewer dtypes, to run under the interpreter on
the CPU.
"""
from __future__ import annotations

import dataclasses
import sys
import time
import traceback
import zlib

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import packed_kernels as pk
from packed_kernels.ops.ctc.padded_torch import ctc_loss_padded
from packed_kernels.ops.lstm.triton_kernels import RecurrenceConfig, RecurrentProduct, StepWait
from packed_kernels.ops.segment import api as segment_api
from packed_kernels.ops.segment import triton_kernels as segment_kernels
from packed_kernels.ops.sinkhorn import padded_torch as sinkhorn_padded
from packed_kernels.ops.sinkhorn import triton_kernels as sinkhorn_kernels

DEVICE = pk.runtime.KERNEL_DEVICE
GPU = DEVICE == "cuda"
QUICK = "--quick" in sys.argv
SMALL = "--small" in sys.argv
#: ``--progress``: a line per comparison, with the seconds since the start, so that a run
#: stopped at its time limit (sanitizers slow every launch) shows how far it got
PROGRESS = "--progress" in sys.argv
_START = time.perf_counter()
SECTIONS = ("packing", "ctc", "sinkhorn", "sinkhorn_tile", "segment", "lstm")
DEFAULT_SECTIONS = ("packing", "ctc", "sinkhorn", "segment", "lstm")

# float32 references: no TF32 in PyTorch's products (nn.LSTM, the reference matmuls)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

#: the comparisons that failed, as messages
FAILURES: list = []
#: comparisons made
CHECKS = [0]


def sized(full, small=None, quick=None):
    """``full`` by default, ``small`` under ``--small``, ``quick`` under ``--quick``
    (each falling back to the larger one)."""
    small = full if small is None else small
    quick = small if quick is None else quick
    return quick if QUICK else small if SMALL else full


def generator(*key) -> torch.Generator:
    """A generator seeded from ``key`` (the same in every run)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, g, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(DEVICE, dtype)


def _count(name):
    CHECKS[0] += 1
    if PROGRESS:
        print(f"  {CHECKS[0]:5d} {time.perf_counter() - _START:8.1f} s  {name}", flush=True)


def check(name, actual, expected, tol, scale=None, floor=0.0):
    """``|actual - expected| <= tol * (scale + |expected|)``, ``scale`` the largest
    finite ``|expected|`` (at least ``floor``) unless given; NaN and infinities must sit
    in the same places."""
    _count(name)
    if actual is None or expected is None:
        if actual is not expected:
            FAILURES.append(f"{name}: got {type(actual).__name__}, expected {type(expected).__name__}")
        return
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        FAILURES.append(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
        return
    if a.numel() == 0:
        return
    finite = torch.isfinite(e)
    if not torch.equal(torch.isnan(a), torch.isnan(e)) or not torch.equal(a[torch.isinf(e)], e[torch.isinf(e)]):
        FAILURES.append(f"{name}: non-finite entries differ ({int((~torch.isfinite(a)).sum())} vs "
                        f"{int((~finite).sum())} of {a.numel()})")
        return
    if not finite.any():
        return
    a, e = a[finite], e[finite]
    scale = max(float(e.abs().max()), floor) if scale is None else scale
    diff = (a - e).abs()
    bad = diff > tol * (scale + e.abs())
    if bool(bad.any()):
        worst = int(torch.argmax(diff))
        FAILURES.append(f"{name}: {int(bad.sum())}/{bad.numel()} off (tol {tol:g}, scale {scale:.3g}); max diff "
                        f"{float(diff.max()):.3e}: got {float(a[worst]):.6g}, expected {float(e[worst]):.6g}")


def check_equal(name, actual, expected):
    _count(name)
    if actual.shape != expected.shape or actual.dtype != expected.dtype or not torch.equal(actual, expected):
        FAILURES.append(f"{name}: not bitwise equal ({tuple(actual.shape)} {actual.dtype} vs "
                        f"{tuple(expected.shape)} {expected.dtype})")


# --------------------------------------------------------------------------------------
# packing


def packing():
    for lengths in ([], [0], [1], [0, 0], [3, 0, 2], [5, 1, 1, 7]):
        g = generator("packing", *lengths)
        B, T = len(lengths), max(lengths, default=0)
        padded = randn((B, T + 1, 3), g)
        packed = pk.pack(padded, torch.tensor(lengths, dtype=torch.int64, device=DEVICE))
        expected = torch.cat([padded[b, :n] for b, n in enumerate(lengths)]) if B else padded.new_zeros(0, 3)
        check_equal(f"pack L{lengths} data", packed.data, expected)
        offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
        check_equal(f"pack L{lengths} cu_seqlens", packed.cu_seqlens.cpu(), offsets)
        check_equal(f"cu_seqlens_from_lengths L{lengths}", pk.cu_seqlens_from_lengths(lengths).cpu(), offsets)
        ids = torch.repeat_interleave(torch.arange(B, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int64))
        check_equal(f"segment_ids_from_lengths L{lengths}", pk.segment_ids_from_lengths(lengths).cpu(), ids)
        check_equal(f"segment_ids_from_cu_seqlens L{lengths}",
                    pk.segment_ids_from_cu_seqlens(offsets.to(DEVICE), dtype=torch.int64).cpu(), ids.long())
        mask = (torch.arange(T + 1, device=DEVICE)[None, :] < packed.lengths[:, None])[..., None]
        check_equal(f"unpack L{lengths}", pk.unpack(packed, total_length=T + 1), padded * mask)
        if B and min(lengths) > 0:
            sequence = packed.to_packed_sequence()
            reference = pack_padded_sequence(padded, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
            check_equal(f"to_packed_sequence L{lengths}", pad_packed_sequence(sequence, batch_first=True)[0],
                        pad_packed_sequence(reference, batch_first=True)[0])
            check_equal(f"from_packed_sequence L{lengths}", pk.Packed.from_packed_sequence(sequence).data,
                        packed.data)
        if B:
            check_equal(f"nested round trip L{lengths}", pk.Packed.from_nested(packed.to_nested()).data, packed.data)


# --------------------------------------------------------------------------------------
# CTC


def ctc_cases():
    """``(frame lengths, C, U, blank)``: no utterances, one frame, no frames at all,
    zero-frame utterances with the blank last, ordinary ones, targets of 70 labels (128
    lanes: several warps) with impossible alignments, vocabularies over one class tile."""
    return sized(
        full=[([], 5, 2, 0), ([1], 2, 1, 0), ([0, 0, 0], 5, 2, 0), ([0, 4, 1, 0, 6], 7, 3, 6),
              ([37, 20, 1, 36], 29, 6, 0), ([50, 2, 49, 140], 40, 70, 3), ([300] * 4 + [150] * 12, 1025, 40, 0),
              ([64, 3, 64], 1500, 20, 1499)],
        small=[([], 5, 2, 0), ([1], 2, 1, 0), ([0, 0, 0], 5, 2, 0), ([0, 4, 1, 0, 6], 7, 3, 6),
               ([37, 20, 1, 36], 29, 6, 0), ([50, 2, 49, 140], 40, 70, 3), ([9, 3], 1100, 5, 1099)],
        quick=[([], 5, 2, 0), ([1], 2, 1, 0), ([0, 0, 0], 5, 2, 0), ([0, 4, 1, 0, 6], 7, 3, 6),
               ([9, 3, 12], 20, 8, 0)])


def ctc_inputs(lengths, C, U, blank, g):
    """Targets with repeats, blank ids inside a target, and lengths from 0 to ``U``."""
    B = len(lengths)
    targets = torch.randint(0, C, (B, U), generator=g)
    if U >= 2:
        targets[::2, 1] = targets[::2, 0]  # a repeated label needs a blank between
    if B and U:
        targets[0, -1] = blank
    target_lengths = torch.randint(0, U + 1, (B,), generator=g)
    if B:
        target_lengths[-1] = U
    return targets.to(DEVICE), target_lengths.to(DEVICE)


def ctc_per_utterance(logits64, lengths, targets, target_lengths, blank):
    """Each utterance's loss of ``logits64.log_softmax(-1)``, differentiable: autograd
    through the padded float64 PyTorch recursion (``(0,)`` for no utterances)."""
    if not lengths:
        return logits64.new_zeros(0) + logits64.sum() * 0
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=logits64.device)
    padded = pk.unpack(pk.Packed(logits64.log_softmax(-1), pk.cu_seqlens_from_lengths(lengths_t), lengths_t),
                       total_length=max(max(lengths), 1))
    return ctc_loss_padded(padded, lengths_t, targets, target_lengths, blank, "none", False)


def ctc_reduce(nll, target_lengths, reduction, zero_infinity):
    """``F.ctc_loss``'s reductions: ``"mean"`` divides each loss by its target length
    (at least 1), then averages over the batch."""
    if zero_infinity:
        nll = torch.where(torch.isinf(nll), torch.zeros_like(nll), nll)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return (nll / target_lengths.clamp(min=1).to(nll.dtype)).mean()


def ctc_grad_checks(name, grad, ref_loss, x64, upstream, per_utterance, lengths_t, zero_infinity, tol):
    """The gradient of the logits on the frames of possible utterances against the
    reference's; on impossible ones 0 with ``zero_infinity``, NaN without."""
    if grad.shape[0] == 0:
        return
    (ref_grad,) = torch.autograd.grad(ref_loss, x64, upstream, retain_graph=True)
    possible = torch.repeat_interleave(torch.isfinite(per_utterance), lengths_t)
    check(f"{name} grad", grad[possible], ref_grad[possible], tol, scale=1.0)
    impossible = grad[~possible]
    expected = torch.zeros_like(impossible) if zero_infinity else torch.full_like(impossible, float("nan"))
    check(f"{name} grad of impossible utterances", impossible, expected, 0.0)


def ctc():
    reductions = ("none", "sum", "mean")
    for lengths, C, U, blank in ctc_cases():
        g = generator("ctc", *lengths, C, U)
        T_total, B = sum(lengths), len(lengths)
        targets, target_lengths = ctc_inputs(lengths, C, U, blank, g)
        logits = randn((T_total, C), g, torch.float64, scale=2.0)
        lengths_t = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
        weights = randn((B,), g, torch.float64)
        dtypes = sized((torch.float32, torch.float64, torch.float16, torch.bfloat16),
                       quick=(torch.float32, torch.float64))
        for dtype in dtypes:
            # the reference of the logits as the kernels see them (rounded to dtype)
            x64 = logits.to(dtype).double().requires_grad_()
            per_utterance = ctc_per_utterance(x64, lengths, targets, target_lengths, blank)
            nll = per_utterance.detach()
            variants = [(r, z) for r in reductions for z in (False, True)] if dtype == torch.float32 else \
                [("mean", True), ("none", False)]
            if QUICK and dtype == torch.float32:
                variants = [("none", False), ("sum", True), ("mean", False), ("mean", True)]
            tol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 3e-2, torch.bfloat16: 6e-2}[dtype]
            for variant, (reduction, zero_infinity) in enumerate(variants):
                name = f"ctc B{B}-T{T_total}-C{C}-U{U} blank{blank} {dtype} {reduction} zi{zero_infinity}"
                # index dtypes and strides vary with the variant
                cu = pk.cu_seqlens_from_lengths(lengths_t)
                if variant % 2:
                    cu, targets_v, target_lengths_v = cu.long(), targets.int(), target_lengths.int()
                else:
                    targets_v, target_lengths_v = targets, target_lengths
                x = logits.to(dtype).requires_grad_()
                log_probs = x.log_softmax(-1)
                if variant % 3 == 1:
                    log_probs = log_probs.t().contiguous().t()  # column-major (T_total, C)
                loss = pk.packed_ctc_loss(log_probs, cu, targets_v, target_lengths_v, blank=blank,
                                          reduction=reduction, zero_infinity=zero_infinity)
                if reduction != "none":
                    upstream = torch.ones((), dtype=torch.float64, device=DEVICE)
                elif variant % 4 == 0:
                    upstream = weights  # one weight per utterance
                else:
                    upstream = torch.ones((), dtype=torch.float64, device=DEVICE).expand(B)  # stride 0
                (grad,) = torch.autograd.grad(loss, x, upstream.to(loss.dtype))
                ref = ctc_reduce(per_utterance, target_lengths, reduction, zero_infinity)
                check(f"{name} loss", loss, ref, tol, floor=1.0)
                ctc_grad_checks(name, grad, ref, x64, upstream, nll, lengths_t, zero_infinity, tol)
                if dtype == torch.float32 and reduction != "none" and (not QUICK or variant == 1):
                    fused_ctc(name, x.detach(), cu, targets_v, target_lengths_v, blank, reduction, zero_infinity,
                              lengths, targets, target_lengths, lengths_t, g)


def fused_ctc(name, logits, cu, targets, target_lengths, blank, reduction, zero_infinity, lengths,
              targets_ref, target_lengths_ref, lengths_t, g):
    """The two losses that fuse the softmax or the classifier, where the package has them:
    against the padded float64 reference of the same logits."""
    T_total, C = logits.shape
    kwargs = dict(blank=blank, reduction=reduction, zero_infinity=zero_infinity)
    one = torch.ones((), dtype=torch.float64, device=DEVICE)
    if hasattr(pk, "packed_ctc_loss_from_logits"):
        x = logits.clone().requires_grad_()
        loss = pk.packed_ctc_loss_from_logits(x, cu, targets, target_lengths, **kwargs)
        (grad,) = torch.autograd.grad(loss, x)
        x64 = logits.double().requires_grad_()
        per_utterance = ctc_per_utterance(x64, lengths, targets_ref, target_lengths_ref, blank)
        ref = ctc_reduce(per_utterance, target_lengths_ref, reduction, zero_infinity)
        check(f"{name} from_logits loss", loss, ref, 1e-5, floor=1.0)
        ctc_grad_checks(f"{name} from_logits", grad, ref, x64, one, per_utterance.detach(), lengths_t,
                        zero_infinity, 1e-5)
    if hasattr(pk, "linear_packed_ctc_loss") and zero_infinity:
        D = 33 if C < 1000 else 64
        hidden = randn((T_total, D), g, scale=D ** -0.5)
        weight = randn((C, D), g)
        for bias_on, chunk_frames in sized(((True, None), (False, 1), (True, 7)), quick=((True, 7), (False, None))):
            bias = randn((C,), g) if bias_on else None
            leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
            loss = pk.linear_packed_ctc_loss(leaves[0], leaves[1], leaves[2] if bias_on else None, cu, targets,
                                             target_lengths, chunk_frames=chunk_frames, **kwargs)
            grads = torch.autograd.grad(loss, leaves)
            leaves64 = [t.detach().double().requires_grad_() for t in leaves]
            logits64 = leaves64[0] @ leaves64[1].T + (leaves64[2] if bias_on else 0)
            ref = ctc_reduce(ctc_per_utterance(logits64, lengths, targets_ref, target_lengths_ref, blank),
                             target_lengths_ref, reduction, zero_infinity)
            label = f"{name} linear bias{bias_on} chunk{chunk_frames}"
            check(f"{label} loss", loss, ref, 1e-5, floor=1.0)
            # zero_infinity: impossible utterances contribute nothing, so every gradient is finite
            for part, got, want in zip(("hidden", "weight", "bias"), grads,
                                       torch.autograd.grad(ref, leaves64, allow_unused=True)):
                check(f"{label} grad {part}", got, torch.zeros_like(got) if want is None else want, 1e-4)


# --------------------------------------------------------------------------------------
# Sinkhorn


def implicit_reference(R, grad_R):
    """The implicit gradient by a float64 least-squares solve of the weighted system
    ``[[diag(rowsum R), R], [R^T, diag(colsum R)]] [alpha; beta] = [rowsum(R dR); colsum(R dR)]``
    (singular along ``(1, -1)``, which leaves ``alpha_i + beta_j`` unchanged)."""
    R, grad_R = R.double(), grad_R.double()
    n = R.shape[-1]
    if R.shape[0] == 0:
        return torch.zeros_like(R)
    system = torch.cat([torch.cat([torch.diag_embed(R.sum(-1)), R], -1),
                        torch.cat([R.transpose(-1, -2), torch.diag_embed(R.sum(-2))], -1)], -2)
    G = R * grad_R
    rhs = torch.cat([G.sum(-1), G.sum(-2)], -1)[..., None]
    solution = (torch.linalg.pinv(system, hermitian=True) @ rhs)[..., 0]
    alpha, beta = solution[..., :n], solution[..., n:]
    return R * (grad_R - alpha[..., :, None] - beta[..., None, :])


#: tolerances of R (entries in [0, 1]) and of the gradients (relative to the largest)
SINKHORN_R_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SINKHORN_GRAD_TOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def _grad_scale(want, grad_R) -> float:
    """The gradient's natural size: its largest entry, or that of ``grad_R`` (``|dlogits|
    <= 2 max|grad_R|``) where the gradient vanishes (``n`` = 1)."""
    if want.numel() == 0:
        return 0.0
    return max(float(want.detach().abs().max()), float(grad_R.detach().abs().max()))


def _tile_layout(n: int) -> bool:
    # the backwards run the tile kernels wherever they do not take one token a thread
    # (the forward from n = 9 to 32 runs column groups, which share no memory)
    return sinkhorn_kernels.unrolled_backward_config(n, torch.float32, 20).layout is sinkhorn_kernels.Layout.TILE


def sinkhorn(tile_only: bool = False):
    ns = sized(full=(1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32), quick=(1, 2, 3, 4, 8))
    if tile_only:
        ns = [n for n in ns if _tile_layout(n)] + [4]  # n = 4: conjugate gradient takes the tile kernel
    for n in ns:
        if QUICK:
            dtypes = [torch.float32] + ([torch.float64] if n == 4 else [])
        else:
            dtypes = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if n in (2, 3, 4, 8, 16) else [])
        for dtype in dtypes:
            token_counts = sized(full=(0, 1, 3, 129, 1000), small=(0, 1, 129), quick=(0, 2))
            if dtype == torch.float32 and not SMALL and not QUICK:
                token_counts += (70000 if n <= 8 else 5000,)
            for tokens in token_counts:
                sinkhorn_case(n, dtype, tokens, tile_only)
    sinkhorn_slices(tile_only)


def sinkhorn_case(n, dtype, tokens, tile_only):
    g = generator("sinkhorn", n, str(dtype), tokens)
    tol = SINKHORN_R_TOL[dtype]
    # peaked enough that 40 iterations have not converged: every iterate shapes the
    # unrolled gradient (a converged tail would hide a wrong one)
    logits = randn((tokens, n, n), g, dtype, scale=3.0)
    name = f"sinkhorn n{n} T{tokens} {dtype}"
    # unrolled: 20 iterations from registers at n = 2, 4 and 40 from the scratch buffer
    # (always the scratch at n = 8); checkpoint segments in the tile kernel
    backwards = [("implicit", None), ("implicit", 1), ("implicit", 2 * n)]
    backwards += [("unrolled", iters) for iters in (1, 20, 40, 128)]
    if QUICK:
        backwards = [("implicit", None), ("implicit", 2 * n), ("unrolled", 20)] + \
            ([("unrolled", 40)] if n in (2, 4) else [])
    if tile_only and not _tile_layout(n):
        backwards = [("implicit", 1), ("implicit", 2 * n)]  # conjugate gradient: the tile kernel
    grad_R = randn((tokens, n, n), g, dtype)
    for backward, parameter in backwards:
        iters = parameter if backward == "unrolled" else 20
        cg_iters = parameter if backward == "implicit" else None
        x = logits.clone().requires_grad_()
        R = pk.sinkhorn(x, iters, backward=backward, cg_iters=cg_iters)
        (grad,) = torch.autograd.grad(R, x, grad_R)
        x64 = logits.double().requires_grad_()
        R64 = sinkhorn_padded.sinkhorn_padded(x64, iters)
        label = f"{name} {backward} {'iters' if backward == 'unrolled' else 'cg'}{parameter}"
        check(f"{label} R", R, R64, tol, scale=1.0)
        if backward == "unrolled":
            (want,) = torch.autograd.grad(R64, x64, grad_R.double())
        elif cg_iters is None or cg_iters == 2 * n:
            want = implicit_reference(R.detach(), grad_R.to(dtype))
        else:  # a few steps: the same conjugate gradient in float64
            want = sinkhorn_padded.implicit_backward_padded(R.detach().double(), grad_R.to(dtype).double(), cg_iters)
        check(f"{label} grad", grad, want, SINKHORN_GRAD_TOL[dtype], scale=_grad_scale(want, grad_R))
    if tokens and not tile_only:
        # the public implicit backward alone, grad_R of another dtype, leading dims and strides
        R = pk.sinkhorn(logits, 20)
        for cg_iters in sized((None, 2 * n), quick=(None,)):
            shaped = R.reshape(1, tokens, n, n).transpose(-1, -2)
            grad = pk.sinkhorn_backward(shaped, grad_R.double().reshape(shaped.shape), cg_iters=cg_iters)
            want = implicit_reference(shaped.reshape(-1, n, n), grad_R.reshape(-1, n, n).to(dtype))
            check(f"{name} sinkhorn_backward cg{cg_iters}", grad.reshape(-1, n, n), want, SINKHORN_GRAD_TOL[dtype],
                  scale=_grad_scale(want, grad_R))


def sinkhorn_slices(tile_only):
    """Inputs larger than one launch takes run in slices of whole tokens: with a small
    launch limit, every launcher's sliced result equals the one-launch result bitwise."""
    for n in [n for n in sized((3, 4, 8, 16), quick=(3,)) if _tile_layout(n) or not tile_only]:
        g = generator("slices", n)
        tokens = sized(300, quick=130)  # slices of 128 tokens
        logits = randn((tokens, n, n), g)
        grad_R = randn((tokens, n, n), g)
        limit = dict(max_launch_elements=128 * n * n)
        forward = sinkhorn_kernels.forward_config(n, torch.float32)
        R = sinkhorn_kernels.sinkhorn_forward_triton(logits, 20, forward)
        check_equal(f"sinkhorn slices n{n} forward",
                    sinkhorn_kernels.sinkhorn_forward_triton(logits, 20, dataclasses.replace(forward, **limit)), R)
        for cg_iters in sized((None, 2 * n), quick=(None,)):
            config = sinkhorn_kernels.implicit_backward_config(n, torch.float32, cg_iters is not None)
            whole = sinkhorn_kernels.sinkhorn_implicit_backward_triton(R, grad_R, cg_iters, config)
            sliced = sinkhorn_kernels.sinkhorn_implicit_backward_triton(R, grad_R, cg_iters,
                                                                        dataclasses.replace(config, **limit))
            check_equal(f"sinkhorn slices n{n} implicit cg{cg_iters}", sliced, whole)
        for iters in sized((20, 40), quick=(20,)):
            config = sinkhorn_kernels.unrolled_backward_config(n, torch.float32, iters)
            whole = sinkhorn_kernels.sinkhorn_unrolled_backward_triton(logits, grad_R, iters, config)
            sliced = sinkhorn_kernels.sinkhorn_unrolled_backward_triton(logits, grad_R, iters,
                                                                        dataclasses.replace(config, **limit))
            check_equal(f"sinkhorn slices n{n} unrolled iters{iters}", sliced, whole)


# --------------------------------------------------------------------------------------
# segment operations

#: chunks of a few rows, lanes of two rows, combine blocks of two partials, outputs
#: poisoned: many chunks and combine blocks through small inputs, unwritten rows show
SMALL_CHUNKS = dataclasses.replace(segment_kernels.segment_config(), chunk_elements=4, min_chunk_rows=4,
                                   rows_per_thread=2, vector_rows_per_thread=2, rows_in_order_threads=4,
                                   combine_parts=2, combine_back_parts=4, rowwise_elements=64, poison_outputs=True)


def segment_reference(op, inputs, idx, S):
    """The float64 operations by index_add and gather (autograd to any order)."""
    idx = idx.long()
    counts = torch.bincount(idx, minlength=S).to(torch.float64).clamp(min=1)

    def total(rows):
        return rows.new_zeros((S,) + rows.shape[1:]).index_add(0, idx, rows)

    x = inputs[0]
    if op == "sum":
        return total(x)
    if op == "mean":
        return total(x) / (counts if x.dim() == 1 else counts[:, None])
    if op == "dot":
        return total(x * inputs[1] if x.dim() == 1 else (x * inputs[1]).sum(-1))
    if op == "mul":
        y = inputs[1][idx]
        return x * (y[:, None] if y.dim() < x.dim() else y)
    if op == "rms_norm":
        s = total(x * x if x.dim() == 1 else (x * x).sum(-1)) / counts
        positive = s > 0
        return torch.where(positive, torch.sqrt(torch.where(positive, s, torch.ones_like(s))), torch.zeros_like(s))
    if op == "matvec":
        return torch.einsum("nd,ndk->nk", x, inputs[1][idx])
    raise AssertionError(op)


#: relative to the largest entry of each output and gradient (sums of many rows rounded
#: to the input dtype)
SEGMENT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

SEGMENT_PUBLIC = {"sum": pk.segmented_sum, "mean": pk.segmented_mean, "dot": pk.segmented_dot,
                  "mul": pk.segmented_mul, "rms_norm": pk.segmented_rms_norm, "matvec": pk.segmented_matvec}


def segment_inputs(op, N, S, width, dtype, g, broadcast=False):
    rows = (N,) if width is None else (N, width)
    x = randn(rows, g, dtype)
    if op in ("sum", "mean", "rms_norm"):
        return [x]
    if op == "dot":
        return [x, randn(rows, g, dtype)]
    if op == "mul":
        return [x, randn((S,) if broadcast else (S,) + rows[1:], g, dtype)]
    return [x, randn((S, width, 3 if width == 3 else 5), g, dtype)]  # matvec: (S, D, K)


def segment_orders(name, fn, op, inputs, idx, S, tol):
    """Output, first and second derivatives of ``fn`` (``w`` a differentiable cotangent,
    so that the second order runs the backward of every backward) against the float64
    reference."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    w = torch.randn(out.shape, generator=generator(name), dtype=torch.float64).to(DEVICE, out.dtype)
    w.requires_grad_()
    first = torch.autograd.grad((out * w).sum(), leaves, create_graph=True)
    v = [torch.randn(f.shape, generator=generator(name, k), dtype=torch.float64).to(DEVICE, f.dtype)
         for k, f in enumerate(first)]
    second_of = [*leaves, w]
    second = torch.autograd.grad(sum((f * vk).sum() for f, vk in zip(first, v)), second_of, allow_unused=True)

    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    w64 = w.detach().double().requires_grad_()
    out64 = segment_reference(op, leaves64, idx, S)
    first64 = torch.autograd.grad((out64 * w64).sum(), leaves64, create_graph=True)
    second64 = torch.autograd.grad(sum((f * vk.double()).sum() for f, vk in zip(first64, v)), [*leaves64, w64],
                                   allow_unused=True)
    check(f"{name} out", out, out64, tol)
    for k, (got, want) in enumerate(zip(first, first64)):
        check(f"{name} grad{k}", got, want, tol)
    # half precision: the first derivatives are rounded before the second differentiates
    # them, so entries that cancel exactly in float64 keep a rounding of the terms (order 1)
    floor = 1.0 if out.dtype in (torch.float16, torch.bfloat16) else 0.0
    for k, (got, want, like) in enumerate(zip(second, second64, second_of)):
        zeros = torch.zeros_like(like, dtype=torch.float64)
        check(f"{name} grad2 {k}", zeros if got is None else got, zeros if want is None else want, tol, floor=floor)


def segment_layouts():
    """``(name, lengths, extra empty segments)``: nothing, one row, empty segments
    around short and long ones, one long segment, random layouts."""
    g = torch.Generator().manual_seed(11)
    random_lengths = torch.randint(0, 60, (37,), generator=g).tolist()
    layouts = [("empty", [0, 0, 0], 0), ("none", [], 0), ("one", [1], 0), ("mixed", [3, 0, 5, 1, 0, 7, 2], 2),
               ("long", [600], 0), ("random", random_lengths, 1)]
    big = [("many-empty", torch.randint(0, 3, (4000,), generator=g).tolist(), 0),
           ("long-segments", [10000] * 20, 0)]
    return sized(full=layouts + big, small=layouts, quick=layouts[:4])


def segment():
    widths = sized(full=(None, 1, 2, 3, 4, 5, 64, 65), small=(None, 1, 3, 4, 5, 65), quick=(None, 3, 5))
    for layout, lengths, extra in segment_layouts():
        S = len(lengths) + extra
        idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
        idx = idx.to(DEVICE, torch.int32)
        N = idx.shape[0]
        large = N > 5000
        for width in widths:
            if large and width not in (None, 3, 65):
                continue
            dtypes = (torch.float64, torch.float32) if not QUICK or layout == "mixed" else (torch.float64,)
            if not large and not QUICK:
                dtypes += (torch.float16, torch.bfloat16)
            for dtype in dtypes:
                for op in SEGMENT_PUBLIC:
                    if op == "matvec" and width is None:
                        continue
                    for broadcast in ((False, True) if op == "mul" and width is not None else (False,)):
                        g = generator("segment", layout, width, str(dtype), op, broadcast)
                        inputs = segment_inputs(op, N, S, width, dtype, g, broadcast)
                        if op == "rms_norm" and N and layout == "mixed":
                            inputs[0][:3] = 0  # a segment of zero rows: rms 0, gradient 0
                        name = f"segment {op}{'-broadcast' if broadcast else ''} {layout} N{N}-S{S}-D{width} {dtype}"
                        tol = SEGMENT_TOL[dtype]
                        key = idx.long() if dtype == torch.float32 else idx  # int64 idx: converted once
                        segment_orders(name, lambda *t: SEGMENT_PUBLIC[op](*t, key, S), op, inputs, idx, S, tol)
                        if not large and dtype == torch.float64 and (not QUICK or layout == "mixed"):
                            small = segment_api.UNCHECKED[op]
                            segment_orders(f"{name} small chunks", lambda *t: small(*t, idx, S, config=SMALL_CHUNKS),
                                           op, inputs, idx, S, tol)
        if N:
            segment_misaligned(layout, idx, S)


def segment_misaligned(layout, idx, S):
    """Rows and ids that start 4 bytes past a 16-byte boundary: the compiled in-order
    pass then reads them one element at a time instead of in 16-byte vectors."""
    N = idx.shape[0]
    g = generator("segment misaligned", layout)
    for width in (None, 2):
        shape = (N + 1,) if width is None else (N + 1, width)
        base = randn(shape, g).requires_grad_()
        x = base[1:] if width is None else base.view(-1)[width:].view(N, width)
        ids = torch.cat([idx[:1], idx])[1:]
        for op in ("sum", "mean"):
            out = SEGMENT_PUBLIC[op](x, ids, S)
            w = randn(out.shape, g)
            (grad,) = torch.autograd.grad((out * w).sum(), base)
            x64 = base.detach().double().requires_grad_()
            rows = x64[1:] if width is None else x64.view(-1)[width:].view(N, width)
            ref = segment_reference(op, [rows], idx, S)
            (ref_grad,) = torch.autograd.grad((ref * w.double()).sum(), x64)
            name = f"segment {op} misaligned {layout} N{N}-S{S}-D{width}"
            check(f"{name} out", out, ref, SEGMENT_TOL[torch.float32])
            check(f"{name} grad", grad, ref_grad, SEGMENT_TOL[torch.float32])


# --------------------------------------------------------------------------------------
# persistent LSTM


def lstm_modules():
    """``(input size, hidden, layers, bidirectional, bias, batch_first)``: hidden 1, a hidden
    size that leaves masked units, input projections on tensor cores (160 features, and
    the second layer's 2H), the largest hidden sizes."""
    return sized(
        full=[(7, 1, 1, False, True, True), (24, 32, 1, True, True, True), (13, 40, 2, True, False, False),
              (160, 64, 2, True, True, True), (60, 128, 2, True, True, True), (20, 256, 1, True, True, True),
              (9, 256, 1, False, True, True)],
        small=[(7, 1, 1, False, True, True), (13, 40, 2, True, False, False), (160, 64, 2, True, True, True)],
        quick=[(7, 1, 1, False, True, True), (5, 16, 2, True, False, False)])


def lstm_configs(hidden):
    """The configurations to force besides the chooser's: single-program ones
    everywhere, and on a GPU the cooperative ones (every wait, product and tiling)."""
    single = [RecurrenceConfig(programs_per_tile=1, rows_per_tile=rows, product=product, wait=StepWait.CTA_BARRIER,
                               **options)
              for rows, product, options in [(1, RecurrentProduct.ROW_SUMS, dict(prefetch_steps=2)),
                                             (2, RecurrentProduct.FOUR_GATES, dict(tiles_per_program=2)),
                                             (16, RecurrentProduct.TENSOR_CORES, {})]]
    if QUICK:
        single = single[1:2]
    if not GPU:
        return single
    block_h = max(pk.runtime.next_power_of_2(hidden), 16)
    single = [dataclasses.replace(c, fast_math=True, l2_prefetch_steps=2) if c.product != RecurrentProduct.TENSOR_CORES
              else c for c in single]
    cooperative = []
    W = StepWait
    for k, rows, product, wait, warps, options in [
            (2, 1, RecurrentProduct.FOUR_GATES, W.TAGGED_WORDS, 8, dict(prefetch_steps=2, l2_prefetch_steps=8)),
            (2, 2, RecurrentProduct.FOUR_GATES, W.TAGGED_WORDS_PTX, 8, dict(tiles_per_program=3)),
            (4, 2, RecurrentProduct.ROW_SUMS, W.STEP_COUNTER, 4, dict(tiles_per_program=2)),
            (4, 16, RecurrentProduct.TENSOR_CORES, W.STEP_COUNTER, 4, dict(l2_prefetch_steps=8)),
            (4, 4, RecurrentProduct.FOUR_GATES, W.TAGGED_WORDS, 4, {}),
            (2, 1, RecurrentProduct.FOUR_GATES, W.TAGGED_WORDS_PTX, 8, dict(prefetch_steps=2))]:
        if block_h % k or block_h // k < 16:  # slices of at least 16 units
            continue
        fast = product != RecurrentProduct.TENSOR_CORES
        cooperative.append(RecurrenceConfig(programs_per_tile=k, rows_per_tile=rows, product=product, wait=wait,
                                            num_warps=warps, fast_math=fast, **options))
    return single + cooperative


def lstm_reference(lstm, x, hx, lengths):
    """``nn.LSTM`` on the padded batch (``lengths``: through a PackedSequence of the
    non-empty sequences; an empty one keeps its initial state and has no output)."""
    batch_first = lstm.batch_first
    padded = x if batch_first else x.transpose(0, 1)
    B, T = padded.shape[:2]
    D = 2 if lstm.bidirectional else 1
    h0, c0 = hx if hx is not None else (padded.new_zeros(lstm.num_layers * D, B, lstm.hidden_size),) * 2
    if lengths is None:
        y, state = lstm(x, (h0, c0))
        return (y if batch_first else y.transpose(0, 1)), state
    keep = lengths > 0
    y = padded.new_zeros(B, T, D * lstm.hidden_size)
    h_n, c_n = h0.clone(), c0.clone()
    if bool(keep.any()):
        sequence = pack_padded_sequence(padded[keep], lengths[keep].cpu(), batch_first=True, enforce_sorted=False)
        out, (h, c) = lstm(sequence, (h0[:, keep].contiguous(), c0[:, keep].contiguous()))
        y[keep] = pad_packed_sequence(out, batch_first=True, total_length=T)[0]
        h_n[:, keep], c_n[:, keep] = h, c
    return y, (h_n, c_n)


def lstm():
    for I, H, layers, bidirectional, bias, batch_first in lstm_modules():
        torch.manual_seed(I * 1000 + H)
        module = torch.nn.LSTM(I, H, num_layers=layers, bidirectional=bidirectional, bias=bias,
                               batch_first=batch_first).to(DEVICE).eval()
        D = 2 if bidirectional else 1
        # forced configurations at hidden sizes whose weight slices every one of them holds
        configs = [None] + (lstm_configs(H) if H <= 64 and (not QUICK or layers > 1) else [])
        batches = sized(full=(1, 7, 64), small=(1, 7), quick=(3,))
        for config in configs:
            fast = pk.PersistentLSTM.from_torch(module, config)
            label = "chooser" if config is None else (f"K{config.programs_per_tile}-rows{config.rows_per_tile}-"
                                                      f"{config.product.name}-{config.wait.name}-"
                                                      f"tiles{config.tiles_per_program}")
            for B in batches:
                g = generator("lstm", I, H, B, label)
                T = sized(50, 20, 6)
                name = f"lstm I{I}-H{H}-L{layers}-D{D} {label} B{B}-T{T}"
                padded = randn((B, T, I), g)
                x = padded if batch_first else padded.transpose(0, 1).contiguous()
                lengths = torch.randint(0, T + 1, (B,), generator=g).to(DEVICE)
                lengths[0] = T
                if B > 2:
                    lengths[1], lengths[2] = 0, 1  # an empty sequence, a one-frame one
                hx = (randn((layers * D, B, H), g), randn((layers * D, B, H), g))
                with torch.no_grad():
                    lstm_call(name, fast, module, x, padded, lengths, hx)
        if GPU and H <= 64:
            lstm_many_launches(module, I, H, D)


def lstm_call(name, fast, module, x, padded, lengths, hx):
    """Padded, padded with lengths, Packed, PackedSequence and unbatched calls."""
    tol = 1e-5
    for with_state in (False, True):
        state = hx if with_state else None
        y, (h, c) = fast(x, state)
        y_ref, (h_ref, c_ref) = lstm_reference(module, x, state, None)
        check(f"{name} padded state{with_state} y", y if module.batch_first else y.transpose(0, 1), y_ref, tol, 1.0)
        check(f"{name} padded state{with_state} h_n", h, h_ref, tol, 1.0)
        check(f"{name} padded state{with_state} c_n", c, c_ref, tol, 1.0)
    y, (h, c) = fast(x, hx, lengths=lengths)
    y_ref, (h_ref, c_ref) = lstm_reference(module, x, hx, lengths)
    check(f"{name} lengths y", y if module.batch_first else y.transpose(0, 1), y_ref, tol, 1.0)
    check(f"{name} lengths h_n", h, h_ref, tol, 1.0)
    check(f"{name} lengths c_n", c, c_ref, tol, 1.0)
    packed = pk.pack(padded, lengths)
    out, (h, c) = fast(packed, hx)
    check(f"{name} Packed y", out.data, pk.pack(y_ref, lengths).data, tol, 1.0)
    check(f"{name} Packed c_n", c, c_ref, tol, 1.0)
    if bool((lengths > 0).all()):
        sequence = packed.to_packed_sequence()
        out, (h, _) = fast(sequence, hx)
        reference, (h_ref2, _) = module(sequence, hx)
        check(f"{name} PackedSequence y", out.data, reference.data, tol, 1.0)
        check(f"{name} PackedSequence h_n", h, h_ref2, tol, 1.0)
    unbatched = padded[0]  # (T, I), whatever batch_first says
    y, _ = fast(unbatched)
    check(f"{name} unbatched y", y, module(unbatched)[0], tol, 1.0)
    empty = pk.Packed(padded.new_zeros(0, padded.shape[-1]), pk.cu_seqlens_from_lengths(lengths[:0]), lengths[:0])
    out, (h, _) = fast(empty)
    check(f"{name} empty batch", out.data, padded.new_zeros(0, y.shape[-1]), tol, 1.0)


def lstm_many_launches(module, I, H, D):
    """A batch larger than one launch of cooperating programs holds: several launches."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    config = RecurrenceConfig(programs_per_tile=2, rows_per_tile=1, product=RecurrentProduct.FOUR_GATES,
                              wait=StepWait.TAGGED_WORDS, fast_math=True)
    B = sms // (D * 2) + 7
    g = generator("lstm launches", I, H)
    padded = randn((B, 19, I), g)
    lengths = torch.randint(1, 20, (B,), generator=g).to(DEVICE)
    x = padded if module.batch_first else padded.transpose(0, 1).contiguous()
    with torch.no_grad():
        out, (h, c) = pk.PersistentLSTM.from_torch(module, config)(x, lengths=lengths)
        ref, (h_ref, c_ref) = lstm_reference(module, x, None, lengths)
    name = f"lstm I{I}-H{H} {B} rows over several launches"
    check(f"{name} y", out if module.batch_first else out.transpose(0, 1), ref, 1e-5, 1.0)
    check(f"{name} h_n", h, h_ref, 1e-5, 1.0)


# --------------------------------------------------------------------------------------


def main(argv) -> int:
    chosen = [a for a in argv if not a.startswith("--")] or list(DEFAULT_SECTIONS)
    unknown = [a for a in chosen if a not in SECTIONS]
    if unknown:
        print(f"unknown section(s) {unknown}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    where = "interpreted on the CPU" if pk.runtime.INTERPRETED else f"compiled, {torch.cuda.get_device_name()}"
    size = "quick" if QUICK else "small" if SMALL else "full"
    print(f"sanitizer workload ({size}; kernels {where})", flush=True)
    failed_sections = []
    for section in chosen:
        start, checks, failures = time.perf_counter(), CHECKS[0], len(FAILURES)
        try:
            sinkhorn(tile_only=True) if section == "sinkhorn_tile" else globals()[section]()
            if GPU:
                torch.cuda.synchronize()
        except Exception:
            FAILURES.append(f"{section}: raised\n{traceback.format_exc()}")
        bad = len(FAILURES) - failures
        if bad:
            failed_sections.append(section)
        print(f"{section}: {CHECKS[0] - checks} checks, {bad} failed ({time.perf_counter() - start:.1f} s)",
              flush=True)
    for message in FAILURES:
        print("FAILED", message)
    print("all checks passed" if not FAILURES else f"{len(FAILURES)} failed in {failed_sections}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
