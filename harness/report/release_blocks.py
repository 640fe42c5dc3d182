"""The sign-off's "what changed since the last release" sections, as neutral blocks: numerics vs
the reviewed golden files (with a plot of each drifting cell), checkpoints of earlier versions,
speed vs the stored bench baseline; and, in Mutation testing, what the golden cells alone kill."""

from __future__ import annotations

from typing import Any

from harness.report.document import (
    FOLD_ROWS,
    MAX_LISTED,
    Block,
    Bullets,
    Chart,
    Code,
    Details,
    Heading,
    Md,
    Para,
    Table,
    fold,
    more_para,
)
from harness.report.golden_view import MAX_PLOTS, GoldenCell, drift_text, plotted
from harness.report.junit_format import GOLDEN_BAND, GOLDEN_DRIFT, GOLDEN_MISSING
from harness.report.junit_read import one_line_cause
from harness.report.sections import Report, gpu_only_here, numerics_survivors
from harness.report.speed import SpeedRow

COMPAT_CAUSE_CHARS = 480  # a compatibility failure's cause: room for the file problems a damaged fixture lists


def _series_names(cells: list[GoldenCell]) -> list[str]:
    return list(dict.fromkeys(s.name for g in cells for s in g.series))


def _versions(g: GoldenCell) -> str:
    v = g.golden_versions
    return ", ".join(f"{k} {v[k]}" for k in ("git", "torch", "cuda", "nccl", "transformer_engine")
                     if v.get(k) not in (None, "None")) or "-"


def _status(g: GoldenCell) -> str:
    return g.status if g.ok else g.status.upper()


def _cell_table(cells: list[GoldenCell], names: list[str], detail: bool = False) -> Table:
    rows = []
    for g in cells:
        by_name = {s.name: s for s in g.series}
        row: list[object] = [Code(g.cell), g.platform, g.case.run, _status(g), g.compared,
                             *(drift_text(by_name[n]) if n in by_name else "-" for n in names), _versions(g)]
        if detail:
            row.append(Md(g.detail or (f"no file `{g.path}`" if g.status == GOLDEN_MISSING else
                                       "plot below" if g.status == GOLDEN_DRIFT else "")))
        rows.append(row)
    headers = ["cell", "platform", "run", "status", "compared", *(f"{n}: max drift @ first step" for n in names),
               "golden made with", *(["detail"] if detail else [])]
    return Table(headers, rows)


def _drift_detail(g: GoldenCell) -> Table:
    rows = []
    for s in g.series:
        if s.first_drift_step is None:
            continue
        k = s.first_drift_step
        run = s.run[k] if k < len(s.run) else None
        want = s.golden[k] if s.golden is not None and k < len(s.golden) else None
        rows.append([s.name, k, "-" if run is None else repr(run), "-" if want is None else repr(want),
                     "-" if s.max_rel_drift is None else f"{s.max_rel_drift:.3g}", f"{s.tolerance:g}"])
    return Table(["series", "first drifting step", "run there", "golden there", "max relative drift", "tolerance"],
                 rows)


