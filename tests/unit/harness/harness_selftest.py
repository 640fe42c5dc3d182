"""Helpers for the harness self-tests: run sample files in a pytest subprocess and read its JUnit XML.

A uniquely named module (not ``conftest``) so test files can import it without clashing with other
directories' conftest modules."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = pathlib.Path(__file__).resolve().parents[3]
SAMPLES = pathlib.Path(__file__).resolve().parent / "samples"


@dataclasses.dataclass
class Case:
    """One <testcase> of the sample run's JUnit XML."""

    name: str
    outcome: str  # passed / failed / skipped / error
    message: str
    text: str
    props: list[tuple[str, str]]
    time: float = 0.0

    def prop(self, name: str) -> str | None:
        return next((v for n, v in self.props if n == name), None)

    def rank_props(self, name: str) -> dict[int, str]:
        """``rank<r>.<name>`` properties (per-rank values) keyed by rank."""
        out = {}
        for n, v in self.props:
            if n.startswith("rank") and n.endswith("." + name):
                out[int(n[4:].split(".")[0])] = v
        return out


@dataclasses.dataclass
class SampleRun:
    returncode: int
    output: str
    cases: dict[str, Case]

    def all_rank_pids(self) -> set[int]:
        return {int(v) for c in self.cases.values() for n, v in c.props if n.endswith(".pid") or n == "pid"}


def parse_junit(path: pathlib.Path) -> dict[str, Case]:
    cases = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message, text = "passed", "", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message, text = el.get("message", ""), el.text or ""
                break
        props = [(p.get("name"), p.get("value")) for p in tc.iter("property")]
        cases[tc.get("name")] = Case(tc.get("name"), outcome, message, text, props, float(tc.get("time", 0)))
    return cases


def run_samples(tmp: pathlib.Path, *names: str, args: tuple[str, ...] = (), env: dict | None = None,
                timeout: float = 600) -> SampleRun:
    """Run sample files in a fresh pytest process from the repo root (as a user would)."""
    junit = tmp / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", *[str(SAMPLES / n) for n in names], "-p", "no:cacheprovider",
           "-q", "-rA", f"--junitxml={junit}", f"--basetemp={tmp / 'basetemp'}", *args]
    # Hermetic: the outer run's harness settings (CI exports HARNESS_FORCE_CPU=1) must not change
    # what a sample run sees; a self-test that wants one passes it in ``env``.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    cases = parse_junit(junit) if junit.exists() else {}
    return SampleRun(proc.returncode, proc.stdout + proc.stderr, cases)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
