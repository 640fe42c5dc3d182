"""torchrun mode: ``torchrun --nproc-per-node N -m pytest ...`` (single node; multi-node by design).

Every rank runs the same pytest session. The process group is initialised once; distributed tests
whose world size equals WORLD_SIZE run on every rank, others skip with a reason naming both sizes;
single-process tests run on rank 0 only. Ranks meet per test through the rendezvous store (never
the process group): rank 0 announces each test, every rank posts its serialised reports, rank 0
combines them and is the only one that prints and writes JUnit.
"""
from __future__ import annotations

import datetime
import faulthandler
import hashlib
import os
import pathlib
import tempfile
import time
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from harness import backend as backend_mod
from harness import protocol
from harness.combine import ReportBuilder
from harness.context import RANK_STATE_KEY, DistEnv, RankState
from harness.outcome import Fault, TestOutcome, first_failed_rank
from harness.spec import SPEC_KEY, resolve_timeout
from harness.wait import Payloads, wait_for_answers

_WAIT_S = 600.0


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def quiet_non_zero_ranks(config: pytest.Config) -> None:
    """Before junitxml and the terminal reporter configure: only rank 0 reports."""
    if not is_rank0():
        config.option.xmlpath = None
        config.pluginmanager.set_blocked("terminalreporter")


class TorchrunSession:
    """Per-rank plugin under torchrun; rank 0 is the reporter."""

    def __init__(self, config: pytest.Config) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.config = config
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
        # Every rank must choose the same backend: NCCL only when each local rank has its own GPU
        # (4 ranks on a 2-GPU node run gloo on CPU instead of half of them waiting forever).
        use_cuda = torch.cuda.is_available() and not backend_mod.force_cpu(config) \
            and torch.cuda.device_count() >= local_world
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group(backend)
        self.store = dist.PrefixStore(protocol.TORCHRUN_PREFIX, c10d._get_default_store())
        self.store.set_timeout(datetime.timedelta(seconds=_WAIT_S))
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        env = DistEnv(rank=self.rank, world_size=self.world_size, local_rank=local_rank, device=device, backend=backend)
        self.state = RankState(env=env, session_shared_dir=self._shared_dir("session"))
        config.stash[RANK_STATE_KEY] = self.state
        self.seq = 0

    def _shared_dir(self, tag: str) -> pathlib.Path:
        """Rank 0 creates a directory and publishes its path; every rank gets the same path."""
        key = protocol.key_dir(tag)
        if self.rank == 0:
            protocol.put(self.store, key, tempfile.mkdtemp(prefix=f"harness-torchrun-{tag}-"))
        return pathlib.Path(protocol.get(self.store, key))

    # ----- collection ---------------------------------------------------------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        for item in items:
            spec = item.stash.get(SPEC_KEY, None)
            if spec is not None and spec.world_size != self.world_size:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs world_size={spec.world_size}, torchrun provides WORLD_SIZE={self.world_size}"))
            missing = backend_mod.missing_requirements(item, config, spec.world_size if spec else None)
            if missing:
                item.add_marker(pytest.mark.skip(reason="missing requirement(s): " + "; ".join(missing)))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Every rank must have collected the same items, in the same order."""
        ids = [item.nodeid for item in session.items]
        digest = hashlib.sha1("\n".join(ids).encode()).hexdigest()
        protocol.put(self.store, protocol.key_collected(self.rank), [len(ids), digest])
        seen = {r: tuple(protocol.get(self.store, protocol.key_collected(r))) for r in range(self.world_size)}
        if len(set(seen.values())) > 1:
            detail = ", ".join(f"rank {r}: {n} items ({d[:10]})" for r, (n, d) in seen.items())
            raise pytest.UsageError(f"torchrun mode: ranks collected different tests ({detail}); "
                                    "collection must be identical on every rank")

    # ----- running --------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        distributed = item.stash.get(SPEC_KEY, None) is not None and item.get_closest_marker("skip") is None
        if not distributed:
            return None if self.rank == 0 else True  # single-process tests and skips: rank 0 only
        seq = self.seq
        self.seq += 1
        go = self._announce(seq, item)
        if go["op"] == "stop":
            item.session.shouldstop = "torchrun mode: rank 0 stopped the session"
            return True
        self.state.shared_tmp = pathlib.Path(go["shared_tmp"])
        timeout = resolve_timeout(self.config, item.stash[SPEC_KEY], self.state.env.backend)
        faulthandler.dump_traceback_later(timeout, exit=False)
        if self.rank == 0:
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        try:
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
        finally:
            faulthandler.cancel_dump_traceback_later()
        hook = self.config.hook
        payload = {"rank": self.rank, "t": time.time(), "error": None,
                   "reports": [hook.pytest_report_to_serializable(config=self.config, report=r) for r in reports]}
        protocol.put(self.store, protocol.key_res(seq, self.rank), payload)
        if self.rank == 0:
            self._gather_and_report(item, seq, timeout)
        verdict = protocol.get(self.store, protocol.key_verdict(seq))
        if verdict.get("abort"):
            item.session.shouldstop = verdict["abort"]
        return True

    def _announce(self, seq: int, item: pytest.Item) -> dict[str, Any]:
        if self.rank == 0:
            go = {"op": "run", "shared_tmp": str(self._shared_dir(f"t{seq}"))} if not item.session.shouldstop \
                else {"op": "stop"}
            protocol.put(self.store, protocol.key_go(seq), go)
            return go
        return protocol.get(self.store, protocol.key_go(seq))

    def _gather_and_report(self, item: pytest.Item, seq: int, timeout: float) -> None:
        """Rank 0: wait for every rank's reports (timeout, grace), combine, log, publish the verdict."""
        start = time.monotonic()

        def collect(payloads: Payloads) -> bool:
            protocol.collect_answers(self.store, seq, range(self.world_size), payloads)
            return len(payloads) == self.world_size

        grace = float(self.config.getoption("harness_grace"))
        res = wait_for_answers(collect, start, timeout, grace)
        payloads = res.payloads
        pending = [r for r in range(self.world_size) if r not in payloads]
        fault: Fault | None = None
        if res.end == "grace_expired":
            fault = Fault("peer_failed", f"rank(s) {pending} did not finish within the {grace:g} s grace period "
                          "after a failure (probably blocked in a collective); the session stops",
                          first_failed_rank(payloads), [])
        elif res.end == "timed_out":
            fault = Fault("timeout", f"rank(s) {pending} exceeded the {timeout:g} s timeout (their stacks are in "
                          "their stderr, dumped by faulthandler); the session stops", first_failed_rank(payloads), [])
        outcome = TestOutcome(payloads, fault, time.monotonic() - start)
        for rep in ReportBuilder(item, self.world_size, outcome).build():
            item.ihook.pytest_runtest_logreport(report=rep)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        verdict = {"abort": f"torchrun mode: {fault.summary}"} if fault is not None else {}
        protocol.put(self.store, protocol.key_verdict(seq), verdict)

    # ----- end ------------------------------------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Release ranks still waiting for a test rank 0 will not run, then meet before exiting."""
        import torch.distributed as dist

        if self.rank == 0:
            protocol.put(self.store, protocol.key_go(self.seq), {"op": "stop"})
        self.store.add(protocol.KEY_END, 1)
        deadline = time.monotonic() + 60
        while int(self.store.add(protocol.KEY_END, 0)) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
        if dist.is_initialized():
            dist.destroy_process_group()
