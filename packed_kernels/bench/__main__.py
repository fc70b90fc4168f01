"""``python -m packed_kernels.bench [all | CHAPTER ...] [--out DIR]``: see the package docstring."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

CHAPTERS = ("ctc", "sinkhorn", "segment_ops", "lstm")


def default_results_dir() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(repo, "book", "results")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m packed_kernels.bench", description=__doc__)
    parser.add_argument("chapters", nargs="*", default=["all"], help=f"all, or some of {', '.join(CHAPTERS)}")
    parser.add_argument("--out", default=default_results_dir(), help="results folder (default: book/results)")
    args = parser.parse_args(argv)
    chapters = CHAPTERS if "all" in args.chapters else args.chapters
    unknown = [c for c in chapters if c not in CHAPTERS]
    if unknown:
        parser.error(f"unknown chapter(s) {unknown}; choose from {CHAPTERS}")
    if not torch.cuda.is_available():
        print("the benchmarks time compiled kernels and need a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from .harness import environment, measure_copy_bandwidth, run_cases, write_environment, write_rows

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    env = environment()
    bandwidth = measure_copy_bandwidth()
    os.makedirs(args.out, exist_ok=True)
    write_environment(os.path.join(args.out, "environment.json"), env, bandwidth)
    for chapter in chapters:
        module = importlib.import_module(f"packed_kernels.bench.{chapter}")
        path = os.path.join(args.out, f"{chapter}.csv")
        rows = run_cases(chapter, module.cases(), bandwidth, env, path=path)
        write_rows(path, rows)
        print(f"wrote {len(rows)} rows to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
