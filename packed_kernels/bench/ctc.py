"""CTC loss benchmark: forward plus backward, reduction ``"mean"``; and forced alignment.

Four workloads. ``fwd+bwd``: the loss of given log-probabilities, each provider on the
same problem in its own layout:

* ``torch``: ``torch.nn.functional.ctc_loss`` on the padded ``(T, B, C)`` log-probabilities,
  as a model's CTC head calls it (eager);
* ``torch_compiled``: the same loss under ``torch.compile`` (its forward and backward
  compiled, the gradient taken eagerly as in the other providers). ``F.ctc_loss`` reads
  the lengths on the host, so it cannot be captured in a CUDA graph: it has no replayed row;
* ``triton_packed``: :func:`packed_kernels.packed_ctc_loss` on the packed ``(T_total, C)``
  rows, eager (the host's work of the call included);
* ``triton_packed_graph``: the same forward and backward captured once into a CUDA graph
  and replayed: the kernels' time alone;
* ``padded_torch``: the chapter's padded PyTorch stage (autograd through the recursion),
  at the shorter shapes only.

``fwd``: the loss alone (``reduction="none"``, no gradient), at the same shapes, for the
chapter's teaching kernel beside the production forward:

* ``triton_teaching``: :func:`~packed_kernels.ops.ctc.teaching.ctc_loss_teaching`, the
  alpha recursion with one state per lane, one utterance per program;
* ``triton_packed``: :func:`packed_kernels.packed_ctc_loss` (its forward computes ``alpha``
  and ``beta`` at once, which its backward would need);
* ``torch``: ``F.ctc_loss`` on the padded batch.

``head fwd+bwd``: the whole output layer, from the hidden states through the vocabulary
projection to the loss, with the gradients of the hidden states, the weight and the bias,
at vocabularies of 1k to 64k classes (:data:`HEAD_VOCABULARIES`), in bfloat16 and float32:

* ``torch``: ``F.linear``, ``log_softmax`` (in float32) and ``F.ctc_loss`` on the padded batch;
* ``packed_log_softmax``: ``F.linear``, ``log_softmax`` and :func:`packed_kernels.packed_ctc_loss`;
* ``packed_from_logits``: ``F.linear`` and :func:`packed_kernels.packed_ctc_loss_from_logits`;
* ``linear_packed``: :func:`packed_kernels.linear_packed_ctc_loss` (no logits held).

:func:`head_memory_plan` gives, from the shapes alone, the tensors each of these four
holds at its peak.

``align``: the best path of each utterance (no gradient), for batches of 1 to 128
utterances (:data:`ALIGN_BATCHES`) of the first shape's lengths and vocabulary:

* ``triton``: :func:`packed_kernels.packed_ctc_align` on the packed rows;
* ``padded``: the padded PyTorch stage, :func:`~packed_kernels.ops.ctc.padded_torch.ctc_align_padded`,
  on the padded ``(B, T, C)`` batch;
* ``torchaudio_loop``: ``torchaudio.functional.forced_align``, one utterance at a time
  (it takes one), where torchaudio is installed;
* ``numpy``: the float64 NumPy stage, at ``B = 1`` only (a Python loop over frames and states).

Its floor is a latency: the longest utterance's frames, each one step of the recursion
and one of the walk back, are sequential whatever the batch.

Utterance lengths are uniform in ``[T/3, T]`` (fixed seed); each target has about
``length / ratio`` labels drawn from the non-blank classes. Each provider computes the
gradient with ``torch.autograd.grad``, so no ``.grad`` accumulates between calls.
The floor of ``fwd+bwd`` is the packed log-probabilities read once plus the gradient
written once; that of ``head fwd+bwd`` the inputs read once and their gradients written
once (the rows also carry the products' ``matmul_flops``, for a compute floor).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional

import torch

from .harness import Case, captured

#: Where the alignment workload's inputs live (the other workloads' are on ``"cuda"``).
DEVICE = "cuda"

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


def _torch_compiled_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        import torch.nn.functional as F

        x, targets, il, tl = _inputs((T, B, C), B, C, input_lengths, target_lengths, seed)
        # one compiled graph per shape (static shapes), as a model with fixed buckets has
        loss_of = torch.compile(lambda x: F.ctc_loss(x, targets, il, tl, blank=0, reduction="mean"),
                                dynamic=False)
        return _step(loss_of, x)

    return factory


def _packed_graph_provider(B, T, C, input_lengths, target_lengths, seed):
    def factory():
        return captured(_packed_provider(B, T, C, input_lengths, target_lengths, seed)())

    return factory


def _forward_provider(name: str, B, T, C, input_lengths, target_lengths, seed):
    """The loss alone (``reduction="none"``, no gradient) by provider ``name``."""

    def factory():
        import torch.nn.functional as F

        from .. import cu_seqlens_from_lengths, packed_ctc_loss
        from ..ops.ctc.teaching import ctc_loss_teaching

        layout = (T, B, C) if name == "torch" else (int(input_lengths.sum()), C)
        x, targets, il, tl = _inputs(layout, B, C, input_lengths, target_lengths, seed)
        x = x.detach()
        cu = cu_seqlens_from_lengths(il)
        if name == "torch":
            return lambda: F.ctc_loss(x, targets, il, tl, blank=0, reduction="none")
        if name == "triton_packed":
            return lambda: packed_ctc_loss(x, cu, targets, tl, blank=0, reduction="none")
        if name == "triton_teaching":
            return lambda: ctc_loss_teaching(x, cu, targets, tl, blank=0)
        raise ValueError(f"unknown forward provider {name!r}")

    return factory


FORWARD_PROVIDERS = ("triton_teaching", "triton_packed", "torch")


def _log_prob_cases() -> Iterator[Case]:
    for index, (B, T, C, ratio) in enumerate(SHAPES):
        seed = 1000 + index
        input_lengths, target_lengths = utterance_lengths(B, T, ratio, seed)
        T_total = int(input_lengths.sum())
        U = int(target_lengths.max())
        args = (B, T, C, input_lengths, target_lengths, seed)
        providers = {
            "torch": _torch_provider(*args),
            "torch_compiled": _torch_compiled_provider(*args),
            "triton_packed": _packed_provider(*args),
            "triton_packed_graph": _packed_graph_provider(*args),
        }
        if T <= 500:  # a Python loop over frames, one step per frame: the short shapes only
            providers["padded_torch"] = _padded_stage_provider(*args)
        params = {"shape": f"B{B} T{T} C{C} U{U}", "B": B, "T": T, "C": C, "ratio": ratio}
        notes = {"T_total": T_total, "U": U, "packed_fraction": T_total / (B * T)}
        yield Case(
            workload="fwd+bwd",
            params=params,
            providers=providers,
            floor_bytes=2.0 * T_total * C * 4,  # read the float32 log-probs once, write the gradient once
            notes=notes,
        )
        yield Case(
            workload="fwd",
            params=params,
            providers={name: _forward_provider(name, *args) for name in FORWARD_PROVIDERS},
            # each frame's blank and label columns read once (float32), one loss per utterance written
            floor_bytes=float((input_lengths * (target_lengths + 1)).sum() * 4 + B * 4),
            notes=notes,
        )


# ---------------------------------------------------------------------------------------
# the output layer: hidden states -> vocabulary -> loss

#: Vocabulary sizes of the ``head fwd+bwd`` workload.
HEAD_VOCABULARIES = (1025, 8192, 32768, 65536)
#: Its batch: (B, longest T, D, frames per target label), and the seed of its lengths.
HEAD_SHAPE = (32, 1000, 1024, 6)
HEAD_SEED = 2000
HEAD_DTYPES = ("bfloat16", "float32")


def _head_inputs(padded: bool, B, C, D, dtype, input_lengths, target_lengths, seed):
    """On the GPU: hidden states (``(T, B, D)`` padded, or ``(T_total, D)`` packed), the
    weight and bias of the projection, all requiring a gradient, and the targets."""
    device = "cuda"
    g = torch.Generator(device=device).manual_seed(seed)
    T = int(input_lengths.max())
    rows = (T, B) if padded else (int(input_lengths.sum()),)
    hidden = torch.randn(*rows, D, generator=g, device=device, dtype=dtype)
    weight = torch.randn(C, D, generator=g, device=device, dtype=dtype) * D ** -0.5
    bias = torch.zeros(C, device=device, dtype=dtype)
    targets = torch.randint(1, C, (B, int(target_lengths.max())), generator=g, device=device)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    return leaves, targets, input_lengths.to(device), target_lengths.to(device)


def _head_step(loss_of, leaves):
    def step():
        return torch.autograd.grad(loss_of(*leaves), leaves)

    return step


def _head_provider(name: str, B, C, D, dtype_name, input_lengths, target_lengths, seed):
    def factory():
        import torch.nn.functional as F

        from .. import (cu_seqlens_from_lengths, linear_packed_ctc_loss, packed_ctc_loss,
                        packed_ctc_loss_from_logits)

        dtype = getattr(torch, dtype_name)
        leaves, targets, il, tl = _head_inputs(name == "torch", B, C, D, dtype, input_lengths, target_lengths,
                                               seed)
        cu = cu_seqlens_from_lengths(il)
        if name == "torch":
            def loss_of(h, w, b):
                # F.ctc_loss has no float16/bfloat16 CUDA kernel: the log-softmax is taken in float32
                log_probs = F.linear(h, w, b).log_softmax(-1, dtype=torch.float32)
                return F.ctc_loss(log_probs, targets, il, tl, blank=0, reduction="mean")
        elif name == "packed_log_softmax":
            def loss_of(h, w, b):
                return packed_ctc_loss(F.linear(h, w, b).log_softmax(-1), cu, targets, tl)
        elif name == "packed_from_logits":
            def loss_of(h, w, b):
                return packed_ctc_loss_from_logits(F.linear(h, w, b), cu, targets, tl)
        else:
            def loss_of(h, w, b):
                return linear_packed_ctc_loss(h, w, b, cu, targets, tl)
        return _head_step(loss_of, leaves)

    return factory


HEAD_PROVIDERS = ("torch", "packed_log_softmax", "packed_from_logits", "linear_packed")


def _head_cases() -> Iterator[Case]:
    B, T, D, ratio = HEAD_SHAPE
    input_lengths, target_lengths = utterance_lengths(B, T, ratio, HEAD_SEED)
    T_total, U = int(input_lengths.sum()), int(target_lengths.max())
    for dtype_name in HEAD_DTYPES:
        size = getattr(torch, dtype_name).itemsize
        for C in HEAD_VOCABULARIES:
            args = (B, C, D, dtype_name, input_lengths, target_lengths, HEAD_SEED)
            plans = head_memory_plan(C, getattr(torch, dtype_name))
            yield Case(
                workload="head fwd+bwd",
                params={"shape": f"B{B} T{T} D{D} C{C} U{U} {dtype_name}", "B": B, "T": T, "C": C, "D": D,
                        "ratio": ratio, "dtype": dtype_name},
                providers={name: _head_provider(name, *args) for name in HEAD_PROVIDERS},
                # hidden, weight and bias read once, their gradients written once
                floor_bytes=2.0 * (T_total * D + C * D + C) * size,
                notes={"T_total": T_total, "U": U, "matmul_flops": 6 * T_total * D * C,
                       **{f"plan_bytes_{name}": plans[name].bytes for name in HEAD_PROVIDERS}},
            )


# ---------------------------------------------------------------------------------------
# forced alignment

#: Utterances per batch of the ``align`` workload.
ALIGN_BATCHES = (1, 8, 32, 128)
#: Its utterances: (longest T, C, frames per target label), the first shape's; the seed
#: of batch ``B``'s lengths is ``ALIGN_SEED + B``.
ALIGN_SHAPE = SHAPES[0][1:]
ALIGN_SEED = 3000
ALIGN_PROVIDERS = ("triton", "padded", "torchaudio_loop", "numpy")


def _torchaudio_forced_align():
    """``torchaudio.functional.forced_align``, or ``None`` where torchaudio (or the function)
    is not installed."""
    try:
        from torchaudio.functional import forced_align
    except (ImportError, OSError, RuntimeError):
        return None
    return forced_align


def _align_provider(name: str, B: int, T: int, C: int, input_lengths, target_lengths, seed: int):
    """The factory of provider ``name``: it draws the batch on :data:`DEVICE` (log-probabilities,
    targets padded to the longest) and returns the call to time, which returns the
    provider's own result."""

    def factory():
        from ..packing import cu_seqlens_from_lengths

        g = torch.Generator(device=DEVICE).manual_seed(seed)
        T_total = int(input_lengths.sum())
        log_probs = torch.randn(T_total, C, generator=g, device=DEVICE).log_softmax(-1)
        targets = torch.randint(1, C, (B, int(target_lengths.max())), generator=g, device=DEVICE)
        frames, labels = input_lengths.to(DEVICE), target_lengths.to(DEVICE)
        cu = cu_seqlens_from_lengths(frames)
        if name == "triton":
            from .. import packed_ctc_align

            return lambda: packed_ctc_align(log_probs, cu, targets, labels)
        if name == "padded":
            from ..ops.ctc.padded_torch import ctc_align_padded
            from ..packing import Packed, unpack

            padded = unpack(Packed(log_probs, cu, frames))
            return lambda: ctc_align_padded(padded, frames, targets, labels)
        starts, lengths = cu.tolist(), target_lengths.tolist()
        if name == "torchaudio_loop":
            forced_align = _torchaudio_forced_align()
            pieces = [(log_probs[starts[b]:starts[b + 1]][None], targets[b:b + 1, :lengths[b]].int())
                      for b in range(B)]
            return lambda: [forced_align(rows, target, blank=0) for rows, target in pieces]
        if name == "numpy":
            from ..ops.ctc.naive_numpy import ctc_align_numpy

            values, ids = log_probs.double().cpu().numpy(), targets.cpu().numpy()
            return lambda: [ctc_align_numpy(values[starts[b]:starts[b + 1]], ids[b, :lengths[b]], 0)
                            for b in range(B)]
        raise ValueError(f"unknown alignment provider {name!r}")

    return factory


