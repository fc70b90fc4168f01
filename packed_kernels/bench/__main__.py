"""``python -m packed_kernels.bench [all | CHAPTER ...] [--out DIR] [--only REGEX]``: time every chapter's cases.

Each provider of each case is timed with ``triton.testing.do_bench`` (median and
quartiles) in one run, beside its baselines, with its peak memory; the rows, with the
GPU name, torch and triton versions and the date, go to ``DIR/<chapter>.csv`` and the
measured copy bandwidth to ``DIR/environment.json``. With ``--only``, just the
providers whose ``"<workload> k=v ... <provider>"`` matches the regular expression run,
and their rows replace the same rows of ``DIR/<chapter>.csv`` (the others stay, each
with its own date). Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

CHAPTERS = ("ctc", "sinkhorn", "segment_ops", "lstm", "models")

#: the folder the book reads, relative to the repository root
BOOK_RESULTS = os.path.join("book", "results")


def default_results_dir(start: Optional[str] = None) -> Optional[str]:
    """``book/results`` under ``start`` (default: the current directory) when it exists,
    else ``results`` there (a notebook runs inside ``book/``), else ``None``."""
    start = os.getcwd() if start is None else start
    for candidate in (os.path.join(start, BOOK_RESULTS), os.path.join(start, "results")):
        if os.path.isdir(candidate):
            return candidate
    return None


def chapter_summaries() -> str:
    """One line per chapter: the first line of its benchmark module's docstring."""
    lines = []
    for chapter in CHAPTERS:
        module = importlib.import_module(f"packed_kernels.bench.{chapter}")
        lines.append(f"  {chapter:12s} {(module.__doc__ or '').strip().splitlines()[0]}")
    return "chapters:\n" + "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m packed_kernels.bench", description=__doc__.split("\n\n", 1)[1],
        epilog=chapter_summaries(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", default=["all"], help=f"all (default), or some of {', '.join(CHAPTERS)}")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default: {BOOK_RESULTS} under the current directory, "
                             "which must exist: run from the repository root or name a folder)")
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="time only the providers whose '<workload> k=v ... <provider>' matches "
                             "REGEX, and merge their rows into the recorded ones")
    args = parser.parse_args(argv)
    chapters = CHAPTERS if "all" in args.chapters else tuple(args.chapters)
    unknown = [c for c in chapters if c not in CHAPTERS]
    if unknown:
        parser.error(f"unknown chapter(s) {unknown}; choose from {CHAPTERS}")
    out = args.out
    if out is None:
        out = os.path.join(os.getcwd(), BOOK_RESULTS)
        if not os.path.isdir(out):
            parser.error(f"no {BOOK_RESULTS} folder under {os.getcwd()}: run from the repository root, "
                         "or pass --out DIR")

    import torch

    if not torch.cuda.is_available():
        print("the benchmarks time compiled kernels and need a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    from .harness import environment, measure_copy_bandwidth, read_rows, run_cases, select, write_environment, write_rows

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    env = environment()
    bandwidth = measure_copy_bandwidth()
    os.makedirs(out, exist_ok=True)
    write_environment(os.path.join(out, "environment.json"), env, bandwidth)
    for chapter in chapters:
        module = importlib.import_module(f"packed_kernels.bench.{chapter}")
        path = os.path.join(out, f"{chapter}.csv")
        if args.only is None:
            rows = run_cases(chapter, module.cases(), bandwidth, env, path=path)
        else:
            rows = run_cases(chapter, select(module.cases(), args.only), bandwidth, env, path=path,
                             recorded=read_rows(path))
        write_rows(path, rows)
        print(f"wrote {len(rows)} rows to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
