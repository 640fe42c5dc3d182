"""Make a bench baseline (``bench/baselines/<gen>-w<world>[-fake].json``) from one or more bench results.

    python -m harness.report.speed_baseline --gen h200 --out bench/baselines/h200-w2.json \\
        run1/suite.jsonl [run2/suite.jsonl ...] [--note "..."]

Give several runs of the same code when you can: the baseline's ``spread`` (which sets the speed
threshold, see ``harness.report.speed``) is then the run-to-run spread of each implementation's
ratio to the reference; from one run it is the spread of the per-repetition ratios, and with one
repetition the documented default. Per cell: median tokens/s and ratio over the runs, the largest
peak memory. The format is in ``bench/baselines/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from harness.report.junit_read import JunitError
from harness.report.speed import DEFAULT_SPREAD, FORMAT, REFERENCE, BenchResult, read_bench

VERSION_KEYS = ("torch", "cuda", "nccl", "transformer_engine", "megatron_fsdp", "python")


def half_range(values: Sequence[float]) -> float | None:
    """(max - min) / 2 relative to the median; None for fewer than two values."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / 2 / statistics.median(values)


def _git() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cell(size: str, impl: str, results: Sequence[BenchResult]) -> dict[str, Any]:
    cells = [c for r in results if (c := r.cell(size, impl)) is not None]
    ratios = [c.ratio for c in cells if c.ratio is not None]
    out: dict[str, Any] = {"size": size, "impl": impl, "runs": len(cells), "reps": sum(c.reps for c in cells),
                           "tok_s_per_gpu": round(statistics.median(c.tok_s for c in cells), 1),
                           "peak_gib": round(max(c.peak_gib for c in cells), 3),
                           "ratio": round(statistics.median(ratios), 6) if ratios else None}
    spread = half_range(ratios) if len(ratios) > 1 else half_range([x for c in cells for x in c.rep_ratios])
    if spread is not None and impl != REFERENCE:
        out["spread"] = round(spread, 4)
    return out


def make_baseline(results: Sequence[BenchResult], gen: str, note: str = "", git: str | None = None) -> dict[str, Any]:
    """The baseline document for ``gen`` from ``results`` (runs of the same code and configuration)."""
    if not results or not any(r.cells for r in results):
        raise JunitError("no measured cell in the bench results")
    bad = [p for r in results for c in r.cells for p in c.problems]
    if bad:
        raise JunitError("a baseline needs finite, positive figures: " + "; ".join(bad[:5])
                         + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))
    meta = results[0].meta
    keys = list(dict.fromkeys((c.size, c.impl) for r in results for c in r.cells))
    cells = [_cell(size, impl, results) for size, impl in keys]
    spreads = [c["spread"] for c in cells if "spread" in c]
    measured = max(spreads) if spreads else None
    versions = {k: str(v) for k, v in (meta.get("versions") or {"torch": meta.get("torch")}).items()
                if k in VERSION_KEYS and v is not None}
    versions["git"] = git or _git()
    return {
        "format": FORMAT, "gen": gen, "reference": REFERENCE, "world": meta.get("world"),
        "fake": bool(meta.get("fake", False)), "device": meta.get("device"),
        "made": datetime.date.today().isoformat(), "sources": [r.path for r in results], "versions": versions,
        "spread": measured if measured is not None else DEFAULT_SPREAD,
        "spread_note": (f"largest relative half-range of a ratio to {REFERENCE} over "
                        + (f"{len(results)} runs" if len(results) > 1 else "one run's repetitions")
                        if measured is not None else "not measured (one repetition): the documented default"),
        "note": note, "cells": cells}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report.speed_baseline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=pathlib.Path, help="bench results (suite.jsonl) of the same code")
    parser.add_argument("--gen", required=True, help="GPU generation the results were measured on (h100, h200, ...)")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="baseline file to write")
    parser.add_argument("--note", default="", help="what was run, and anything a reviewer should know")
    parser.add_argument("--git", default=None, help="revision the results were made with (default: this checkout's)")
    args = parser.parse_args(argv)
    try:
        doc = make_baseline([read_bench(p) for p in args.results], args.gen, args.note, args.git)
    except JunitError as exc:
        print(f"speed_baseline: error: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"speed_baseline: {len(doc['cells'])} cells, spread {doc['spread']:.4f} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