def align_providers(B: int) -> tuple:
    """The providers of the ``align`` workload at ``B`` utterances."""
    names = ["triton", "padded"]
    if _torchaudio_forced_align() is not None:
        names.append("torchaudio_loop")
    if B == 1:  # a Python loop over frames and states: one utterance only
        names.append("numpy")
    return tuple(names)


def _align_cases() -> Iterator[Case]:
    T, C, ratio = ALIGN_SHAPE
    for B in ALIGN_BATCHES:
        seed = ALIGN_SEED + B
        input_lengths, target_lengths = utterance_lengths(B, T, ratio, seed)
        T_total, U = int(input_lengths.sum()), int(target_lengths.max())
        args = (B, T, C, input_lengths, target_lengths, seed)
        yield Case(
            workload="align",
            params={"shape": f"B{B} T{T} C{C} U{U}", "B": B, "T": T, "C": C, "ratio": ratio},
            providers={name: _align_provider(name, *args) for name in align_providers(B)},
            # each frame's label columns read once (the blank's and L_b labels', float32), and
            # its label, token (int64) and score (float32) written once
            floor_bytes=float(((input_lengths * (target_lengths + 1)).sum() * 4 + T_total * 20)),
            notes={"T_total": T_total, "U": U, "T_max": int(input_lengths.max())},
        )


