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

from harness import numerics, protocol
from harness.backend import Placement
from harness.outcome import Fault, TestOutcome, first_failed_rank
from harness.spawn import procs as procs_mod
from harness.spawn.rank_faults import DUMP_SIGNAL
from harness.wait import Payloads, wait_for_answers


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
    pinned_numerics: bool = False  # the ranks start with harness.numerics.PINNED_ENV


def thread_env(env: dict[str, str], world_size: int) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` for the ranks of a multi-rank bucket unless the user set it, as torchrun
    does: each rank's intra-op pool otherwise starts one spinning thread per core, and N ranks on a
    small CPU box oversubscribe it many times (a 4-rank CPU test took 20x longer)."""
    if world_size > 1 and "OMP_NUM_THREADS" not in env:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def _path_entries(value: str) -> list[str]:
    """The non-empty entries of a PATH-like variable."""
    return [p for p in value.split(os.pathsep) if p]


class Bucket:
    """Owns the store and rank processes of one bucket from start to teardown."""

    def __init__(self, setup: BucketSetup) -> None:
        import torch.distributed as dist

        self.setup = setup
        self.seq = 0
        self.alive = True
        self.ready = False
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.port = int(self.store.port)
        setup.workdir.mkdir(parents=True, exist_ok=True)
        self.ranks = [procs_mod.start_rank(r, setup.workdir, setup.rootdir, self._rank_env(r))
                      for r in range(setup.world_size)]

    def _rank_env(self, rank: int) -> dict[str, str]:
        s = self.setup
        rank_args = [*s.pytest_args, "--basetemp", str(s.workdir / f"rank{rank}-tmp")]
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
            protocol.ENV_PYTEST_ARGS: protocol.encode(rank_args),
            protocol.ENV_BUCKET: s.label,
            protocol.ENV_SPILL_DIR: str(s.workdir / f"rank{rank}-output"),
            "RANK": str(rank), "WORLD_SIZE": str(s.world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(s.world_size), "GROUP_RANK": "0", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(s.harness_path), *_path_entries(env.get("PYTHONPATH", ""))]),
        })
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        env.update(thread_env(env, s.world_size))
        if s.pinned_numerics:
            env.update(numerics.rank_env())
        else:
            env.pop(numerics.ENV_MODE, None)
        if s.placement.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = procs_mod.gpu_env(s.placement.gpu_ids[rank])
        return env

    def run_test(self, nodeid: str, next_nodeid: str | None, shared_tmp: pathlib.Path, timeout_s: float) -> TestOutcome:
        """Run one test on every rank and wait for all answers or a fault.

        The test's timeout counts from the command; the ranks' start-up has its own allowance
        (``startup_s``), measured until every rank reported ready.
        """
        offsets = {p.rank: p.fault_size() for p in self.ranks}
        start = time.monotonic()
        if not self.ready:
            startup_fault = self._wait_ready(offsets)
            if startup_fault is not None:
                return TestOutcome({}, startup_fault, time.monotonic() - start)
            start = time.monotonic()
        seq = self.seq
        self.seq += 1
        protocol.put(self.store, protocol.key_cmd(seq),
                     {"op": "run", "nodeid": nodeid, "next": next_nodeid, "shared_tmp": str(shared_tmp)})

        def collect(payloads: Payloads) -> bool:
            answered = self.store.check([protocol.key_all(seq)])
            protocol.collect_answers(self.store, seq, range(self.setup.world_size), payloads)
            return answered

        res = wait_for_answers(collect, start, timeout_s, self.setup.grace_s, stopped=self._any_dead)
        if res.end == "stopped":  # the report's duration includes collecting the dead ranks' stacks
            return TestOutcome(res.payloads, self._died(offsets), time.monotonic() - start)
        fault: Fault | None = None
        if res.end == "grace_expired":
            fault = self._peer_failed(res.payloads)
        elif res.end == "timed_out":
            fault = self._timed_out(f"test exceeded its timeout of {timeout_s:g} s; stacks of every rank follow")
        return TestOutcome(res.payloads, fault, res.at - start)

    def _any_dead(self) -> bool:
        return any(not p.alive() for p in self.ranks)

    def _wait_ready(self, offsets: dict[int, int]) -> Fault | None:
        """Wait until every rank joined the process group and collected; a fault if one died or was late."""
        def collect(payloads: Payloads) -> bool:
            return int(self.store.add(protocol.KEY_READY, 0)) >= self.setup.world_size

        res = wait_for_answers(collect, time.monotonic(), self.setup.startup_s, self.setup.grace_s,
                               stopped=self._any_dead)
        if res.end == "answered":
            self.ready = True
            return None
        if res.end == "stopped":
            return self._died(offsets)
        return self._timed_out(f"the bucket's ranks did not start (join the process group and collect) within the "
                               f"{self.setup.startup_s:g} s start-up allowance; stacks of every rank follow")

    def _died(self, offsets: dict[int, int]) -> Fault:
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

    def _peer_failed(self, payloads: Payloads) -> Fault:
        cause = first_failed_rank(payloads)
        pending = [p.rank for p in self.ranks if p.rank not in payloads]
        before = procs_mod.dump_stacks([p for p in self.ranks if p.rank in pending], int(DUMP_SIGNAL))
        sections = [(f"rank {r} stack while blocked", self.ranks[r].fault_text(before[r]).strip()) for r in pending]
        summary = (f"rank {cause} failed first; rank(s) {pending} did not finish within the "
                   f"{self.setup.grace_s:g} s grace period (probably blocked in a collective); bucket torn down")
        return Fault("peer_failed", summary, cause, sections)

    def _timed_out(self, summary: str) -> Fault:
        before = procs_mod.dump_stacks(self.ranks, int(DUMP_SIGNAL))
        sections = []
        for p in self.ranks:
            sections.append((f"rank {p.rank} stack at timeout", p.fault_text(before[p.rank]).strip() or "(no dump)"))
            sections.append((f"rank {p.rank} last output lines", p.log_tail()))
        return Fault("timeout", summary, None, sections)

    def close(self, graceful: bool) -> None:
        """Stop the ranks (politely when ``graceful``) and reap them; idempotent."""
        if not self.alive:
            return
        self.alive = False
        if graceful:
            try:
                protocol.put(self.store, protocol.key_cmd(self.seq), {"op": "stop"})
            except Exception:
                graceful = False
        procs_mod.reap(self.ranks, graceful_s=15.0 if graceful else 0.0)
        del self.store

