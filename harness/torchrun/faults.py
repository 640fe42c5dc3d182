"""Rank 0's descriptions of what went wrong in a torchrun-mode test: a timeout, a rank that failed
while others stayed blocked, a rank whose process died on rank 0's node, a rank or a whole node lost
(no heartbeat, ``harness.torchrun.liveness``). Every rank still around is asked for its stacks;
ranks are named with their node, host and local rank once the job spans several nodes."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from harness import protocol
from harness.outcome import Fault, first_failed_rank
from harness.stacks import format_stacks
from harness.wait import Payloads

if TYPE_CHECKING:
    from torch.distributed import Store

    from harness.torchrun.session import TorchrunSession
    from harness.torchrun.state import Running

STACK_WAIT_S = 3.0


class FaultBuilder:
    """Builds the ``Fault`` of one test for rank 0 (from its main thread or its watchdog)."""

    def __init__(self, session: TorchrunSession, grace_s: float) -> None:
        self.session = session
        self.world_size = session.world_size
        self.grace_s = grace_s
        self.placement = session.placement
        self.liveness = session.liveness

    def _store(self) -> Store:
        return self.session.watch_store if self.session.in_watchdog() else self.session.store

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
            label = self.placement.label(r)
            if answer is None:
                sections.append((f"{label} {title}", f"(no answer within {STACK_WAIT_S:g} s: the rank's process "
                                                     "is gone or its watchdog thread cannot run)"))
                continue
            sections.append((f"{label} {title}", answer.get("stack", "").strip()))
            if answer.get("output"):
                sections.append((f"{label} last output lines", answer["output"]))
        return sections

    def where_section(self, ranks: list[int]) -> list[tuple[str, str]]:
        """Across nodes: where each named rank ran and where its log is."""
        if not ranks or not self.placement.multinode():
            return []
        return [("where these ranks ran", "\n".join(self.placement.where(r) for r in ranks))]

    def lost_text(self, lost: list[int]) -> str:
        """``node 1 (host b) lost: rank(s) [2, 3] ...`` for a whole node, else per rank."""
        parts = []
        for node, ranks in self.placement.by_node(lost).items():
            silent = max(self.liveness.silent_s(r) for r in ranks)
            first = self.placement.get(ranks[0])
            if node is not None and first is not None and ranks == self.placement.node_ranks(node):
                parts.append(f"node {node} (host {first.host}) lost: rank(s) {ranks} sent no heartbeat for "
                             f"{silent:.0f} s (the node, its torchrun agent or all its ranks are gone)")
            else:
                names = ", ".join(self.placement.label(r) for r in ranks)
                parts.append(f"{names} lost: no heartbeat for {silent:.0f} s")
        return "; ".join(parts)

    def _lost(self, pending: list[int]) -> list[int]:
        """The lost ranks among ``pending``, once those that have just gone silent are known to be lost
        or alive (the ranks of one lost node stop beating within a beat of each other)."""
        store = self._store()
        return self.liveness.settle(pending, self.liveness.timeout_s, poll=lambda: self.liveness.poll(store))

    def _silent_text(self, ranks: list[int]) -> str:
        silent = self.liveness.silent(ranks)
        if not silent:
            return ""
        return "; no heartbeat for a while from " + ", ".join(
            f"{self.placement.label(r)} ({self.liveness.silent_s(r):.0f} s)" for r in silent)

    def timed_out(self, run: Running, pending: list[int], own_output: str = "") -> Fault:
        """Reported at once: lost ranks (and ranks silent for a while) are named, not waited for."""
        lost = self.liveness.lost(pending)
        also = (f"; {self.lost_text(lost)}" if lost else "") + self._silent_text(pending)
        summary = (f"test exceeded its timeout of {run.timeout:g} s on rank(s) {pending}{also}; stacks of every "
                   "rank follow; the session stops")
        sections = self.stack_sections(list(range(self.world_size)), "stack at timeout", own_output)
        return Fault("timeout", summary, None, sections + self.where_section(pending), dead_ranks=tuple(lost))

    def peer_failed(self, payloads: Payloads, pending: list[int], own_output: str = "") -> Fault:
        """A rank failed and others did not finish. If those others are gone (a lost node), that is
        the cause and the failure is its consequence (gloo reports the closed connection at
        once, long before the heartbeat timeout): wait until each has beaten again or is lost."""
        store = self._store()
        if self.liveness.settle_since([r for r in pending if r != 0], time.monotonic(),
                                      poll=lambda: self.liveness.poll(store)):
            return self.died(pending, own_output)
        cause = first_failed_rank(payloads)
        name = self.placement.label(cause) if cause is not None else "a rank"
        summary = (f"{name} failed first; rank(s) {pending} did not finish within the {self.grace_s:g} s "
                   "grace period (probably blocked in a collective); the session stops")
        named = ([cause] if cause is not None else []) + pending
        sections = self.stack_sections(pending, "stack while blocked", own_output) + self.where_section(named)
        return Fault("peer_failed", summary, cause, sections)

    def died(self, pending: list[int], own_output: str = "", terminated: bool = False) -> Fault:
        """Ranks are gone: dead processes on rank 0's node, or silent ranks on any node (lost), or only
        announced by torchrun's SIGTERM to the rest."""
        gone = self.placement.gone(self._store(), pending)
        # SIGTERM leaves torchrun's 30 s before SIGKILL: no waiting then
        lost = [r for r in (self.liveness.lost(pending) if terminated else self._lost(pending)) if r not in gone]
        if not gone and not lost and terminated:
            summary = (f"the session received SIGTERM (the job was cancelled or timed out) while rank(s) {pending} "
                       "had not finished this test; stacks of every rank follow")
            sections = self.stack_sections(list(range(self.world_size)), "stack at SIGTERM", own_output)
            return Fault("timeout", summary, None, sections)
        parts = []
        if gone:
            names = ", ".join(f"{self.placement.label(r)} (pid {pid})" for r, pid in gone.items())
            then = "; torchrun then stopped the other ranks (SIGTERM)" if terminated else ""
            parts.append(f"rank process died: {names} is gone{then} (torchrun reports its exit status; its "
                         "stack, if any, is in its stderr)")
        if lost:
            parts.append(self.lost_text(lost))
        if not parts:
            parts.append(f"rank(s) {pending} stopped answering")
        dead = sorted(set(gone) | set(lost))
        alive = [r for r in range(self.world_size) if r not in dead]
        sections = self.stack_sections(alive, "stack", own_output) + self.where_section(dead)
        return Fault("died", "; ".join(parts) + "; the session stops", min(dead) if dead else None, sections,
                     dead_ranks=tuple(dead))
