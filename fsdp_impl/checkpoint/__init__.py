"""Checkpoints of a sharded model and optimizer through ``torch.distributed.checkpoint``.

``save(path, model, optimizer, extra=None, format="fsdp_impl")`` and ``load(path, model,
optimizer) -> extra`` make resume exact: a run resumed from step k reproduces the uninterrupted
run's losses and parameters, also after changing world size or ZeRO strategy. ``load`` also
reads FSDP2, torchtitan and Megatron-FSDP DCP checkpoints, and ``save(format="torch_dcp")``
writes one FSDP2 loads. See :mod:`._api`.
"""

from ._api import FORMATS, data_dir, load, save
from ._errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)

__all__ = [
    "save",
    "load",
    "data_dir",
    "FORMATS",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptedError",
    "CheckpointWriteError",
]
