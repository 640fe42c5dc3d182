"""Wrap-time agreement: every rank must wrap the same model with the same configuration.

Ranks that wrap different models, or pass a different strategy, would otherwise issue different
collectives (different unit sizes, all-gathers on one rank and not on the other) and hang until
the backend's timeout. ``check_ranks_agree`` costs one small all-reduce over the world: each
item's value is hashed to a non-negative 62-bit int and the ranks MAX-reduce ``[h, -h]``, so
``max(h) != min(h)`` reveals an item that differs. Only when something differs do the ranks
gather the differing values (every rank is then in the same branch), so each rank raises the same
error naming the item and each rank's value.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .expert import is_expert_param

if TYPE_CHECKING:
    from .config import FSDPConfig
    from .parallel_dims import ParallelDims

_HASH_BITS = 62  # non-negative, and its negation fits int64 too


def digest(value: Any) -> int:
    """A hash of ``repr(value)`` that is the same in every process (``hash()`` is salted)."""
    raw = hashlib.sha256(repr(value).encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << _HASH_BITS) - 1)


def check_ranks_agree(items: Sequence[tuple[str, Any]], device: torch.device,
                      group: dist.ProcessGroup | None = None) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any item's value differs.

    ``items`` are ``(what, value)`` pairs in the same order on every rank; ``repr(value)`` must
    not depend on the rank (names, shapes, dtypes, ints). Lists of tuples (e.g. parameters) are
    compared element by element in the message.
    """
    hashes = [digest(value) for _, value in items]
    flags = torch.tensor(hashes + [-h for h in hashes], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    k = len(hashes)
    top = flags.tolist()
    differ = [i for i in range(k) if top[i] != -top[k + i]]
    if not differ:
        return
    mine = [items[i][1] for i in differ]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    lines = [_describe(items[i][0], [g[j] for g in gathered]) for j, i in enumerate(differ)]
    raise ValueError("fully_shard was called with different arguments or models on different ranks; "
                     "every rank must wrap the same model with the same configuration:\n  "
                     + "\n  ".join(lines))


def _by_value(per_rank: list[Any]) -> list[tuple[list[int], Any]]:
    """Group ranks that hold the same value, in order of first appearance."""
    groups: list[tuple[list[int], Any]] = []
    for rank, value in enumerate(per_rank):
        for ranks, seen in groups:
            if seen == value:
                ranks.append(rank)
                break
        else:
            groups.append(([rank], value))
    return groups


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _describe(what: str, per_rank: list[Any]) -> str:
    """``what`` and each distinct value with the ranks holding it; for lists, the first entry
    that differs (a parameter list is long, the first difference is what the user needs)."""
    if all(isinstance(v, list) for v in per_rank):
        longest = max(len(v) for v in per_rank)
        for index in range(longest):
            entries = [v[index] if index < len(v) else "<none>" for v in per_rank]
            if len({repr(e) for e in entries}) > 1:
                counts = ", ".join(f"{_ranks_text(r)}: {n}" for r, n in _by_value([len(v) for v in per_rank]))
                shown = "; ".join(f"{_ranks_text(r)}: {e}" for r, e in _by_value(entries))
                return f"{what} differ at entry {index} ({shown}); entries per rank: {counts}"
    shown = "; ".join(f"{_ranks_text(r)}: {v!r}" for r, v in _by_value(per_rank))
    return f"{what} differs ({shown})"


def agreement_items(module: nn.Module, mesh: DeviceMesh, classes: tuple[type, ...], config: FSDPConfig,
                    dims: ParallelDims, expert_dims: ParallelDims | None,
                    device: torch.device) -> list[tuple[str, Any]]:
    """What every rank must pass to ``fully_shard`` identically, as rank-independent values
    (names, not objects)."""
    params = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad,
               is_expert_param(name, p) and expert_dims is not None)
              for name, p in module.named_parameters()]

    def mesh_of(d: ParallelDims | None) -> Any:
        return None if d is None else (d.mesh.device_type, d.mesh.mesh.tolist(), d.mesh.mesh_dim_names,
                                       d.inner_mesh.mesh_dim_names, d.outer_group is not None,
                                       None if d.hybrid_group is None else dist.get_world_size(d.hybrid_group))

    strategy, outer = config.strategy, config.outer_strategy
    return [
        ("zero_dp_strategy", f"{strategy.name.lower()!r}/{int(strategy)}"),
        ("outer_dp_sharding_strategy", f"{outer.name.lower()!r}/{int(outer)}"),
        ("fsdp_unit_modules", tuple(f"{c.__module__}.{c.__qualname__}" for c in classes)),
        ("mixed_precision_policy", repr(config.mixed_precision_policy)),
        ("flags", dict(sorted(config.switches().items()))),
        ("unshard storage", repr(config.unshard)),
        ("offload_policy", repr(config.offload_policy)),
        ("device type", device.type),
        ("device_mesh", (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names)),
        ("(mesh, dp_shard_dim, dp_outer given, hybrid_fsdp_group size)", mesh_of(dims)),
        ("tp_dim", dims.tp_dim),
        ("expt_device_mesh (mesh, dp_shard_dim, dp_outer given, hybrid_fsdp_expt_group size)",
         mesh_of(expert_dims)),
        ("module class", f"{type(module).__module__}.{type(module).__qualname__}"),
        ("parameters (name, shape, dtype, requires_grad, expert)", params),
    ]
