"""The rank-side pytest plugin: run exactly the tests the controller names, in its order.

Each rank process runs its own in-process pytest session over the bucket's files, so parametrisation,
fixtures, skips and xfail resolve naturally; this plugin replaces the run loop with a loop that takes
commands from the controller's TCPStore and posts each test's serialised reports back.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

from harness import payload as payload_mod
from harness import protocol
from harness.context import RANK_STATE_KEY, RankState
from harness.rank_guard import RankGuard

if TYPE_CHECKING:
    from torch.distributed import Store


class RankSession:
    """Registered in each rank's pytest session; owns the command loop."""

    def __init__(self, store: Store, state: RankState) -> None:
        self.store = store
        self.state = state
        self.rank = state.env.rank
        self.world_size = state.env.world_size
        self.reports: list[pytest.TestReport] | None = None
        self.config: pytest.Config | None = None
        self.spill_dir = pathlib.Path(os.environ.get(protocol.ENV_SPILL_DIR, f"harness-rank{self.rank}-output"))
        self.guard = RankGuard(default_group=_default_group)

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        self.config = config
        config.stash[RANK_STATE_KEY] = self.state
        config.pluginmanager.register(self.guard, "fsdp_harness_rank_guard")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.reports is not None:
            self.reports.append(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        items = {item.nodeid: item for item in session.items}
        self.store.add(protocol.KEY_READY, 1)
        seq = 0
        while True:
            cmd = protocol.get(self.store, protocol.key_cmd(seq))
            if cmd["op"] == "stop":
                break
            self._run_one(items, cmd, seq)
            seq += 1
        return True

    def _run_one(self, items: dict[str, pytest.Item], cmd: dict[str, Any], seq: int) -> None:
        """Run one item through pytest's own protocol and post the reports."""
        assert self.config is not None
        nodeid = cmd["nodeid"]
        item = items.get(nodeid)
        print(f"[harness] rank {self.rank}: start {nodeid}", flush=True)
        payload: dict[str, Any] = {"rank": self.rank, "reports": [], "error": None}
        if item is None:
            payload["error"] = f"rank {self.rank} did not collect {nodeid!r} (collected {len(items)} items)"
        else:
            self.state.shared_tmp = pathlib.Path(cmd["shared_tmp"])
            nextitem = items.get(cmd["next"]) if cmd.get("next") else None
            self.reports = []
            self.guard.before_test()
            try:
                item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            finally:
                reports, self.reports = self.reports, None
            payload["state_changes"], payload["restart"] = self.guard.after_test()
            spiller = payload_mod.Spiller(self.spill_dir, f"{seq:05d}-{item.name}")
            payload["reports"] = payload_mod.serialize_reports(self.config, reports, spiller)
        payload["t"] = time.time()
        sys.stdout.flush()
        sys.stderr.flush()
        payload = payload_mod.fit(payload, lambda size: (
            f"rank {self.rank}: the reports of {nodeid} are {size} bytes even with captured output spilled to "
            f"{self.spill_dir}; the store holds at most {payload_mod.PAYLOAD_LIMIT} (record_property values?)"))
        protocol.put(self.store, protocol.key_res(seq, self.rank), payload)
        if self.store.add(protocol.key_done(seq), 1) == self.world_size:
            self.store.set(protocol.key_all(seq), "1")


def _default_group() -> object | None:
    """The default process group object, None when there is none."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None
