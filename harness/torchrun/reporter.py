"""Rank 0's side of torchrun mode: wait for every rank's answer, turn what went wrong into a ``Fault``
(``harness.torchrun.faults``), log one merged outcome per test, and write JUnit.

Two threads may report. Normally rank 0's main thread does, after its own part of the test. When the
main thread itself is stuck in a test (its own hang, or blocked in a collective with a rank that
failed), or SIGTERM arrives, the watchdog thread reports instead (``emergency``): it logs the test,
runs pytest's session finish (summary, JUnit of everything that finished) and ends the process.
A JUnit snapshot is also written every second or so, so that even a crash of rank 0 (which nothing
in it can report) leaves the results up to the last finished test behind.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

import pytest

from harness import protocol
from harness.combine import ReportBuilder, warn_state_changes
from harness.outcome import Fault, TestOutcome
from harness.torchrun import groups
from harness.torchrun.faults import FaultBuilder
from harness.torchrun.state import TakeOver
from harness.torchrun.watchdog import end_process, say
from harness.wait import Payloads, wait_for_answers

if TYPE_CHECKING:
    from torch.distributed import Store

    from harness.torchrun.session import TorchrunSession
    from harness.torchrun.state import Running

LIVENESS_EVERY_S = 0.5


class Reporter:
    """Rank 0's reporting for one torchrun session."""

    def __init__(self, session: TorchrunSession) -> None:
        self.session = session
        self.config = session.config
        self.world_size = session.world_size
        self.grace_s = float(self.config.getoption("harness_grace"))
        self.faults = FaultBuilder(session, self.grace_s)
        self.stuck: list[int] = []
        self._first_failure: tuple[int, float] | None = None
        self._liveness_at = 0.0
        self._snapshot_at = float("-inf")
        self._snapshot_every = 1.0

    def _store(self) -> Store:
        """This thread's store client: the watchdog thread has its own (the main one may be in use)."""
        return self.session.watch_store if self.session.in_watchdog() else self.session.store

    # ----- main thread ----------------------------------------------------------------------------
    def gather(self, run: Running) -> None:
        """Wait for every rank's answer to ``run`` (timeout from its start, grace after a failure)."""
        store = self._store()

        def collect(payloads: Payloads) -> bool:
            protocol.collect_answers(store, run.seq, range(self.world_size), payloads)
            return len(payloads) == self.world_size

        res = wait_for_answers(collect, run.start, run.timeout, self.grace_s,
                               stopped=lambda: self.session.abandoned() or self._someone_gone(run))
        self.session.park_if_abandoned()
        pending = [r for r in range(self.world_size) if r not in res.payloads]
        fault = None
        if res.end == "grace_expired":
            fault = self.faults.died(pending) if self._settle(run, pending) else \
                self.faults.peer_failed(res.payloads, pending)
        elif res.end == "timed_out":
            fault = self.faults.timed_out(run, pending)
        elif res.end == "stopped":
            fault = self.faults.died(pending)
        with self.session.lock:
            self.session.park_if_abandoned(locked=True)
            self.report(run, res.payloads, fault, res.at - run.start)
        if fault is None and len(res.payloads) == self.world_size:
            self.session.release_next = groups.merge(p.get("groups") for p in res.payloads.values())
        for r in res.payloads:  # torchrun's store lives as long as the job: keep it small
            store.delete_key(protocol.key_res(run.seq, r))

    def _pending(self, run: Running, among: list[int] | range | None = None) -> list[int]:
        store = self._store()
        ranks = range(self.world_size) if among is None else among
        return [r for r in ranks if not store.check([protocol.key_res(run.seq, r)])]

    def _someone_gone(self, run: Running) -> bool:
        """Whether a rank that has not answered died or is lost (checked every ``LIVENESS_EVERY_S``)."""
        now = time.monotonic()
        if now - self._liveness_at < LIVENESS_EVERY_S:
            return False
        self._liveness_at = now
        pending = self._pending(run)
        return bool(self.session.placement.gone(self._store(), pending) or self.session.liveness.lost(pending))

    def _settle(self, run: Running, pending: list[int]) -> list[int]:
        """After a grace period: a pending rank that has also stopped beating may be lost rather than
        blocked. Wait until that is known (at most the heartbeat timeout, never past the test's own
        timeout); return the lost ranks."""
        liveness, store = self.session.liveness, self._store()
        limit = min(liveness.timeout_s, max(0.0, run.start + run.timeout - time.monotonic()))
        return liveness.settle(pending, limit, poll=lambda: liveness.poll(store))

    def report(self, run: Running, payloads: Payloads, fault: Fault | None, duration: float) -> None:
        """Log the merged outcome of ``run``; a fault stops the session."""
        item = run.item
        outcome = TestOutcome(payloads, fault, duration)
        warn_state_changes(item, outcome)
        placement = self.session.placement
        where = placement.where if placement.multinode() else None
        for rep in ReportBuilder(item, self.world_size, outcome, placement.label, where).build():
            item.ihook.pytest_runtest_logreport(report=rep)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        if fault is not None:
            item.session.shouldstop = f"torchrun mode: {fault.summary}"
            self.stuck = [r for r in range(self.world_size) if r not in payloads]
        self.snapshot_junit()

    # ----- watchdog thread ------------------------------------------------------------------------
    def judge(self) -> None:
        """While rank 0's main thread is inside a test: time it out, report ranks that are lost, or end
        the grace period after another rank failed; each time report in its place. Also reads the
        heartbeats, whatever the main thread does."""
        store = self._store()
        self.session.liveness.poll(store)
        run = self.session.running_test()
        if run is None:
            return
        now = time.monotonic()
        if now - run.start > run.timeout:
            self.session.take_over(TakeOver.TIMEOUT)
            return
        lost = self.session.liveness.lost(list(range(1, self.world_size)))
        if lost and self._pending(run, lost):
            self.session.take_over(TakeOver.LOST)
            return
        if int(store.add(protocol.key_failed(run.seq), 0)) == 0:
            return
        if self._first_failure is None or self._first_failure[0] != run.seq:
            self._first_failure = (run.seq, now)
        elif now - self._first_failure[1] > self.grace_s:
            silent = self.session.liveness.silent(list(range(1, self.world_size)))
            if silent and self._pending(run, silent):
                return  # perhaps lost rather than blocked: known once they beat again or are lost
            self.session.take_over(TakeOver.PEER_FAILED)

    def emergency(self, kind: TakeOver, run: Running | None, own_output: str) -> None:
        """Report ``run`` (if a test was under way) as failed by ``kind``, finish the session, exit.
        ``own_output``: what the test printed on rank 0 so far, if rank 0 was still in it."""
        capman = self.config.pluginmanager.getplugin("capturemanager")
        if run is not None:
            payloads: Payloads = {}
            protocol.collect_answers(self._store(), run.seq, range(self.world_size), payloads)
            pending = [r for r in range(self.world_size) if r not in payloads]
            if kind == TakeOver.TERMINATED:
                fault = self.faults.died(pending, own_output, terminated=True)
            elif kind == TakeOver.LOST:
                fault = self.faults.died(pending, own_output)
            elif kind == TakeOver.PEER_FAILED:
                fault = self.faults.peer_failed(payloads, pending, own_output)
            else:
                fault = self.faults.timed_out(run, pending, own_output)
            if capman is not None:
                with contextlib.suppress(Exception):
                    capman.suspend_global_capture(in_=True)
            with self.session.lock:
                self.report(run, payloads, fault, time.monotonic() - run.start)
        elif capman is not None:
            with contextlib.suppress(Exception):
                capman.suspend_global_capture(in_=True)
        session = self.session.pytest_session
        if session is not None:
            session.shouldstop = session.shouldstop or f"torchrun mode: {kind}"
            try:
                self.config.hook.pytest_sessionfinish(session=session, exitstatus=pytest.ExitCode.TESTS_FAILED)
            except BaseException as exc:  # still publish final and exit: the other ranks wait for it
                say(f"rank 0: finishing the session failed: {exc!r}")
        self.session.publish_final()
        end_process(int(pytest.ExitCode.TESTS_FAILED), f"rank 0: session ended by the watchdog ({kind})")

    # ----- JUnit ----------------------------------------------------------------------------------
    def snapshot_junit(self) -> None:
        """Write the JUnit XML of the tests so far (throttled), atomically next to its final path.
        Uses pytest's junitxml plugin object (private API): without it, no snapshot."""
        try:
            from _pytest.junitxml import xml_key
        except ImportError:
            return
        xml = self.config.stash.get(xml_key, None)
        now = time.monotonic()
        if xml is None or now - self._snapshot_at < self._snapshot_every:
            return
        final = xml.logfile
        partial = f"{final}.partial-{os.getpid()}"
        try:
            xml.logfile = partial
            xml.pytest_sessionfinish()
            os.replace(partial, final)
        except OSError as exc:
            say(f"rank 0: JUnit snapshot failed: {exc!r}")
        finally:
            xml.logfile = final
        cost = time.monotonic() - now
        self._snapshot_at = time.monotonic()
        self._snapshot_every = max(1.0, 20 * cost)
