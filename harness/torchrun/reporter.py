"""Rank 0's side of torchrun mode: wait for every rank's answer, turn what went wrong into a ``Fault``
with every rank's stacks, log one merged outcome per test, and write JUnit.

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
from harness.outcome import Fault, TestOutcome, first_failed_rank
from harness.stacks import format_stacks
from harness.torchrun.state import TakeOver
from harness.torchrun.watchdog import end_process, say
from harness.wait import Payloads, wait_for_answers

if TYPE_CHECKING:
    from torch.distributed import Store

    from harness.torchrun.session import TorchrunSession
    from harness.torchrun.state import Running

STACK_WAIT_S = 3.0
LIVENESS_EVERY_S = 0.5


class Reporter:
    """Rank 0's reporting for one torchrun session."""

    def __init__(self, session: TorchrunSession) -> None:
        self.session = session
        self.config = session.config
        self.world_size = session.world_size
        self.grace_s = float(self.config.getoption("harness_grace"))
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
            fault = self._peer_failed(res.payloads, pending)
        elif res.end == "timed_out":
            fault = self._timed_out(run, pending)
        elif res.end == "stopped":
            fault = self._died(pending)
        with self.session.lock:
            self.session.park_if_abandoned(locked=True)
            self.report(run, res.payloads, fault, res.at - run.start)
        for r in res.payloads:  # torchrun's store lives as long as the job: keep it small
            store.delete_key(protocol.key_res(run.seq, r))

    def _someone_gone(self, run: Running) -> bool:
        """Whether a rank that has not answered died (checked every ``LIVENESS_EVERY_S``)."""
        now = time.monotonic()
        if now - self._liveness_at < LIVENESS_EVERY_S:
            return False
        self._liveness_at = now
        store = self._store()
        pending = [r for r in range(self.world_size) if not store.check([protocol.key_res(run.seq, r)])]
        return bool(self.session.peers.gone(store, pending))

    def report(self, run: Running, payloads: Payloads, fault: Fault | None, duration: float) -> None:
        """Log the merged outcome of ``run``; a fault stops the session."""
        item = run.item
        outcome = TestOutcome(payloads, fault, duration)
        warn_state_changes(item, outcome)
        for rep in ReportBuilder(item, self.world_size, outcome).build():
            item.ihook.pytest_runtest_logreport(report=rep)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        if fault is not None:
            item.session.shouldstop = f"torchrun mode: {fault.summary}"
            self.stuck = [r for r in range(self.world_size) if r not in payloads]
        self.snapshot_junit()

    # ----- faults ---------------------------------------------------------------------------------
    def stack_sections(self, ranks: list[int], title: str, own_output: str = "") -> list[tuple[str, str]]:
        """Every listed rank's stacks (and running test's output), asked of its watchdog; rank 0's own
        are taken here. A rank that does not answer within a few seconds is said to be silent."""
        store = self._store()
        dump = int(store.add(protocol.KEY_DUMP, 1))
        answers: dict[int, dict[str, str]] = {}
        if 0 in ranks:
            watchdog = self.session.watchdog.thread.ident
            answers[0] = {"stack": format_stacks(skip=frozenset({watchdog} if watchdog else ())), "output": own_output}
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and len(answers) < len(ranks):
            for r in ranks:
                key = protocol.key_stack(dump, r)
                if r not in answers and store.check([key]):
                    answers[r] = protocol.get(store, key)
            time.sleep(0.02)
        sections = []
        for r in ranks:
            answer = answers.get(r)
            if answer is None:
                sections.append((f"rank {r} {title}", f"(no answer within {STACK_WAIT_S:g} s: the rank's process "
                                                      "is gone or its watchdog thread cannot run)"))
                continue
            sections.append((f"rank {r} {title}", answer.get("stack", "").strip()))
            if answer.get("output"):
                sections.append((f"rank {r} last output lines", answer["output"]))
        return sections

    def _timed_out(self, run: Running, pending: list[int], own_output: str = "") -> Fault:
        summary = (f"test exceeded its timeout of {run.timeout:g} s on rank(s) {pending}; stacks of every rank "
                   "follow; the session stops")
        sections = self.stack_sections(list(range(self.world_size)), "stack at timeout", own_output)
        return Fault("timeout", summary, None, sections)

    def _peer_failed(self, payloads: Payloads, pending: list[int], own_output: str = "") -> Fault:
        cause = first_failed_rank(payloads)
        summary = (f"rank {cause} failed first; rank(s) {pending} did not finish within the {self.grace_s:g} s "
                   "grace period (probably blocked in a collective); the session stops")
        return Fault("peer_failed", summary, cause, self.stack_sections(pending, "stack while blocked", own_output))

    def _died(self, pending: list[int], own_output: str = "", terminated: bool = False) -> Fault:
        """A rank's process is gone (seen by rank 0, or announced by torchrun's SIGTERM to the rest)."""
        gone = self.session.peers.gone(self._store(), pending)
        if not gone and terminated:
            summary = (f"the session received SIGTERM (the job was cancelled or timed out) while rank(s) {pending} "
                       "had not finished this test; stacks of every rank follow")
            sections = self.stack_sections(list(range(self.world_size)), "stack at SIGTERM", own_output)
            return Fault("timeout", summary, None, sections)
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone.items())
        then = "; torchrun then stopped the other ranks (SIGTERM)" if terminated else ""
        summary = (f"rank process died: {names} is gone{then} (torchrun reports its exit status; its stack, if "
                   "any, is in its stderr); the session stops")
        alive = [r for r in range(self.world_size) if r not in gone]
        return Fault("died", summary, min(gone) if gone else None, self.stack_sections(alive, "stack", own_output))

    # ----- watchdog thread ------------------------------------------------------------------------
    def judge(self) -> None:
        """While rank 0's main thread is inside a test: time it out, or end the grace period after
        another rank failed; either way report in its place."""
        run = self.session.running_test()
        if run is None:
            return
        now = time.monotonic()
        if now - run.start > run.timeout:
            self.session.take_over(TakeOver.TIMEOUT)
            return
        if int(self._store().add(protocol.key_failed(run.seq), 0)) == 0:
            return
        if self._first_failure is None or self._first_failure[0] != run.seq:
            self._first_failure = (run.seq, now)
        elif now - self._first_failure[1] > self.grace_s:
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
                fault = self._died(pending, own_output, terminated=True)
            elif kind == TakeOver.PEER_FAILED:
                fault = self._peer_failed(payloads, pending, own_output)
            else:
                fault = self._timed_out(run, pending, own_output)
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
