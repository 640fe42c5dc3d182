"""Rank processes of ``pinned_numerics`` tests start pinned and others do not, and
``--golden-update`` publishes a cell's file only when its test passed on every rank
(issue 46 item 1; issue 52 item 6). One sample run of 4 small world-2 tests."""
from __future__ import annotations

import pathlib

import pytest
from harness_selftest import SampleRun, run_samples

from harness import golden_file


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[SampleRun, pathlib.Path]:
    tmp = tmp_path_factory.mktemp("golden_ranks")
    gdir = tmp / "golden"
    result = run_samples(tmp, "sample_golden_update.py",
                         args=("--golden-update", f"--golden-dir={gdir}", "--golden-platform=cpu"), timeout=300)
    return result, gdir


def test_pinned_and_unpinned_buckets_start_as_marked(run: tuple[SampleRun, pathlib.Path]) -> None:
    sample, _ = run
    assert sample.cases["test_pinned"].outcome == "passed", sample.cases["test_pinned"].text[-2000:]
    assert sample.cases["test_unpinned"].outcome == "passed", sample.cases["test_unpinned"].text[-2000:]


def test_an_update_a_rank_failed_is_not_written(run: tuple[SampleRun, pathlib.Path]) -> None:
    sample, gdir = run
    assert sample.cases["test_update_then_rank1_fails"].outcome == "failed"
    assert not (gdir / "cpu" / "failing.json").exists(), "a test that failed on rank 1 rewrote its golden file"
    assert "failing.json not updated" in sample.output
    passing = golden_file.read(gdir / "cpu" / "passing.json")
    assert sample.cases["test_update_passes"].outcome == "passed"
    assert passing is not None and passing.series == {"loss": [1.0, 2.0]}
    assert not list((gdir / "cpu").glob(".*pending")), "a pending write was left behind"
