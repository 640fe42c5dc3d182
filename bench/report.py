"""Turn the suite's JSON lines into medians, ratios, target checks and a markdown table.

Pure Python (no torch), so a table can be rebuilt from ``suite.jsonl`` anywhere:

    python -m bench.report suite.jsonl [--md suite.md]

Rows with ``"kind": "cell"`` are measurements (one per size x impl x repetition); ``"skip"`` and
``"error"`` rows say what did not run and why. Throughput is tokens/s per GPU; memory is the
largest rank's, in GiB, relative to what was allocated before the cell was built.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench import source_trees

BASELINE, NORESHARD, CEILING = "fsdp2", "fsdp2-noreshard", "ceiling"
OURS_Z3, OURS_Z2 = "ours-z3", "ours-z2"


@dataclass(frozen=True)
class Cell:
    size: str
    impl: str
    reps: int
    tok_s: float  # median over repetitions
    tok_s_min: float
    tok_s_max: float
    step_ms: float
    peak_gib: float  # largest over repetitions (memory targets are upper bounds)
    rest_gib: float
    build_gib: float
    by_rep: dict[int, float]  # repetition -> tokens/s, for paired ratios


def load(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(rows: Iterable[dict]) -> list[Cell]:
    """One Cell per (size, impl) with at least one measurement, in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("kind") == "cell":
            groups.setdefault((r["size"], r["impl"]), []).append(r)
    cells = []
    for (size, impl), rs in groups.items():
        tok = [r["tok_s_per_gpu"] for r in rs]
        cells.append(Cell(size, impl, len(rs), statistics.median(tok), min(tok), max(tok),
                          1e3 * statistics.median(r["step_s"] for r in rs),
                          max(r["peak_gib"] for r in rs), statistics.median(r["rest_gib"] for r in rs),
                          statistics.median(r["build_gib"] for r in rs),
                          {r["rep"]: r["tok_s_per_gpu"] for r in rs}))
    return cells


def _find(cells: list[Cell], size: str, impl: str) -> Cell | None:
    return next((c for c in cells if c.size == size and c.impl == impl), None)


def ratio(cells: list[Cell], size: str, impl: str, ref: str) -> float | None:
    a, b = _find(cells, size, impl), _find(cells, size, ref)
    return a.tok_s / b.tok_s if a and b else None


def paired_ratios(cells: list[Cell], size: str, impl: str, ref: str) -> list[float]:
    """impl/ref per repetition in which both ran: the spread of the ratio itself."""
    a, b = _find(cells, size, impl), _find(cells, size, ref)
    if not a or not b:
        return []
    return [a.by_rep[r] / b.by_rep[r] for r in sorted(a.by_rep) if r in b.by_rep]


