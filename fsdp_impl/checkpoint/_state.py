"""Name-keyed views of model and optimizer state, and re-installing optimizer state.

DCP needs stable string keys, but ``optimizer.state_dict()`` numbers parameters by position.
This module translates those numbers into the model's parameter names (FQNs), so a checkpoint
stays loadable when the world size, sharding strategy or parameter order changes, and it
rebuilds the optimizer state that a never-stepped optimizer has not created yet (Adam creates
it lazily) *without* calling ``step()``: a dummy step would advance Adam's step count and, with
weight decay, move the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..dcp_optim_state import PlaceholderStateHook, user_optimizer_class
from ._errors import CheckpointMismatchError

MODEL_KEY = "model"
OPTIM_KEY = "optim"

# State-entry kinds recorded in the manifest, so load can rebuild the exact placeholders.
PARAM_LIKE = "param_like"  # a tensor laid out like its parameter (e.g. Adam's moments)
TENSOR = "tensor"  # any other tensor (e.g. Adam's scalar ``step``), replicated on every rank
OBJECT = "object"  # a non-tensor value, stored by DCP as bytes

_COMPILE_PREFIX = "_orig_mod."
_MAX_WRAP_DEPTH = 8


def canonical_name(fqn: str) -> str:
    """Drop ``torch.compile``'s ``_orig_mod.`` segments so compiled and eager models share keys."""
    return fqn.replace(_COMPILE_PREFIX, "")


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The first ``torch.optim.Optimizer`` reached by following ``.optimizer`` attributes.

    Engines may hand users a wrapper around the torch optimizer; its int-keyed
    ``state_dict`` format is what this module translates.
    """
    current = optimizer
    for _ in range(_MAX_WRAP_DEPTH):
        if isinstance(current, torch.optim.Optimizer):
            return current
        current = getattr(current, "optimizer", None)
        if current is None:
            break
    raise TypeError(
        "optimizer must be a torch.optim.Optimizer or an object wrapping one in an `.optimizer` "
        f"attribute; got {type(optimizer).__name__}"
    )


def model_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """``model.state_dict()`` under canonical keys, plus canonical -> original key map."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    state: dict[str, Any] = {}
    original: dict[str, str] = {}
    for key, value in model.state_dict().items():
        name = canonical_name(key)
        state[name] = value
        original[name] = key
    return state, original


def parameters_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical FQN -> parameter; tied parameters appear once, under their first name."""
    return {canonical_name(n): p for n, p in model.named_parameters()}


def group_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """FQNs of each optimizer param group's parameters, in group order."""
    name_of = {id(p): n for n, p in parameters_by_name(model).items()}
    groups: list[list[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        names: list[str] = []
        for i, param in enumerate(group["params"]):
            if id(param) not in name_of:
                raise CheckpointMismatchError(
                    f"optimizer param group {g}, parameter {i} (shape {tuple(param.shape)}) is not a "
                    "parameter of the model; pass the optimizer built over this model's parameters()"
                )
            names.append(name_of[id(param)])
        groups.append(names)
    return groups


def _index_to_name(names: list[list[str]], sd: Mapping) -> dict[int, str]:
    """Map ``optimizer.state_dict()``'s integer parameter ids to FQNs (groups are parallel)."""
    mapping: dict[int, str] = {}
    for group_names, saved_group in zip(names, sd["param_groups"], strict=True):
        mapping.update(zip(saved_group["params"], group_names, strict=True))
    return mapping


def _entry_kind(value: Any, param: torch.Tensor) -> str:
    if not isinstance(value, torch.Tensor):
        return OBJECT
    same_layout = isinstance(value, DTensor) == isinstance(param, DTensor)
    return PARAM_LIKE if same_layout and tuple(value.shape) == tuple(param.shape) else TENSOR


@dataclass
class OptimizerSnapshot:
    """What save writes for the optimizer: DCP state, manifest description, pickled hyperparameters."""

    state: dict[str, dict[str, Any]]  # fqn -> state key -> value (goes through DCP)
    description: dict[str, Any]  # JSON-able: class, per-group FQNs, state keys and their kinds
    hyperparameters: list[dict[str, Any]]  # param_groups without "params"/"param_names"


def snapshot_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                       placeholders: bool = False) -> OptimizerSnapshot:
    """Re-key the optimizer's state and param groups by parameter name. ``placeholders``: list
    the state a first step would create for params without state (``dcp_optim_state``), as
    FSDP2's ``get_state_dict`` does, so FSDP2 finds every entry it expects."""
    names = group_param_names(model, optimizer)
    params = parameters_by_name(model)
    sd = optimizer.state_dict()
    if placeholders:
        sd = PlaceholderStateHook()(optimizer, sd)
    to_name = _index_to_name(names, sd)
    state: dict[str, dict[str, Any]] = {}
    kinds: dict[str, dict[str, str]] = {}
    for index in sorted(sd["state"]):  # sorted: identical DCP key order on all ranks
        name = to_name[index]
        entry = sd["state"][index]
        state[name] = dict(entry)
        kinds[name] = {str(k): _entry_kind(v, params[name]) for k, v in entry.items()}
    hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in sd["param_groups"]]
    description = {"class": optimizer_class_name(optimizer), "param_groups": names, "state": kinds}
    return OptimizerSnapshot(state=state, description=description, hyperparameters=hyper)


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    return user_optimizer_class(optimizer).__name__


