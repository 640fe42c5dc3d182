"""Rank-side crash forensics and hygiene: faulthandler, an ``os._exit`` wrapper, an orphan watchdog.

Everything here writes to the rank's fault file (not stderr, which pytest's capture may redirect),
so the controller can show the Python stack of a rank that died or hung. The rank is a child
subreaper (``harness.proc_tree``), and every way out of it that runs Python code kills what its tests
started first.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, NoReturn

from harness import proc_tree

DUMP_SIGNAL = signal.SIGUSR1


class ExitInterceptor:
    """Replaces ``os._exit`` in this rank process so a direct exit still leaves a stack behind."""

    def __init__(self, fault_file: IO[str], real_exit: Callable[[int], NoReturn]) -> None:
        self.fault_file = fault_file
        self.real_exit = real_exit

    def __call__(self, code: int) -> NoReturn:
        try:
            self.fault_file.write(f"\nos._exit({code}) called; Python stack of the calling thread:\n")
            self.fault_file.flush()
            faulthandler.dump_traceback(file=self.fault_file, all_threads=False)
            self.fault_file.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            proc_tree.kill_tree(os.getpid(), include_root=False)
        finally:
            self.real_exit(code)


class OrphanWatchdog:
    """Kills this rank and everything its tests started if its controller disappears (SIGKILL, SIGTERM).

    Polls the parent pid from a daemon thread; cheap and independent of whatever the main thread is
    blocked in (a collective, a sleep).
    """

    def __init__(self, controller_pid: int, real_exit: Callable[[int], NoReturn], interval_s: float = 0.5) -> None:
        self.controller_pid = controller_pid
        self.real_exit = real_exit
        self.interval_s = interval_s
        self.thread = threading.Thread(target=self._run, name="harness-orphan-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while True:
            if os.getppid() != self.controller_pid:
                proc_tree.kill_tree(os.getpid(), include_root=False)
                self.real_exit(70)
            time.sleep(self.interval_s)


def install(fault_path: str, controller_pid: int) -> IO[str]:
    """Enable faulthandler for fatal signals and SIGUSR1 (all threads), wrap ``os._exit``, adopt orphans."""
    proc_tree.become_subreaper()
    fault_file = open(fault_path, "a", buffering=1)
    faulthandler.enable(file=fault_file, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=fault_file, all_threads=True, chain=False)
    real_exit = os._exit
    os._exit = ExitInterceptor(fault_file, real_exit)  # type: ignore[assignment]
    if controller_pid > 0:
        OrphanWatchdog(controller_pid, real_exit).start()
    return fault_file
