"""How torchrun-mode ranks reach each other without the process group: the rendezvous store
(where each rank runs is ``harness.torchrun.placement``).

The store is torchrun's own (the agent hosts it when ``TORCHELASTIC_USE_AGENT_STORE`` is set), or
else a TCPStore that rank 0 hosts on ``MASTER_ADDR:MASTER_PORT`` with multi-tenancy, exactly as
``init_process_group("env://")`` would create it, so a suite that initialises its own process group
later shares that server instead of failing to bind the port.
"""
from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

from harness import protocol

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
