"""torchrun mode on CPU/gloo: rank 0 reports every rank's outcome, mismatched world sizes skip, JUnit once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness_selftest import REPO, SAMPLES, parse_junit


def _torchrun(tmp_path, nproc: int):
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "pytest", str(SAMPLES / "sample_torchrun.py"), "-p", "no:cacheprovider", "-rA",
           f"--junitxml={junit}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc, parse_junit(junit)


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_mode(tmp_path, nproc):
    proc, cases = _torchrun(tmp_path, nproc)
    out = proc.stdout + proc.stderr
    assert len(cases) == 4, out[-3000:]
    assert out.count("generated xml file") == 1, out[-3000:]  # only rank 0 writes JUnit
    assert out.count("test session starts") == 1  # and only rank 0 prints
    assert cases["test_single_process"].outcome == "passed"
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


def test_torchrun_collection_mismatch_is_an_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "pytest", str(SAMPLES / "sample_torchrun_mismatch.py"), "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ranks collected different tests" in out and "rank 1: 2 items" in out, out[-3000:]
