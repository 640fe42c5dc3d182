"""The pytest-forked pin works: a test that kills its process fails alone, the next one still runs.

Single-process tests that run native code able to crash (CUDA kernels, FP8 matmuls, graph capture) are marked
``@pytest.mark.forked``. pytest-forked 1.7.5 fails every test on pytest 9.2 (its report marshalling breaks),
so pyproject pins pytest below 9.2; this test catches a pytest that breaks the pin.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SAMPLE = textwrap.dedent(
    """
    import os, signal
    import pytest

    @pytest.mark.forked
    def test_segfaults():
        os.kill(os.getpid(), signal.SIGSEGV)

    @pytest.mark.forked
    def test_passes_in_fork():
        assert os.getpid() != int(os.environ["PARENT_PID"])

    def test_after():
        assert 1 + 1 == 2
    """
)


def test_forked_crash_fails_only_that_test(tmp_path):
    sample = tmp_path / "test_sample_forked.py"
    sample.write_text(SAMPLE)
    env = {**os.environ, "PARENT_PID": str(os.getpid())}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(sample)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "test_segfaults" in out and "crashed" in out.lower(), out


# A conftest that makes the running pytest report 9.2.0 before collection (the check reads
# ``pytest.__version__`` when collection starts), so the refusal can be seen on the pinned pytest.
PRETEND_92 = textwrap.dedent(
    """
    import pytest

    def pytest_configure(config):
        pytest.__version__ = "9.2.0"
    """
)


def _run_sample(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample_forked.py").write_text(SAMPLE)
    (tmp_path / "conftest.py").write_text(PRETEND_92)
    env = {**os.environ, "PARENT_PID": str(os.getpid())}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "test_sample_forked.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )


def test_pytest_92_with_forked_fails_at_collection(tmp_path):
    """pytest >= 9.2 with pytest-forked active: one usage error before any test runs, naming the
    versions and the ways out (issue 47, item 9)."""
    proc = _run_sample(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "pytest 9.2.0 with pytest-forked 1.7.5 active" in out, out
    assert "pytest<9.2" in out and "-p no:pytest_forked" in out and "distributed(world_size=1)" in out, out
    assert "passed" not in out and "failed" not in out, out  # nothing ran


def test_pytest_92_without_forked_runs(tmp_path):
    """With pytest-forked turned off the check lets the run go on (the marker is then unknown to
    pytest and the tests run in-process, so the crashing one is deselected here)."""
    proc = _run_sample(tmp_path, "-p", "no:pytest_forked", "-k", "not segfaults and not in_fork")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed" in out, out


def test_incompatibility_versions():
    from harness.forked_compat import incompatibility

    assert incompatibility("9.1.1", True, "1.7.5") is None
    assert incompatibility("8.4.0", True, "1.7.5") is None
    assert incompatibility("9.2.0", False, None) is None
    assert incompatibility("9.2.0.dev3+g1234", True, "1.7.5") is not None
    assert incompatibility("10.0.1", True, "1.7.5") is not None
