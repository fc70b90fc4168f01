"""Reading recorded benchmark results and drawing them, for the notebooks.

The results are long-format CSV rows written by ``python -m packed_kernels.bench``
under ``book/results/``: one row per (workload, sizes, provider), with the median
and quartile times, peak memory, the floor, the GPU name, versions and date. pandas
and matplotlib are needed here only (``pip install packed-kernels[bench]``).
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import pandas as pd

from .__main__ import default_results_dir


def _results_dir(results_dir: Optional[str]) -> Optional[str]:
    return results_dir if results_dir is not None else default_results_dir()


def load_results(chapter: str, results_dir: Optional[str] = None) -> Optional[pd.DataFrame]:
    """The recorded rows of one chapter, or ``None`` when nothing was recorded.

    ``results_dir`` defaults to ``book/results`` (or ``results``, inside ``book/``)
    under the current directory.
    """
    folder = _results_dir(results_dir)
    path = None if folder is None else os.path.join(folder, f"{chapter}.csv")
    if path is None or not os.path.exists(path):
        return None
    return pd.read_csv(path, keep_default_na=False, na_values=["nan", "NaN", ""])


def describe_run(rows: pd.DataFrame) -> str:
    """One sentence saying where, when and with what the rows were measured (every date
    and version among them, where rows were re-measured on another day)."""
    def values(column):
        seen = [str(v) for v in rows[column].dropna().unique()] if column in rows else []
        return " and ".join(sorted(seen)) or "?"

    bandwidths = sorted({float(v) / 1e12 for v in rows["copy_bytes_per_s"].dropna()}) if "copy_bytes_per_s" in rows else []
    shown = list(dict.fromkeys(f"{b:.2f}" for b in (bandwidths[0], bandwidths[-1]))) if bandwidths else ["?"]
    bandwidth = " to ".join(shown)
    return (
        f"Measured on {values('gpu')} on {values('date')} with torch {values('torch')} and "
        f"triton {values('triton')} (CUDA {values('cuda')}); measured copy bandwidth "
        f"{bandwidth} TB/s. Times are medians of `triton.testing.do_bench`."
    )


def speedup_table(
    rows: pd.DataFrame, index: Sequence[str], baseline: str, workload: Optional[str] = None
) -> pd.DataFrame:
    """Median times (ms) per provider, one row per size, and each provider's speedup over ``baseline``."""
    if workload is not None:
        rows = rows[rows["workload"] == workload]
    times = rows.pivot_table(index=list(index), columns="provider", values="ms_p50", aggfunc="first")
    floor = rows.groupby(list(index))["floor_ms"].first()
    table = times.copy()
    for provider in times.columns:
        if provider != baseline:
            table[f"speedup {provider}"] = times[baseline] / times[provider]
    table["floor ms"] = floor
    return table


def plot_speedup(ax, rows: pd.DataFrame, x: str, baseline: str, providers: Sequence[str],
                 labels: Optional[Sequence[str]] = None, title: str = "") -> None:
    """Bars of speedup over ``baseline`` for each provider at each ``x``, with the floor marked.

    The floor marker is the speedup a kernel running at the floor (``floor_ms``)
    would reach: the hardware limit for that size.
    """
    import numpy as np

    rows = rows.reset_index(drop=True)
    groups = list(dict.fromkeys(rows[x]))
    base = rows[rows["provider"] == baseline].set_index(x)["ms_p50"]
    floor = rows.groupby(x)["floor_ms"].first()
    width = 0.8 / max(len(providers), 1)
    positions = np.arange(len(groups))
    for i, provider in enumerate(providers):
        sub = rows[rows["provider"] == provider].set_index(x)["ms_p50"]
        speedups = [base.get(g, np.nan) / sub.get(g, np.nan) for g in groups]
        label = labels[i] if labels else provider
        bars = ax.bar(positions + (i - (len(providers) - 1) / 2) * width, speedups, width, label=label)
        ax.bar_label(bars, fmt="%.2f×", fontsize=7)
    limit = [base.get(g, np.nan) / floor.get(g, np.nan) for g in groups]
    ax.scatter(positions, limit, marker="_", s=900, color="black", zorder=3, label="floor (hardware limit)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(positions, [str(g) for g in groups], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"speedup over {baseline} (×)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)


def environment_info(results_dir: Optional[str] = None) -> Optional[dict]:
    folder = _results_dir(results_dir)
    path = None if folder is None else os.path.join(folder, "environment.json")
    if path is None or not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


# --- numbers in prose, and figures a reader can read -------------------------------------------

#: Width (CSS px) of the book's text column at a 1280 px window: a figure wider than this
#: is scaled down to it, and its text with it.
BOOK_COLUMN_PX = 740
#: The smallest text a figure may show, in CSS px at the size the page shows it.
MIN_TEXT_PX = 11.0


class GluedText:
    """A value shown in prose exactly as formatted: ``repr`` gives the text, so myst-nb's
    ``{glue}`` role pastes ``1.6`` rather than ``'1.6'``."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def glue_number(name: str, value, fmt: str = ".2g", suffix: str = "") -> str:
    """Format ``value`` with ``fmt`` (plus ``suffix``, e.g. ``"×"`` or ``" ms"``) and glue
    it under ``name`` for the chapter's prose (``{glue}`name```); returns the text.

    Every number a chapter's prose states goes through here, from the recorded results,
    so that the prose and the figures cannot disagree."""
    text = f"{value:{fmt}}{suffix}"
    try:
        from myst_nb import glue
    except ImportError:  # outside the book build: nothing to paste into
        return text
    glue(name, GluedText(text), display=False)
    return text


def book_style() -> dict:
    """matplotlib settings for the book's figures: text large enough to read once the
    figure is scaled to the text column (see :func:`check_figure_text`)."""
    return {
        "font.size": 12.5, "axes.titlesize": 13, "axes.labelsize": 12.5, "xtick.labelsize": 12,
        "ytick.labelsize": 12, "legend.fontsize": 12, "figure.titlesize": 13,
        "axes.spines.top": False, "axes.spines.right": False,
    }


def figure_text_px(fig, column_px: float = BOOK_COLUMN_PX) -> list:
    """``(px, text)`` for every visible text of ``fig``: its size in CSS px once the
    figure, saved at its dpi with a tight bounding box, is shown at most ``column_px``
    wide."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width_px = fig.get_tightbbox(renderer).width * fig.dpi
    scale = min(1.0, column_px / width_px) if width_px > 0 else 1.0
    sizes = []
    for text in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text")):
        if text.get_visible() and text.get_text().strip():
            sizes.append((text.get_fontsize() * fig.dpi / 72.0 * scale, text.get_text()))
    return sizes


def check_figure_text(fig, column_px: float = BOOK_COLUMN_PX, min_px: float = MIN_TEXT_PX) -> None:
    """Raise ``ValueError`` if any text of ``fig`` would show smaller than ``min_px``."""
    small = [(round(px, 1), text) for px, text in figure_text_px(fig, column_px) if px < min_px - 1e-6]
    if small:
        raise ValueError(f"figure text below {min_px} px at {column_px} px wide: {small[:5]}")


def show_figure(fig) -> None:
    """Lay ``fig`` out, check that its text is readable at the page's size, and show it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    check_figure_text(fig)
    plt.show()
