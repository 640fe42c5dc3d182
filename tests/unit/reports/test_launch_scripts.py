"""The launch scripts: syntax, CI headers, shellcheck, and their behaviour on fake nodes.

A fake ``nvidia-smi`` on PATH stands in for a GPU node; ``HARNESS_DRY_RUN=1`` makes a
script print the pytest command instead of running it, so the selection, generation
check and capability variables are checked without GPUs.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "launch_scripts"
GENERATIONS = ("cpu", "h100", "h200", "b200", "gb200")
TIER_SCRIPTS = sorted(SCRIPTS.glob("*/active/*.sh")) + sorted(SCRIPTS.glob("*/flaky/*.sh"))
ALL_SCRIPTS = sorted(SCRIPTS.glob("*.sh")) + TIER_SCRIPTS
HEADER = re.compile(r"^# (GPU_COUNT|CI_TIMEOUT)=(.*)$")
GPU_NAMES = {"h100": "NVIDIA H100 80GB HBM3, 9.0", "h200": "NVIDIA H200, 9.0",
             "b200": "NVIDIA B200, 10.0", "gb200": "NVIDIA GB200, 10.0"}


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO))


def parse_headers(script: pathlib.Path) -> dict[str, int]:
    """The ``# KEY=N`` header lines a CI system reads (before the first command)."""
    found: dict[str, int] = {}
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        match = HEADER.match(line)
        if match:
            key, value = match.groups()
            assert key not in found, f"{rel(script)}: {key} given twice"
            assert value.isdigit(), f"{rel(script)}: {key}={value!r} is not an integer"
            found[key] = int(value)
    return found


def fake_node(tmp_path: pathlib.Path, gpu_line: str | None, count: int = 8) -> dict[str, str]:
    """Environment whose PATH has an nvidia-smi that reports ``count`` GPUs ``gpu_line``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    body = "exit 9\n" if gpu_line is None else (
        f'i=0; while [ $i -lt {count} ]; do echo "{gpu_line}"; i=$((i+1)); done\n')
    smi.write_text("#!/bin/sh\n" + body)
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HARNESS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", HARNESS_OUT_DIR=str(tmp_path / "out"),
               PYTHON=sys.executable)  # the scripts' pytest and harness-signoff run in this environment
    return env


def run_script(script: pathlib.Path, env: dict[str, str], *args: str,
               dry: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(env, HARNESS_DRY_RUN="1" if dry else "0")
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd="/")


def test_layout_every_generation_has_tiers_and_flaky_dir() -> None:
    for gen in GENERATIONS:
        assert (SCRIPTS / gen / "flaky").is_dir()
        names = [p.name for p in (SCRIPTS / gen / "active").glob("*.sh")]
        for tier in ("L0", "L1", "L2"):
            assert any(n.startswith(f"{tier}_") for n in names), (gen, tier, names)
    assert (SCRIPTS / "README.md").is_file() and (SCRIPTS / "known_bugs.txt").is_file()


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=rel)
def test_bash_syntax(script: pathlib.Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.access(script, os.X_OK), f"{rel(script)} is not executable"


@pytest.mark.parametrize("script", TIER_SCRIPTS, ids=rel)
def test_tier_script_headers(script: pathlib.Path) -> None:
    gen = script.parts[-3]
    assert gen in GENERATIONS
    assert re.match(r"^L[012]_\w+\.sh$", script.name), script.name
    headers = parse_headers(script)
    assert set(headers) == {"GPU_COUNT", "CI_TIMEOUT"}, headers
    assert headers["CI_TIMEOUT"] > 0
    if gen == "cpu":
        assert headers["GPU_COUNT"] == 0
    else:
        assert headers["GPU_COUNT"] in (1, 2, 4, 8)
    text = script.read_text()
    assert re.search(rf"^harness_init {gen} \d+$", text, re.M), "must init its own generation"
    assert "common.sh" in text and "harness_run_pytest " in text


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", *map(str, ALL_SCRIPTS)], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_script_forces_cpu_backend_even_with_gpus(tmp_path) -> None:
    env = fake_node(tmp_path, GPU_NAMES["h100"])
    proc = run_script(SCRIPTS / "cpu/active/L0_unit.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert "cpu/L0_unit: FP8_MATMUL=0 MXFP8=0 GPUs=0 xdist=2 force_cpu=1" in proc.stderr
    command = proc.stderr.split("running: ")[1]
    assert f"--junitxml={tmp_path}/out/cpu/L0_unit.xml" in command
    assert "junit_suite_name=cpu/L0_unit" in command and command.rstrip().endswith("tests/unit")


@pytest.mark.parametrize(("gen", "fp8", "mxfp8"), [
    ("h100", 1, 0), ("h200", 1, 0), ("b200", 1, 1), ("gb200", 1, 1)])
def test_gpu_scripts_set_capabilities(tmp_path, gen, fp8, mxfp8) -> None:
    env = fake_node(tmp_path, GPU_NAMES[gen])
    proc = run_script(SCRIPTS / gen / "active/L1_functional.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert f"{gen}/L1_functional: FP8_MATMUL={fp8} MXFP8={mxfp8}" in proc.stderr
    assert "force_cpu=0" in proc.stderr
    assert "tests/functional -m not\\ slow" in proc.stderr


def test_generation_mismatch_fails_or_warns(tmp_path) -> None:
    env = fake_node(tmp_path, GPU_NAMES["b200"])
    script = SCRIPTS / "h100/active/L0_unit.sh"
    proc = run_script(script, env)
    assert proc.returncode == 3
    assert "this script is for h100 GPUs but the node has: b200 (8 GPU(s))" in proc.stderr
    assert "running:" not in proc.stderr
    proc = run_script(script, dict(env, HARNESS_ALLOW_GEN_MISMATCH="1"))
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: this script is for h100" in proc.stderr and "running:" in proc.stderr


def test_too_few_gpus_and_no_gpu_fail(tmp_path) -> None:
    proc = run_script(SCRIPTS / "h200/active/L1_functional.sh", fake_node(tmp_path, GPU_NAMES["h200"], 4))
    assert proc.returncode == 3 and "needs 8 h200 GPU(s) but the node has 4" in proc.stderr
    proc = run_script(SCRIPTS / "h200/active/L0_unit.sh", fake_node(tmp_path, GPU_NAMES["h200"], 1))
    assert proc.returncode == 3 and "needs 2 h200 GPU(s) but the node has 1" in proc.stderr
    proc = run_script(SCRIPTS / "gb200/active/L0_unit.sh", fake_node(tmp_path, None))
    assert proc.returncode == 3 and "the node has: cpu (0 GPU(s))" in proc.stderr


def make_tier_script(tmp_path: pathlib.Path, name: str, selection: str) -> pathlib.Path:
    script = tmp_path / f"{name}.sh"
    script.write_text(f"""#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=5