def golden_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Numerics vs golden")]
    cells = rep.golden
    if not cells:
        return out + [Para("No golden cell ran (`pytest -m golden`; reviewed files in `tests/golden/<platform>/`).")]
    counts: dict[str, int] = {}
    for g in cells:
        counts[_status(g)] = counts.get(_status(g), 0) + 1
    platforms = ", ".join(sorted({g.platform for g in cells} - {"-"})) or "-"
    out.append(Para(f"{len(cells)} golden cell(s) on {platforms}: "
                    + ", ".join(f"{n} {s}" for s, n in counts.items())
                    + ". Each is a short fixed-seed run compared step by step with its reviewed file; drift is "
                      "relative (|run - golden| / |golden|); a tolerance of 0 means bit for bit. Where the run's "
                      "fingerprint (what decides its bits: torch, BLAS, CPU kernels, threads; GPU stack) equals "
                      "the file's, the comparison is exact; where it differs, within the band measured for the "
                      "cell (column *compared*)."))
    banded = [g for g in cells if g.comparison == GOLDEN_BAND]
    if banded:
        out.append(Para(f"**Note: {len(banded)} of {len(cells)} cell(s) were compared within their band, not bit "
                        f"for bit**, because this run's fingerprint differs from their file's (first "
                        f"`{banded[0].cell}`: {'; '.join(banded[0].fingerprint_diff) or '?'}). A band catches a "
                        "real change (a learning rate off by 1e-3) but not a last-bit one: compare on the "
                        "fingerprint that made the files for that."))
    names = _series_names(cells)
    problems = [g for g in cells if not g.ok]
    if problems:
        out.append(_cell_table(problems[:MAX_LISTED], names, detail=True))
        if len(problems) > MAX_LISTED:
            out.append(more_para(len(problems), MAX_LISTED, "problem cells", rep.details_file))
        listed = f"; the first {MAX_LISTED} listed" if len(cells) > MAX_LISTED else ""
        every = f"Every golden cell ({len(cells)} rows{listed})"
        out.append(Details(every, [_cell_table(cells[:MAX_LISTED], names)]))
    else:
        out.append(fold("Every golden cell", _cell_table(cells[:MAX_LISTED], names)))
        if len(cells) > MAX_LISTED:
            out.append(more_para(len(cells), MAX_LISTED, "golden cells", rep.details_file))
    out += _missing_blocks([g for g in problems if g.status == GOLDEN_MISSING])
    drawn = plotted(problems)
    for g in drawn:
        out.append(Heading(3, f"Drift: {g.cell} ({g.platform}, run {g.case.run})"))
        out.append(Para(f"`{g.case.test_id}` against `{g.path}` ({g.compared}). The golden curve is grey, the "
                        "run's red; the last panel is the relative drift per step (log scale), the dashed line the "
                        "tolerance (the band, when compared within it)."))
        out.append(Chart("golden_plot", fallback=[_drift_detail(g)], data=g))
    drifting = sum(g.status == GOLDEN_DRIFT for g in problems)
    if drifting > len(drawn):
        out.append(Para(f"... and {drifting - MAX_PLOTS} more drifting cells (see the table above)."))
    return out


def _missing_blocks(missing: list[GoldenCell]) -> list[Block]:
    """The commands that make the missing golden files (the first ``MAX_LISTED``)."""
    if not missing:
        return []
    return [Para("**Missing golden files**: make each with its command, review the printed values and "
                 "commit the file (on the platform it is for):"),
            Table(["cell", "platform", "command"],
                  [[Code(g.cell), g.platform, Code(g.update_command)] for g in missing[:MAX_LISTED]])]


def compat_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Checkpoint compatibility")]
    if not rep.compat:
        return out + [Para("No checkpoint-compatibility test ran (`@pytest.mark.checkpoint_compat`; fixtures in "
                           "`tests/golden/checkpoints/`).")]
    ok = sum(r.ok for r in rep.compat)
    out.append(Para(f"Checkpoints committed by an earlier version (model + optimizer) must load into this "
                    f"version and train on to their golden curve, or be refused at load naming the format they "
                    f"have: {ok} of {len(rep.compat)} test(s) passed."))
    rows: list[list[object]] = []
    for r in rep.compat:
        curve = "-" if r.golden is None else f"{_status(r.golden)}" + (
            f" ({r.golden.series[0].name} drift {drift_text(r.golden.series[0])})" if r.golden.series else "")
        rows.append([Code(r.fixture), r.check, r.case.run, r.case.outcome if r.ok else r.case.outcome.upper(), curve,
                     "" if r.ok else Md(f"`{r.case.test_id}`: {one_line_cause(r.case, COMPAT_CAUSE_CHARS)}")])
    return out + [fold("Every checkpoint-compatibility test",
                       Table(["fixture", "check", "run", "outcome", "continued curve", "failure"], rows))]


