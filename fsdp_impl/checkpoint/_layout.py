"""Where a checkpoint's files live, and how a save becomes visible without a window of loss.

A checkpoint at ``path`` is the file ``path/manifest.json`` plus the data directory it names,
``path/ckpt-data-<id>/`` (DCP's ``.metadata`` and ``*.distcp``, and ``extra.pt``). A save
writes a fresh data directory next to the current one and then *commits* by atomically
replacing ``manifest.json`` (``os.replace`` of a fully written, fsynced file), so at every
instant ``path`` holds a complete checkpoint: the old one until the replace, the new one after.
Only then is the superseded data directory removed.

Nothing else in ``path`` is touched: a user's notes or an ``eval/`` folder survive any number
of saves. Leftovers of a save that died (a data directory no manifest names, a manifest temp
file) match this module's own name patterns and are removed by the next save. Format version 1
(the files directly in ``path``, published by renaming directories) was never released; its
checkpoints are refused like any unknown version (``_files.read_manifest``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from ._errors import CheckpointCorruptedError, CheckpointWriteError
from ._files import DCP_METADATA_NAME, MANIFEST_NAME, fsync_dir, write_file_durably

DATA_PREFIX = "ckpt-data-"
_DATA_RE = re.compile(r"ckpt-data-[0-9a-f]{12}")
_MANIFEST_TMP_RE = re.compile(re.escape(MANIFEST_NAME) + r"\.tmp-[0-9a-f]{12}")


def _unique() -> str:
    return uuid.uuid4().hex[:12]


def is_data_dir_name(name: str) -> bool:
    return _DATA_RE.fullmatch(name) is not None


def _is_own_leftover(name: str) -> bool:
    """A data directory or manifest temp file this module creates (never a user's file)."""
    return is_data_dir_name(name) or _MANIFEST_TMP_RE.fullmatch(name) is not None


def data_dir(path: Path, manifest: dict[str, Any]) -> Path:
    """The directory holding the DCP files of the checkpoint whose manifest is ``manifest``."""
    name = manifest.get("data")
    if not isinstance(name, str) or not is_data_dir_name(name):
        raise CheckpointCorruptedError(f"checkpoint file {path / MANIFEST_NAME} names no valid data "
                                       f"directory (data={name!r})")
    return path / name


def _current_manifest(path: Path) -> dict[str, Any] | None:
    """The committed manifest, or ``None`` when there is none or it is unreadable."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def check_replaceable(path: Path) -> None:
    """Saving may go into a missing or empty directory or a checkpoint directory (whatever else
    it holds stays). A non-empty directory that is not a checkpoint is refused: it is more likely
    a wrong path than a place for checkpoints."""
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointWriteError(f"checkpoint path {path} exists and is not a directory")
    if (path / MANIFEST_NAME).is_file() or (path / DCP_METADATA_NAME).is_file():
        return
    foreign = sorted(p.name for p in path.iterdir() if not _is_own_leftover(p.name))
    if foreign:
        raise CheckpointWriteError(
            f"checkpoint path {path} is a non-empty directory that is not a checkpoint (it holds "
            f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); refusing to save into it"
        )


def remove_leftovers(path: Path) -> None:
    """Delete this module's artifacts in ``path`` that the committed manifest does not name."""
    if not path.is_dir():
        return
    manifest = _current_manifest(path)
    live = manifest.get("data") if manifest is not None else None
    for entry in sorted(path.iterdir()):
        if not _is_own_leftover(entry.name) or entry.name == live:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def prepare(path: Path) -> Path:
    """Rank 0, before a save: recover/clean what an interrupted save left, create and return a
    fresh data directory inside ``path``."""
    check_replaceable(path)
    path.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    new = path / f"{DATA_PREFIX}{_unique()}"
    new.mkdir()
    return new


def publish_manifest(tmp: Path, manifest_path: Path) -> None:
    """The commit point of a save: one atomic replace. Its own function so that crash tests
    stop exactly here, not at a rename torch's DCP writer does while writing the data."""
    os.replace(tmp, manifest_path)


def commit(path: Path, new_data: Path, manifest: dict[str, Any]) -> None:
    """Make ``new_data`` the checkpoint at ``path``: one atomic replace of ``manifest.json``;
    then remove the data directory the previous manifest named."""
    previous = _current_manifest(path)
    manifest = dict(manifest, data=new_data.name)
    fsync_dir(new_data)
    tmp = path / f"{MANIFEST_NAME}.tmp-{_unique()}"
    write_file_durably(tmp, json.dumps(manifest, indent=1).encode())
    try:
        publish_manifest(tmp, path / MANIFEST_NAME)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path)
    if previous is not None:
        _remove_superseded(path, previous, new_data.name)


def _remove_superseded(path: Path, previous: dict[str, Any], live: str) -> None:
    """Delete exactly what the previous manifest named (never anything else in ``path``)."""
    old = previous.get("data")
    if isinstance(old, str) and is_data_dir_name(old) and old != live:
        shutil.rmtree(path / old, ignore_errors=True)


def discard(data: Path | None) -> None:
    """Best-effort removal of an abandoned data directory (a failed save)."""
    if data is not None:
        shutil.rmtree(data, ignore_errors=True)