def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def table(cells: list[Cell]) -> str:
    lines = ["| size | impl | reps | tok/s/GPU (median) | min–max | step ms | vs fsdp2 | vs ceiling "
             "| peak GiB | at rest GiB | after build GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells:
        lines.append(
            f"| {c.size} | {c.impl} | {c.reps} | {c.tok_s:,.0f} | {c.tok_s_min:,.0f}–{c.tok_s_max:,.0f} "
            f"| {c.step_ms:.1f} | {_fmt_ratio(ratio(cells, c.size, c.impl, BASELINE))} "
            f"| {_fmt_ratio(ratio(cells, c.size, c.impl, CEILING))} | {c.peak_gib:.2f} | {c.rest_gib:.2f} "
            f"| {c.build_gib:.2f} |")
    return "\n".join(lines)


def _check(cells: list[Cell], size: str, impl: str, ref: str, need: float) -> tuple[str, str]:
    r = ratio(cells, size, impl, ref)
    if r is None:
        return f"{impl} ≥ {need:.2f}× {ref}", "n/a (not measured)"
    pairs = paired_ratios(cells, size, impl, ref)
    spread = f", per rep {min(pairs):.3f}–{max(pairs):.3f}" if pairs else ""
    return f"{impl} ≥ {need:.2f}× {ref}", f"{'met' if r >= need else 'NOT met'}: {r:.3f}{spread}"


def targets(cells: list[Cell]) -> list[tuple[str, str, str]]:
    """(size, target, verdict) for the performance targets, per measured size."""
    out = []
    for size in dict.fromkeys(c.size for c in cells):
        out.append((size, *_check(cells, size, OURS_Z3, BASELINE, 1.03)))
        z3, f2 = _find(cells, size, OURS_Z3), _find(cells, size, BASELINE)
        verdict = ("n/a (not measured)" if not (z3 and f2) else
                   f"{'met' if z3.peak_gib <= f2.peak_gib else 'NOT met'}: {z3.peak_gib:.2f} vs {f2.peak_gib:.2f} GiB")
        out.append((size, f"{OURS_Z3} peak ≤ {BASELINE} peak", verdict))
        out.append((size, *_check(cells, size, OURS_Z3, CEILING, 0.97)))
        out.append((size, *_check(cells, size, OURS_Z2, NORESHARD, 1.0)))
    return out


LEGEND = ("tok/s/GPU: median over repetitions (min–max); ratios are of medians. peak: most allocated during the "
          "timed steps; at rest: after the warm-up's last zero_grad; after build: before any step. Memory is GiB "
          "above what was allocated before the build, max over ranks (peak: and over repetitions).")


def header(rows: list[dict]) -> str:
    meta = next((r for r in rows if r.get("kind") == "meta"), None)
    if meta is None:
        return "# Benchmark suite"
    world = (f"fake world {meta['world']} (one process, collectives move nothing: the step without "
             f"communication)" if meta.get("fake") else f"world {meta['world']}")
    versions = meta.get("versions") or {}
    extra = "".join(f", {label} {versions[key]}" for key, label in
                    (("cuda", "CUDA"), ("transformer_engine", "TE"), ("megatron_fsdp", "megatron-fsdp"))
                    if versions.get(key))
    isolation = f", {meta['isolation']}" if meta.get("isolation") else ""
    return (f"# Benchmark suite: {world}, {meta['device']}, torch {meta['torch']}{extra}, "
            f"{meta['steps']} timed steps after {meta['warmup']} warm-up, micro-batch {meta['micro_batch']}"
            f"{isolation}, {meta['date']}")


def _setups(rows: list[dict]) -> list[str]:
    meta = next((r for r in rows if r.get("kind") == "meta"), {})
    lines = [f"- `{name}`: {text}" for name, text in meta.get("setups", {}).items()]
    return ["", "All: AdamW (lr 1e-4), same init (seed 0) and per-rank tokens, bf16 compute.", *lines] if lines else []


def ab_pairs(cells: list[Cell]) -> list[tuple[str, str, float]]:
    """(size, NAME@LABEL, NAME / NAME@LABEL throughput) for every cell from another source tree
    whose own-tree implementation ran at that size too (``bench.source_trees``)."""
    pairs = []
    for c in cells:
        base, label = source_trees.split(c.impl)
        r = ratio(cells, c.size, base, c.impl) if label is not None else None
        if r is not None:
            pairs.append((c.size, c.impl, r))
    return pairs


def markdown(rows: list[dict]) -> str:
    cells = summarise(rows)
    parts = [header(rows), "", table(cells), "", LEGEND, *_setups(rows), ""]
    if any(r.get("kind") == "meta" and r.get("fake") for r in rows):
        parts += ["Fake world: the verdicts compare the engines without communication; the targets "
                  "themselves are for a real run.", ""]
    parts += ["| size | target | verdict |", "| --- | --- | --- |"]
    parts += [f"| {s} | {t} | {v} |" for s, t, v in targets(cells)]
    parts += source_trees.ab_lines(ab_pairs(cells))
    notes = [r for r in rows if r.get("kind") in ("skip", "error")]
    if notes:
        parts += ["", "Not measured:"]
        parts += [f"- {r['kind']}: {r.get('size')} {r.get('impl')} rep {r.get('rep')}: {r.get('reason')}"
                  for r in notes]
    parts += _loss_check(rows)
    leaks = [r for r in rows if r.get("kind") == "cell" and abs(r.get("leak_mib", 0.0)) > 64]
    if leaks:
        isolated = any(r.get("kind") == "meta" and r.get("isolation") for r in rows)
        parts += ["", "Memory the engine still held after its objects were deleted (MiB; " + (
            "each cell runs in a process of its own, so no other cell sees it):" if isolated
            else "later cells' numbers are relative to it):")]
        parts += [f"- {r['size']} {r['impl']} rep {r['rep']}: {r['leak_mib']:.0f}" for r in leaks]
    return "\n".join(parts) + "\n"


def _loss_check(rows: list[dict], tol: float = 0.05) -> list[str]:
    """Every implementation starts from the same init and data, so the first step's loss must agree
    (to bf16-vs-autocast rounding, well under ``tol`` nats); a different one means a broken setup."""
    first: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("kind") == "cell":
            first.setdefault(r["size"], {}).setdefault(r["impl"], r["loss_first"])
    out = [f"- {r['size']} {r['impl']} rep {r['rep']}: non-finite loss" for r in rows
           if r.get("kind") == "cell" and not r.get("finite", True)]
    for size, by_impl in first.items():
        mid = statistics.median(by_impl.values())
        out += [f"- {size} {impl}: first-step loss {v:.4f} vs median {mid:.4f}"
                for impl, v in by_impl.items() if abs(v - mid) > tol]
    return ["", "Loss check FAILED (same init and data must give the same first loss):", *out] if out else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsonl", type=Path)
    p.add_argument("--md", type=Path, default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    text = markdown(load(args.jsonl))
    print(text)
    if args.md is not None:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
