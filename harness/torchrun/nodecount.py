"""torchrun mode: did the rendezvous form as many nodes as every rank was started for?

torchrun's c10d rendezvous lets agents that disagree meet: one started with ``--nnodes 3`` and one with
``--nnodes 2`` run together on 2 nodes without a word. Every rank posts the node counts it knows it
was started for (``harness.nodes.expected_node_counts``: ``HARNESS_NNODES``, ``PET_NNODES``, its agent's
``--nnodes``) before it reports its collection; once all have collected, every rank compares them with
the nodes the rendezvous formed (torchrun's ``GROUP_WORLD_SIZE``, else the nodes the ranks posted) and
all of them fail alike, naming both numbers and where each came from.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest

from harness import protocol
from harness.nodes import NodeCount, expected_node_counts

if TYPE_CHECKING:
    from torch.distributed import Store

    from harness.torchrun.placement import Placement


def key(rank: int) -> str:
    return f"nnodes/{rank}"


def own_expectation(environ: Mapping[str, str], agent_pid: int | None) -> dict[str, Any]:
    """What this rank posts: its expected counts, or the error reading one of them."""
    try:
        counts = expected_node_counts(environ, agent_pid)
    except pytest.UsageError as exc:
        return {"counts": [], "error": str(exc)}
    return {"counts": [[c.low, c.high, c.source] for c in counts], "error": None}


def post(store: Store, rank: int) -> None:
    protocol.put(store, key(rank), own_expectation(os.environ, os.getppid()))


def formed_nodes(environ: Mapping[str, str], placement: Placement, world_size: int) -> tuple[int, str]:
    """How many nodes the rendezvous formed, and how that is known."""
    value = environ.get("GROUP_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value), f"GROUP_WORLD_SIZE={value}"
    nodes = {p.node for r in range(world_size) if (p := placement.get(r)) is not None}
    return len(nodes), "the nodes the ranks reported"


def problems(posted: dict[int, dict[str, Any]], formed: int, placement: Placement) -> list[str]:
    """One line per distinct disagreement: which node (and ranks) expected what, from where."""
    seen: dict[str, list[int]] = {}
    for rank, entry in sorted(posted.items()):
        if entry.get("error"):
            seen.setdefault(entry["error"], []).append(rank)
        for low, high, source in entry.get("counts", []):
            count = NodeCount(low, high, source)
            if not count.admits(formed):
                seen.setdefault(f"started for {count.text()} ({source})", []).append(rank)
    lines = []
    for what, ranks in seen.items():
        where = placement.by_node(ranks)
        nodes = "; ".join(f"node {n} ({_host(placement, rs)}ranks {', '.join(map(str, rs))})" if n is not None
                          else f"ranks {', '.join(map(str, rs))}" for n, rs in where.items())
        lines.append(f"{nodes}: {what}")
    return lines


def _host(placement: Placement, ranks: list[int]) -> str:
    place = placement.get(ranks[0])
    return f"host {place.host}, " if place is not None else ""


def check(store: Store, placement: Placement, world_size: int) -> None:
    """After every rank collected: raise the same usage error on every rank when the node count the
    rendezvous formed is not what a rank was started for."""
    posted = {r: protocol.get(store, key(r)) for r in range(world_size) if store.check([key(r)])}
    formed, how = formed_nodes(os.environ, placement, world_size)
    lines = problems(posted, formed, placement)
    if lines:
        raise pytest.UsageError(
            f"torchrun mode: the rendezvous formed {formed} node(s) ({how}), but not every node was started for "
            "that many: " + " | ".join(lines) + ". torchrun's c10d rendezvous lets agents that disagree run "
            "together; start every node's torchrun with the same --nnodes (the Slurm templates pass "
            "--nnodes and HARNESS_NNODES from the allocation)")
