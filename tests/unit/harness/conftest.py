"""Session fixtures of the harness self-tests: each sample run happens once per session (also under
xdist) and is inspected by many tests."""
from __future__ import annotations

import pytest
from harness_selftest import SampleRun, run_samples_once


@pytest.fixture(scope="session")
def faults_run(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return run_samples_once(tmp_path_factory, "faults", "sample_faults.py", args=("--harness-grace=3",))


@pytest.fixture(scope="session")
def bucket20_run(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return run_samples_once(tmp_path_factory, "bucket20", "sample_bucket20.py")