def _speed_row(r: SpeedRow) -> list[object]:
    base, now = r.base or {}, r.now

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    return [r.size, r.impl, num(base.get("tok_s_per_gpu"), ",.0f"), num(now.tok_s if now else None, ",.0f"),
            num(base.get("ratio"), ".3f"), num(now.ratio if now else None, ".3f"), num(r.change, "+.1%"),
            f"-{r.threshold:.1%}" if r.base and r.change is not None else "-", num(base.get("peak_gib"), ".2f"),
            num(now.peak_gib if now else None, ".2f"), num(r.memory_change, "+.1%"), r.status]


def speed_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Speed vs baseline")]
    v = rep.speed
    if v is None:
        return out + [Para("No bench result given (`--bench <result> --bench-baseline bench/baselines`): "
                           "speed is not part of this sign-off.")]
    b = v.baseline
    ref = b.get("reference", "fsdp2")
    made = ", ".join(f"{k} {val}" for k, val in (b.get("versions") or {}).items())
    out.append(Para(f"Bench `{v.bench}` against `{v.baseline_path}` ({b.get('gen', '?')}, world {b.get('world', '?')}"
                    f"{', fake' if b.get('fake') else ''}, made {b.get('made', '?')} with {made or '?'}). Each "
                    f"implementation is compared by its throughput ratio to `{ref}` in the same run, so a faster or "
                    "slower machine does not count; a drop beyond the threshold fails. "
                    f"Threshold: {v.threshold_source}."))
    head = ["size", "impl", "tok/s/GPU baseline", "tok/s/GPU now", f"vs {ref} baseline", f"vs {ref} now", "change",
            "threshold", "peak GiB baseline", "peak GiB now", "memory change", "status"]
    out.append(fold("Every bench cell", Table(head, [_speed_row(r) for r in v.rows]), limit=FOLD_ROWS))
    if v.notes:
        out += [Para("Notes:"), Bullets(v.notes)]
    return out


def golden_mutant_blocks(rep: Report) -> list[Block]:
    """Per mutant: do the golden cells alone kill it? Every mutant that changes numerics must be."""
    gm = rep.golden_mutants
    if gm is None:
        return []
    muts = gm["mutants"]
    killed = sum(m.get("status") == "killed" for m in muts)
    gpu_only = gpu_only_here(gm)
    numerics = [m for m in muts if m.get("numerics") and m.get("name") not in gpu_only]
    survivors = numerics_survivors(gm)
    verdict = ("every one killed" if not survivors else
               "NOT killed: " + ", ".join(f"`{m['name']}`" for m in survivors))
    gen = gm.get("gen", "?")
    rows = [[Code(m.get("name", "?")), m.get("bug_class", ""),
             (m.get("numerics") or "no") + (" (GPU only)" if m.get("numerics_gpu_only") else ""),
             m.get("status", "?"), Code(", ".join(m.get("killed_by", [])[:2])) if m.get("killed_by") else "-",
             m.get("reason", "")] for m in muts]
    text = (f"Each mutant against the golden cells only (`pytest -m golden tests/functional`, "
            f"`python -m tests.mutants.runner --golden`, on {gen}): {killed} of {len(muts)} killed. "
            f"Mutants that change numerics on {gen} ({len(numerics)}): {verdict}.")
    if gpu_only:
        status = {m.get("name"): m.get("status", "?") for m in muts}
        text += (" Numbers that change only on GPUs (not counted on cpu): "
                 + ", ".join(f"`{n}` ({status[n]})" for n in gpu_only) + ".")
    return [Heading(3, "Golden cells alone"), Para(text),
            fold("Every mutant", Table(["mutant", "bug class", "changes numerics", "golden cells", "killed by",
                                        "reason"], rows))]
