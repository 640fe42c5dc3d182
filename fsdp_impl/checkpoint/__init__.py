"""Checkpoints of a sharded model and optimizer through ``torch.distributed.checkpoint``.

``save(path, model, optimizer, extra=None)`` and ``load(path, model, optimizer) -> extra``
make resume exact: a run resumed from step k reproduces the uninterrupted run's losses and
parameters, also after changing world size or ZeRO strategy.  See :mod:`._api`.
"""

from ._api import data_dir, load, save
from ._errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)

__all__ = [
    "save",
    "load",
    "data_dir",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptedError",
    "CheckpointWriteError",
]
