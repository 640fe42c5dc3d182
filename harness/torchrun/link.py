"""How torchrun-mode ranks reach each other without the process group: the rendezvous store, and
each rank's pid and host (to tell a dead rank from a slow one on the same node).

The store is torchrun's own (the agent hosts it when ``TORCHELASTIC_USE_AGENT_STORE`` is set), or
else a TCPStore that rank 0 hosts on ``MASTER_ADDR:MASTER_PORT`` with multi-tenancy, exactly as
``init_process_group("env://")`` would create it, so a suite that initialises its own process group
later shares that server instead of failing to bind the port.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import TYPE_CHECKING, Any

from harness import proc_tree, protocol

if TYPE_CHECKING:
    from torch.distributed import Store

STORE_TIMEOUT_S = 600.0


def connect_store(rank: int, world_size: int, host: bool) -> Store:
    """A new client of the rendezvous store, under this run attempt's harness prefix.

    ``host``: rank 0's first connection, which hosts the server when torchrun's agent does not.
    """
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    hosting = host and rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    # A client passes no world size: it would count itself among the workers a server waits for.
    base = dist.TCPStore(addr, port, world_size if hosting else None, hosting, timeout,
                         wait_for_workers=False, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{protocol.TORCHRUN_PREFIX}{attempt}/", base)


def publish_info(store: Store, rank: int) -> None:
    protocol.put(store, protocol.key_info(rank), {"pid": os.getpid(), "host": socket.gethostname()})


class Peers:
    """Every rank's pid and host, read from the store once each; tells which ranks' processes died.
    Used by one thread at a time (rank 0's main thread, or its watchdog once that took over)."""

    def __init__(self) -> None:
        self.host = socket.gethostname()
        self.info: dict[int, dict[str, Any]] = {}

    def gone(self, store: Store, ranks: list[int]) -> dict[int, int]:
        """Ranks among ``ranks`` on this host whose process no longer exists: rank -> pid."""
        out = {}
        for r in ranks:
            if r not in self.info and store.check([protocol.key_info(r)]):
                self.info[r] = protocol.get(store, protocol.key_info(r))
            info = self.info.get(r)
            if info is not None and info.get("host") == self.host and not proc_tree.alive(int(info["pid"])):
                out[r] = int(info["pid"])
        return out
