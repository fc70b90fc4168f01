"""Benchmark cases of the persistent LSTM chapter: pyannote's segmentation stack.

Four bidirectional layers, 60 input features, hidden size 128, 589 frames (10 s of
audio), at batch 1, 8, 32, 64, 128 and 256; a hidden-256 variant; and a packed batch of
chunks of different lengths. Providers: cuDNN through ``nn.LSTM`` (float32, TF32
off), ``PersistentLSTM`` and, at small batch, the padded PyTorch stage; at hidden size
128 the chapter's teaching kernel (``triton_teaching``: one program per sequence, one
launch per layer and direction, so the directions run one after the other).

Each of these is called eagerly, as a model calls it. In the ``forward`` workload the
two fast ones are also replayed from a CUDA graph (``cudnn_graph``,
``triton_persistent_graph``: the GPU's time alone, no host work), and at batch 1, 32 and
128 ``nn.LSTM`` runs under ``torch.compile`` (``cudnn_compiled``). Dynamo does not trace
``nn.LSTM`` by default (``torch._dynamo.config.allow_rnn`` is off): it breaks the graph
and calls cuDNN, so that row is what a user who compiles the model gets.

In half precision (workloads ``forward float16`` and ``forward bfloat16``): the same
stack at batch 1, 32 and 128 and a hidden-512 variant at batch 32, with the module and
its input in that dtype, ``cudnn`` being ``nn.LSTM`` in that dtype (cuDNN's float16
path in ``forward float16``) and ``triton_persistent`` ``PersistentLSTM`` of it.

Every row carries ``layer_steps``, ``T x layers``: ``ms_p50 / layer_steps`` is the time
of one layer's step (both directions), which ``floor_ms / layer_steps`` (the hand-off)
bounds from below at every batch size.

The floor is a sequential-latency bound: the recurrence has ``T x layers``
dependent steps (the two directions run side by side), and a design that splits
``W_hh`` over several SMs must hand the new hidden state from SM to SM at every
step. ``floor_ms`` is ``T x layers`` times the measured one-way latency of such a
hand-off (a flag passed back and forth between two programs through L2). It
ignores the arithmetic and the input projections, so no implementation of this
design can go below it.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import triton
import triton.language as tl

from .harness import Case, captured

PYANNOTE = dict(I=60, H=128, layers=4, T=589)


@triton.jit
def _ping_pong_kernel(flag_ptr, n_rounds):
    """Two programs pass a counter back and forth: program ``p`` waits for ``2 i + p``, writes ``2 i + p + 1``."""
    pid = tl.program_id(0)
    for i in range(n_rounds):
        expected = 2 * i + pid
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        while seen != expected:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        tl.atomic_xchg(flag_ptr, expected + 1, sem="release", scope="gpu")


def handoff_latency_ms(n_rounds: int = 20000) -> float:
    """One-way latency (ms) of handing a value from one SM to another through L2."""
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(5):
        flag.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _ping_pong_kernel[(2,)](flag, n_rounds, num_warps=1)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / (2 * n_rounds)


def _lstm(I, H, layers, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.LSTM(I, H, num_layers=layers, bidirectional=True, batch_first=True).cuda().to(dtype).eval()


def _no_grad(build):
    """A provider from ``build(B, T, I, H, layers) -> (model, input)``: the factory builds
    both once, and the timed call is ``model(input)`` without autograd, run as ``mode``
    says: ``"eager"``, ``"graph"`` (captured once into a CUDA graph and replayed) or
    ``"compiled"`` (``model`` under ``torch.compile``)."""

    def provider(B, T, I, H, layers, mode="eager"):
        def factory():
            model, inputs = build(B, T, I, H, layers)
            if mode == "compiled":
                model = torch.compile(model)

            def run():
                with torch.no_grad():
                    return model(inputs)
            return captured(run) if mode == "graph" else run
        return factory
    return provider


def _packed_lengths(B, T):
    generator = torch.Generator().manual_seed(B)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=generator)
    lengths[0] = T
    return lengths


@_no_grad
def _cudnn(B, T, I, H, layers):
    return _lstm(I, H, layers), torch.randn(B, T, I, device="cuda")


@_no_grad
def _persistent(B, T, I, H, layers):
    from ..ops.lstm import PersistentLSTM

    return PersistentLSTM.from_torch(_lstm(I, H, layers)), torch.randn(B, T, I, device="cuda")


def _cudnn_in(dtype):
    """``nn.LSTM`` with parameters and input in ``dtype`` (cuDNN's path for it)."""

    @_no_grad
    def build(B, T, I, H, layers):
        return _lstm(I, H, layers, dtype=dtype), torch.randn(B, T, I, device="cuda", dtype=dtype)
    return build


def _persistent_in(dtype):
    """``PersistentLSTM`` of an ``nn.LSTM`` in ``dtype``, on an input in ``dtype``."""

    @_no_grad
    def build(B, T, I, H, layers):
        from ..ops.lstm import PersistentLSTM

        return (PersistentLSTM.from_torch(_lstm(I, H, layers, dtype=dtype)),
                torch.randn(B, T, I, device="cuda", dtype=dtype))
    return build


@_no_grad
def _padded_stage(B, T, I, H, layers):
    from ..ops.lstm.padded_torch import lstm_padded, lstm_weights

    weights = lstm_weights(_lstm(I, H, layers))
    return (lambda x: lstm_padded(x, weights)), torch.randn(B, T, I, device="cuda")


@_no_grad
def _cudnn_packed(B, T, I, H, layers):
    padded = torch.randn(B, T, I, device="cuda")
    sequence = torch.nn.utils.rnn.pack_padded_sequence(padded, _packed_lengths(B, T), batch_first=True,
                                                       enforce_sorted=False)
    return _lstm(I, H, layers), sequence


@_no_grad
def _persistent_packed(B, T, I, H, layers):
    from ..ops.lstm import PersistentLSTM
    from ..packing import pack

    model = PersistentLSTM.from_torch(_lstm(I, H, layers))
    return model, pack(torch.randn(B, T, I, device="cuda"), _packed_lengths(B, T).cuda())


def _teaching_stack(lstm):
    """The stack of ``lstm`` run by the chapter's teaching kernel on a ``Packed`` batch:
    per layer, the forward and then the reverse direction, each one launch of
    ``lstm_layer_teaching``; returns the last layer's ``(N, 2H)`` rows."""
    from ..ops.lstm.padded_torch import lstm_weights
    from ..ops.lstm.teaching import lstm_layer_teaching

    weights = lstm_weights(lstm)

    def run(packed):
        rows = packed.data
        for layer in weights:
            rows = torch.cat([lstm_layer_teaching(rows, packed.cu_seqlens, *w, reverse=direction == 1)[0]
                              for direction, w in enumerate(layer)], dim=1)
        return rows
    return run


@_no_grad
def _teaching(B, T, I, H, layers):
    from ..packing import pack

    full = torch.full((B,), T, device="cuda")
    return _teaching_stack(_lstm(I, H, layers)), pack(torch.randn(B, T, I, device="cuda"), full)


@_no_grad
def _teaching_packed(B, T, I, H, layers):
    from ..packing import pack

    return _teaching_stack(_lstm(I, H, layers)), pack(torch.randn(B, T, I, device="cuda"),
                                                      _packed_lengths(B, T).cuda())


def _floor_bytes(B, T, I, H, layers, frames=None, element_size=4):
    frames = B * T if frames is None else frames
    weights = sum(4 * H * ((I if layer == 0 else 2 * H) + H + 2) * 2 for layer in range(layers))
    return element_size * (frames * I + weights + frames * 2 * H + 2 * 2 * layers * B * H)


def cases() -> Iterable[Case]:
    # without a GPU the cases can be listed, not timed: no hand-off to measure
    step_ms = handoff_latency_ms() if torch.cuda.is_available() else math.nan
    I, H, layers, T = PYANNOTE["I"], PYANNOTE["H"], PYANNOTE["layers"], PYANNOTE["T"]
    notes = {"handoff_us": step_ms * 1e3, "layer_steps": T * layers}
    for H_case, batches in ((H, (1, 8, 32, 64, 128, 256)), (256, (32,))):
        for B in batches:
            shape = (B, T, I, H_case, layers)
            providers = {"cudnn": _cudnn(*shape), "triton_persistent": _persistent(*shape),
                         "cudnn_graph": _cudnn(*shape, mode="graph"),
                         "triton_persistent_graph": _persistent(*shape, mode="graph")}
            if H_case == H:
                providers["triton_teaching"] = _teaching(*shape)
            if H_case == H and B in (1, 32, 128):
                providers["cudnn_compiled"] = _cudnn(*shape, mode="compiled")
            if H_case == H and B in (1, 32):
                providers["padded_torch"] = _padded_stage(*shape)
            yield Case(
                workload="forward",
                params=dict(B=B, T=T, I=I, H=H_case, layers=layers),
                providers=providers,
                floor_bytes=_floor_bytes(*shape),
                floor_ms=T * layers * step_ms,
                notes=notes,
            )
    B = 32
    frames = int(_packed_lengths(B, T).sum())
    shape = (B, T, I, H, layers)
    yield Case(
        workload="packed forward",
        params=dict(B=B, T=T, I=I, H=H, layers=layers),
        providers={"cudnn": _cudnn_packed(*shape), "triton_persistent": _persistent_packed(*shape),
                   "triton_teaching": _teaching_packed(*shape)},
        floor_bytes=_floor_bytes(*shape, frames=frames),
        floor_ms=T * layers * step_ms,
        notes=dict(notes, frames=frames),
    )
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        for H_case, B in ((H, 1), (H, 32), (H, 128), (512, 32)):
            shape = (B, T, I, H_case, layers)
            yield Case(
                workload=f"forward {name}",
                params=dict(B=B, T=T, I=I, H=H_case, layers=layers),
                providers={"cudnn": _cudnn_in(dtype)(*shape), "triton_persistent": _persistent_in(dtype)(*shape)},
                floor_bytes=_floor_bytes(*shape, element_size=2),
                floor_ms=T * layers * step_ms,
                notes=notes,
            )
