"""torchrun mode: process groups a test left behind are destroyed before the next test, on every rank,
while groups the suite still reaches keep working (issue 52, item 18: gloo groups piling up over a
long Megatron file starved 8 ranks on 2 cores until a test ran past its timeout)."""
from __future__ import annotations

import pathlib
import re

from test_harness_torchrun import torchrun

from harness.torchrun.groups import _gloo_only, merge


def test_groups_left_behind_are_destroyed_and_kept_ones_work(tmp_path):
    proc, cases, _ = torchrun(tmp_path, 2, "sample_torchrun_groups.py")
    out = proc.stdout + proc.stderr
    assert len(cases) == 18, out[-3000:]
    bad = {name: (c.outcome, c.message) for name, c in cases.items() if c.outcome != "passed"}
    assert not bad, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    # Each rank's log says what it destroyed before the next test: the 3 groups every mesh test left
    # behind, then the one of each DTensor test (held by DTensor's caches until the harness empties them).
    found = re.search(r"rank logs and spilled output in (\S+)", out)
    assert found, out[-3000:]
    for log in (pathlib.Path(found.group(1)) / f"rank{r}.log" for r in range(2)):
        released = [int(n) for n in re.findall(r"destroyed (\d+) process group", log.read_text())]
        assert released == [3] * 12 + [1] * 4, (log, released)


def test_merge_releases_what_no_rank_keeps():
    surveys = [{"orphaned": ["3", "10", "2"], "kept": ["5"]}, {"orphaned": ["3", "5", "abc"], "kept": ["10"]}, None]
    assert merge(surveys) == ["2", "3", "abc"]  # numeric names in number order, "10" and "5" kept somewhere
    assert merge([]) == []


def test_only_gloo_groups_are_released():
    assert _gloo_only("gloo") and _gloo_only("cpu:gloo,cuda:gloo")
    assert not _gloo_only("cuda:nccl") and not _gloo_only("cpu:gloo,cuda:nccl") and not _gloo_only("")
