"""Speed vs baseline: a new bench result against the stored per-GPU-generation baseline.

Throughput is compared as the ratio of each implementation to the reference (FSDP2) *from the same
run*, so a faster or slower machine, driver or clock moves both sides and does not count; only a
drop of that ratio beyond a threshold is a regression. The threshold comes from measured
run-to-run spread (``spread``: the relative half-range of the ratio over repeated runs of
unchanged code), which the baseline file carries; a drop is flagged beyond ``SPREAD_FACTOR`` times
it. ``DEFAULT_SPREAD`` is the spread ``bench/RESULTS.md`` measured, for a baseline that has none:

- 1xH200, fake world 2, 1.3B (2026-12-02): FSDP2's step over three runs of unchanged code
  150.7-154.3 ms, a half-range of 1.8 ms on a median of 151.7 ms: 1.2 %. Ours was steadier
  (149.6-150.4 ms), so the ratio inherits FSDP2's noise: 1.026 and 1.008 in two runs (+-0.9 %).
- 2xH200, real world 2, 1.3B (2026-12-01): the per-repetition ratio ranged 1.000-1.035 (+-1.7 %);
  the medians over three repetitions that a baseline holds are steadier than one repetition.

So 3 x 1.2 % = 3.6 %: twice the largest run-to-run difference of two ratios seen (1.8 %), while a
10 % slow-down is caught. Memory (peak GiB) is shown with its change and noted beyond
``MEMORY_TOLERANCE`` (peaks reproduce to ~0.3 %: the 65 MiB cuBLAS workspace artefact), not gating.

The bench writes JSON lines (``bench/suite.py --out suite.jsonl``): a ``meta`` row (world, fake,
device, versions) and per measurement a ``cell`` row (size, impl, rep, tok_s_per_gpu, peak_gib);
``skip``/``error`` rows are ignored. The baseline format is in ``bench/baselines/README.md``;
``python -m harness.report.speed_baseline`` writes one from bench results. Standard library only.

Every figure must be a number that can be compared: a throughput (``tok_s_per_gpu``, ours or the
reference, in the result or the baseline) or a baseline ratio that is NaN, infinite, zero or
negative fails the sign-off's figures rule by name (NaN fails both threshold comparisons, so it
would otherwise read as "ok"; a zero reference would divide by zero), and its row is INVALID;
peak memory and spreads must be finite and not negative.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from harness.gpu_generation import generation_of
from harness.report.junit_read import JunitError
from harness.report.verdict import Rule, figures_rule

FORMAT = 1
REFERENCE = "fsdp2"
SPREAD_FACTOR = 3.0
DEFAULT_SPREAD = 0.012
MEMORY_TOLERANCE = 0.02
SLOWER, FASTER, OK, NOT_MEASURED, NEW, REF = "SLOWER", "faster", "ok", "NOT MEASURED", "new (no baseline)", "reference"
INVALID = "INVALID"  # a figure of the cell (or of its reference) is not a finite positive number


@dataclasses.dataclass(frozen=True)
class BenchCell:
    """One (size, impl) of a bench result: medians over repetitions, peak over them, ratio to the reference."""

    size: str
    impl: str
    reps: int
    tok_s: float
    peak_gib: float
    ratio: float | None  # median tokens/s over the reference's median, same run
    rep_ratios: tuple[float, ...] = ()  # per repetition in which both ran
    problems: tuple[str, ...] = ()  # its own figures that are not finite and positive
    reference_invalid: bool = False  # the reference's figures at this size are not: no ratio


@dataclasses.dataclass(frozen=True)
class BenchResult:
    path: str
    meta: dict[str, Any]
    cells: tuple[BenchCell, ...]

    def cell(self, size: str, impl: str) -> BenchCell | None:
        return next((c for c in self.cells if c.size == size and c.impl == impl), None)


@dataclasses.dataclass(frozen=True)
class SpeedRow:
    size: str
    impl: str
    base: dict[str, Any] | None  # the baseline's cell
    now: BenchCell | None
    change: float | None  # relative change of the ratio to the reference (now / baseline - 1)
    threshold: float
    memory_change: float | None
    status: str


@dataclasses.dataclass
class SpeedView:
    """The comparison the sign-off shows; ``problems`` fail the speed rule."""

    bench: str
    baseline_path: str
    baseline: dict[str, Any]
    result_meta: dict[str, Any]
    rows: list[SpeedRow]
    threshold_source: str
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    bad_figures: list[str] = dataclasses.field(default_factory=list)  # the figures rule's evidence
    figures_checked: str = ""  # what the figures rule looked at, for its evidence


def positive(value: object) -> bool:
    """A finite number above 0 (a throughput, a ratio)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def not_negative(value: object) -> bool:
    """A finite number, 0 or above (a peak memory, a spread)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _row_problems(size: str, impl: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """The figures of one (size, impl)'s bench rows that cannot be compared, each named."""
    out = []
    for i, r in enumerate(rows):
        where = f"bench result: {impl} at {size} rep {r.get('rep', i + 1)}"
        tok, peak = float(r["tok_s_per_gpu"]), float(r["peak_gib"])
        if not positive(tok):
            out.append(f"{where}: tok_s_per_gpu is {tok!r} (must be finite and above 0)")
        if not not_negative(peak):
            out.append(f"{where}: peak_gib is {peak!r} (must be finite and not negative)")
    return out


