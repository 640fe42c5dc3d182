"""Load a DCP checkpoint in another engine's layout (FSDP2, torchtitan, Megatron-FSDP) or in our
``torch_dcp`` layout into a model wrapped by ``fully_shard`` and its optimizer.

Three phases, so nothing is modified unless everything fits: (1) match the DCP metadata against
the model and the optimizer and read the small entries (param groups, the other entries);
(2) read every tensor into fresh buffers laid out like the current parameters (DCP reshards
from any world size and sharding); (3) install them through ``model.load_state_dict`` and
``optimizer.load_state_dict`` (no ``step()``: Adam's step counts are the saved ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..dcp_optim_state import PlaceholderStateHook
from . import _comm
from ._dcp_layout import DcpLayout, describe
from ._errors import CheckpointCorruptedError, CheckpointMismatchError
from ._foreign_check import (
    check_hyperparameter_kinds,
    group_entries,
    match_model,
    match_optimizer_state,
    saved_hyperparameters,
)
from ._names import aliases, own_name, own_state, tensor_items, wrapper_prefix
from ._state import group_param_names, install_optimizer_state, optimizer_class_name, unwrap_optimizer


def read(reader_path: Path, state: dict[str, Any], source: str) -> dict[str, Any]:
    """``dcp.load`` of a flat ``{checkpoint key: placeholder}`` dict (tensors filled in place,
    non-tensor entries replaced); a failed read is reported as a damaged checkpoint."""
    if not state:
        return state
    try:
        # keys are already flat: DCP's flattening maps each to itself (and writes non-tensor
        # values back into this dict; its flatten_state_dict=False path would not)
        dcp.load(state, storage_reader=FileSystemReader(reader_path), no_dist=not _comm.is_distributed())
    except CheckpointException as e:
        raise CheckpointCorruptedError(f"reading checkpoint {source} failed: {e}") from e
    return state


def _positions(model: nn.Module, optimizer: torch.optim.Optimizer
               ) -> tuple[list[list[str]], dict[str, int], dict[str, str]]:
    """Own names per param group, each name's position as ``optimizer.state_dict()`` numbers
    it, and own name -> canonical name (what ``_state`` keys optimizer state by)."""
    prefix = wrapper_prefix(model)
    canonical = group_param_names(model, optimizer)
    groups: list[list[str]] = []
    positions: dict[str, int] = {}
    to_canonical: dict[str, str] = {}
    for names in canonical:
        own = []
        for name in names:
            mine = own_name(name, prefix)
            to_canonical[mine] = name
            positions.setdefault(mine, len(positions))
            own.append(mine)
        groups.append(own)
    return groups, positions, to_canonical


def _expected_state(model: nn.Module, optimizer: torch.optim.Optimizer, to_canonical: Mapping[str, str]
                    ) -> dict[str, dict[str, Any]]:
    """Own name -> the state entries this optimizer keeps for it (live, or the placeholders a
    first step would create: ``dcp_optim_state``), in parameter order."""
    sd = PlaceholderStateHook()(optimizer, optimizer.state_dict())
    by_position: dict[int, str] = {}
    for names, group in zip(group_param_names(model, optimizer), sd["param_groups"], strict=True):
        by_position.update(zip(group["params"], names, strict=True))
    canonical_to_own = {c: o for o, c in to_canonical.items()}
    out: dict[str, dict[str, Any]] = {}
    for position in sorted(sd["state"]):
        out[canonical_to_own[by_position[position]]] = dict(sd["state"][position])
    return out


def _other_entries(layout: DcpLayout, metadata: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for keys in layout.other.values():
        for key in keys:
            md = metadata[key]
            out[key] = (torch.empty(tuple(md.size), dtype=md.properties.dtype)
                        if isinstance(md, TensorStorageMetadata) else None)
    return out


def _nest(flat: Mapping[str, Any], planner_data: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the nesting DCP flattened (its ``planner_data`` keeps each key's path)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        path = planner_data.get(key)
        parts = [str(p) for p in path] if isinstance(path, (tuple, list)) and path else key.split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return out


def load_foreign(data: Path, source: str, model: nn.Module, optimizer: Any, *, model_key: str | None = None,
                 optim_key: str | None = None) -> tuple[DcpLayout, dict[str, Any]]:
    """Load the DCP checkpoint in ``data`` into ``model`` (and ``optimizer`` unless None);
    collective. Returns the layout found and the checkpoint's other entries, nested as saved."""
    try:
        metadata = FileSystemReader(data).read_metadata()
    except Exception as e:
        raise CheckpointCorruptedError(f"DCP metadata of checkpoint {source} is unreadable: {e}") from e
    entries = metadata.state_dict_metadata
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    torch_optimizer = None if optimizer is None else unwrap_optimizer(optimizer)

    model_sd, original = own_state(model)
    tensors = tensor_items(model_sd)
    groups, positions, to_canonical = ([], {}, {}) if torch_optimizer is None else _positions(model, torch_optimizer)
    layout = describe(set(entries), planner_data, [n for n, _ in tensors], list(positions), model_key, optim_key)
    found = match_model(layout, entries, tensors, aliases(model), source)

    small = _other_entries(layout, entries)
    plan, hyper = None, None
    if torch_optimizer is not None:
        if layout.optim is None:
            raise CheckpointMismatchError(f"checkpoint {source} ({layout.writer}) holds no optimizer state; "
                                          "pass optimizer=None to load only the model")
        small.update(group_entries(layout, entries))
    read(data, small, source)  # param groups and other entries: small, read before deciding
    if torch_optimizer is not None:
        class_name = optimizer_class_name(torch_optimizer)
        hyper = saved_hyperparameters(layout, small, groups, positions, source)  # group structure first
        plan = match_optimizer_state(layout, entries, _expected_state(model, torch_optimizer, to_canonical),
                                     positions, class_name, source)
        current = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                   for g in torch_optimizer.param_groups]
        check_hyperparameter_kinds(hyper, current, class_name, source)
        hyper = [{**now, **old} for now, old in zip(current, hyper, strict=True)]

    # Phase 2: every tensor into fresh buffers (the model is untouched if a read fails).
    big: dict[str, Any] = {}
    for name, key in found.items():
        big.setdefault(key, torch.empty_like(model_sd[name]))
    if plan is not None:
        big.update({key: placeholder for key, (_, _, placeholder) in plan.reads.items()})
    read(data, big, source)

    # Phase 3: install.
    model.load_state_dict({original[name]: big[key] for name, key in found.items()} |
                          {original[n]: v for n, v in model_sd.items() if not isinstance(v, torch.Tensor)},
                          strict=True)
    if torch_optimizer is not None and plan is not None and hyper is not None:
        state: dict[str, dict[str, Any]] = {}
        for key, (name, entry, _) in plan.reads.items():
            state.setdefault(to_canonical[name], {})[entry] = big[key]
        install_optimizer_state(model, torch_optimizer, state, hyper)
    others = {key: small[key] for keys in layout.other.values() for key in keys}
    return layout, _nest(others, planner_data)
