"""Directories written once and published whole: ``torch_dcp`` checkpoints and Hugging Face exports.

Readers of these formats (``dcp.load``, ``from_pretrained``) take the files directly in the
directory, so there is no manifest to swap atomically as in the default layout. Instead the files
go into a sibling ``<path>.tmp-<id>`` and one ``rename`` publishes them: ``path`` is either
absent or complete. Replacing an existing directory cannot be done atomically, so ``path`` must
not exist or be empty; leftovers of our own interrupted saves (the sibling temp directories,
recognised by their exact name pattern) are removed by the next save to the same ``path``.
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

from . import _comm
from ._errors import CheckpointError, CheckpointWriteError
from ._files import fsync_dir


def check_target(path: Path, what: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointWriteError(
            f"{path} exists and is not an empty directory: a {what} is written once (its readers take the "
            "files in place, so it cannot be replaced atomically); write each one to a new directory (e.g. "
            "step-<n>) or remove the old one first")


def _prepare(path: Path, what: str) -> Path:
    check_target(path, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    own = re.compile(re.escape(path.name) + r"\.tmp-[0-9a-f]{12}")
    for entry in sorted(path.parent.iterdir()):
        if own.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    tmp = path.parent / f"{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def prepare(path: Path, what: str) -> Path:
    """Collective: rank 0 checks ``path`` and makes the temp directory; every rank gets its name."""
    tmp, error = None, None
    if _comm.rank() == 0:
        try:
            tmp = _prepare(path, what)
        except (OSError, CheckpointError) as e:
            error = e
    _comm.raise_if_any_failed(error, f"preparing {path}", CheckpointWriteError)
    return Path(_comm.broadcast_from_rank0(None if tmp is None else str(tmp)))


def publish(tmp: Path, path: Path, what: str) -> None:
    """Rank 0 only: make the complete ``tmp`` the directory ``path`` (one rename)."""
    fsync_dir(tmp)
    check_target(path, what)
    if path.exists():
        path.rmdir()  # empty (checked): rename cannot replace a directory on every platform
    tmp.rename(path)
    fsync_dir(path.parent)


def discard(tmp: Path) -> None:
    """Rank 0, after a failed save: remove the temp directory."""
    if _comm.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
