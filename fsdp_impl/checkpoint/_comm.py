"""The few collectives checkpointing needs, valid with or without a process group.

Checkpointing runs over the default (world) group because DCP coordinates over it.
Without an initialised process group every helper degrades to the single-process
behaviour, so the same code serves unit tests and scripts.  Every helper is a
collective: all ranks must call it in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import _files
from ._errors import CheckpointError


def is_distributed() -> bool:
    """True when a default process group exists (DCP then coordinates over it)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Ranks in the default group (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def broadcast_from_rank0(obj: Any) -> Any:
    """Return rank 0's ``obj`` on every rank (e.g. a name only rank 0 may choose)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, indexed by rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_if_any_failed(error: BaseException | None, what: str, exc_type: type[Exception]) -> None:
    """Collective error agreement: raise on *every* rank if any rank failed.

    A rank that raised alone would leave the others blocked in the next collective;
    gathering the failures first turns a one-rank failure into the same clear error on
    all ranks instead of a hang.
    """
    messages: Sequence[str | None] = all_gather(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if isinstance(error, CheckpointError):
        raise error  # already precise and self-explanatory
    detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
    raise exc_type(f"{what} failed on {len(failed)} rank(s): {detail}") from error


def gathered_digests(names: list[str], root: Path, error_type: type[CheckpointError]) -> dict[str, Any]:
    """Every rank hashes its share of the files ``names`` under ``root``; all ranks get every digest
    (a failure on any rank raises ``error_type`` on all)."""
    digests: dict[str, Any] = {}
    error = None
    try:
        for name in _files.my_share(names, rank(), world_size()):
            digests[name] = _files.file_digest(root / name)
    except OSError as e:
        error = e
    raise_if_any_failed(error, "hashing checkpoint files", error_type)
    files: dict[str, Any] = {}
    for part in all_gather(digests):
        files.update(part)
    return files
