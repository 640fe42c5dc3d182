"""On-disk layout of a checkpoint: atomic publication, manifest, integrity checks.

A checkpoint directory holds DCP's files (``.metadata`` and ``*.distcp``), ``extra.pt``
(optimizer hyperparameters and the user's ``extra`` dict, written by rank 0) and, written
last, ``manifest.json`` (format version, optimizer description, size and SHA-256 of every
other file).  Everything is written into a sibling temporary directory which rank 0 renames
into place, so a crash mid-save never leaves a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._errors import CheckpointCorruptedError, CheckpointNotFoundError, CheckpointWriteError

MANIFEST_NAME = "manifest.json"
EXTRA_NAME = "extra.pt"
DCP_METADATA_NAME = ".metadata"
FORMAT_NAME = "fsdp_impl.checkpoint"
FORMAT_VERSION = 1

_CHUNK = 1 << 20


def as_path(path: Any, argument: str = "path") -> Path:
    """Validate a user-supplied path argument early, naming it in the error."""
    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise TypeError(f"{argument} must be a non-empty str or os.PathLike; got {path!r}")
    return Path(path)


def new_temp_dir(path: Path) -> Path:
    """Create ``<path>.tmp-<unique>`` next to ``path`` (same filesystem, so rename is atomic)."""
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    return tmp


def is_checkpoint_dir(path: Path) -> bool:
    """A directory that a previous save (or a bare DCP save) produced."""
    return (path / MANIFEST_NAME).is_file() or (path / DCP_METADATA_NAME).is_file()


def check_replaceable(path: Path) -> None:
    """Refuse to overwrite anything but an earlier checkpoint or an empty directory."""
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointWriteError(f"checkpoint path {path} exists and is not a directory")
    if any(path.iterdir()) and not is_checkpoint_dir(path):
        raise CheckpointWriteError(
            f"checkpoint path {path} is a non-empty directory that is not a checkpoint; "
            "refusing to replace it"
        )


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (directory entries live in the parent directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` directory to ``path``, replacing an older checkpoint.

    The old checkpoint is renamed aside and deleted only after the new one is in place; if
    the second rename fails, the old one is put back.
    """
    check_replaceable(path)
    aside = None
    if path.exists():
        aside = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, aside)
    try:
        os.rename(tmp, path)
    except BaseException:
        if aside is not None:
            os.rename(aside, path)
        raise
    _fsync_dir(path.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def discard(tmp: Path | None) -> None:
    """Best-effort removal of an abandoned temporary directory."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write bytes and fsync, so a published checkpoint never points at unflushed data."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def file_digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a file (chunked, so big shards do not need to fit in memory)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def data_files(directory: Path) -> list[str]:
    """Every file of the checkpoint except the manifest, sorted (same order on all ranks)."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_NAME)


def my_share(names: list[str], rank: int, world_size: int) -> list[str]:
    """Round-robin split, so hashing costs one read of the checkpoint in total, not per rank."""
    return [n for i, n in enumerate(names) if i % world_size == rank]


def write_manifest(directory: Path, optimizer: Mapping[str, Any], files: Mapping[str, Any],
                   world_size: int, torch_version: str) -> None:
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "saved_world_size": world_size,
        "torch_version": torch_version,
        "optimizer": optimizer,
        "files": dict(sorted(files.items())),
    }
    write_file_durably(directory / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())


def _leftovers(path: Path) -> list[str]:
    """Sibling temp/aside directories that hint at an interrupted save."""
    if not path.parent.is_dir():
        return []
    prefixes = (f"{path.name}.tmp-", f"{path.name}.old-")
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(prefixes))


def read_manifest(path: Path) -> dict[str, Any]:
    """Open a checkpoint directory: clear errors for a missing, foreign or damaged one."""
    if not path.exists():
        hint = _leftovers(path)
        more = f" (found leftovers of an interrupted save: {', '.join(hint)})" if hint else ""
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist{more}")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint path {path} is not a directory")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        kind = "a bare DCP checkpoint" if (path / DCP_METADATA_NAME).is_file() else "not a checkpoint"
        raise CheckpointNotFoundError(
            f"{path} has no {MANIFEST_NAME}: it is {kind} (fsdp_impl.checkpoint.save writes {MANIFEST_NAME} last)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorruptedError(f"checkpoint file {manifest_path} is unreadable or corrupted: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointCorruptedError(f"checkpoint file {manifest_path} is not an {FORMAT_NAME} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptedError(
            f"checkpoint {path} has format version {manifest.get('version')}; this code reads version {FORMAT_VERSION}"
        )
    return manifest


def verify_files(path: Path, expected: Mapping[str, Mapping[str, Any]], names: list[str]) -> list[str]:
    """Problems with the listed files (missing, truncated, altered), as messages naming each file."""
    problems: list[str] = []
    for name in names:
        file = path / name
        want = expected[name]
        if not file.is_file():
            problems.append(f"{file} is missing")
            continue
        size = file.stat().st_size
        if size != want["size"]:
            what = "truncated" if size < want["size"] else "longer than written"
            problems.append(f"{file} is {what}: {size} bytes, expected {want['size']}")
            continue
        if file_digest(file)["sha256"] != want["sha256"]:
            problems.append(f"{file} is corrupted: SHA-256 differs from the one recorded at save")
    return problems
