"""A ``--junitxml`` path that cannot be written is refused before any test runs, in one line naming
it (issue 52: a read-only directory gave an INTERNALERROR traceback from ``harness/sidecar.py``
once the session started)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from harness_selftest import REPO

TEST = '''
import pathlib

def test_writes_a_marker():
    pathlib.Path(__file__).with_name("ran").write_text("yes")
'''


def _unwritable_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory this process cannot write: a chmod 0o555 one, or where root ignores that (as on
    the dev machine), a sysfs directory; skip if neither is unwritable here."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    for candidate in (ro, pathlib.Path("/sys/kernel")):
        try:
            (candidate / "probe").write_text("x")
        except OSError:
            return candidate
        (candidate / "probe").unlink()
    pytest.skip("no unwritable directory on this machine")


@pytest.mark.parametrize("below", ["", "sub/dir"], ids=["in-it", "below-it"])
def test_an_unwritable_junitxml_path_is_a_one_line_usage_error(tmp_path, below) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_marker.py").write_text(TEST)
    target = _unwritable_dir(tmp_path) / below / "out.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "t"), "-p", "no:cacheprovider", "-q",
                           f"--junitxml={target}", f"--basetemp={tmp_path / 'bt'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    (error,) = [line for line in out.splitlines() if line.startswith("ERROR:")]
    assert error.startswith(f"ERROR: --junitxml={target}: cannot write {target} (")  # (Permission denied), ...
    assert error.endswith("); give a path in a writable directory"), error
    assert not (tmp_path / "t" / "ran").exists()  # refused before any test ran