set -euo pipefail
source {SCRIPTS / 'common.sh'}
harness_init cpu 1
harness_run_pytest {selection}
""")
    return script


def test_no_tests_selected_is_success_and_failures_propagate(tmp_path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_one.py").write_text("def test_fails():\n    assert 1 + 1 == 3\n")
    env = fake_node(tmp_path, None)
    env["HARNESS_PYTEST_ARGS"] = "-p no:cacheprovider"
    empty = run_script(make_tier_script(tmp_path, "L0_empty", f"{suite} -k nothing_matches"),
                       env, dry=False)
    assert empty.returncode == 0, empty.stdout + empty.stderr
    assert "WARNING: cpu/L0_empty selected no tests (pytest exit 5)" in empty.stderr
    failing = run_script(make_tier_script(tmp_path, "L0_failing", str(suite)), env, dry=False)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    root = ET.parse(tmp_path / "out/cpu/L0_failing.xml").getroot()
    assert root.find("testsuite").get("name") == "cpu/L0_failing"
    assert root.find("testsuite").get("failures") == "1"


@pytest.mark.parametrize(("args", "message"), [
    ((), "tier must be one of L0, L1, L2 (got '')"),
    (("L3",), "tier must be one of L0, L1, L2 (got 'L3')"),
    (("L0", "--gen", "a100"), "generation 'a100' is not one of: cpu h100 h200 b200 gb200"),
    (("L0", "--frobnicate"), "unknown argument '--frobnicate'"),
])
def test_run_tier_usage_errors(tmp_path, args, message) -> None:
    proc = run_script(SCRIPTS / "run_tier.sh", fake_node(tmp_path, None), *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_run_tier_runs_each_active_script_and_fails_without_junit(tmp_path) -> None:
    """Dry-run scripts write no XML: run_tier must notice that and exit 1, not PASS."""
    proc = run_script(SCRIPTS / "run_tier.sh", fake_node(tmp_path, None), "L0")
    assert proc.returncode == 1, proc.stderr
    assert "detected generation: cpu (0 GPU(s))" in proc.stderr
    ran = re.findall(r"=== (launch_scripts/\S+)", proc.stderr)
    assert ran == ["launch_scripts/cpu/active/L0_functional.sh", "launch_scripts/cpu/active/L0_unit.sh"]
    assert "WARNING: launch_scripts/cpu/active/L0_unit.sh wrote no JUnit XML" in proc.stderr
    assert "tier L0 on cpu: FAIL" in proc.stderr
    # the sign-off still runs and shows each missing run as an error, never a PASS
    report = (tmp_path / "out" / "signoff" / "report.md").read_text()
    assert "## Verdict: FAIL" in report
    assert "`cpu/L0_unit::<no results>`" in report and "`cpu/L0_functional::<no results>`" in report
    assert (tmp_path / "out" / "signoff" / "report.html").exists()


def test_bad_worker_count_is_rejected_by_name(tmp_path) -> None:
    env = dict(fake_node(tmp_path, None), HARNESS_XDIST_WORKERS="four")
    proc = run_script(SCRIPTS / "cpu/active/L0_unit.sh", env)
    assert proc.returncode == 2
    assert "HARNESS_XDIST_WORKERS must be a non-negative integer (got 'four')" in proc.stderr


def test_old_driver_without_compute_cap_still_detects_generation(tmp_path) -> None:
    env = fake_node(tmp_path, None)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in *compute_cap*) echo "Field not valid" >&2; exit 2;; esac\n'
                   'i=0; while [ $i -lt 8 ]; do echo "NVIDIA H100 80GB HBM3"; i=$((i+1)); done\n')
    proc = run_script(SCRIPTS / "h100/active/L0_unit.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert "h100/L0_unit: FP8_MATMUL=1 MXFP8=0 GPUs=8" in proc.stderr
