"""Run a test tier once per mutant and report which mutants the suite killed.

    python -m tests.mutants.runner [--tier L0|L1|L2] [--gen cpu] [--narrow | --golden] [--only NAME ...]

For each mutant of ``tests.mutants.catalogue``: first check, in a fresh interpreter, that it
applies (its targets exist and are replaced); then run the tier's launch scripts
(``launch_scripts/<gen>/active/<tier>_*.sh``, L1 and L2 after the L0 scripts: a daily tier includes
the per-change one) with ``HARNESS_MUTANT`` set and ``-x``, stopping at the first script with a
failing test. KILLED: some test failed or errored; the failing tests are the killers. SURVIVED:
the mutant does not apply, or no test failed. ``--narrow`` runs each mutant's own narrow selection
instead (the quick check while writing a mutant). ``--golden`` runs the golden cells alone
(``pytest -m golden tests/functional``): their regression power, reported per mutant; every mutant
that changes numerics on this platform must be killed by them (the catalogue's ``numerics``).
Writes ``<out>/summary.json`` (``<out>/golden/summary.json`` for ``--golden``; read by
``harness-signoff --mutants``) and a JUnit file per mutant and script under ``<out>/<mutant>/``.
Exit status: 0 when the kill rate reaches ``--min-kill-rate`` (``--golden``: when every
numerics-changing mutant was killed), 1 otherwise, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Any

from harness.report.junit_read import JunitError, read_junit
from tests.mutants.catalogue import BY_NAME, MUTANTS, Mutant

REPO = pathlib.Path(__file__).resolve().parents[2]
CATALOGUE = "tests.mutants.catalogue"
GOLDEN_SELECTION = ("-m", "golden", "tests/functional")
TIERS = {"L0": ("L0",), "L1": ("L0", "L1"), "L2": ("L0", "L1", "L2")}
DEFAULT_MIN_RATE = {"L0": 80.0, "L1": 100.0, "L2": 100.0}
_CHECK = """
import sys
from tests.mutants import catalogue, patching
try:
    getattr(catalogue, sys.argv[1])()
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(1)
problems = patching.verify()
if problems or not patching.APPLIED:
    print("; ".join(problems) or "the mutant patched nothing")
    sys.exit(1)
