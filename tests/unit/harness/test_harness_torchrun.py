"""torchrun mode on CPU/gloo: every test runs on every rank in lockstep, rank 0 reports one merged
outcome per test and writes JUnit once; a plain suite gives the same outcomes as without the plugin;
marked tests of another world size skip."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from harness_selftest import REPO, SAMPLES, Case, parse_junit

_OUTCOME_ORDER = ("passed", "skipped", "failed", "error")


def torchrun(tmp_path, nproc: int, *names: str, args: tuple[str, ...] = (), env: dict | None = None,
             plugin: bool = True, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict[str, Case], float]:
    """Run sample files under ``torchrun --standalone``; return the process, rank 0's JUnit cases (or,
    without the plugin, each rank's JUnit merged: the worst outcome per test) and the wall time."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    full_env.update(env or {})
    junit = tmp_path / ("junit-RANK.xml" if not plugin else "junit.xml")
    extra: list[str] = []
    if not plugin:
        extra = ["-p", "no:fsdp_harness", "-p", "per_rank_junit"]
        full_env["PYTHONPATH"] = os.pathsep.join([str(SAMPLES), full_env.get("PYTHONPATH", "")])
    paths = [str(REPO / n if "/" in n else SAMPLES / n) for n in names]  # a sample, or a path in the repository
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pytest", *paths, "-p", "no:cacheprovider", "-rA",
           f"--junitxml={junit}", *extra, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    elapsed = time.monotonic() - start
    if plugin:
        return proc, (parse_junit(junit) if junit.exists() else {}), elapsed
    merged: dict[str, Case] = {}
    for r in range(nproc):
        path = tmp_path / f"junit-{r}.xml"
        for name, case in (parse_junit(path) if path.exists() else {}).items():
            if name not in merged or _OUTCOME_ORDER.index(case.outcome) > _OUTCOME_ORDER.index(merged[name].outcome):
                merged[name] = case
    return proc, merged, elapsed


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_mode(tmp_path, nproc):
    proc, cases, _ = torchrun(tmp_path, nproc, "sample_torchrun.py")
    out = proc.stdout + proc.stderr
    assert len(cases) == 5, out[-3000:]
    assert out.count("generated xml file") == 1, out[-3000:]  # only rank 0 writes JUnit
    assert out.count("test session starts") == 1  # and only rank 0 prints
    unmarked = cases["test_unmarked_runs_on_every_rank"]
    assert unmarked.outcome == "passed"
    assert unmarked.rank_props("rank") == {r: str(r) for r in range(nproc)}  # it ran on every rank
    assert cases["test_unmarked_finds_no_harness_process_group"].outcome == "passed", out[-3000:]
    if nproc == 2:
        assert proc.returncode == 0, out[-3000:]
        assert cases["test_ws2_sum"].outcome == "passed"
        for name in ("test_ws4_rank2_fails", "test_ws4_passes"):
            assert cases[name].outcome == "skipped"
            assert "needs world_size=4, torchrun provides WORLD_SIZE=2" in cases[name].message
    else:
        assert proc.returncode != 0
        assert "needs world_size=2, torchrun provides WORLD_SIZE=4" in cases["test_ws2_sum"].message
        failed = cases["test_ws4_rank2_fails"]
        assert failed.outcome == "failed"
        assert failed.message == "[rank 2] AssertionError: rank two says no"
        assert [failed.prop(f"rank{r}") for r in range(4)] == ["passed", "passed", "failed", "passed"]
        assert cases["test_ws4_passes"].outcome == "passed"


def test_plain_suite_same_outcomes_with_and_without_the_plugin(tmp_path):
    """A Megatron-style class (``setup_class`` initialises the process group) runs on every rank in
    lockstep; the failure on one rank only is one failed outcome naming that rank."""
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    proc, cases, _ = torchrun(tmp_path / "with", 2, "sample_torchrun_plain.py")
    _, plain, _ = torchrun(tmp_path / "without", 2, "sample_torchrun_plain.py", plugin=False)
    out = proc.stdout + proc.stderr
    assert len(cases) == 8 and plain, out[-3000:]
    assert {n: c.outcome for n, c in cases.items()} == {n: c.outcome for n, c in plain.items()}
    one_rank = cases["test_fails_on_last_rank_only"]
    assert one_rank.message == "[rank 1] AssertionError: the last rank disagrees"
    assert [one_rank.prop(f"rank{r}") for r in range(2)] == ["passed", "failed"]
    assert sum(c.outcome == "passed" for c in cases.values()) == 5, {n: c.outcome for n, c in cases.items()}


@pytest.mark.slow
def test_megatron_seed_suite_same_outcomes_with_and_without_the_plugin(tmp_path):
    """Megatron-FSDP's fully_shard tests (tests/functional/seed) on 8 gloo ranks: the same outcome for
    each of its 328 cases with and without the plugin, and no runnable case failing. Slow: two
    8-rank runs, about 1 min each on an idle 2-core machine."""
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    seed = "tests/functional/seed"
    proc, cases, _ = torchrun(tmp_path / "with", 8, seed, timeout=1800)
    _, plain, _ = torchrun(tmp_path / "without", 8, seed, plugin=False, timeout=1800)
    out = proc.stdout + proc.stderr
    assert len(cases) == len(plain) == 328, out[-3000:]
    assert {n: c.outcome for n, c in cases.items()} == {n: c.outcome for n, c in plain.items()}
    assert [n for n, c in cases.items() if c.outcome in ("failed", "error")] == [], out[-3000:]
    assert sum(c.outcome == "passed" for c in cases.values()) >= 9


def test_torchrun_collection_mismatch_is_an_error(tmp_path):
    proc, _, _ = torchrun(tmp_path, 2, "sample_torchrun_mismatch.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ranks collected different tests" in out and "rank 1: 2 items" in out, out[-3000:]
