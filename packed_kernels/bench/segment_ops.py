"""Benchmark cases of the segment operations (chapter 3).

Rows ``N`` = 1M and 16M, average segment length 10, 100 and 10,000 (segment ids
drawn uniformly and sorted, so lengths vary around the mean), scalar and 3-vector
rows, float32. Workloads: ``forward``, ``fwd+bwd`` (forward then the gradient of
every input; at 1M rows ``sum`` at length 10 only) and ``fwd+bwd+bwd2`` (forward, the
first gradient with ``create_graph=True``, then the gradient of that gradient, as in
training on forces).
Beside them, at 16M rows, bfloat16 rows (read as bfloat16, summed in float32: workloads
``forward, bfloat16`` and ``fwd+bwd, bfloat16``) and ``sum`` with many trailing empty
segments (``num_segments`` four times the last index plus one: workload ``forward,
trailing empty segments``), under workload names of their own so that they never mix
with the float32 rows of the same parameters.

Providers (a suffix names how the step runs: none, eager; ``_graph``, captured once into
a CUDA graph and replayed with ``harness.captured``, the GPU's time without the host's
per-call work; ``_compiled``, under ``torch.compile``):

* ``triton``: the operators without the eager argument checks (what
  runs inside ``torch.compile`` and CUDA graphs, where the host-reading checks are
  skipped); ``triton_graph``: the same, replayed (forward, ``fwd+bwd`` and
  ``fwd+bwd+bwd2``). The gradients come from ``torch.autograd.grad`` for every provider,
  so none accumulates into ``.grad``, eager or replayed;
* ``triton_checked``: the public function in eager mode, checks included;
* ``triton_teaching``: the chapter's teaching kernel, one program per segment
  (:mod:`packed_kernels.ops.segment.teaching`), forward ``sum`` only, at every size;
* ``index_add``: PyTorch composed from ``index_add`` / ``index_select`` (scatter with
  atomics: nondeterministic in float on the GPU), differentiable to any order;
  ``index_add_graph``: the same, replayed, wherever ``triton_graph`` runs;
  ``index_add_compiled``: the same function under ``torch.compile`` (its backward
  compiled by AOTAutograd), at 16M rows only (``forward`` of sum and mean, ``fwd+bwd``
  of sum): each compile costs seconds, and AOTAutograd refuses a double backward, so
  ``fwd+bwd+bwd2`` has no compiled provider;
* ``segment_reduce``: ``torch.segment_reduce`` with precomputed lengths (sum and mean;
  it has no second derivative); ``segment_reduce_graph``: the same, replayed (forward at
  16M rows);
* ``padded``: the padded PyTorch stage of this chapter (eager only: it reads the longest
  segment's length on the host);
* ``eager_floor``: the least an eager call through autograd costs on this host
  whatever its kernels: an ``autograd.Function`` that allocates its output and launches
  one Triton kernel that does nothing (and, for ``fwd+bwd``, the same in its backward).
  Host time shorter than the cache flush ``do_bench`` runs between repetitions hides
  behind it, so its ``forward`` rows show little more than the empty kernel; its
  ``fwd+bwd`` rows show the host's floor for an eager step.

The floor is the bytes each stage must move (its inputs read once, its outputs written
once, ``idx`` read once per stage) over the measured copy bandwidth.

``python -m packed_kernels.bench.segment_ops host`` prints the host's own time per eager
call instead, on the CPU with the kernels stubbed (:func:`host_times`).
"""
from __future__ import annotations

from typing import Callable, Iterable, List

import torch

from .harness import Case, captured

ROW_COUNTS = (1 << 20, 1 << 24)
MEAN_LENGTHS = (10, 100, 10_000)
#: Where the inputs are allocated (a CPU smoke test of the providers may change it).
DEVICE = "cuda"
ORDERS = ("forward", "fwd+bwd", "fwd+bwd+bwd2")


#: ``num_segments`` of the trailing-empties cases, from the last index of ``idx``.
TRAILING_SEGMENTS = 4


