"""One golden file: its format, reading it with clear errors, and writing it atomically.

Format 2 (written since fingerprints; format 1 files, which have none, are still read)::

    {"format": 2, "cell": ..., "platform": ..., "versions": {...}, "fingerprint": {...},
     "dtype": "fp32", "note": ..., "tolerance": {series: rel}, "band": {series: rel},
     "band_note": ..., "series": {series: [one float per step]}}

``fingerprint`` is what decided the bits (``harness.numerics.fingerprint``); ``tolerance`` applies
when a run's fingerprint equals it (0: bit for bit), ``band`` when it differs (measured
cross-platform spread, ``harness.golden_band``; ``band_note`` says how).

Writes never leave a half-written file and never collide: the new content goes to a temp file
with a unique name in the same directory, and ``os.replace`` publishes it (the last writer wins).
Under ``--golden-update`` the temp file is *pending* until the test passed on every rank
(``harness.golden`` publishes or discards it).
"""
from __future__ import annotations

import json
import os
import pathlib
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMAT = 2
READABLE_FORMATS = (1, 2)
PENDING_SUFFIX = ".pending"


class GoldenFileError(Exception):
    """A golden file that cannot be used: unreadable, damaged, or of an unknown format. The
    message names the file and what is wrong."""


@dataclass
class GoldenFile:
    """The content of one golden file."""

    cell: str
    platform: str
    series: dict[str, list[float]]
    tolerance: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    fingerprint: dict[str, str] | None = None  # None: a format 1 file (made before fingerprints)
    band: dict[str, float] = field(default_factory=dict)
    band_note: str = ""
    dtype: str = ""
    note: str = ""
    format: int = FORMAT

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"format": FORMAT, "cell": self.cell, "platform": self.platform,
                                "versions": self.versions, "fingerprint": self.fingerprint or {},
                                "dtype": self.dtype, "note": self.note, "tolerance": self.tolerance}
        if self.band:
            body["band"] = self.band
            body["band_note"] = self.band_note
        body["series"] = {k: [float(v) for v in vs] for k, vs in self.series.items()}
        return body


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_shape(body: Any, path: pathlib.Path) -> None:
    """Raise ``GoldenFileError`` naming the first field of ``body`` that is missing or mistyped."""
    if not isinstance(body, dict):
        raise GoldenFileError(f"golden file {path} is damaged: its top level is {type(body).__name__}, not an object")
    fmt = body.get("format")
    if fmt not in READABLE_FORMATS:
        raise GoldenFileError(f"golden file {path} has format {fmt!r}; this harness reads formats "
                              f"{', '.join(map(str, READABLE_FORMATS))} (a newer harness made it, or it is damaged)")
    series = body.get("series")
    if not isinstance(series, dict) or not all(
            isinstance(v, list) and all(_number(x) for x in v) for v in series.values()):
        raise GoldenFileError(f"golden file {path} is damaged: 'series' must map each series name to a list of numbers")
    for key in ("tolerance", "band"):
        value = body.get(key, {})
        if not isinstance(value, dict) or not all(_number(v) and v >= 0 for v in value.values()):
            raise GoldenFileError(f"golden file {path} is damaged: '{key}' must map series names to numbers >= 0")
    for key in ("versions", "fingerprint"):
        if not isinstance(body.get(key, {}), dict):
            raise GoldenFileError(f"golden file {path} is damaged: '{key}' must be an object")
    if fmt == 2 and not body.get("fingerprint"):
        raise GoldenFileError(f"golden file {path} is damaged: format 2 needs a non-empty 'fingerprint'")


def read(path: pathlib.Path) -> GoldenFile | None:
    """The golden file at ``path``, None when there is none; ``GoldenFileError`` when it cannot be used."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise GoldenFileError(f"golden file {path} cannot be read: {exc}") from None
    if not text.strip():
        raise GoldenFileError(f"golden file {path} is empty")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GoldenFileError(f"golden file {path} is damaged (not JSON: {exc.msg} at line {exc.lineno}, "
                              f"column {exc.colno}); it may have been truncated") from None
    _check_shape(body, path)
    return GoldenFile(
        cell=str(body.get("cell", path.stem)), platform=str(body.get("platform", path.parent.name)),
        series={k: [float(x) for x in v] for k, v in body["series"].items()},
        tolerance={k: float(v) for k, v in body.get("tolerance", {}).items()},
        versions={k: str(v) for k, v in body.get("versions", {}).items()},
        fingerprint={k: str(v) for k, v in body["fingerprint"].items()} if body.get("fingerprint") else None,
        band={k: float(v) for k, v in body.get("band", {}).items()}, band_note=str(body.get("band_note", "")),
        dtype=str(body.get("dtype", "")), note=str(body.get("note", "")), format=int(body["format"]))


def write_pending(path: pathlib.Path, content: GoldenFile) -> pathlib.Path:
    """Write ``content`` to a uniquely named temp file beside ``path`` (nothing is published yet);
    return the temp file's path for :func:`publish` or :func:`discard`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}{PENDING_SUFFIX}")
    tmp.write_text(json.dumps(content.as_json(), indent=1) + "\n", encoding="utf-8")
    return tmp


def publish(pending: pathlib.Path, path: pathlib.Path) -> None:
    """Make ``pending`` the file at ``path`` in one atomic rename (the last writer wins)."""
    os.replace(pending, path)


def discard(pending: pathlib.Path) -> None:
    """Remove a pending write that will not be published."""
    try:
        pending.unlink()
    except FileNotFoundError:
        pass


def write(path: pathlib.Path, content: GoldenFile) -> None:
    """Write ``content`` to ``path`` now (atomically, through a unique temp file)."""
    publish(write_pending(path, content), path)
