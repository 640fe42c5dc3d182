"""The CUDA-graph bench's table: medians over alternating repetitions, ratios against eager."""
from __future__ import annotations

from bench.cuda_graph_bench import markdown, median_rows


def _rows() -> list[dict]:
    times = [("eager", 10.0), ("graph", 2.0), ("eager", 12.0), ("graph", 3.0), ("eager", 11.0), ("graph", 2.5)]
    return [{"config": "small", "mode": m, "rep": i // 2 + 1, "step_ms": t, "peak_gib": 1.0 + i,
             "loss_first": 9.0, "loss_last": 7.0, "finite": True} for i, (m, t) in enumerate(times)]


def test_median_over_repetitions_and_ratio() -> None:
    med = {r["mode"]: r for r in median_rows(_rows())}
    assert med["eager"]["step_ms"] == 11.0 and med["graph"]["step_ms"] == 2.5
    assert med["graph"]["times"] == [2.0, 3.0, 2.5]
    text = markdown(_rows(), "# t")
    assert "| small | graph | 3 | 2.50 | 2.00–3.00 | 4.40× | 6.00 |" in text  # peak: max over repetitions


def test_non_finite_loss_is_flagged() -> None:
    rows = _rows()
    rows[3]["finite"] = False
    assert "NON-FINITE" in markdown(rows, "# t")
