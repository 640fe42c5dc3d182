"""``harness-signoff``: turn the JUnit XML (and sidecars) of one or more runs into a QA sign-off.

A release manager signs off from one page: the verdict and the rules behind it, what changed since
a baseline run and since the last release (numerics vs the reviewed golden files, checkpoints of
earlier versions, speed vs the stored bench baseline), the configuration matrix of the functional
suites, which known bugs have a passing regression test, failures by rank, flaky tests, skips by
reason, the slowest tests and buckets, and the environment. Written as Markdown (``report.md``), a
self-contained HTML page with the matrix as a heat map (``report.html``) and JSON
(``summary.json``); ``merged-junit.xml`` holds every run in one JUnit file, a crashed run's tests
included; ``golden-plots/`` the SVG plots the Markdown links to. The long lists (failures, golden
cells) are capped in the report and ``summary.json``; ``details.json`` next to them holds them all.
Exit codes: 0 PASS, 1 FAIL, 2 unusable input.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from harness.report import render_html, render_md
from harness.report.diff import DEFAULT_LIMIT
from harness.report.junit_read import JunitError
from harness.report.regressions import parse_required_regressions
from harness.report.runs import Run, load_runs, merged_junit
from harness.report.sections import Report, build_report, read_mutants, split_mutants
from harness.report.speed import SpeedView, compare, find_baseline, read_baseline, read_bench
from harness.report.summary import details, dumps, summary

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_TITLE = "QA sign-off report"
OUT_FILES = {"md": "report.md", "html": "report.html", "json": "summary.json", "junit": "merged-junit.xml",
             "details": "details.json"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness-signoff",
        description="Turn JUnit XML (with the harness's *.harness.json sidecars) from one or more test runs into "
                    "a QA sign-off: Markdown, self-contained HTML and JSON, with a PASS/FAIL verdict.",
        epilog="Exit status: 0 PASS, 1 FAIL, 2 bad input. A run in which nothing ran is not a PASS.")
    parser.add_argument("--junit", action="append", default=[], metavar="PATH",
                        help="JUnit XML file, its sidecar/journal, or a directory of them (repeatable); in a "
                             "directory, runs under a 'flaky' subdirectory are reported but never gate the verdict")
    parser.add_argument("--flaky-junit", action="append", default=[], metavar="PATH",
                        help="JUnit of a quarantined (flaky) script: reported, never gating (repeatable)")
    parser.add_argument("--missing-run", action="append", default=[], metavar="LABEL",
                        help="a run that was expected but left no results; reported as an error (repeatable)")
    parser.add_argument("--baseline", nargs="+", action="extend", metavar="PATH",
                        help="JUnit XML files/directories of the baseline run")
    parser.add_argument("--diff-limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                        help=f"at most N entries per baseline-diff list (default {DEFAULT_LIMIT})")
    parser.add_argument("--require-regressions", type=pathlib.Path, metavar="FILE",
                        help="list of bug ids that must have a passing regression test")
    parser.add_argument("--mutants", type=pathlib.Path, action="append", default=[], metavar="FILE",
                        help="mutation-testing summary (tests/mutants) to show the kill rate and killers; "
                             "repeatable: one of a tier and one of the golden cells (runner --golden)")
    parser.add_argument("--bench", type=pathlib.Path, metavar="RESULT",
                        help="bench result (bench/suite.py JSON lines): compared with --bench-baseline; a speed "
                             "drop beyond the threshold fails the verdict")
    parser.add_argument("--bench-baseline", type=pathlib.Path, metavar="FILE|DIR",
                        help="stored baseline (bench/baselines/<gen>-w<world>[-fake].json), or a directory of "
                             "them: the file for the result's GPU generation, world and fake-world mode")
    parser.add_argument("--bench-threshold", type=float, metavar="FRACTION",
                        help="fail on a drop of the ratio to FSDP2 beyond this (e.g. 0.05); default: 3 x the "
                             "baseline's measured run-to-run spread")
    parser.add_argument("--out-dir", type=pathlib.Path, metavar="DIR",
                        help="write " + ", ".join(OUT_FILES.values()) + " into DIR")
    parser.add_argument("--output", type=pathlib.Path, metavar="FILE", help="write the Markdown report here")
    parser.add_argument("--html", type=pathlib.Path, metavar="FILE", help="write the HTML report here")
    parser.add_argument("--json", type=pathlib.Path, metavar="FILE", help="write summary JSON here")
    parser.add_argument("--details", type=pathlib.Path, metavar="FILE",
                        help="write every failure and golden cell (capped in the report) here; default: "
                             "details.json next to the report")
    parser.add_argument("--title", default=DEFAULT_TITLE, help="report title")
    return parser


def _outputs(args: argparse.Namespace) -> dict[str, pathlib.Path]:
    out: dict[str, pathlib.Path] = {}
    if args.out_dir is not None:
        out = {kind: args.out_dir / name for kind, name in OUT_FILES.items()}
    for kind, path in (("md", args.output), ("html", args.html), ("json", args.json), ("details", args.details)):
        if path is not None:
            out[kind] = path
    if out and "details" not in out:  # the full lists go with the report, wherever it goes
        first = next(out[k] for k in ("json", "html", "md") if k in out)
        out["details"] = first.parent / OUT_FILES["details"]
    return out


def _details_label(outputs: dict[str, pathlib.Path]) -> str | None:
    """How the report names ``details.json``: its file name when it sits next to the report pages."""
    path = outputs.get("details")
    if path is None:
        return None
    pages = [outputs[k].parent for k in ("md", "html") if k in outputs]
    return path.name if all(p.resolve() == path.parent.resolve() for p in pages) else str(path)


def _write(outputs: dict[str, pathlib.Path], rep: Report, runs: list[Run]) -> None:
    texts = {"md": lambda: render_md.render(rep, with_assets=True), "html": lambda: render_html.render(rep),
             "json": lambda: dumps(summary(rep)), "details": lambda: dumps(details(rep), indent=None)}
    for kind, path in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "junit":
            merged_junit(runs).write(str(path), pretty=False)
        else:
            path.write_text(texts[kind](), encoding="utf-8")
    if "md" in outputs:  # the golden plots the Markdown links to, next to it
        for rel, svg in render_md.assets(rep).items():
            target = outputs["md"].parent / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(svg, encoding="utf-8")


def _speed(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SpeedView | None:
    if args.bench is None and args.bench_baseline is None:
        return None
    if args.bench is None or args.bench_baseline is None:
        parser.error("--bench and --bench-baseline go together")
    if args.bench_threshold is not None and not 0 < args.bench_threshold < 1:
        parser.error("--bench-threshold is a fraction between 0 and 1 (e.g. 0.05)")
    result = read_bench(args.bench)
    path = find_baseline(args.bench_baseline, result) if args.bench_baseline.is_dir() else args.bench_baseline
    return compare(result, read_baseline(path), str(path), args.bench_threshold)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.junit and not args.missing_run and not args.flaky_junit:
        parser.error("the following arguments are required: --junit")
    if args.diff_limit < 1:
        parser.error("--diff-limit must be >= 1")
    try:
        runs = load_runs(args.junit, args.missing_run, args.flaky_junit)
        baseline = [c for r in load_runs(args.baseline) if r.gating for c in r.cases] if args.baseline else None
        required = parse_required_regressions(args.require_regressions) if args.require_regressions else {}
        mutants, golden_mutants = split_mutants([read_mutants(p) for p in args.mutants])
        speed = _speed(args, parser)
    except JunitError as exc:
        print(f"harness-signoff: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sources = [*args.junit, *(f"{p} (flaky)" for p in args.flaky_junit), *(f"{m} (missing)" for m in args.missing_run)]
    rep = build_report(args.title, runs, required, baseline, sources, args.baseline or (), args.diff_limit, mutants,
                       speed, golden_mutants)
    outputs = _outputs(args)
    rep.details_file = _details_label(outputs)
    if not outputs:
        sys.stdout.write(render_md.render(rep))
        return EXIT_PASS if rep.passed else EXIT_FAIL
    try:
        _write(outputs, rep, runs)
    except OSError as exc:
        print(f"harness-signoff: error: cannot write the report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    verdict = "PASS" if rep.passed else "FAIL"
    where = ", ".join(str(p) for p in outputs.values())
    print(f"harness-signoff: {verdict} ({rep.counts.total} tests) -> {where}")
    for reason in rep.reasons:
        print(f"harness-signoff:   {reason}")
    return EXIT_PASS if rep.passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
