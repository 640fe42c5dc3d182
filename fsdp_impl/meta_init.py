"""Materialise a meta-device model unit by unit, keeping only each rank's shard.

Modules are visited in post-order (children before parents), which is the order an eager
``__init__`` runs their initialisers; each module holding meta tensors gets fresh storage and its
``reset_parameters()`` (or ``_reset_parameters()``) is called. When a unit's module finishes, the
unit copies its shard and the full tensors are dropped. The RNG of the init device starts from
shard-rank 0's state on every rank, so all ranks draw the same values (as an eager model built
after the same ``torch.manual_seed`` would).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .device import get_rng_state, set_rng_state
from .param import ManagedParam


def _reset_fn(module: nn.Module) -> Callable[[], None] | None:
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def _materialise_direct(module: nn.Module, by_id: dict[int, ManagedParam], device: torch.device) -> bool:
    """Give the module's own meta params/buffers real storage; True if anything was meta."""
    touched = False
    with torch.no_grad():
        for param in list(module._parameters.values()):
            if param is None or not param.is_meta:
                continue
            managed = by_id[id(param)]
            fresh = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                 requires_grad=param.requires_grad)
            managed.set_on_module(fresh)  # all tied locations at once
            touched = True
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
                touched = True
    return touched


def sync_rng_from_rank0(device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Make every rank's init-device RNG equal the state of ``group``'s rank 0 (``None``: the
    default group), so all ranks init identically."""
    state = [get_rng_state(device).cpu()]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(state, src=src, group=group)
    set_rng_state(state[0], device)


def materialise(root: nn.Module, groups: list[list[ManagedParam]], unit_modules: list[nn.Module],
                device: torch.device, on_unit_ready: Callable[[int], None]) -> None:
    """Post-order walk; ``on_unit_ready(i)`` fires when unit i's subtree is materialised
    (the root group, index ``len(unit_modules)``, fires last)."""
    by_id = {p.orig_id: p for group in groups for p in group}
    unit_index = {id(m): i for i, m in enumerate(unit_modules)}
    visited: set = set()

    def visit(module: nn.Module, name: str) -> None:
        visited.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in visited:
                visit(child, f"{name}.{child_name}" if name else child_name)
        if _materialise_direct(module, by_id, device):
            reset = _reset_fn(module)
            if reset is None:
                raise ValueError(f"module {name or type(module).__qualname__!r} "
                                 f"({type(module).__qualname__}) has meta-device tensors but no "
                                 "reset_parameters() to initialise them (init_model_with_meta_device=True)")
            with torch.no_grad():
                reset()
        if id(module) in unit_index:
            on_unit_ready(unit_index[id(module)])

    visit(root, "")
    on_unit_ready(len(unit_modules))