def check_optimizer_class(saved: str, optimizer: torch.optim.Optimizer) -> None:
    """Another optimizer's state (Adam's moments into SGD) would load and then fail or
    silently misbehave in ``step()``; refuse it here."""
    current = optimizer_class_name(optimizer)
    if saved != current:
        raise CheckpointMismatchError(
            f"checkpoint was saved with optimizer {saved} but is being loaded into {current}; their "
            f"states differ: build a {saved} optimizer to resume from this checkpoint"
        )


def check_optimizer_matches(saved: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                            limit: int = 5) -> None:
    """Raise ``CheckpointMismatchError`` if the optimizer class differs or the param groups
    differ in count or parameter names."""
    check_optimizer_class(saved["class"], optimizer)
    current = group_param_names(model, optimizer)
    saved_groups: list[list[str]] = saved["param_groups"]
    if len(saved_groups) != len(current):
        raise CheckpointMismatchError(
            f"optimizer has {len(current)} param group(s) but the checkpoint has {len(saved_groups)}"
        )
    problems: list[str] = []
    for g, (old, new) in enumerate(zip(saved_groups, current, strict=True)):
        old_set, new_set = set(old), set(new)
        missing = [n for n in new if n not in old_set]
        extra = [n for n in old if n not in new_set]
        problems += [f"group {g}: parameter '{n}' is not in the checkpoint's group" for n in missing]
        problems += [f"group {g}: checkpoint parameter '{n}' is not in the optimizer's group" for n in extra]
    if problems:
        shown = "\n  ".join(problems[:limit])
        raise CheckpointMismatchError(
            f"optimizer param groups differ from the checkpoint's ({len(problems)} difference(s)); "
            f"first {min(limit, len(problems))}:\n  {shown}"
        )


def empty_optimizer_state(saved: Mapping[str, Any], model: nn.Module,
                          metadata_entry: Any) -> dict[str, dict[str, Any]]:
    """Placeholders for DCP to load the optimizer state into, shaped from the checkpoint.

    ``metadata_entry(fqn, key)`` returns DCP's storage metadata for ``optim.<fqn>.<key>``.
    Param-like entries become zeros laid out exactly like the *current* parameter (same
    mesh and placements), so DCP reshards into the current world size / strategy.
    """
    params = parameters_by_name(model)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(saved["state"]):
        if name not in params:
            continue
        entry: dict[str, Any] = {}
        for key, kind in saved["state"][name].items():
            md = metadata_entry(name, key)
            if kind == OBJECT:
                entry[key] = None  # DCP replaces it with the unpickled value
            elif kind == PARAM_LIKE:
                entry[key] = torch.zeros_like(params[name].detach(), dtype=md.properties.dtype)
            else:
                entry[key] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
        out[name] = entry
    return out


def install_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                            state: Mapping[str, Mapping[str, Any]],
                            hyperparameters: list[dict[str, Any]]) -> None:
    """Install name-keyed state and saved hyperparameters through ``load_state_dict`` (no ``step()``).

    ``load_state_dict`` applies torch's own device/dtype policy (e.g. ``step`` moves to the
    parameter's device for capturable/fused Adam), so the result matches a real resume.
    """
    names = group_param_names(model, optimizer)
    current = optimizer.state_dict()
    index_of = {n: i for i, n in _index_to_name(names, current).items()}
    groups = []
    for saved_hp, group in zip(hyperparameters, current["param_groups"], strict=True):
        merged = dict(saved_hp)
        merged["params"] = list(group["params"])
        if "param_names" in group:
            merged["param_names"] = list(group["param_names"])
        groups.append(merged)
    indexed = {index_of[n]: dict(entry) for n, entry in state.items() if n in index_of}
    optimizer.load_state_dict({"state": indexed, "param_groups": groups})
