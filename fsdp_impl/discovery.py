"""Find the FSDP units of a module and assign every parameter to exactly one unit.

Order is derived from ``named_modules()`` / ``_parameters`` insertion order only (never from a
set or id-ordered dict), so every rank builds the same units in the same order.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch.nn as nn

from .param import ManagedParam

UnitSpec = Sequence[str | type[nn.Module]] | None


def resolve_unit_classes(spec: UnitSpec) -> tuple[type[nn.Module], ...]:
    """Classes from ``fsdp_unit_modules`` (classes or "pkg.mod.Class" strings)."""
    if spec is None:
        return ()
    if isinstance(spec, (str, type)):
        spec = [spec]
    classes = []
    for item in spec:
        if isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
            continue
        if not isinstance(item, str) or "." not in item:
            raise ValueError(f"fsdp_unit_modules entry {item!r} must be an nn.Module subclass or an "
                             "import path string like 'torch.nn.Linear'")
        mod_name, _, cls_name = item.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"fsdp_unit_modules entry {item!r} cannot be imported: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"fsdp_unit_modules entry {item!r} is not an nn.Module subclass")
        classes.append(cls)
    return tuple(classes)


def find_unit_modules(root: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[tuple[str, nn.Module]]:
    """Outermost submodules that are instances of ``classes`` (a match's descendants are skipped).

    The root itself may match (as in Megatron-FSDP): then it is the outermost match and the whole
    model is one unit, the root unit, gathered before the root's forward."""
    if classes and isinstance(root, classes):
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if module is root or not isinstance(module, classes):
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in found):
            continue
        found.append((name, module))
    if classes and not found:
        names = [c.__qualname__ for c in classes]
        raise ValueError(f"fsdp_unit_modules={names} matched no submodule of "
                         f"{type(root).__qualname__}; pass classes that occur in the model")
    return found


def _unit_of(module_name: str, unit_names: list[str]) -> int:
    for i, prefix in enumerate(unit_names):
        if module_name == prefix or module_name.startswith(prefix + "."):
            return i
    return len(unit_names)  # root


def assign_params(root: nn.Module, unit_names: list[str]) -> list[list[ManagedParam]]:
    """Per unit (root last) the params it owns. A param referenced from more than one unit
    (tied weights across units) goes to the root, which is unsharded for the whole forward."""
    info: dict[int, dict] = {}
    order: list[int] = []
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is None:
                continue
            key = id(param)
            if key not in info:
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                info[key] = {"fqn": fqn, "param": param, "locations": [], "owners": []}
                order.append(key)
            entry = info[key]
            if not any(m is module and n == pname for m, n in entry["locations"]):
                entry["locations"].append((module, pname))
            owner = _unit_of(mod_name, unit_names)
            if owner not in entry["owners"]:
                entry["owners"].append(owner)
    groups: list[list[ManagedParam]] = [[] for _ in range(len(unit_names) + 1)]
    for key in order:
        entry = info[key]
        owner = entry["owners"][0] if len(entry["owners"]) == 1 else len(unit_names)
        groups[owner].append(ManagedParam(entry["fqn"], entry["param"], entry["locations"]))
    return groups
