"""Match another engine's DCP checkpoint against the model and optimizer it is loaded into.

Everything here reads only DCP metadata (and the small param-group entries), so a foreign
checkpoint that does not fit is refused with every difference named before a single tensor is
read or the model touched: missing / unexpected keys, shapes, dtypes, and an optimizer whose
state has other entries (SGD's ``momentum_buffer`` where AdamW keeps ``exp_avg``) or other
param groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ._dcp_layout import DcpLayout, OptimLayout
from ._errors import CheckpointMismatchError

_LIMIT = 5


def _format(title: str, items: list[str]) -> str:
    shown = "\n    ".join(items[:_LIMIT])
    more = f"\n    ... and {len(items) - _LIMIT} more" if len(items) > _LIMIT else ""
    return f"  {title} ({len(items)}):\n    {shown}{more}"


def _raise(what: str, parts: list[str]) -> None:
    if parts:
        raise CheckpointMismatchError(f"{what}:\n" + "\n".join(parts))


def match_model(layout: DcpLayout, metadata: Mapping[str, Any], tensors: list[tuple[str, torch.Tensor]],
                alias: Mapping[str, str], source: str) -> dict[str, str]:
    """Own tensor name -> checkpoint key, or ``CheckpointMismatchError`` naming every missing,
    unexpected, reshaped or retyped entry. A tied parameter's second name may be absent when its
    first name is present (Hugging Face style); both then read the one entry."""
    prefix = layout.model_prefix
    found: dict[str, str] = {}
    missing, reshaped, retyped = [], [], []
    for name, value in tensors:
        key = prefix + name
        if key not in metadata and name in alias and prefix + alias[name] in metadata:
            key = prefix + alias[name]
        md = metadata.get(key)
        if md is None:
            missing.append(key)
        elif not isinstance(md, TensorStorageMetadata):
            reshaped.append(f"{key}: the model has a tensor, the checkpoint a non-tensor value")
        elif tuple(md.size) != tuple(value.shape):
            reshaped.append(f"{key}: model {tuple(value.shape)}, checkpoint {tuple(md.size)}")
        elif md.properties.dtype != value.dtype:
            retyped.append(f"{key}: model {value.dtype}, checkpoint {md.properties.dtype}")
        else:
            found[name] = key
    own = {prefix + n for n, _ in tensors} | {prefix + a for a in alias}
    unexpected = [k for k in layout.model_keys if k not in own and isinstance(metadata[k], TensorStorageMetadata)]
    parts = []
    if missing:
        parts.append(_format("in the model but not in the checkpoint", missing))
    if unexpected:
        parts.append(_format("in the checkpoint but not in the model", unexpected))
    if reshaped:
        parts.append(_format("shape differs", reshaped))
    if retyped:
        parts.append(_format("dtype differs", retyped))
    _raise(f"checkpoint {source} ({layout.writer}) does not fit the model", parts)
    return found


@dataclass
class OptimPlan:
    """What to read for the optimizer: checkpoint key -> (own param name, state key, placeholder)."""

    reads: dict[str, tuple[str, str, Any]]


def state_key_of(optim: OptimLayout, name: str, position: int) -> str:
    """The checkpoint prefix of one parameter's state (``...state.<fqn>.`` or ``...state.<i>.``)."""
    return f"{optim.state_prefix}{position if optim.by_position else name}."


def match_optimizer_state(layout: DcpLayout, metadata: Mapping[str, Any], expected: Mapping[str, Mapping[str, Any]],
                          positions: Mapping[str, int], class_name: str, source: str) -> OptimPlan:
    """Check every parameter's saved state entries against the ones this optimizer keeps
    (``expected``: own name -> state key -> live value or placeholder) and plan their reads."""
    optim = layout.optim
    assert optim is not None
    base = optim.base + "state."
    claimed: set[str] = set()
    reads: dict[str, tuple[str, str, Any]] = {}
    missing, other_keys, reshaped = [], [], []
    for name, entry in expected.items():
        prefix = state_key_of(optim, name, positions[name])
        saved = {k[len(prefix):]: k for k in metadata if k.startswith(prefix)}
        claimed.update(saved.values())
        if not saved:
            missing.append(f"{name} ({prefix}*)")
            continue
        if set(saved) != set(entry):
            other_keys.append(f"{name}: checkpoint keeps {sorted(saved)}, {class_name} keeps {sorted(entry)}")
            continue
        for key, value in entry.items():
            md = metadata[saved[key]]
            if isinstance(value, torch.Tensor):
                if not isinstance(md, TensorStorageMetadata):
                    reshaped.append(f"{saved[key]}: {class_name} keeps a tensor, the checkpoint a non-tensor value")
                elif tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
                    reshaped.append(f"{saved[key]}: {class_name} {tuple(value.shape)} {value.dtype}, "
                                    f"checkpoint {tuple(md.size)} {md.properties.dtype}")
                else:
                    reads[saved[key]] = (name, key, torch.zeros_like(value))
            elif isinstance(md, BytesStorageMetadata):
                reads[saved[key]] = (name, key, None)
            else:
                reshaped.append(f"{saved[key]}: {class_name} keeps a non-tensor value, the checkpoint a tensor")
    unexpected = sorted(k for k in metadata if k.startswith(base) and k not in claimed)
    if other_keys:
        raise CheckpointMismatchError(
            f"checkpoint {source} holds the state of a different optimizer than this {class_name}:\n"
            + _format("state entries differ", other_keys))
    parts = []
    if missing:
        parts.append(_format("optimizer state of these parameters is not in the checkpoint", missing))
    if unexpected:
        parts.append(_format("optimizer state in the checkpoint for no parameter of the model", unexpected))
    if reshaped:
        parts.append(_format("optimizer state shape or dtype differs", reshaped))
    _raise(f"checkpoint {source} ({layout.writer}): optimizer state does not fit", parts)
    return OptimPlan(reads=reads)


