"""Helpers for the harness self-tests: run sample files in a pytest subprocess and read its JUnit XML.

A uniquely named module (not ``conftest``) so test files can import it without clashing with other
directories' conftest modules."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Any

import pytest

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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SampleRun:
        data = json.loads(text)
        cases = {name: Case(**{**c, "props": [tuple(p) for p in c["props"]]}) for name, c in data["cases"].items()}
        return cls(data["returncode"], data["output"], cases)


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


def run_samples_once(tmp_path_factory: pytest.TempPathFactory, key: str, *names: str,
                     **kwargs: Any) -> SampleRun:
    """``run_samples`` once per pytest session, also under xdist.

    The first worker to ask runs the samples and leaves the result for the others, which wait on a
    lock meanwhile: tests that read one sample run but land on different workers do not repeat it.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's basetemp, shared by its workers
    result = base / f"sample-run-{key}.json"
    with open(base / f"sample-run-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return SampleRun.from_json(result.read_text())
        tmp = base / f"sample-run-{key}"
        tmp.mkdir(exist_ok=True)
        run = run_samples(tmp, *names, **kwargs)
        result.write_text(run.to_json())
        return run


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
