"""The benchmark harness's bookkeeping, without a GPU: choosing providers with
``--only`` and merging re-measured rows into the recorded ones."""
import pandas as pd
import pytest
import torch

from packed_kernels.bench.harness import Case, merge_rows, provider_label, read_rows, select, write_rows
from packed_kernels.bench.report import describe_run


def _case(workload, **params):
    return Case(workload, params, {"triton": lambda: None, "torch_loop": lambda: None}, floor_bytes=8.0)


def test_select_keeps_only_matching_providers_and_drops_empty_cases():
    cases = [_case("fwd", n=4, tokens=65536), _case("fwd", n=16, tokens=65536), _case("bwd", n=4, tokens=65536)]
    assert provider_label(cases[0], "triton") == "fwd n=4 tokens=65536 triton"
    chosen = select(cases, r"^fwd n=4 .* triton$")
    assert [(c.workload, c.params, list(c.providers)) for c in chosen] == [("fwd", {"n": 4, "tokens": 65536}, ["triton"])]
    assert chosen[0].floor_bytes == 8.0
    assert select(cases, "no such provider") == []
    assert [len(c.providers) for c in select(cases, "n=16")] == [2]


def test_merge_replaces_the_same_rows_in_place_and_appends_new_ones(tmp_path):
    path = str(tmp_path / "chapter.csv")
    old = [{"workload": "fwd", "provider": p, "n": n, "ms_p50": 1.0, "date": "2026-12-01"}
           for n in (4, 16) for p in ("triton", "torch_loop")]
    write_rows(path, old)
    recorded = read_rows(path)
    new = [{"workload": "fwd", "provider": "triton", "n": 16, "ms_p50": 0.5, "date": "2026-12-02"},
           {"workload": "fwd", "provider": "triton", "n": 32, "ms_p50": 0.7, "date": "2026-12-02"}]
    merged = merge_rows(recorded, new, ["n"])
    assert [(str(r["provider"]), str(r["n"]), str(r["date"])) for r in merged] == [
        ("triton", "4", "2026-12-01"), ("torch_loop", "4", "2026-12-01"),
        ("triton", "16", "2026-12-02"), ("torch_loop", "16", "2026-12-01"),
        ("triton", "32", "2026-12-02")]
    assert merged[2]["ms_p50"] == 0.5
    # a parameter that tells rows apart must be part of the key
    assert len(merge_rows(recorded, [dict(new[0], n=4)], ["n"])) == 4
    assert read_rows(str(tmp_path / "missing.csv")) == []


def test_describe_run_names_every_date_of_merged_rows():
    rows = pd.DataFrame({"gpu": ["H200", "H200"], "date": ["2026-12-02", "2026-12-01"], "torch": ["2.11", "2.11"],
                         "triton": ["3.6", "3.6"], "cuda": ["13.0", "13.0"], "copy_bytes_per_s": [4.25e12, 4.24e12]})
    text = describe_run(rows)
    assert "on 2026-12-01 and 2026-12-02 with torch 2.11" in text
    assert "4.24 to 4.25 TB/s" in text
    assert "on 2026-12-01 with" in describe_run(rows.iloc[1:])
    # runs whose bandwidths round alike state one value, not a range from it to itself
    close = rows.assign(copy_bytes_per_s=[4.2512e12, 4.2498e12])
    assert "copy bandwidth 4.25 TB/s." in describe_run(close)


def test_the_potential_step_gives_the_index_add_gradients(monkeypatch):
    """The model-shaped potential step (energies, forces with ``create_graph``, a loss on
    both, weight gradients) through the package equals its ``index_add`` version."""
    import torch

    from packed_kernels.bench import models

    monkeypatch.setattr(models, "DEVICE", "cpu")
    got = [g.clone() for g in models.potential_step("triton", 5, hidden=8)[0]()]
    want = models.potential_step("index_add", 5, hidden=8)[0]()
    assert len(got) == len(want) == 6
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_every_model_workload_has_eager_and_replayed_providers():
    from packed_kernels.bench import models

    cases = list(models.cases())
    assert {c.workload for c in cases} == {"potential", "mhc", "ctc_head", "segmentation"}
    for case in cases:
        names = set(case.providers)
        assert {n.rsplit("_", 1)[0] for n in names if n.endswith("_eager")} == {
            n.rsplit("_", 1)[0] for n in names if n.endswith("_graph")}, case.workload
        assert any(n.endswith("_compiled") for n in names), case.workload


def test_segmentation_workload_runs_both_models_alike(monkeypatch):
    from packed_kernels.bench import models

    monkeypatch.setattr(models, "DEVICE", "cpu")
    monkeypatch.setattr(models, "_SEGMENTATION", dict(frames=7, features=5, hidden=4, layers=2))
    got = models._segmentation_provider("triton", "eager", 2)()()
    want = models._segmentation_provider("cudnn", "eager", 2)()()
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_glued_numbers_and_figure_text():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from packed_kernels.bench import report

    assert report.glue_number("x", 1.2345, ".2f", "×") == "1.23×"
    assert repr(report.GluedText("0.59 µs")) == "0.59 µs"
    with plt.rc_context(report.book_style()):
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar([0, 1], [1, 2])
        ax.set_xlabel("shape")
        report.check_figure_text(fig)
        ax.text(0, 1, "small", fontsize=6)
        with pytest.raises(ValueError, match="small"):
            report.check_figure_text(fig)
        # the same text drawn on a figure twice the column's width shrinks with it
        fig.set_size_inches(2 * report.BOOK_COLUMN_PX / fig.dpi, 4)
        sizes = dict((t, px) for px, t in report.figure_text_px(fig))
        assert 0.5 < sizes["shape"] / (12.5 * fig.dpi / 72) < 0.7
    plt.close("all")
