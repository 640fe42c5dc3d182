"""Checkpoint files: the manifest, durable writes, integrity checks.

A checkpoint's data directory holds DCP's files (``.metadata`` and ``*.distcp``) and
``extra.pt`` (optimizer hyperparameters and the user's ``extra`` dict, written by rank 0);
``manifest.json`` (format version, optimizer description, size and SHA-256 of every data file,
and the data directory's name) is written last and commits the save (see ``_layout``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._errors import CheckpointCorruptedError, CheckpointNotFoundError

MANIFEST_NAME = "manifest.json"
EXTRA_NAME = "extra.pt"
DCP_METADATA_NAME = ".metadata"
FORMAT_NAME = "fsdp_impl.checkpoint"
FORMAT_VERSION = 2  # data in a directory the manifest names (1, never released, kept it next to the manifest)
TORCH_DCP_VERSION = 3  # save(format="torch_dcp"): FSDP2's layout, DCP files directly in the checkpoint directory
READABLE_VERSIONS = (2, 3)

_CHUNK = 1 << 20


def as_path(path: Any, argument: str = "path") -> Path:
    """Validate a user-supplied path argument early, naming it in the error."""
    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise TypeError(f"{argument} must be a non-empty str or os.PathLike; got {path!r}")
    return Path(path)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (directory entries live in the directory)."""
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
    """Every file of a data directory, sorted (same order on all ranks)."""
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def my_share(names: list[str], rank: int, world_size: int) -> list[str]:
    """Round-robin split, so hashing costs one read of the checkpoint in total, not per rank."""
    return [n for i, n in enumerate(names) if i % world_size == rank]


def new_manifest(optimizer: Mapping[str, Any], files: Mapping[str, Any], world_size: int,
                 torch_version: str, version: int = FORMAT_VERSION) -> dict[str, Any]:
    """The manifest of a new checkpoint (``_layout.commit`` adds the data directory's name)."""
    return {
        "format": FORMAT_NAME,
        "version": version,
        "saved_world_size": world_size,
        "torch_version": torch_version,
        "optimizer": optimizer,
        "files": dict(sorted(files.items())),
    }


def leftovers(path: Path) -> list[str]:
    """Sibling temp/aside directories that hint at an interrupted save."""
    if not path.parent.is_dir():
        return []
    prefixes = (f"{path.name}.tmp-", f"{path.name}.old-")
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(prefixes))


def require_directory(path: Path) -> None:
    """A checkpoint path that is no directory is refused, naming leftovers of an interrupted save."""
    if not path.exists():
        hint = leftovers(path)
        more = f" (found leftovers of an interrupted save: {', '.join(hint)})" if hint else ""
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist{more}")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint path {path} is not a directory")


def read_manifest(path: Path) -> dict[str, Any]:
    """Open a checkpoint directory: clear errors for a missing, foreign or damaged one."""
    require_directory(path)
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
    if manifest.get("version") not in READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise CheckpointCorruptedError(
            f"checkpoint {path} has format version {manifest.get('version')}; this code reads versions {readable}"
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