def _layout(n_rows: int, mean_length: int, trailing: bool = False):
    """Sorted uniform segment ids and ``num_segments`` (``TRAILING_SEGMENTS`` times the last
    index plus one when ``trailing``: three quarters of the segments empty, at the end)."""
    num_segments = max(1, n_rows // mean_length)
    g = torch.Generator(device=DEVICE).manual_seed(n_rows + mean_length)
    idx = torch.randint(0, num_segments, (n_rows,), device=DEVICE, generator=g, dtype=torch.int32)
    idx = torch.sort(idx).values
    if trailing:
        num_segments = TRAILING_SEGMENTS * int(idx[-1]) + 1
    return idx, num_segments


def _inputs(op: str, n_rows: int, num_segments: int, width: int, dtype: torch.dtype = torch.float32):
    shape = (n_rows,) if width == 1 else (n_rows, width)

    def randn(*size):
        return torch.randn(size, device=DEVICE).to(dtype)

    x = randn(*shape)
    if op == "dot":
        return [x, randn(*shape)]
    if op == "mul":
        return [x, randn(num_segments, *shape[1:])]
    if op == "matvec":
        return [x, randn(num_segments, width, width)]
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


def _eager_floor() -> Callable:
    """``(x, idx, S) -> (S, ...)``: one allocation and one empty Triton launch each way."""
    import triton

    @triton.jit
    def nothing(out_ptr):
        pass

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, num_segments):
            ctx.rows = x.shape
            out = x.new_empty((num_segments,) + x.shape[1:])
            nothing[(1,)](out)
            return out

        @staticmethod
        def backward(ctx, grad):
            grad_x = grad.new_empty(ctx.rows)
            nothing[(1,)](grad_x)
            return grad_x, None

    return lambda x, idx, S: Floor.apply(x, S)


def _segment_reduce(op: str, lengths: torch.Tensor) -> Callable:
    reduce = "sum" if op == "sum" else "mean"
    return lambda x, idx, S: torch.segment_reduce(x, reduce, lengths=lengths, axis=0, unsafe=True)


#: How a provider's step runs, from its name's suffix: ``eager`` (no suffix), ``graph``
#: (captured once into a CUDA graph and replayed) or ``compiled`` (``torch.compile``).
MODES = ("graph", "compiled")


def _implementation_and_mode(provider: str):
    for mode in MODES:
        if provider.endswith(f"_{mode}"):
            return provider[: -len(mode) - 1], mode
    return provider, "eager"


def _provider(op: str, provider: str, order: str, n_rows: int, mean_length: int, width: int,
              dtype: torch.dtype = torch.float32, trailing: bool = False):
    implementation, mode = _implementation_and_mode(provider)

    def factory():
        from ..ops.segment import api as functions, padded_torch, teaching

        idx, num_segments = _layout(n_rows, mean_length, trailing)
        inputs = _inputs(op, n_rows, num_segments, width, dtype)
        counts = torch.bincount(idx, minlength=num_segments)
        if implementation == "triton":
            fn = functions.UNCHECKED[op]
        elif implementation == "triton_checked":
            fn = getattr(functions, f"segmented_{op}")
        elif implementation == "triton_teaching" and op == "sum" and order == "forward":
            fn = teaching.segmented_sum_teaching
        elif implementation == "index_add":
            fn = _torch_composed(op, counts)
        elif implementation == "segment_reduce":
            fn = _segment_reduce(op, counts)
        elif implementation == "padded":
            fn = getattr(padded_torch, f"segmented_{op}_padded")
        elif implementation == "eager_floor":
            fn = _eager_floor()
        else:
            raise ValueError(provider)
        if mode == "compiled":
            # the plain PyTorch function under torch.compile; its backward is compiled too
            fn = torch.compile(fn)

        def replayed_if_graph(step):
            return captured(step) if mode == "graph" else step

        if order == "forward":
            return replayed_if_graph(lambda: fn(*inputs, idx, num_segments))
        for t in inputs:
            t.requires_grad_()
        probe = fn(*inputs, idx, num_segments)
        grad_out = torch.randn_like(probe)
        del probe
        if order == "fwd+bwd":
            # the gradients as autograd.grad returns them: no .grad accumulates, eager or replayed
            def step():
                torch.autograd.grad(fn(*inputs, idx, num_segments), inputs, grad_out)
            return replayed_if_graph(step)
        grad_out.requires_grad_()
        cotangents = [torch.randn_like(t) for t in inputs]

        def step2():
            out = fn(*inputs, idx, num_segments)
            firsts = torch.autograd.grad(out, inputs, grad_out, create_graph=True)
            torch.autograd.grad(firsts, inputs + [grad_out], cotangents, allow_unused=True)
        return replayed_if_graph(step2)

    return factory


