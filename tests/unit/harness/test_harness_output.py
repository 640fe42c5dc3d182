"""Megabytes of output on a rank never fail a test: the full text goes to a file, the report keeps the tail."""
from __future__ import annotations

import pathlib
import re

from harness_selftest import run_samples


def test_large_output_is_spilled_not_fatal(tmp_path):
    run = run_samples(tmp_path, "sample_big_output.py", args=("-o", "junit_logging=all"), timeout=300)
    cases = {name.rsplit("::", 1)[-1]: c for name, c in run.cases.items()}
    assert "INTERNALERROR" not in run.output, run.output[-3000:]
    passed = cases["test_prints_5mb_and_passes"]
    assert passed.outcome == "passed", run.output[-3000:]
    failed = cases["test_prints_5mb_and_fails"]
    assert failed.outcome == "failed" and "rank zero fails after printing" in failed.message
    assert cases["test_next_test_same_bucket"].outcome == "passed"
    assert passed.rank_props("pid") == cases["test_next_test_same_bucket"].rank_props("pid")  # bucket kept
    for marker in ("of the passing test", "of the failing test"):
        notes = re.findall(r"the full text is in (\S+);", run.output)
        spilled = [pathlib.Path(p) for p in notes if marker in pathlib.Path(p).read_text()[-100:]]
        assert spilled, (marker, notes)
        assert pathlib.Path(spilled[0]).stat().st_size > 5_000_000
    assert "last line of the failing test" in failed.text + run.output
    assert len(run.output) < 3_000_000, "the tail kept in the report should be far smaller than the output"
