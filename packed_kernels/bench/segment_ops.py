"""Benchmark cases of the segment operations (chapter 3).

Rows ``N`` = 1M and 16M, average segment length 10, 100 and 10,000 (segment ids
drawn uniformly and sorted, so lengths vary around the mean), scalar and 3-vector
rows, float32. Workloads: ``forward``, ``fwd+bwd`` (forward then the gradient of
every input) and ``fwd+bwd+bwd2`` (forward, the first gradient with
``create_graph=True``, then the gradient of that gradient, as in training on forces).

Providers:

* ``triton``: the operators without the eager argument checks (what
  runs inside ``torch.compile`` and CUDA graphs, where the host-reading checks are
  skipped);
* ``triton_graph``: the same, replayed from a CUDA graph (GPU time without the host's
  per-call overhead);
* ``triton_checked``: the public function in eager mode, checks included (one host
  synchronisation to validate ``idx``);
* ``index_add``: PyTorch composed from ``index_add`` / ``index_select`` (scatter with
  atomics: nondeterministic in float on the GPU), differentiable to any order;
* ``segment_reduce``: ``torch.segment_reduce`` with precomputed lengths (sum and mean;
  it has no second derivative);
* ``padded``: the padded PyTorch stage of this chapter.

The floor is the bytes each stage must move (its inputs read once, its outputs written
once, ``idx`` read once per stage) over the measured copy bandwidth.
"""
from __future__ import annotations

from typing import Callable, Iterable, List

import torch

from .harness import Case

ROW_COUNTS = (1 << 20, 1 << 24)
MEAN_LENGTHS = (10, 100, 10_000)
#: Where the inputs are allocated (a CPU smoke test of the providers may change it).
DEVICE = "cuda"
ORDERS = ("forward", "fwd+bwd", "fwd+bwd+bwd2")


