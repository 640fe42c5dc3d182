"""Compare a checkpoint's DCP metadata with the model it is about to be loaded into.

DCP's own errors for a foreign checkpoint are raw planner assertions about one key; users
need the list of differing names and shapes up front, before any tensor is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._errors import CheckpointMismatchError
from ._state import MODEL_KEY

_LIMIT = 5


def _format(title: str, items: list[str]) -> str:
    shown = "\n    ".join(items[:_LIMIT])
    more = f"\n    ... and {len(items) - _LIMIT} more" if len(items) > _LIMIT else ""
    return f"  {title} ({len(items)}):\n    {shown}{more}"


def check_model_matches(model_state: Mapping[str, Any], metadata: Any, path: Any) -> None:
    """Raise ``CheckpointMismatchError`` listing the first missing/unexpected/reshaped entries."""
    saved: dict[str, Any] = {}
    prefix = MODEL_KEY + "."
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            saved[key[len(prefix):]] = md
    missing: list[str] = []
    reshaped: list[str] = []
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue  # non-tensor extra state: DCP stores it as bytes; nothing to compare
        md = saved.get(name)
        if md is None:
            missing.append(name)
        elif not isinstance(md, TensorStorageMetadata):
            reshaped.append(f"{name}: model has a tensor, checkpoint has a non-tensor value")
        elif tuple(md.size) != tuple(value.shape):
            reshaped.append(f"{name}: model {tuple(value.shape)}, checkpoint {tuple(md.size)}")
    # Nested non-tensor values are flattened by DCP, so only tensor entries can be "unexpected".
    unexpected = [n for n, md in saved.items()
                  if isinstance(md, TensorStorageMetadata) and n not in model_state]
    if not (missing or reshaped or unexpected):
        return
    parts = []
    if missing:
        parts.append(_format("in the model but not in the checkpoint", missing))
    if unexpected:
        parts.append(_format("in the checkpoint but not in the model", sorted(unexpected)))
    if reshaped:
        parts.append(_format("shape differs", reshaped))
    raise CheckpointMismatchError(
        f"checkpoint {path} was saved from a different model:\n" + "\n".join(parts)
    )