def _rows(path: pathlib.Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        rows = data.get("rows", []) if isinstance(data, dict) else data
    except ValueError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("expected JSON lines of bench rows (or a JSON list of them)")
    return rows


def summarise(rows: Sequence[dict[str, Any]], reference: str = REFERENCE) -> list[BenchCell]:
    """One cell per (size, impl) measured, as ``bench/report.py`` summarises them; a ratio only
    where both throughputs are finite and positive (never a division by zero or NaN)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("kind") == "cell":
            groups.setdefault((str(r["size"]), str(r["impl"])), []).append(r)
    medians = {k: statistics.median(float(r["tok_s_per_gpu"]) for r in rs) for k, rs in groups.items()}
    by_rep = {k: {r.get("rep", i): float(r["tok_s_per_gpu"]) for i, r in enumerate(rs)} for k, rs in groups.items()}
    problems = {k: _row_problems(*k, rs) for k, rs in groups.items()}
    cells = []
    for (size, impl), rs in groups.items():
        key, ref = (size, impl), (size, reference)
        ref_ok = ref in groups and not problems[ref]
        ok = ref_ok and not problems[key]
        ratio = medians[key] / medians[ref] if ok else None
        pairs = tuple(v / by_rep[ref][rep] for rep, v in sorted(by_rep[key].items())
                      if rep in by_rep[ref]) if ok else ()
        cells.append(BenchCell(size, impl, len(rs), medians[key], max(float(r["peak_gib"]) for r in rs), ratio,
                               pairs, tuple(problems[key]), ref in groups and not ref_ok and impl != reference))
    return cells


def read_bench(path: str | pathlib.Path, reference: str = REFERENCE) -> BenchResult:
    """A bench result file; a ``JunitError`` (the sign-off's bad-input error) naming it if unusable."""
    p = pathlib.Path(path)
    try:
        rows = _rows(p)
        meta = next((r for r in rows if r.get("kind") == "meta"), {})
        return BenchResult(str(p), meta, tuple(summarise(rows, reference)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JunitError(f"cannot read bench result {p}: {exc}") from None


def read_baseline(path: str | pathlib.Path) -> dict[str, Any]:
    p = pathlib.Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JunitError(f"cannot read bench baseline {p}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("cells"), list):
        raise JunitError(f"{p}: not a bench baseline of format {FORMAT} (bench/baselines/README.md)")
    for cell in data["cells"]:
        if not isinstance(cell, dict) or not {"size", "impl", "tok_s_per_gpu"} <= set(cell):
            raise JunitError(f"{p}: every cell needs size, impl and tok_s_per_gpu (got {cell!r})")
    return data


def baseline_file_name(gen: str, world: int, fake: bool) -> str:
    """``<gen>-w<world>[-fake].json``: one baseline per generation and bench world (a result is
    only comparable with a baseline of the same world and fake-world mode)."""
    return f"{gen}-w{world}{'-fake' if fake else ''}.json"


def find_baseline(directory: str | pathlib.Path, result: BenchResult) -> pathlib.Path:
    """The baseline in ``directory`` for ``result``'s GPU generation, world and fake-world mode;
    a clear error naming the file expected, the files there and the command that makes it."""
    d = pathlib.Path(directory)
    device = str(result.meta.get("device", ""))
    gen, world, fake = generation_of(device), result.meta.get("world"), bool(result.meta.get("fake", False))
    if gen is None or not isinstance(world, int):
        raise JunitError(f"bench result {result.path}: its device {device!r} / world {world!r} name no baseline in "
                         f"{d}; pass --bench-baseline FILE")
    path = d / baseline_file_name(gen, world, fake)
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in d.glob("*.json"))) or "none"
        raise JunitError(f"no bench baseline {path} for {gen}, world {world}{' (fake)' if fake else ''} "
                         f"(there: {have}); make it from bench runs of the last release: python -m "
                         f"harness.report.speed_baseline --gen {gen} --out {path} RUN1.jsonl [RUN2.jsonl ...]")
    return path


def baseline_problems(baseline: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    """Per baseline cell (and ``("", "")`` for the file), its figures that cannot be compared."""
    out: dict[tuple[str, str], list[str]] = {}
    if baseline.get("spread") is not None and not not_negative(baseline["spread"]):
        out[("", "")] = [f"baseline: spread is {baseline['spread']!r} (must be finite and not negative)"]
    for cell in baseline["cells"]:
        size, impl = str(cell["size"]), str(cell["impl"])
        where, bad = f"baseline: {impl} at {size}", []
        if not positive(cell.get("tok_s_per_gpu")):
            bad.append(f"{where}: tok_s_per_gpu is {cell.get('tok_s_per_gpu')!r} (must be finite and above 0)")
        if cell.get("ratio") is not None and not positive(cell["ratio"]):
            bad.append(f"{where}: ratio is {cell['ratio']!r} (must be finite and above 0)")
        for key in ("peak_gib", "spread"):
            if cell.get(key) is not None and not not_negative(cell[key]):
                bad.append(f"{where}: {key} is {cell[key]!r} (must be finite and not negative)")
        if bad:
            out[(size, impl)] = bad
    return out


def _threshold(cell: dict[str, Any], baseline: dict[str, Any], override: float | None) -> float:
    """``SPREAD_FACTOR`` x the cell's (else the file's) measured spread, never below
    ``DEFAULT_SPREAD``: two or three runs easily show a half-range smaller than the noise three
    runs of unchanged code showed on the H200 (1.2 %), and a threshold built on it flags noise.
    A spread that is not a finite number is skipped (the figures rule names it)."""
    if override is not None:
        return override
    spreads = [v for v in (cell.get("spread"), baseline.get("spread")) if not_negative(v) and v]
    return SPREAD_FACTOR * max(float(spreads[0]) if spreads else DEFAULT_SPREAD, DEFAULT_SPREAD)


def _relative(now: float | None, base: float | None) -> float | None:
    return None if now is None or not base else now / base - 1.0


def _invalid(now: BenchCell | None, base_bad: Sequence[str]) -> bool:
    return bool(base_bad) or (now is not None and (bool(now.problems) or now.reference_invalid))


def _row(base: dict[str, Any], now: BenchCell | None, reference: str, threshold: float,
         base_bad: Sequence[str] = ()) -> SpeedRow:
    size, impl = str(base["size"]), str(base["impl"])
    if _invalid(now, base_bad):
        return SpeedRow(size, impl, base, now, None, threshold, None, INVALID)
    memory = _relative(now.peak_gib, base.get("peak_gib")) if now else None
    if impl == reference:
        return SpeedRow(size, impl, base, now, None, threshold, memory, REF if now else NOT_MEASURED)
    change = _relative(now.ratio if now else None, base.get("ratio"))
    if change is None:
        status = NOT_MEASURED
    else:
        status = SLOWER if change < -threshold else FASTER if change > threshold else OK
    return SpeedRow(size, impl, base, now, change, threshold, memory, status)


def _comparable(result: BenchResult, baseline: dict[str, Any]) -> tuple[list[str], list[str]]:
    problems, notes = [], []
    meta = result.meta
    for key in ("world", "fake"):
        if key in meta and key in baseline and meta[key] != baseline[key]:
            problems.append(f"not comparable: the result has {key}={meta[key]}, the baseline {key}={baseline[key]}")
    gen, device = str(baseline.get("gen", "")), str(meta.get("device", ""))
    if gen and device and gen.lower() not in device.lower():
        notes.append(f"the result ran on {device!r}, the baseline is for {gen}")
    versions = meta.get("versions") or {"torch": meta.get("torch")}
    for lib, was in (baseline.get("versions") or {}).items():
        now = versions.get(lib)
        if now is not None and was is not None and str(now) != str(was):
            notes.append(f"{lib} {was} -> {now}")
    return problems, notes


def _figures(result: BenchResult, baseline_bad: dict[tuple[str, str], list[str]]) -> list[str]:
    return [p for c in result.cells for p in c.problems] + [p for ps in baseline_bad.values() for p in ps]


def _row_problem(row: SpeedRow, reference: str) -> str | None:
    if row.status == SLOWER and row.change is not None:
        return f"{row.impl} at {row.size}: {row.change:+.1%} vs {reference} (threshold -{row.threshold:.1%})"
    if row.status == NOT_MEASURED:
        return f"{row.impl} at {row.size}: not measured (or no {reference} to compare with)"
    if row.status == INVALID:
        return f"{row.impl} at {row.size}: not compared (a figure of it or of {reference} is not finite and positive)"
    return None


def compare(result: BenchResult, baseline: dict[str, Any], baseline_path: str,
            threshold: float | None = None) -> SpeedView:
    """Every baseline cell against the result; cells the result adds are listed as new."""
    reference = str(baseline.get("reference", REFERENCE))
    base_bad = baseline_problems(baseline)
    rows = [_row(b, result.cell(str(b["size"]), str(b["impl"])), reference, _threshold(b, baseline, threshold),
                 base_bad.get((str(b["size"]), str(b["impl"])), ())) for b in baseline["cells"]]
    known = {(str(b["size"]), str(b["impl"])) for b in baseline["cells"]}
    rows += [SpeedRow(c.size, c.impl, None, c, None, 0.0, None, INVALID if _invalid(c, ()) else NEW)
             for c in result.cells if (c.size, c.impl) not in known]
    spread = (f"the baseline's {float(baseline['spread']):.1%}" if not_negative(baseline.get("spread"))
              and baseline.get("spread") else f"none measured: the default {DEFAULT_SPREAD:.1%}")
    source = (f"--bench-threshold {threshold:g}" if threshold is not None else
              f"{SPREAD_FACTOR:g} x the measured run-to-run spread of the ratio (a cell's own where it has one, "
              f"else {spread})")
    problems, notes = _comparable(result, baseline)
    view = SpeedView(result.path, baseline_path, baseline, result.meta, rows, source, problems, notes,
                     _figures(result, base_bad), f"{sum(c.reps for c in result.cells)} bench row(s) and "
                     f"{len(baseline['cells'])} baseline cell(s)")
    for row in rows:
        problem = _row_problem(row, reference)
        if problem:
            view.problems.append(problem)
        if row.memory_change is not None and row.memory_change > MEMORY_TOLERANCE:
            view.notes.append(f"{row.impl} at {row.size}: peak memory {row.memory_change:+.1%}")
    if not any(r.status in (OK, FASTER, SLOWER) for r in rows):
        view.problems.append("no implementation could be compared with the baseline")
    return view


def speed_figures_rule(view: SpeedView) -> Rule:
    """Every throughput, ratio, peak and spread of the bench result and its baseline is a usable number."""
    return figures_rule(view.bad_figures, view.figures_checked)


def speed_rule(view: SpeedView) -> Rule:
    """A speed drop beyond the threshold (or a bench that measured nothing comparable) fails."""
    compared = sum(r.status in (OK, FASTER, SLOWER) for r in view.rows)
    return Rule("speed vs baseline", "no implementation's throughput ratio to the reference dropped beyond the "
                "threshold since the baseline (only when a bench result is given)", not view.problems,
                "; ".join(view.problems) or f"{compared} cell(s) within the threshold")