def _floor_bytes(op: str, order: str, n_rows: int, mean_length: int, width: int, es: int = 4,
                 segments: int = 1) -> float:
    """Each stage reads its inputs (and ``idx``) once and writes its outputs once; ``es``
    bytes per element, ``segments`` times the segments of the layout."""
    S = segments * max(1, n_rows // mean_length)
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


def _case(op: str, order: str, n_rows: int, mean_length: int, width: int, providers: List[str],
          dtype: torch.dtype = torch.float32, trailing: bool = False) -> Case:
    dtype_name = str(dtype).removeprefix("torch.")
    workload = order
    if dtype != torch.float32:
        workload += f", {dtype_name}"
    if trailing:
        workload += ", trailing empty segments"
    return Case(
        workload=workload,
        params={"op": op, "N": n_rows, "mean_length": mean_length, "width": width},
        providers={p: _provider(op, p, order, n_rows, mean_length, width, dtype, trailing) for p in providers},
        floor_bytes=_floor_bytes(op, order, n_rows, mean_length, width, es=dtype.itemsize,
                                 segments=TRAILING_SEGMENTS if trailing else 1),
        notes={"dtype": dtype_name, "accumulate": "float64" if dtype == torch.float64 else "float32",
               "num_segments": f"{TRAILING_SEGMENTS} x last index + 1" if trailing else "N / mean_length"},
    )


def cases() -> Iterable[Case]:
    n_rows = ROW_COUNTS[-1]
    # Sum and mean forward at every size, length and width: each implementation eager and
    # replayed, the teaching kernel beside the production one, and at the largest size
    # (the speed figure's) the padded stage and index_add under torch.compile.
    for rows in ROW_COUNTS:
        for mean_length in MEAN_LENGTHS:
            for width in (1, 3):
                for op in ("sum", "mean"):
                    providers = ["triton", "triton_graph", "index_add", "index_add_graph", "segment_reduce"]
                    if op == "sum":
                        # the public function (checks included), the least an eager call
                        # through autograd costs, and the one-program-per-segment kernel
                        providers += ["triton_checked", "eager_floor", "triton_teaching"]
                    if rows == n_rows:
                        providers += ["segment_reduce_graph", "padded", "index_add_compiled"]
                    yield _case(op, "forward", rows, mean_length, width, providers)
    # Sum with its gradient at 1M rows, short segments: eager against graph replay.
    for width in (1, 3):
        yield _case("sum", "fwd+bwd", ROW_COUNTS[0], 10, width,
                    ["triton", "triton_graph", "triton_checked", "eager_floor", "index_add", "index_add_graph"])
    # Sum and mean with their gradient at 16M rows; sum eager, replayed and compiled.
    for mean_length in MEAN_LENGTHS:
        for width in (1, 3):
            for op in ("sum", "mean"):
                extra = ["triton_graph", "triton_checked", "eager_floor", "index_add_graph",
                         "index_add_compiled"] if op == "sum" else []
                yield _case(op, "fwd+bwd", n_rows, mean_length, width,
                            ["triton", "index_add", "segment_reduce", "padded"] + extra)
    # Every op, vec3 rows, both derivative orders, the two extreme lengths. torch.compile
    # cannot take a double backward (AOTAutograd), so the second order has no compiled row.
    for mean_length in (10, 10_000):
        for op in ("sum", "mean", "dot", "mul", "rms_norm", "matvec"):
            orders = ("fwd+bwd+bwd2",) if op in ("sum", "mean") else ORDERS
            for order in orders:
                providers = ["triton", "index_add", "padded"]
                if order == "fwd+bwd+bwd2":
                    providers += ["triton_graph", "index_add_graph"]
                yield _case(op, order, n_rows, mean_length, 3, providers)
    # bfloat16 rows (float32 sums) beside float32, at the extreme lengths.
    for mean_length in (10, 10_000):
        for width in (1, 3):
            for op in ("sum", "mean"):
                yield _case(op, "forward", n_rows, mean_length, width,
                            ["triton", "triton_graph", "index_add", "index_add_graph"], dtype=torch.bfloat16)
        yield _case("sum", "fwd+bwd", n_rows, mean_length, 3, ["triton", "index_add"], dtype=torch.bfloat16)
    # Three quarters of the segments empty, after the last index.
    for width in (1, 3):
        yield _case("sum", "forward", n_rows, 10, width,
                    ["triton", "triton_graph", "triton_checked", "index_add", "index_add_graph"], trailing=True)


# --- host time per eager call, launches stubbed -------------------------------------------------

def host_times(n_rows: int = 4096, mean_length: int = 10, repeats: int = 2000) -> dict:
    """Host microseconds per eager call of each public segment function, kernels not run.

    Runs on CPU tensors with every Triton kernel of :mod:`..ops.segment.triton_kernels`
    replaced by a no-op and the launchers taking their compiled-code branches, so what
    remains is the host's own work: the argument checks, the ``idx`` check (its device
    ops and one host read), the allocations, the configuration lookups, the dispatch
    through the operators and autograd, and the (stubbed) launch calls. Returns
    ``{(op, order): {part: us}}`` with ``order`` ``forward`` or ``fwd+bwd`` and the parts
    ``total``, ``idx check``, ``allocation``, ``config``, ``launch`` and ``rest`` (argument
    checks, dispatch, autograd). CPU tensor ops cost the host about what CUDA launches
    of the same ops cost, so the split shows where an eager call's host time goes.
    """
    import contextlib
    import time

    from .. import runtime
    from ..ops.segment import api as functions, triton_kernels as tk

    spent = {}
    inner = []  # the time of the timed calls inside each running timed call

    def timed(part, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                # each part its own time only: the allocation inside the idx check is allocation
                spent[part] = spent.get(part, 0.0) + elapsed - inner.pop()
                if inner:
                    inner[-1] += elapsed
        return wrapper

    class Kernel:
        def __getitem__(self, grid):
            return timed("launch", lambda *args, **kwargs: None)

    class Allocations:  # torch, as the launchers see it, with timed allocations
        def __getattr__(self, name):
            value = getattr(torch, name)
            return timed("allocation", value) if name in ("empty", "zeros", "full", "empty_like") else value

    kernels = {name: Kernel() for name, value in vars(tk).items() if name.endswith("_kernel")}
    patches = [(runtime, "INTERPRETED", False), (tk, "torch", Allocations()),
               (functions, "_check_idx", timed("idx check", functions._check_idx)),
               (functions, "_config", timed("config", functions._config)),
               (functions, "config_text", timed("config", functions.config_text)),
               (tk, "segment_config", timed("config", tk.segment_config))]
    patches += [(tk, name, kernel) for name, kernel in kernels.items()]
    global DEVICE
    saved_device, DEVICE = DEVICE, "cpu"
    results = {}
    with contextlib.ExitStack() as stack:
        for module, name, value in patches:
            saved = getattr(module, name)
            setattr(module, name, value)
            stack.callback(setattr, module, name, saved)
        stack.callback(globals().__setitem__, "DEVICE", saved_device)
        idx, num_segments = _layout(n_rows, mean_length)
        for op in ("sum", "mean", "dot", "mul", "rms_norm", "matvec"):
            fn = getattr(functions, f"segmented_{op}")
            for order in ("forward", "fwd+bwd"):
                inputs = [t.requires_grad_(order != "forward") for t in _inputs(op, n_rows, num_segments, 3)]
                grad = torch.ones_like(fn(*inputs, idx, num_segments)) if order != "forward" else None

                def call():
                    out = fn(*inputs, idx, num_segments)
                    if grad is not None:
                        out.backward(grad)
                for _ in range(repeats // 10):
                    call()
                # the quickest of five rounds: the machine's other work only ever adds time
                rounds = []
                for _ in range(5):
                    spent.clear()
                    start = time.perf_counter()
                    for _ in range(repeats // 5):
                        call()
                    rounds.append({"total": time.perf_counter() - start, **spent})
                parts = min(rounds, key=lambda r: r["total"])
                parts["rest"] = parts["total"] - sum(t for part, t in parts.items() if part != "total")
                results[(op, order)] = {part: 1e6 * t / (repeats // 5) for part, t in parts.items()}
    return results


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["host"]:
        sys.exit("usage: python -m packed_kernels.bench.segment_ops host  (host time per eager call, "
                 "kernels stubbed; the GPU cases run through python -m packed_kernels.bench segment_ops)")
    order_of = ("total", "idx check", "allocation", "config", "launch", "rest")
    print(f"{'op':10s} {'order':8s} " + " ".join(f"{p:>10s}" for p in order_of) + "   (us per call)")
    for (op, order), parts in host_times().items():
        print(f"{op:10s} {order:8s} " + " ".join(f"{parts.get(p, 0.0):10.1f}" for p in order_of))
