"""Checkpoints of a sharded model and optimizer through ``torch.distributed.checkpoint``.

``save(path, model, optimizer, extra=None, format="fsdp_impl")`` and ``load(path, model,
optimizer) -> extra`` make resume exact: a run resumed from step k reproduces the uninterrupted
run's losses and parameters, also after changing world size or ZeRO strategy. ``load`` also
reads FSDP2, torchtitan and Megatron-FSDP DCP checkpoints, and ``save(format="torch_dcp")``
writes one FSDP2 loads. ``save_hf`` / ``load_hf`` export and import Hugging Face safetensors
without gathering the model on one rank. See :mod:`._api` and :mod:`._hf`.
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
from ._hf import load_hf, save_hf

__all__ = [
    "save",
    "load",
    "data_dir",
    "FORMATS",
    "save_hf",
    "load_hf",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptedError",
    "CheckpointWriteError",
]
