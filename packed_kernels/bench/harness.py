"""Timing, memory and bookkeeping shared by every chapter's benchmark."""
from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

#: A provider factory allocates its inputs and returns the function to time, or
#: ``(function, tensors whose .grad is reset between repetitions)``.
ProviderFactory = Callable[[], Any]


@dataclass
class Case:
    """One problem size of one workload, with every provider that solves it.

    Attributes:
        workload: what is timed, e.g. ``"fwd+bwd"``.
        params: the size parameters, written as columns (``B``, ``T``, ...).
        providers: provider name -> factory (see :data:`ProviderFactory`).
        floor_bytes: fewest bytes the workload must move through device memory
            (each input read once, each output written once); with the measured
            copy bandwidth it gives the memory floor in the results.
        floor_ms: a floor known in milliseconds instead (a sequential-latency
            bound, say); the larger of the two floors is recorded.
    """

    workload: str
    params: Dict[str, Any]
    providers: Dict[str, ProviderFactory]
    floor_bytes: Optional[float] = None
    floor_ms: Optional[float] = None
    notes: Dict[str, Any] = field(default_factory=dict)


def captured(step: Callable[[], object]) -> Callable[[], None]:
    """``step`` captured into a CUDA graph (after warm-up runs on a side stream, as
    PyTorch's capture needs), returned as the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def environment() -> Dict[str, Any]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "",
        "date": _dt.date.today().isoformat(),
    }


def measure_copy_bandwidth(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import triton.testing

    src = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n_bytes / (ms * 1e-3)


def _time_provider(factory: ProviderFactory) -> Dict[str, float]:
    import triton.testing

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    built = factory()
    fn, grad_to_none = built if isinstance(built, tuple) else (built, None)
    fn()  # warm-up: compilation and autotuning stay out of the numbers
    torch.cuda.synchronize()
    with_inputs = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    p20, p50, p80 = triton.testing.do_bench(
        fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.2, 0.5, 0.8]
    )
    del fn, built, grad_to_none
    return {
        "ms_p20": p20,
        "ms_p50": p50,
        "ms_p80": p80,
        "peak_bytes": peak - before,  # inputs the provider holds plus its working memory
        "extra_bytes": peak - with_inputs,  # working memory and outputs beyond its inputs
    }


def provider_label(case: Case, provider: str) -> str:
    """``"<workload> k=v ... <provider>"``: what ``--only`` matches and the run prints."""
    return " ".join([case.workload, *(f"{k}={v}" for k, v in case.params.items()), provider])


def select(cases: Iterable[Case], pattern: str) -> List[Case]:
    """The cases with only the providers whose :func:`provider_label` matches the regular
    expression ``pattern`` (``re.search``); cases left with no provider are dropped."""
    regex = re.compile(pattern)
    chosen = []
    for case in cases:
        providers = {name: f for name, f in case.providers.items() if regex.search(provider_label(case, name))}
        if providers:
            chosen.append(Case(case.workload, case.params, providers, case.floor_bytes, case.floor_ms, case.notes))
    return chosen


def read_rows(path: str) -> List[Dict[str, Any]]:
    """The rows of a results file (values as text), or none where there is no file."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def merge_rows(recorded: List[Dict[str, Any]], new: List[Dict[str, Any]], params: Iterable[str]) -> List[Dict[str, Any]]:
    """``recorded`` with each row that ``new`` measures again replaced in place (same
    workload, provider and values of ``params``, compared as text); rows of ``new``
    measured for the first time come last. Every row keeps its own date and versions."""
    names = ("workload", "provider", *params)

    def key(row):
        return tuple("" if row.get(k) is None else str(row.get(k)) for k in names)

    fresh = {key(row): row for row in new}
    merged = [fresh.pop(key(row), row) for row in recorded]
    return merged + [row for row in new if key(row) in fresh]


def run_cases(
    chapter: str, cases: Iterable[Case], bandwidth: float, env: Dict[str, Any],
    path: Optional[str] = None, recorded: Optional[List[Dict[str, Any]]] = None,
) -> List[Dict[str, Any]]:
    """Time every provider of every case; print one line per measurement.

    With ``path``, the rows so far are rewritten there after every case, so that an
    interrupted run keeps what it measured; with ``recorded`` too, merged into those
    rows (:func:`merge_rows`) instead of replacing them. Returns what is written.
    """
    cases = list(cases)
    params = list(dict.fromkeys(k for case in cases for k in case.params))
    rows: List[Dict[str, Any]] = []
    for case in cases:
        floors = []
        if case.floor_bytes is not None:
            floors.append(case.floor_bytes / bandwidth * 1e3)
        if case.floor_ms is not None:
            floors.append(case.floor_ms)
        floor_ms = max(floors) if floors else math.nan
        label = " ".join(f"{k}={v}" for k, v in case.params.items())
        for provider, factory in case.providers.items():
            row: Dict[str, Any] = {"chapter": chapter, "workload": case.workload, "provider": provider}
            row.update(case.params)
            start = time.time()
            try:
                row.update(_time_provider(factory))
                row["error"] = ""
            except Exception as err:  # an OOM or a failing baseline must not stop the run
                row.update(ms_p20=math.nan, ms_p50=math.nan, ms_p80=math.nan, peak_bytes=math.nan,
                           extra_bytes=math.nan, error=f"{type(err).__name__}: {err}"[:200])
                torch.cuda.empty_cache()
            row["floor_ms"] = floor_ms
            row["floor_bytes"] = case.floor_bytes if case.floor_bytes is not None else math.nan
            row.update(case.notes)
            row.update(env)
            row["copy_bytes_per_s"] = bandwidth
            rows.append(row)
            status = row["error"] or (
                f"{row['ms_p50']:9.4f} ms  (floor {floor_ms:.4f})  peak {row['peak_bytes'] / 2**20:9.1f} MiB"
            )
            print(f"[{chapter}] {case.workload:12s} {label:40s} {provider:22s} {status}"
                  f"  [{time.time() - start:.1f}s]", flush=True)
        if path is not None:
            write_rows(path, rows if recorded is None else merge_rows(recorded, rows, params))
    return rows if recorded is None else merge_rows(recorded, rows, params)


def write_rows(path: str, rows: List[Dict[str, Any]]) -> None:
    """Write rows as CSV, with the union of their keys as columns, in first-seen order."""
    columns: List[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_environment(path: str, env: Dict[str, Any], bandwidth: float) -> None:
    info = dict(env, copy_bandwidth_bytes_per_s=bandwidth,
                sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    with open(path, "w") as fh:
        json.dump(info, fh, indent=2)
        fh.write("\n")
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s on {env['gpu']}", file=sys.stderr, flush=True)
