"""Where each torchrun rank runs: its node (torchrun's ``GROUP_RANK``), host, local rank, pid and the
per-node directory of its log and spilled output.

Every rank posts its ``Place`` to the store at start (``info/<rank>``); rank 0 reads them into a
``Placement`` to name ranks in failures (``rank 3 (node 1, host b, local rank 1)`` once the job
spans several nodes) and to tell a dead process from a live one: a pid is only checked on the
rank's own node, since pids of other machines (or of another torchrun agent's namespace) mean
nothing here; other nodes' ranks are judged by their heartbeats (``harness.torchrun.liveness``).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from harness import proc_tree, protocol

if TYPE_CHECKING:
    from torch.distributed import Store


def node_index(rank: int) -> int:
    """This process's node: torchrun's ``GROUP_RANK`` (the agent's rank in the rendezvous), else the
    rank's block of ``LOCAL_WORLD_SIZE`` ranks."""
    group = os.environ.get("GROUP_RANK")
    if group is not None and group.isdigit():
        return int(group)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    return rank // local_world if local_world > 0 else 0


@dataclasses.dataclass(frozen=True)
class Place:
    """One rank's whereabouts, as it posted them."""

    rank: int
    local_rank: int
    node: int
    host: str
    pid: int
    node_dir: str = ""

    @classmethod
    def own(cls, rank: int, node_dir: str = "") -> Place:
        return cls(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")), node=node_index(rank),
                   host=socket.gethostname(), pid=os.getpid(), node_dir=node_dir)

    def log_path(self) -> str:
        return os.path.join(self.node_dir, f"rank{self.rank}.log") if self.node_dir else ""


def publish(store: Store, place: Place) -> None:
    protocol.put(store, protocol.key_info(place.rank), dataclasses.asdict(place))


class Placement:
    """Every rank's ``Place``, read from the store once each (rank 0). Thread-safe: the main thread
    and the watchdog (once it reports) both use it."""

    def __init__(self, own: Place) -> None:
        self.own = own
        self.places: dict[int, Place] = {own.rank: own}
        self._lock = threading.Lock()

    def update_own(self, own: Place) -> None:
        """This rank's place once its node directory is known."""
        with self._lock:
            self.own = own
            self.places[own.rank] = own

    def refresh(self, store: Store, ranks: list[int] | range) -> None:
        """Read the places of ``ranks`` that are posted by now and not read yet; never blocks."""
        with self._lock:
            missing = [r for r in ranks if r not in self.places]
        for r in missing:
            if store.check([protocol.key_info(r)]):
                data = protocol.get(store, protocol.key_info(r))
                known = {f.name for f in dataclasses.fields(Place)}
                with self._lock:
                    self.places[r] = Place(**{k: v for k, v in data.items() if k in known})

    def get(self, rank: int) -> Place | None:
        with self._lock:
            return self.places.get(rank)

    def multinode(self) -> bool:
        with self._lock:
            return len({p.node for p in self.places.values()}) > 1

    def label(self, rank: int) -> str:
        """``rank 3``, or ``rank 3 (node 1, host b, local rank 1)`` when the job spans several nodes."""
        place = self.get(rank)
        if place is None or not self.multinode():
            return f"rank {rank}"
        return f"rank {rank} (node {place.node}, host {place.host}, local rank {place.local_rank})"

    def where(self, rank: int) -> str:
        """One line: the rank's node, host, local rank, pid and its log file."""
        place = self.get(rank)
        if place is None:
            return f"rank {rank}: its place was never posted (it did not start)"
        log = f"; log and spilled output in {place.node_dir}" if place.node_dir else ""
        return (f"rank {rank}: node {place.node}, host {place.host}, local rank {place.local_rank}, "
                f"pid {place.pid}{log}")

    def gone(self, store: Store, ranks: list[int]) -> dict[int, int]:
        """Ranks among ``ranks`` on this rank's own node whose process no longer exists: rank -> pid."""
        self.refresh(store, ranks)
        out = {}
        for r in ranks:
            place = self.get(r)
            if place is not None and (place.host, place.node) == (self.own.host, self.own.node) \
                    and not proc_tree.alive(place.pid):
                out[r] = place.pid
        return out

    def by_node(self, ranks: list[int]) -> dict[int | None, list[int]]:
        """``ranks`` grouped by node (None: place unknown), in rank order."""
        out: dict[int | None, list[int]] = {}
        for r in sorted(ranks):
            place = self.get(r)
            out.setdefault(place.node if place else None, []).append(r)
        return out

    def node_ranks(self, node: int) -> list[int]:
        with self._lock:
            return sorted(r for r, p in self.places.items() if p.node == node)

    def to_json(self) -> dict[str, Any]:
        """For the sidecar: every rank's place, and each node's host and directory."""
        with self._lock:
            places = dict(self.places)
        nodes: dict[str, dict[str, Any]] = {}
        for r, p in sorted(places.items()):
            entry = nodes.setdefault(str(p.node), {"host": p.host, "dir": p.node_dir, "ranks": []})
            entry["ranks"].append(r)
        return {"ranks": {str(r): dataclasses.asdict(p) for r, p in sorted(places.items())}, "nodes": nodes}
