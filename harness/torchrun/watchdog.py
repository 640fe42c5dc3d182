"""torchrun mode's watchdog: one thread per rank that keeps working while the rank's main thread is
stuck (in a test, a collective, native code).

Every rank's watchdog
- answers rank 0's stack requests (``dump``) with the Python stacks of all its threads and, while a
  test runs, the last lines of that test's captured output;
- sees SIGTERM (torchrun stopping every rank after one exited with an error, or a cancelled job)
  through a wakeup pipe, so a main thread blocked in native code does not delay it;
- ends its rank when rank 0 has finished the session (``final``) while this rank is still stuck in a
  test, killing what its tests started first;
- beats (``harness.torchrun.liveness``), so that rank 0 tells a lost rank on another node from a slow one.
On rank 0 the session also hands it the judge's work (``TorchrunSession.watch``): timing out a test
while rank 0's own main thread is inside it, and reporting in its place.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from harness import proc_tree, protocol
from harness.stacks import format_stacks
from harness.torchrun.liveness import Beater
from harness.torchrun.state import Phase

if TYPE_CHECKING:
    from torch.distributed import Store

POLL_S = 0.1
FINAL_WAIT_S = 60.0
SIGTERM_WAIT_S = 10.0  # well inside torchrun's 30 s between SIGTERM and SIGKILL
OUTPUT_TAIL_LINES = 40
_REAL_STDERR: list[int] = []
_LOGS: list[Any] = []  # the rank's RankLog (harness.torchrun.dirs), once the session knows its node directory


def keep_real_stderr() -> None:
    """Remember the process's stderr before pytest captures it (at configure time, capture is
    suspended): a watchdog's message must not vanish into a stuck test's captured output."""
    if not _REAL_STDERR:
        _REAL_STDERR.append(os.dup(2))


def log_to(log: Any) -> None:
    """Also write every ``say`` line to ``log`` (an object with ``write(str)``)."""
    _LOGS[:] = [log]


def say(message: str) -> None:
    """One line to the real stderr (and the rank's log)."""
    data = f"[harness] {message}\n".encode(errors="replace")
    try:
        os.write(_REAL_STDERR[0] if _REAL_STDERR else 2, data)
    except OSError:
        pass
    for log in _LOGS:
        log.write(message)


def _noted(signum: int, frame: Any) -> None:
    """The Python-level SIGTERM handler: nothing; the watchdog acts on the wakeup byte."""


class SignalPipe:
    """SIGTERM as a byte on a pipe the watchdog reads (``signal.set_wakeup_fd``). Main thread only."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.previous_handler = signal.signal(signal.SIGTERM, _noted)

    def wait(self, timeout_s: float) -> set[int]:
        """Signal numbers delivered within ``timeout_s``."""
        ready, _, _ = select.select([self.read_fd], [], [], timeout_s)
        if not ready:
            return set()
        try:
            return set(os.read(self.read_fd, 512))
        except BlockingIOError:
            return set()

    def close(self) -> None:
        """Give SIGTERM back its previous handler (main thread only)."""
        signal.signal(signal.SIGTERM, self.previous_handler)
        signal.set_wakeup_fd(self.previous_fd)


class RankWatchdog:
    """The watchdog thread of one rank. ``phase()`` names what the main thread is doing; ``output()``
    returns the captured output of a running test; ``judge()`` (rank 0) and ``on_sigterm()`` are the
    session's callbacks."""

    def __init__(self, rank: int, store: Store, signals: SignalPipe, phase: Callable[[], Phase],
                 output: Callable[[], str], judge: Callable[[], None] | None,
                 on_sigterm: Callable[[], None]) -> None:
        self.rank = rank
        self.store = store
        self.signals = signals
        self.phase = phase
        self.output = output
        self.judge = judge
        self.on_sigterm = on_sigterm
        self.answered = 0
        self.final_seen: float | None = None
        self.beater = Beater(rank)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="harness-torchrun-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopping.is_set():
            delivered = self.signals.wait(POLL_S)
            try:
                if signal.SIGTERM in delivered:
                    self.on_sigterm()
                if self.rank != 0:
                    self.beater.beat(self.store)
                    self.answer_dump()
                    self._check_final()
                elif self.judge is not None:
                    self.judge()
            except Exception as exc:  # the store is gone (its host died): nothing is left to coordinate
                say(f"rank {self.rank} watchdog: {exc!r}")
                self.stopping.wait(1.0)

    def answer_dump(self) -> None:
        """Post this rank's stacks for rank 0's latest request, once per request."""
        latest = int(self.store.add(protocol.KEY_DUMP, 0))
        if latest <= self.answered:
            return
        self.answered = latest
        protocol.put(self.store, protocol.key_stack(latest, self.rank), self.describe())

    def describe(self) -> dict[str, str]:
        """Stacks of every thread but this one, and the running test's output so far."""
        phase = self.phase()
        output = ""
        if phase == Phase.RUNNING:
            with contextlib.suppress(Exception):
                output = "\n".join(self.output().splitlines()[-OUTPUT_TAIL_LINES:])
        return {"phase": phase.value, "stack": format_stacks(skip=frozenset({threading.get_ident()})), "output": output}

    def _check_final(self) -> None:
        """After rank 0 finished, the main thread has ``FINAL_WAIT_S`` to end by itself (a rank stuck in
        a test never will). Usually SIGTERM comes first: torchrun stops every rank once rank 0 exits
        with an error, and rank 0 stays the one torchrun names as the failure."""
        if self.final_seen is None:
            if not self.store.check([protocol.KEY_FINAL]):
                return
            self.final_seen = time.monotonic()
        if time.monotonic() - self.final_seen > FINAL_WAIT_S:
            end_process(1, f"rank {self.rank}: rank 0 finished the session {FINAL_WAIT_S:g} s ago while this "
                           f"rank was still {self.phase()}; exiting")

    def serve_until_final(self, limit_s: float, give_up: Callable[[], bool]) -> bool:
        """Answer stack requests until rank 0 says ``final`` (True), ``limit_s`` passes or
        ``give_up()`` (False)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                self.beater.beat(self.store)
                self.answer_dump()
                if self.store.check([protocol.KEY_FINAL]):
                    return True
                if give_up():
                    return False
            time.sleep(POLL_S)
        return False


def end_process(code: int, why: str) -> None:
    """Kill what this rank's tests started, flush, and leave without running any more Python code."""
    say(why)
    with contextlib.suppress(Exception):
        proc_tree.kill_tree(os.getpid(), include_root=False)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