def _layout(n_rows: int, mean_length: int):
    num_segments = max(1, n_rows // mean_length)
    g = torch.Generator(device=DEVICE).manual_seed(n_rows + mean_length)
    idx = torch.randint(0, num_segments, (n_rows,), device=DEVICE, generator=g, dtype=torch.int32)
    return torch.sort(idx).values, num_segments


def _inputs(op: str, n_rows: int, num_segments: int, width: int):
    shape = (n_rows,) if width == 1 else (n_rows, width)
    x = torch.randn(shape, device=DEVICE)
    if op == "dot":
        return [x, torch.randn(shape, device=DEVICE)]
    if op == "mul":
        return [x, torch.randn((num_segments,) + shape[1:], device=DEVICE)]
    if op == "matvec":
        return [x, torch.randn(num_segments, width, width, device=DEVICE)]
    return [x]


def _torch_composed(op: str, counts: torch.Tensor) -> Callable:
    """The op from PyTorch's scatter/gather ops (twice differentiable)."""

    def scatter(values, idx, num_segments):
        return values.new_zeros((num_segments,) + values.shape[1:]).index_add(0, idx, values)

    def per_row(counts_, like):
        return counts_.to(like.dtype) if like.dim() == 1 else counts_.to(like.dtype)[:, None]

    if op == "sum":
        return lambda x, idx, S: scatter(x, idx, S)
    if op == "mean":
        return lambda x, idx, S: scatter(x, idx, S) / per_row(counts.clamp(min=1), x)
    if op == "dot":
        return lambda x, y, idx, S: scatter((x * y) if x.dim() == 1 else (x * y).sum(1), idx, S)
    if op == "mul":
        return lambda x, y, idx, S: x * y.index_select(0, idx)
    if op == "rms_norm":
        return lambda x, idx, S: (scatter((x * x) if x.dim() == 1 else (x * x).sum(1), idx, S)
                                  / counts.clamp(min=1).to(x.dtype)).sqrt()
    if op == "matvec":
        return lambda v, m, idx, S: torch.einsum("nd,ndk->nk", v, m.index_select(0, idx))
    raise ValueError(op)


def _segment_reduce(op: str, lengths: torch.Tensor) -> Callable:
    reduce = "sum" if op == "sum" else "mean"
    return lambda x, idx, S: torch.segment_reduce(x, reduce, lengths=lengths, axis=0, unsafe=True)


def _provider(op: str, provider: str, order: str, n_rows: int, mean_length: int, width: int):
    def factory():
        from ..ops.segment import api as functions, padded_torch

        idx, num_segments = _layout(n_rows, mean_length)
        inputs = _inputs(op, n_rows, num_segments, width)
        counts = torch.bincount(idx, minlength=num_segments)
        if provider in ("triton", "triton_graph"):
            fn = functions.UNCHECKED[op]
        elif provider == "triton_checked":
            fn = getattr(functions, f"segmented_{op}")
        elif provider == "index_add":
            fn = _torch_composed(op, counts)
        elif provider == "segment_reduce":
            fn = _segment_reduce(op, counts)
        elif provider == "padded":
            fn = getattr(padded_torch, f"segmented_{op}_padded")
        else:
            raise ValueError(provider)
        if order == "forward":
            if provider == "triton_graph":
                # The same operator replayed from a CUDA graph: GPU time without the
                # host's per-call overhead (what torch.compile with CUDA graphs sees).
                fn(*inputs, idx, num_segments)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn(*inputs, idx, num_segments)
                return graph.replay
            return lambda: fn(*inputs, idx, num_segments)
        for t in inputs:
            t.requires_grad_()
        probe = fn(*inputs, idx, num_segments)
        grad_out = torch.randn_like(probe)
        del probe
        if order == "fwd+bwd":
            def step():
                fn(*inputs, idx, num_segments).backward(grad_out)
            return step, inputs
        grad_out.requires_grad_()
        cotangents = [torch.randn_like(t) for t in inputs]

        def step2():
            out = fn(*inputs, idx, num_segments)
            firsts = torch.autograd.grad(out, inputs, grad_out, create_graph=True)
            torch.autograd.grad(firsts, inputs + [grad_out], cotangents, allow_unused=True)
        return step2, None

    return factory


def _floor_bytes(op: str, order: str, n_rows: int, mean_length: int, width: int) -> float:
    """Each stage reads its inputs (and ``idx``) once and writes its outputs once."""
    es = 4
    S = max(1, n_rows // mean_length)
    row = n_rows * width * es
    per_segment = S * width * es
    idx = n_rows * 4
    if op in ("sum", "mean"):
        inputs, out, reread = row, per_segment, 0
    elif op == "dot":
        inputs, out, reread = 2 * row, S * es, 2 * row
    elif op == "mul":
        inputs, out, reread = row + per_segment, row, row + per_segment
    elif op == "rms_norm":
        inputs, out, reread = row, S * es, row + S * es
    else:  # matvec, m (S, D, D)
        inputs, out, reread = row + S * width * width * es, row, row + S * width * width * es
    forward = inputs + idx + out
    backward = out + idx + reread + inputs
    second = inputs + idx + reread + out + inputs + out
    return {"forward": forward, "fwd+bwd": forward + backward, "fwd+bwd+bwd2": forward + backward + second}[order]


def _case(op: str, order: str, n_rows: int, mean_length: int, width: int, providers: List[str]) -> Case:
    return Case(
        workload=order,
        params={"op": op, "N": n_rows, "mean_length": mean_length, "width": width},
        providers={p: _provider(op, p, order, n_rows, mean_length, width) for p in providers},
        floor_bytes=_floor_bytes(op, order, n_rows, mean_length, width),
        notes={"dtype": "float32"},
    )


def cases() -> Iterable[Case]:
    # Sum and mean forward at every size, length and width.
    for n_rows in ROW_COUNTS:
        for mean_length in MEAN_LENGTHS:
            for width in (1, 3):
                for op in ("sum", "mean"):
                    providers = ["triton", "index_add", "segment_reduce"]
                    if n_rows == ROW_COUNTS[-1]:
                        providers += ["triton_graph", "padded"]
                        if op == "sum":
                            providers += ["triton_checked"]
                    yield _case(op, "forward", n_rows, mean_length, width, providers)
    # Sum and mean with their gradient at 16M rows.
    n_rows = ROW_COUNTS[-1]
    for mean_length in MEAN_LENGTHS:
        for width in (1, 3):
            for op in ("sum", "mean"):
                yield _case(op, "fwd+bwd", n_rows, mean_length, width,
                            ["triton", "index_add", "segment_reduce", "padded"])
    # Every op, vec3 rows, both derivative orders, the two extreme lengths.
    for mean_length in (10, 10_000):
        for op in ("sum", "mean", "dot", "mul", "rms_norm", "matvec"):
            orders = ("fwd+bwd+bwd2",) if op in ("sum", "mean") else ORDERS
            for order in orders:
                yield _case(op, order, n_rows, mean_length, 3, ["triton", "index_add", "padded"])