def cases() -> Iterator[Case]:
    yield from _log_prob_cases()
    yield from _head_cases()
    yield from _align_cases()


# ---------------------------------------------------------------------------------------
# the memory plan of the output layer


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The tensors one provider holds at the peak of its forward+backward step.

    Attributes:
        provider: one of :data:`HEAD_PROVIDERS`.
        phase: the step at which the peak falls.
        tensors: name -> bytes of each tensor alive then, beyond the inputs.
    """

    provider: str
    phase: str
    tensors: Dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(self.tensors.values())


def _peak(provider: str, phases: Dict[str, Dict[str, int]]) -> MemoryPlan:
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    return MemoryPlan(provider, phase, dict(phases[phase]))


def head_memory_plan(C: int, dtype: torch.dtype = torch.bfloat16, *, B: Optional[int] = None,
                     T: Optional[int] = None, D: Optional[int] = None, ratio: Optional[int] = None,
                     seed: int = HEAD_SEED, chunk_frames: Optional[int] = None) -> Dict[str, MemoryPlan]:
    """Peak memory of the four ``head fwd+bwd`` providers, computed from the shapes alone.

    For each provider, the phases of one forward+backward step (``torch.autograd.grad`` of
    the loss with respect to hidden, weight and bias) with the tensors alive in each; the
    returned :class:`MemoryPlan` is the phase with the most bytes. Sizes default to
    :data:`HEAD_SHAPE` and the benchmark's seeded lengths (``T_total`` frames, targets of
    at most ``U`` labels, ``S = 2U + 1`` states); ``N`` is the number of logits rows:
    ``T x B`` for ``torch`` (padded), ``T_total`` for the others.

    Assumptions:

    * Counted: every tensor beyond the inputs (hidden, weight, bias, targets, lengths),
      the gradients returned included; not counted: allocator rounding and caching, cuBLAS
      workspaces, tensors of ``O(B)`` or ``O(C)`` elements other than the bias's gradient,
      and the label groups (``3 B (U + 1)`` int32).
    * Autograd frees a saved tensor once the node that saved it has run its backward,
      a node's incoming gradient once the node has run, and a forward intermediate that
      no node saves as soon as the next operation has read it.
    * ``torch``: ``log_softmax(-1, dtype=float32)`` casts the logits to a float32 copy
      first (for float32 logits there is no copy); ``F.ctc_loss`` saves ``log_alpha``
      ``(B, T, S)`` float32, and its backward allocates ``log_beta`` and a float32
      gradient of the log-probabilities; ``log_softmax``'s backward writes a float32
      gradient, then cast to the logits' dtype.
    * ``packed_log_softmax``: ``log_softmax`` in the logits' dtype, read as such by
      ``packed_ctc_loss``, which saves the ``(2, N, S)`` state (the computing dtype,
      float32 here) and writes a gradient in the logits' dtype.
    * ``packed_from_logits``: the loss saves the logits, ``lse`` (``N``) and the state;
      the ``(N, U + 1)`` gathered label log-probabilities live during the forward only.
    * ``linear_packed``: one ``(chunk_frames, C)`` chunk buffer (``chunk_frames`` from
      :func:`~packed_kernels.ops.ctc.triton_kernels.linear_chunk_frames` unless given);
      for float16/bfloat16 over several chunks, ``grad_weight`` and ``grad_bias`` are
      summed in float32 with one ``(C, D)`` product per chunk, and cast at the end.
    """
    defaults = dict(zip(("B", "T", "D", "ratio"), HEAD_SHAPE))
    B, T, D, ratio = (value if value is not None else defaults[key]
                      for key, value in (("B", B), ("T", T), ("D", D), ("ratio", ratio)))
    from ..ops.ctc.triton_kernels import linear_chunk_frames

    input_lengths, target_lengths = utterance_lengths(B, T, ratio, seed)
    T_total, U = int(input_lengths.sum()), int(target_lengths.max())
    T = int(input_lengths.max())
    S = 2 * U + 1
    s = torch.empty((), dtype=dtype).element_size()
    f = 4 if dtype != torch.float64 else 8  # the computing dtype
    low = s < f
    plans = {}

    # torch, padded: N = T x B rows
    N = T * B
    outputs = {"grad_hidden (T, B, D)": N * D * s, "grad_weight (C, D)": C * D * s, "grad_bias (C,)": C * s}
    alpha = {"log_alpha (B, T, S) f32": B * T * S * f}
    phases = {
        "log_softmax": {"logits (N, C)": N * C * s, **({"logits as float32 (N, C)": N * C * f} if low else {}),
                        "log_probs f32 (N, C)": N * C * f},
        "ctc_loss backward": {"log_probs f32 (N, C)": N * C * f, **alpha, "log_beta (B, T, S) f32": B * T * S * f,
                              "grad log_probs f32 (N, C)": N * C * f},
        "log_softmax backward": {"log_probs f32 (N, C)": N * C * f, "grad log_probs f32 (N, C)": N * C * f,
                                 "grad logits f32 (N, C)": N * C * f},
        "linear backward": {"grad logits (N, C)": N * C * s, **outputs},
    }
    if low:
        phases["cast of the gradient"] = {"grad logits f32 (N, C)": N * C * f, "grad logits (N, C)": N * C * s}
    plans["torch"] = _peak("torch", phases)

    # the packed providers: N = T_total rows
    N = T_total
    outputs = {"grad_hidden (T_total, D)": N * D * s, "grad_weight (C, D)": C * D * s, "grad_bias (C,)": C * s}
    state = {"alpha/beta state (2, T_total, S) f32": 2 * N * S * f}
    plans["packed_log_softmax"] = _peak("packed_log_softmax", {
        "log_softmax": {"logits (T_total, C)": N * C * s, "log_probs (T_total, C)": N * C * s},
        "loss forward": {"log_probs (T_total, C)": N * C * s, **state},
        "loss backward": {"log_probs (T_total, C)": N * C * s, **state, "grad log_probs (T_total, C)": N * C * s},
        "log_softmax backward": {"log_probs (T_total, C)": N * C * s, "grad log_probs (T_total, C)": N * C * s,
                                 "grad logits (T_total, C)": N * C * s},
        "linear backward": {"grad logits (T_total, C)": N * C * s, **outputs},
    })
    lse = {"lse (T_total,) f32": N * f}
    plans["packed_from_logits"] = _peak("packed_from_logits", {
        "loss forward": {"logits (T_total, C)": N * C * s, **lse,
                         "gathered label log-probs (T_total, U + 1) f32": N * (U + 1) * f, **state},
        "loss backward": {"logits (T_total, C)": N * C * s, **lse, **state, "grad logits (T_total, C)": N * C * s},
        "linear backward": {"grad logits (T_total, C)": N * C * s, **outputs},
    })
    chunk = min(chunk_frames if chunk_frames is not None else linear_chunk_frames(C), N)
    several = low and chunk < N
    buffer = {f"chunk of logits ({chunk}, C)": chunk * C * s}
    sums = ({"grad_weight sum f32 (C, D)": C * D * f, "grad_bias sum f32 (C,)": C * f} if several else {})
    plans["linear_packed"] = _peak("linear_packed", {
        "forward": {**buffer, **lse, "gathered label log-probs (T_total, U + 1) f32": N * (U + 1) * f, **state},
        "backward, per chunk": {**buffer, **lse, **state, "grad_hidden (T_total, D)": N * D * s, **sums,
                                **({"product of the chunk (C, D)": C * D * s} if several else
                                   {"grad_weight (C, D)": C * D * s, "grad_bias (C,)": C * s})},
        "backward, the end": {**buffer, **lse, **state, **sums, **outputs},
    })
    return plans


def describe() -> List[str]:
    """The shapes, one line each (for the notebook)."""
    B, T, D, ratio = HEAD_SHAPE
    T_a, C_a, ratio_a = ALIGN_SHAPE
    return ([f"B={B}, T<={T}, C={C}, about T/{ratio} labels per target" for B, T, C, ratio in SHAPES]
            + [f"output layer: B={B}, T<={T}, D={D}, C in {list(HEAD_VOCABULARIES)}, {' and '.join(HEAD_DTYPES)}"]
            + [f"alignment: B in {list(ALIGN_BATCHES)}, T<={T_a}, C={C_a}, about T/{ratio_a} labels per target"])
