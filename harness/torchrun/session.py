"""torchrun mode: ``torchrun --nproc-per-node N -m pytest ...`` (single node; multi-node by design).

Every rank runs the same pytest session and every test in the same order, as plain pytest under
torchrun does, but in lockstep: a rank starts a test only when rank 0 announces it (``go/<seq>``),
and rank 0 announces it only after every rank answered the previous one, so a test that failed early
on one rank never pairs its collectives with the next test's. Ranks meet through the rendezvous store
(``harness.torchrun.link``), never the process group; rank 0 alone merges the answers into one
outcome per test, prints and writes JUnit (``harness.torchrun.reporter``).

The harness does not initialise the default process group for unmarked tests: they see what plain
pytest would, so a suite whose ``setup_class`` calls ``init_process_group`` itself works unchanged.
A ``@pytest.mark.distributed`` test (whose world size must equal WORLD_SIZE, else it skips) finds
one initialised: the suite's own if there is one, else one the harness creates (NCCL with a GPU per
local rank, else gloo) and destroys again before the next unmarked test.

Between tests every rank destroys the gloo process groups the previous tests left behind and nothing
can reach any more, as rank 0 decided from every rank's survey (``harness.torchrun.groups``); before
the first test every rank checks that the rendezvous formed as many nodes as it was started for
(``harness.torchrun.nodecount``).

Faults: a test that exceeds its timeout on any rank, or whose ranks stay blocked past the grace
period after one failed, fails with every rank's stacks and ends the session; so does SIGTERM
(torchrun stops all ranks when one exits with an error, e.g. a crash, and so does a cancelled job).
Rank 0 reports even when its own main thread is stuck (``harness.torchrun.watchdog``); a rank still
stuck in a test exits once rank 0 has written its results.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import threading
import time
from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from harness import backend as backend_mod
from harness import payload as payload_mod
from harness import proc_tree, protocol
from harness.context import RANK_STATE_KEY, DistEnv, RankState
from harness.nodes import ENV_SHARED_DIR, PLACEMENT_KEY
from harness.outcome import payload_failed
from harness.rank_guard import RankGuard
from harness.spec import SPEC_KEY, resolve_startup_timeout, resolve_timeout
from harness.torchrun import dirs, ending, groups, link, nodecount
from harness.torchrun.groups import GroupJanitor
from harness.torchrun.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S, Liveness
from harness.torchrun.placement import Place, Placement, publish
from harness.torchrun.reporter import Reporter
from harness.torchrun.state import Phase, Running, TakeOver
from harness.torchrun.watchdog import (
    SIGTERM_WAIT_S,
    RankWatchdog,
    SignalPipe,
    end_process,
    keep_real_stderr,
    log_to,
    say,
)

JUNIT_PATH_KEY = pytest.StashKey[str | None]()
KEPT_GROUPS_WARN = 64  # gloo groups still referenced after a test, on one rank, before a warning
END_WAIT_S = 10.0
FINAL_WAIT_OTHERS_S = 120.0


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def quiet_non_zero_ranks(config: pytest.Config) -> None:
    """Before junitxml and the terminal reporter configure: only rank 0 reports."""
    config.stash[JUNIT_PATH_KEY] = config.option.xmlpath
    if not is_rank0():
        config.option.xmlpath = None
        config.pluginmanager.set_blocked("terminalreporter")


def _span(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``0-3``; otherwise the list."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _park() -> None:
    """The watchdog took over this rank; it ends the process. Never return."""
    threading.Event().wait()


class TorchrunSession:
    """Per-rank plugin under torchrun; rank 0 is the reporter."""

    def __init__(self, config: pytest.Config) -> None:
        import torch

        self.config = config
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.world_size)))
        # Every rank must choose the same backend: NCCL only when each local rank has its own GPU.
        self.use_cuda = torch.cuda.is_available() and not backend_mod.force_cpu(config) \
            and torch.cuda.device_count() >= local_world
        self.backend = "nccl" if self.use_cuda else "gloo"
        proc_tree.become_subreaper()
        keep_real_stderr()
        self.store = link.connect_store(self.rank, self.world_size, host=True)
        self.watch_store = link.connect_store(self.rank, self.world_size, host=False)
        self.placement = Placement(Place.own(self.rank))
        timeout = config.getoption("harness_heartbeat_timeout", None) or DEFAULT_HEARTBEAT_TIMEOUT_S
        self.liveness = Liveness(self.world_size, float(timeout))
        self.log: dirs.RankLog | None = None
        self.node_dir: pathlib.Path | None = None
        self.lock = threading.Lock()
        self.phase = Phase.IDLE
        self.running: Running | None = None
        self.seq = 0
        self.own_group: object | None = None
        self.pytest_session: pytest.Session | None = None
        self.state: RankState | None = None
        self.guard = RankGuard()
        self.janitor = GroupJanitor()
        self.hard_exit = ending.HardExit()
        self._warned_kept = False
        self.release_next: list[str] = []  # rank 0: groups every rank destroys before the next test
        config.pluginmanager.register(self.guard, "fsdp_harness_rank_guard")
        self.reporter = Reporter(self) if self.rank == 0 else None
        self.watchdog = RankWatchdog(self.rank, self.watch_store, SignalPipe(), lambda: self.phase,
                                     self.running_output, self.reporter.judge if self.reporter else None,
                                     self.on_sigterm)
        self.watchdog.start()

    # ----- state shared with the watchdog ---------------------------------------------------------
    def in_watchdog(self) -> bool:
        return threading.current_thread() is self.watchdog.thread

    def abandoned(self) -> bool:
        return self.phase == Phase.ABANDONED

    def enter(self, phase: Phase, running: Running | None = None) -> None:
        """Main thread: move to ``phase``; park for good if the watchdog has taken over."""
        with self.lock:
            self.park_if_abandoned(locked=True)
            self.phase = phase
            self.running = running if phase == Phase.RUNNING else self.running

    def park_if_abandoned(self, locked: bool = False) -> None:
        if self.phase == Phase.ABANDONED and not self.in_watchdog():
            if locked:
                self.lock.release()
            _park()

    def running_test(self) -> Running | None:
        """The test rank 0's main thread is inside, None when it is elsewhere."""
        with self.lock:
            return self.running if self.phase == Phase.RUNNING else None

    def running_output(self, was_running: bool = False) -> str:
        """What the running test printed so far on this rank (taken from pytest's capture)."""
        capman = self.config.pluginmanager.getplugin("capturemanager")
        if capman is None or not (was_running or self.phase == Phase.RUNNING):
            return ""
        out, err = capman.read_global_capture()
        return "\n".join(s for s in (out, err) if s)[-16384:]

    def take_over(self, kind: TakeOver) -> None:
        """Rank 0's watchdog: report in place of the main thread and end the session (``kind``:
        timeout, peer_failed, terminated). Nothing to do while the main thread is finishing."""
        assert self.reporter is not None
        with self.lock:
            if self.phase in (Phase.FINISHING, Phase.ABANDONED):
                return
            was_running = self.phase == Phase.RUNNING
            run = self.running if self.phase in (Phase.RUNNING, Phase.WAITING) else None
            self.phase = Phase.ABANDONED
        own_output = ""
        if was_running:
            try:
                own_output = self.running_output(was_running=True)
            except Exception as exc:
                own_output = f"(could not read the captured output: {exc!r})"
        self.reporter.emergency(kind, run, own_output)

    def on_sigterm(self) -> None:
        """SIGTERM: rank 0 reports and ends; another rank keeps answering stack requests until rank 0
        is done (or a few seconds passed), then ends."""
        if self.rank == 0:
            self.take_over(TakeOver.TERMINATED)
            return
        finished = self.watchdog.serve_until_final(SIGTERM_WAIT_S,
                                                   give_up=lambda: bool(self.placement.gone(self.watch_store, [0])))
        if not finished and self.rank == 1:
            self._note_rank0_gone()
        end_process(128 + 15, f"rank {self.rank}: SIGTERM")

    def _note_rank0_gone(self) -> None:
        """Rank 1 says what rank 0, when it died, could not: which test, and where results are."""
        gone = self.placement.gone(self.watch_store, [0])
        if not gone:
            return
        run = self.running
        where = self.config.stash.get(JUNIT_PATH_KEY, None)
        say(f"rank 0 (pid {gone[0]}) died during {run.item.nodeid if run else 'the session'}; torchrun reports "
            "its exit status, its stderr has its stack"
            + (f"; {where} holds the results of the tests it finished before" if where else ""))

    # ----- session start and collection -----------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """The session and node directories, this rank's log and place, and what ``dist_env`` returns."""
        self.pytest_session = session
        shared = self.config.getoption("harness_shared_dir", None) or os.environ.get(ENV_SHARED_DIR) or None
        session_info = dirs.make_session_dir(self.config, self.store, self.rank, shared)
        own = self.placement.own
        node = dirs.make_node_dir(self.store, own.node, own.local_rank, own.host, session_info)
        own = dataclasses.replace(own, node_dir=node["path"])
        self.placement.update_own(own)
        self.node_dir = pathlib.Path(node["path"])
        self.log = dirs.RankLog(self.node_dir / f"rank{self.rank}.log")
        log_to(self.log)
        self.log.write(f"{self.placement.where(self.rank)}; world size {self.world_size}, session directory "
                       f"{session_info['path']}" + ("" if node["shared"] else " (not visible from this node)"))
        publish(self.store, own)
        import torch

        device = torch.device("cuda", self.local_rank) if self.use_cuda else torch.device("cpu")
        env = DistEnv(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank, device=device,
                      backend=self.backend)
        unshared = None if node["shared"] else (
            f"rank {self.rank} (node {own.node}, host {own.host}) cannot see the session directory "
            f"{session_info['path']} that rank 0 created on its node, so a directory shared by every rank "
            f"does not exist; give --harness-shared-dir (env {ENV_SHARED_DIR}) on a filesystem every node mounts")
        self.state = RankState(env=env, session_shared_dir=pathlib.Path(session_info["path"]), unshared_reason=unshared)
        self.config.stash[RANK_STATE_KEY] = self.state

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
        nodecount.post(self.store, self.rank)
        protocol.put(self.store, protocol.key_collected(self.rank), [len(ids), digest])
        self._wait_for_collection()
        nodecount.check(self.store, self.placement, self.world_size)
        seen = {r: tuple(protocol.get(self.store, protocol.key_collected(r))) for r in range(self.world_size)}
        if len(set(seen.values())) > 1:
            detail = ", ".join(f"rank {r}: {n} items ({d[:10]})" for r, (n, d) in seen.items())
            raise pytest.UsageError(f"torchrun mode: ranks collected different tests ({detail}); "
                                    "collection must be identical on every rank")

    def _wait_for_collection(self) -> None:
        """Every rank must have collected within ``--harness-startup-timeout`` (counted from here):
        a rank that never starts pytest, e.g. a node whose ranks fail at import, is named."""
        limit = resolve_startup_timeout(self.config, self.backend)
        deadline = time.monotonic() + limit
        missing = list(range(self.world_size))
        while missing:
            missing = [r for r in missing if not self.store.check([protocol.key_collected(r)])]
            if not missing:
                break
            if time.monotonic() > deadline:
                self.placement.refresh(self.store, missing)
                names = "; ".join(self.placement.where(r) for r in missing)
                raise pytest.UsageError(f"torchrun mode: rank(s) {missing} did not finish collecting within "
                                        f"{limit:g} s of this rank (--harness-startup-timeout): {names}")
            time.sleep(0.05)
        self.placement.refresh(self.store, range(self.world_size))

    # ----- running --------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        seq = self.seq
        self.seq += 1
        go = self._announce(seq, item)
        if go["op"] == "stop":
            item.session.shouldstop = item.session.shouldstop or "torchrun mode: rank 0 stopped the session"
            return True
        assert self.state is not None
        self.state.shared_tmp = pathlib.Path(go["shared_tmp"]) if go.get("shared_tmp") else None
        self._release_groups(go.get("release_groups") or [], seq)
        self._prepare_group(item, seq)
        spec = item.stash.get(SPEC_KEY, None)
        run = Running(seq, item, time.monotonic(), resolve_timeout(self.config, spec, self.backend))
        if self.rank == 0:
            item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        self._log(f"test {seq} starts: {item.nodeid}")
        self.enter(Phase.RUNNING, run)
        self.guard.before_test()
        own_properties = list(item.user_properties)
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        item.user_properties[:] = own_properties  # what the run recorded travels in this rank's reports
        changes, _ = self.guard.after_test()
        self.enter(Phase.WAITING)
        outcome = next((r.outcome for r in reports if r.failed), None) or \
            next((r.outcome for r in reports if r.skipped), "passed")
        self._log(f"test {seq} {outcome} on this rank in {time.monotonic() - run.start:.2f} s")
        self._answer(run, reports, changes, self._survey_groups())
        if self.reporter is not None:
            self.reporter.gather(run)
        self.enter(Phase.IDLE)
        return True

    def _announce(self, seq: int, item: pytest.Item) -> dict[str, Any]:
        """Rank 0 says whether test ``seq`` runs (and its shared directory); the others wait for it."""
        key = protocol.key_go(seq)
        if self.rank != 0:
            self.enter(Phase.WAITING)
            self._wait_for(key)
            return protocol.get(self.store, key)
        go: dict[str, Any] = {"op": "stop" if item.session.shouldstop or item.session.shouldfail else "run"}
        if go["op"] == "run" and self.release_next:
            go["release_groups"] = self.release_next
        self.release_next = []
        if go["op"] == "run" and "shared_tmp_path" in getattr(item, "fixturenames", ()):
            assert self.state is not None
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)[-60:]
            shared = self.state.session_shared_dir / "shared" / f"{seq:05d}-{name}"
            shared.mkdir(parents=True)
            go["shared_tmp"] = str(shared)
        protocol.put(self.store, key, go)
        return go

    def _wait_for(self, key: str) -> None:
        """Block until ``key`` is set, however long rank 0's part of the previous test takes."""
        import datetime

        import torch.distributed as dist

        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=5))
                return
            except dist.DistStoreError:  # a timeout of this round only; a lost store raises DistNetworkError
                continue

    def _prepare_group(self, item: pytest.Item, seq: int) -> None:
        """A distributed test finds a default process group; an unmarked one finds none of ours."""
        import torch
        import torch.distributed as dist

        if item.stash.get(SPEC_KEY, None) is not None and item.get_closest_marker("skip") is None:
            if not dist.is_initialized():
                if self.use_cuda:
                    torch.cuda.set_device(self.local_rank)
                dist.init_process_group(self.backend, store=dist.PrefixStore(f"pg/{seq}/", self.store),
                                        rank=self.rank, world_size=self.world_size)
                self.own_group = dist.group.WORLD
        elif self.own_group is not None:
            self._release_group()

    def _release_group(self) -> None:
        """Destroy the harness's own default group and free it now (``groups.free_destroyed``)."""
        import torch.distributed as dist

        if self.own_group is not None and dist.is_initialized() and dist.group.WORLD is self.own_group:
            self.own_group = None
            dist.destroy_process_group()
            groups.free_destroyed()
        self.own_group = None

    def _survey_groups(self) -> dict[str, list[str]]:
        """The gloo process groups this rank holds after a test, orphaned or kept (``groups``)."""
        try:
            survey = self.janitor.survey()
        except Exception as exc:  # never fail a test over it: nothing is released then
            self._log(f"surveying process groups failed: {exc!r}")
            return {"orphaned": [], "kept": []}
        if len(survey["kept"]) > KEPT_GROUPS_WARN and not self._warned_kept:
            self._warned_kept = True
            say(f"rank {self.rank}: the tests keep {len(survey['kept'])} gloo process groups referenced (each "
                "has a thread that wakes every 10 ms); on few cores many of them starve every rank")
        return survey

    def _release_groups(self, names: list[str], seq: int) -> None:
        """Destroy the groups earlier tests left behind, as rank 0 decided (every rank the same ones)."""
        if not names:
            return
        done = self.janitor.release(names)
        shown = ", ".join(done[:8]) + (", ..." if len(done) > 8 else "")
        self._log(f"before test {seq}: destroyed {len(done)} process group(s) earlier tests left behind"
                  + (f" ({shown})" if done else ""))

    def _answer(self, run: Running, reports: list[pytest.TestReport], changes: list[str],
                groups: dict[str, list[str]]) -> None:
        assert self.state is not None
        spill_dir = (self.node_dir or self.state.session_shared_dir) / f"rank{self.rank}-output"
        host = self.placement.own.host if self.placement.multinode() else None
        spiller = payload_mod.Spiller(spill_dir, f"{run.seq:05d}-{run.item.name}", host=host)
        payload: dict[str, Any] = {
            "rank": self.rank, "t": time.time(), "error": None, "state_changes": changes, "groups": groups,
            "reports": payload_mod.serialize_reports(self.config, reports, spiller)}
        payload = payload_mod.fit(payload, lambda size: (
            f"rank {self.rank}: the reports of {run.item.nodeid} are {size} bytes even with captured output "
            f"spilled to {spill_dir}; the store holds at most {payload_mod.PAYLOAD_LIMIT}"))
        protocol.put(self.store, protocol.key_res(run.seq, self.rank), payload)
        if payload_failed(payload):
            self.store.add(protocol.key_failed(run.seq), 1)

    def _log(self, message: str) -> None:
        if self.log is not None:
            self.log.write(message)

    # ----- end ------------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Release ranks waiting for a test rank 0 will not run; count this rank as finished."""
        if not self.in_watchdog():
            self.enter(Phase.FINISHING)
        if self.rank == 0:
            protocol.put(self.store if not self.in_watchdog() else self.watch_store,
                         protocol.key_go(self.seq), {"op": "stop"})
            self.config.stash[PLACEMENT_KEY] = dict(self.placement.to_json(), junit_host=self.placement.own.host,
                                                    junit_node=self.placement.own.node)
            return
        self.store.add(protocol.KEY_END, 1)
        if session.exitstatus in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.INTERRUPTED):
            # Rank 0's outcome covers this rank's failures; exiting with an error first would make
            # torchrun stop rank 0 before it wrote JUnit, and name this rank as the failure.
            session.exitstatus = pytest.ExitCode.OK

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Rank 0 (the only rank with a terminal): where JUnit and each node's logs are."""
        lines = []
        junit = self.config.stash.get(JUNIT_PATH_KEY, None)
        own = self.placement.own
        if junit:
            lines.append(f"JUnit written by rank 0 on host {own.host} (node {own.node}): {os.path.abspath(junit)}")
        nodes = self.placement.to_json()["nodes"]
        for node, info in sorted(nodes.items(), key=lambda kv: int(kv[0])):
            lines.append(f"node {node} (host {info['host']}, ranks {_span(info['ranks'])}): rank logs and spilled "
                         f"output in {info['dir']}")
        terminalreporter.write_sep("-", "harness: torchrun placement")
        for line in lines:
            terminalreporter.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Rank 0: results are written, say so and wait briefly for the others; the others: wait
        for that before exiting (torchrun would otherwise stop rank 0 when one of them exits with an
        error before rank 0 wrote JUnit)."""
        if self.rank == 0:
            self.publish_final()
            expected = self.world_size - 1 - len([r for r in self.reporter.stuck if r != 0] if self.reporter else [])
            self._wait_until(lambda: int(self.store.add(protocol.KEY_END, 0)) >= expected, END_WAIT_S)
        else:
            self._wait_until(lambda: self.store.check([protocol.KEY_FINAL]), FINAL_WAIT_OTHERS_S)
        self.watchdog.stop()
        self.watchdog.signals.close()
        self._release_group()
        groups.free_destroyed()  # also a group the suite destroyed itself (e.g. in teardown_class)
        left = ending.gloo_threads()
        if left:
            self.hard_exit.arm(int(self.pytest_session.exitstatus) if self.pytest_session is not None else 0)
            self._log(f"{left} gloo thread(s) still run (a process group torch still holds): this rank ends "
                      "without interpreter finalization, where freeing the group could abort it")
        if self.log is not None:
            self.log.write("session ended")
        proc_tree.kill_tree(os.getpid(), include_root=False)

    def publish_final(self) -> None:
        store = self.watch_store if self.in_watchdog() else self.store
        store.set(protocol.KEY_FINAL, "1")

    @staticmethod
    def _wait_until(predicate: Any, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except Exception:  # the store's host (rank 0) is gone: nobody left to wait for
                return
            time.sleep(0.02)
