"""One bucket: a TCPStore hosted by the controller plus N rank processes that run tests in order.

``Bucket.run_test`` sends one command and waits for every rank's answer, watching for the faults the
harness must report: a rank that dies, a test that exceeds its timeout, and a rank that failed while
its peers stay blocked (in a collective) past a short grace period.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import time
from typing import Any

from harness import procs as procs_mod
from harness import protocol
from harness.backend import Placement

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.01


@dataclasses.dataclass(frozen=True)
class BucketSetup:
    """Everything needed to start a bucket's ranks."""

    label: str
    world_size: int
    placement: Placement
    workdir: pathlib.Path
    rootdir: pathlib.Path
    pytest_args: tuple[str, ...]
    session_shared_dir: pathlib.Path
    startup_s: float
    grace_s: float
    harness_path: pathlib.Path


@dataclasses.dataclass
class Fault:
    """Why a test could not finish normally; ``sections`` are (title, text) pairs for the report."""

    kind: str  # "died", "timeout", "peer_failed"
    summary: str
    cause_rank: int | None
    sections: list[tuple[str, str]]


@dataclasses.dataclass
class TestOutcome:
    """Per-rank payloads that arrived, and the fault if the test did not finish on every rank."""

    payloads: dict[int, dict[str, Any]]
    fault: Fault | None
    duration: float


def payload_failed(payload: dict[str, Any]) -> bool:
    return bool(payload.get("error")) or any(r.get("outcome") == "failed" for r in payload.get("reports", []))