"""


def _env(mutant: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HARNESS_MUTANT"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if mutant is not None:
        env["HARNESS_MUTANT"] = f"{CATALOGUE}:{mutant}"
    return env


def applies(mutant: Mutant) -> str | None:
    """None when the mutant applies in a fresh interpreter, else why not."""
    proc = subprocess.run([sys.executable, "-c", _CHECK, mutant.name], cwd=REPO, env=_env(None),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def tier_scripts(tier: str, gen: str) -> list[pathlib.Path]:
    scripts = [s for t in TIERS[tier] for s in sorted((REPO / "launch_scripts" / gen / "active").glob(f"{t}_*.sh"))]
    if not scripts:
        raise SystemExit(f"mutants: no {tier} scripts in launch_scripts/{gen}/active/")
    return scripts


def _failing(xml: pathlib.Path) -> tuple[list[str], int]:
    """(ids of failing tests, number of tests) in one JUnit file; ([], 0) when it is missing."""
    try:
        cases = read_junit([xml])
    except JunitError:
        return [], 0
    return [c.test_id for c in cases if c.failing], len(cases)


def _run_step(cmd: list[str], env: dict[str, str], xml: pathlib.Path, log: pathlib.Path,
              timeout: float) -> tuple[int, list[str], int]:
    with log.open("w") as out:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    failing, total = _failing(xml)
    return rc, failing, total


def _pytest_step(label: str, out: pathlib.Path, selection: tuple[str, ...]) -> tuple[str, list[str], pathlib.Path]:
    xml = out / f"{label}.xml"
    return label, [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                   *selection], xml


def run_mutant(mutant: Mutant, args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    result: dict[str, Any] = {"name": mutant.name, "bug_class": mutant.bug_class, "status": "survived",
                              "killed_by": [], "reason": "", "tests_run": 0, "numerics": mutant.numerics,
                              "numerics_gpu_only": mutant.numerics_gpu_only}
    problem = applies(mutant)
    if problem is not None:
        result["reason"] = f"does not apply: {problem}"
        return result
    out = args.out / mutant.name
    out.mkdir(parents=True, exist_ok=True)
    env = _env(mutant.name)
    if args.narrow:
        steps = [_pytest_step("narrow", out, mutant.narrow)]
    elif args.golden:
        if args.gen == "cpu":
            env["HARNESS_FORCE_CPU"] = "1"
        steps = [_pytest_step("golden", out, GOLDEN_SELECTION)]
    else:
        extra = os.environ.get("HARNESS_PYTEST_ARGS", "")
        env.update(HARNESS_OUT_DIR=str(out), HARNESS_PYTEST_ARGS=f"-x {extra}".strip())
        steps = [(s.stem, ["bash", str(s)], out / args.gen / f"{s.stem}.xml")
                 for s in tier_scripts(args.tier, args.gen)]
    for label, cmd, xml in steps:
        rc, failing, total = _run_step(cmd, env, xml, out / f"{label}.log", args.timeout)
        result["tests_run"] += total
        if rc == 4:
            result["reason"] = f"{label}: pytest usage error (exit 4), the mutant did not apply in the run"
            break
        if failing:
            result.update(status="killed", killed_by=failing[:20], reason=f"{label}: {len(failing)} test(s) failed")
            break
        result["reason"] = f"no test failed ({result['tests_run']} ran; last exit status {rc})"
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=sorted(TIERS), default="L0")
    parser.add_argument("--gen", default="cpu", help="launch-script generation (default cpu)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--narrow", action="store_true", help="run each mutant's narrow selection, not the tier")
    mode.add_argument("--golden", action="store_true",
                      help="run the golden cells alone (pytest -m golden tests/functional): every mutant that "
                           "changes numerics on this platform must be killed")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these mutants")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "results" / "mutants")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per script or narrow run")
    parser.add_argument("--min-kill-rate", type=float, default=None,
                        help="percent of mutants that must be killed (default: 80 for L0, 100 for L1/L2 and --narrow)")
    return parser


def numerics_gate(results: list[dict[str, Any]], gen: str) -> tuple[list[str], list[str]]:
    """(mutants that change numerics on ``gen`` but survived, those whose numbers change only on GPUs
    when ``gen`` is cpu: not measurable here)."""
    gpu_only = [r["name"] for r in results if r.get("numerics") and r.get("numerics_gpu_only") and gen == "cpu"]
    survivors = [r["name"] for r in results if r.get("numerics") and r["status"] != "killed"
                 and r["name"] not in gpu_only]
    return survivors, gpu_only


def _golden_verdict(summary: dict[str, Any], results: list[dict[str, Any]], gen: str, out: pathlib.Path) -> int:
    survivors, gpu_only = numerics_gate(results, gen)
    gated = [r for r in results if r.get("numerics") and r["name"] not in gpu_only]
    summary.update(numerics_total=len(gated), numerics_killed=len(gated) - len(survivors),
                   numerics_survivors=survivors, numerics_not_measurable_here=gpu_only)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"mutants: golden cells on {gen}: {summary['killed']} of {summary['total']} killed; numerics-changing "
          f"{len(gated) - len(survivors)} of {len(gated)} killed"
          + (f", SURVIVED: {', '.join(survivors)}" if survivors else "")
          + (f" (numbers change only on GPUs, not counted: {', '.join(gpu_only)})" if gpu_only else "")
          + f" -> {out / 'summary.json'}")
    return 1 if survivors else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [n for n in args.only if n not in BY_NAME]
    if unknown:
        print(f"mutants: unknown mutant(s) {unknown}; known: {sorted(BY_NAME)}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.golden:
        args.out = args.out / "golden"
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for mutant in chosen:
        print(f"mutants: {mutant.name} ...", flush=True)
        results.append(run_mutant(mutant, args))
        r = results[-1]
        print(f"mutants: {mutant.name}: {r['status'].upper()} - {r['reason']}"
              + (f" (by {r['killed_by'][0]})" if r["killed_by"] else ""), flush=True)
    killed = sum(r["status"] == "killed" for r in results)
    rate = 100.0 * killed / len(results) if results else 0.0
    tier = "narrow" if args.narrow else "golden" if args.golden else args.tier
    summary = {"tier": tier, "gen": args.gen, "killed": killed, "total": len(results), "kill_rate": round(rate, 1),
               "command": " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
               "mutants": results}
    if args.golden:
        return _golden_verdict(summary, results, args.gen, args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    need = args.min_kill_rate
    if need is None:
        need = 100.0 if args.narrow else DEFAULT_MIN_RATE[args.tier]
    print(f"mutants: {tier} on {args.gen}: {killed} of {len(results)} killed ({rate:.0f} %; required {need:g} %) "
          f"-> {args.out / 'summary.json'}")
    return 0 if rate >= need else 1


if __name__ == "__main__":
    sys.exit(main())
