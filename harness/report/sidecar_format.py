"""The JUnit sidecar's file names and shape, shared by its writer (``harness.sidecar``, a pytest
plugin) and its reader (``harness.report.runs``). Standard library only.

``<name>.harness.json`` (written at session end)::

    {"schema": "fsdp-harness-sidecar/1", "junit": "<name>.xml", "suite_name": ..., "started": ...,
     "finished": ..., "wall_s": ..., "exitstatus": 0, "complete": true, "mutant": null,
     "matrix_axes": ["mesh", ...], "environment": {...},
     "expected": [node ids collected], "expected_axes": {node id: {axis: value}},
     "tests": {node id: {"outcome", "duration_s", "axes", "message"?, "wall_s"?, "flaky"?,
                         "ranks"?: {"0": {"outcome", "duration_s"}}, "bucket"?: {"label", "world_size",
                         "started", "startup_s"?}}},
     "unfinished": [node ids that started and never finished], "buckets": [see bucket_summary]}

``<name>.harness.jsonl`` (the journal, while the session runs; removed at its end): one JSON object
per line with ``event`` = ``start`` (the header fields), ``collected`` (``ids``, ``axes``),
``test_start`` (``nodeid``) or ``test_end`` (``nodeid``, ``record``).
"""
from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping
from typing import Any

SCHEMA = "fsdp-harness-sidecar/1"
SIDECAR_SUFFIX = ".harness.json"
JOURNAL_SUFFIX = ".harness.jsonl"
_XDIST_GROUP_SUFFIX = re.compile(r"@[^@]*::ws\d+$")


def strip_xdist_group(nodeid: str) -> str:
    """A node id as xdist's loadgroup scheduler announces it (``...@<bucket>::wsN``), without the
    bucket group the harness adds (reports carry the real node id)."""
    return _XDIST_GROUP_SUFFIX.sub("", nodeid)


def base_of(path: pathlib.Path) -> pathlib.Path | None:
    """``results/L0`` for ``results/L0.xml``, ``results/L0.harness.json`` or ``.jsonl``; else None."""
    for suffix in (JOURNAL_SUFFIX, SIDECAR_SUFFIX, ".xml"):
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.with_name(path.name[:-len(suffix)])
    return None


def sidecar_paths(xml_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(final JSON, journal) for a JUnit path: ``results/L0.xml`` -> ``results/L0.harness.json(l)``."""
    base = base_of(xml_path) if xml_path.name.endswith(".xml") else xml_path
    assert base is not None
    return base.with_name(base.name + SIDECAR_SUFFIX), base.with_name(base.name + JOURNAL_SUFFIX)


def bucket_summary(tests: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per bucket label, in first-use order: world size, how often it started (a fault or a rerun
    restarts it), each start-up time, its tests and their total wall time."""
    out: dict[str, dict[str, Any]] = {}
    for record in tests.values():
        bucket = record.get("bucket")
        if not bucket:
            continue
        entry = out.setdefault(bucket["label"], {"label": bucket["label"], "world_size": bucket.get("world_size"),
                                                 "starts": 0, "startup_s": [], "tests": 0, "duration_s": 0.0})
        entry["tests"] += 1
        entry["duration_s"] = round(entry["duration_s"] + float(record.get("wall_s", record.get("duration_s", 0.0))), 6)
        if bucket.get("started"):
            entry["starts"] += 1
            if bucket.get("startup_s") is not None:
                entry["startup_s"].append(bucket["startup_s"])
    return list(out.values())