class Bucket:
    """Owns the store and rank processes of one bucket from start to teardown."""

    def __init__(self, setup: BucketSetup) -> None:
        import torch.distributed as dist

        self.setup = setup
        self.seq = 0
        self.alive = True
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.port = int(self.store.port)
        setup.workdir.mkdir(parents=True, exist_ok=True)
        self.ranks = [procs_mod.start_rank(r, setup.workdir, setup.rootdir, self._rank_env(r))
                      for r in range(setup.world_size)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.ranks]

    def _rank_env(self, rank: int) -> dict[str, str]:
        s = self.setup
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_XDIST_", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST", "TORCHELASTIC_"))}
        env.update({
            protocol.ENV_RANK_PROCESS: "1",
            protocol.ENV_STORE_HOST: "127.0.0.1",
            protocol.ENV_STORE_PORT: str(self.port),
            protocol.ENV_BACKEND: s.placement.backend,
            protocol.ENV_DEVICE_TYPE: s.placement.device_type,
            protocol.ENV_FAULT_FILE: str(s.workdir / f"rank{rank}.fault"),
            protocol.ENV_SESSION_SHARED: str(s.session_shared_dir),
            protocol.ENV_CONTROLLER_PID: str(os.getpid()),
            protocol.ENV_PYTEST_ARGS: protocol.encode(list(s.pytest_args) + ["--basetemp", str(s.workdir / f"rank{rank}-tmp")]).decode(),
            protocol.ENV_BUCKET: s.label,
            "RANK": str(rank), "WORLD_SIZE": str(s.world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(s.world_size), "GROUP_RANK": "0", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(s.harness_path)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]),
        })
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        if s.placement.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = procs_mod.gpu_env(s.placement.gpu_ids[rank])
        return env

    def run_test(self, nodeid: str, next_nodeid: str | None, shared_tmp: pathlib.Path, timeout_s: float) -> TestOutcome:
        """Run one test on every rank and wait for all answers or a fault."""
        seq = self.seq
        self.seq += 1
        budget = timeout_s + (self.setup.startup_s if seq == 0 else 0.0)
        offsets = {p.rank: p.fault_size() for p in self.ranks}
        start = time.monotonic()
        self.store.set(protocol.key_cmd(seq), protocol.encode(
            {"op": "run", "nodeid": nodeid, "next": next_nodeid, "shared_tmp": str(shared_tmp)}))
        payloads: dict[int, dict[str, Any]] = {}
        first_failure: float | None = None
        pause = _POLL_MIN_S
        while True:
            if self.store.check([protocol.key_all(seq)]):
                self._collect(seq, payloads)
                return TestOutcome(payloads, None, time.monotonic() - start)
            dead = [p for p in self.ranks if not p.alive()]
            if dead:
                self._collect(seq, payloads)
                return TestOutcome(payloads, self._died(dead, offsets), time.monotonic() - start)
            self._collect(seq, payloads)
            now = time.monotonic()
            if first_failure is None and any(payload_failed(p) for p in payloads.values()):
                first_failure = now
            if first_failure is not None and now - first_failure > self.setup.grace_s:
                return TestOutcome(payloads, self._peer_failed(payloads), now - start)
            if now - start > budget:
                return TestOutcome(payloads, self._timed_out(budget, seq == 0), now - start)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _collect(self, seq: int, payloads: dict[int, dict[str, Any]]) -> None:
        for p in self.ranks:
            key = protocol.key_res(seq, p.rank)
            if p.rank not in payloads and self.store.check([key]):
                payloads[p.rank] = protocol.decode(self.store.get(key))

    def _died(self, dead: list[procs_mod.RankProcess], offsets: dict[int, int]) -> Fault:
        time.sleep(0.2)  # let a crash cascade settle so every dead rank is named
        dead = [p for p in self.ranks if not p.alive()]
        sections = []
        for p in dead:
            stack = p.fault_text(offsets[p.rank]).strip()
            if not stack:
                stack = ("no Python stack available: the process was killed by a signal that cannot be "
                         "intercepted (SIGKILL), so faulthandler could not run") if "SIGKILL" in p.describe_exit() \
                    else "no Python stack was written"
            sections.append((f"rank {p.rank} Python stack (faulthandler)", stack))
            sections.append((f"rank {p.rank} last output lines", p.log_tail()))
        names = ", ".join(f"rank {p.rank} {p.describe_exit()}" for p in dead)
        return Fault("died", f"rank process died: {names}", dead[0].rank, sections)

    def _peer_failed(self, payloads: dict[int, dict[str, Any]]) -> Fault:
        failed = sorted((p.get("t", 0.0), r) for r, p in payloads.items() if payload_failed(p))
        cause = failed[0][1]
        pending = [p.rank for p in self.ranks if p.rank not in payloads]
        before = procs_mod.dump_stacks([p for p in self.ranks if p.rank in pending], protocol_dump_signal())
        sections = [(f"rank {r} stack while blocked", self.ranks[r].fault_text(before[r]).strip()) for r in pending]
        summary = (f"rank {cause} failed first; rank(s) {pending} did not finish within the "
                   f"{self.setup.grace_s:g} s grace period (probably blocked in a collective); bucket torn down")
        return Fault("peer_failed", summary, cause, sections)

    def _timed_out(self, budget: float, first: bool) -> Fault:
        before = procs_mod.dump_stacks(self.ranks, protocol_dump_signal())
        sections = []
        for p in self.ranks:
            sections.append((f"rank {p.rank} stack at timeout", p.fault_text(before[p.rank]).strip() or "(no dump)"))
            sections.append((f"rank {p.rank} last output lines", p.log_tail()))
        extra = " (including the bucket start-up allowance)" if first else ""
        return Fault("timeout", f"test exceeded its timeout of {budget:g} s{extra}; stacks of every rank follow", None, sections)

    def close(self, graceful: bool) -> None:
        """Stop the ranks (politely when ``graceful``) and reap them; idempotent."""
        if not self.alive:
            return
        self.alive = False
        if graceful:
            try:
                self.store.set(protocol.key_cmd(self.seq), protocol.encode({"op": "stop"}))
            except Exception:
                graceful = False
        procs_mod.reap(self.ranks, graceful_s=15.0 if graceful else 0.0)
        del self.store


def protocol_dump_signal() -> int:
    from harness.rank_faults import DUMP_SIGNAL

    return int(DUMP_SIGNAL)
