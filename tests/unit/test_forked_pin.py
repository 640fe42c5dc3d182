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