def group_entries(layout: DcpLayout, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Placeholders for every param-group entry (hyperparameters, ``params`` lists)."""
    assert layout.optim is not None
    out: dict[str, Any] = {}
    for key, md in metadata.items():
        if key.startswith(layout.optim.groups_prefix):
            out[key] = (torch.empty(tuple(md.size), dtype=md.properties.dtype)
                        if isinstance(md, TensorStorageMetadata) else None)
    return out


def _nested_groups(prefix: str, loaded: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    groups: dict[int, dict[str, Any]] = {}
    for key, value in loaded.items():
        index, _, name = key[len(prefix):].partition(".")
        if index.isdigit():
            groups.setdefault(int(index), {})[name] = value
    return groups


def saved_hyperparameters(layout: DcpLayout, loaded: Mapping[str, Any], groups: list[list[str]],
                          positions: Mapping[str, int], source: str) -> list[dict[str, Any]]:
    """The checkpoint's hyperparameters for each of this optimizer's param groups (``groups``:
    own names per group), or ``CheckpointMismatchError`` when the groups do not correspond."""
    optim = layout.optim
    assert optim is not None
    what = f"checkpoint {source} ({layout.writer}): optimizer param groups do not fit"
    if optim.flat_groups:
        return [_flat_group(optim.groups_prefix, loaded, names, g, what) for g, names in enumerate(groups)]
    saved = _nested_groups(optim.groups_prefix, loaded)
    out = []
    for g, names in enumerate(groups):
        want = [positions[n] for n in names] if optim.by_position else names
        matches = [i for i, group in sorted(saved.items()) if _same_members(group.get("params"), want)]
        if not matches:
            listed = [f"group {i}: {len(group.get('params') or [])} parameters" for i, group in sorted(saved.items())]
            hint = ("; the checkpoint keys optimizer state by position, so build the optimizer's param groups "
                    "as its run had them (Megatron-FSDP's fully_shard makes one group over model.parameters())"
                    if optim.by_position else "")
            raise CheckpointMismatchError(
                f"{what}: no saved group holds exactly this optimizer's group {g} ({len(names)} parameters, "
                f"first {names[0] if names else '-'}){hint}\n" + _format("saved groups", listed))
        out.append({k: v for k, v in saved[matches[0]].items() if k not in ("params", "param_names")})
    return out


def _same_members(saved: Any, want: list[Any]) -> bool:
    return isinstance(saved, (list, tuple)) and sorted(map(str, saved)) == sorted(map(str, want))


def _flat_group(prefix: str, loaded: Mapping[str, Any], names: list[str], g: int, what: str) -> dict[str, Any]:
    """torchtitan's per-parameter hyperparameters: every member of one of our groups must agree."""
    per_param = []
    for name in names:
        head = f"{prefix}{name}."
        values = {k[len(head):]: v for k, v in loaded.items() if k.startswith(head) and "." not in k[len(head):]}
        if not values:
            raise CheckpointMismatchError(f"{what}: no hyperparameters saved for parameter {name} ({head}*)")
        per_param.append((name, values))
    first_name, first = per_param[0]
    for name, values in per_param[1:]:
        if not _same_values(values, first):
            raise CheckpointMismatchError(
                f"{what}: the checkpoint gives parameters of this optimizer's group {g} different "
                f"hyperparameters ({first_name}: {_short(first)}; {name}: {_short(values)}); build the "
                "optimizer's param groups as the checkpoint's run did")
    return first


def _same_values(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _short(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={values[k]!r}" for k in sorted(values) if k in ("lr", "weight_decay", "betas"))


def check_hyperparameter_kinds(saved: list[dict[str, Any]], current: list[dict[str, Any]], class_name: str,
                               source: str) -> None:
    """Adam and AdamW keep the same state; the flag torch records in the group tells them apart."""
    for g, (old, new) in enumerate(zip(saved, current, strict=True)):
        flag = "decoupled_weight_decay"
        if flag in old and flag in new and bool(old[flag]) != bool(new[flag]):
            raise CheckpointMismatchError(
                f"checkpoint {source} holds the state of a different optimizer than this {class_name}: its "
                f"param group {g} has {flag}={old[flag]} (AdamW: True, Adam: False), this optimizer's {new[flag]}")
