"""Bad use of the markers is a clear collection error naming the argument, never a hang."""
from __future__ import annotations

import pytest
from harness_selftest import run_samples


@pytest.mark.parametrize("sample, expected", [
    ("sample_bad_world_size.py", "distributed(world_size=0) is invalid; world_size must be an int >= 1"),
    ("sample_bad_world_size_type.py", "distributed(world_size='2') is invalid; world_size must be an int >= 1"),
    ("sample_bad_conflict.py", "markers 'distributed' and 'forked' conflict"),
    ("sample_bad_fixture.py", "requests fixture(s) ['pytester'] that cannot cross into rank processes"),
    ("sample_bad_kwarg.py", "unknown argument(s) ['ranks']"),
    ("sample_bad_pinned.py", "pinned_numerics needs distributed(world_size=N)"),
])
def test_collection_error(tmp_path, sample, expected):
    run = run_samples(tmp_path, sample, timeout=120)
    assert run.returncode == 2, run.output[-2000:]  # interrupted by collection errors
    assert "ERROR collecting" in run.output and expected in run.output, run.output[-2000:]
