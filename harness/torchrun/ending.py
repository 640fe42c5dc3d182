"""How a torchrun-mode rank ends while gloo threads still run (issue 52, item 19).

A gloo process group still alive when the interpreter finalizes keeps its threads (two workers and an
event loop). If one of them needs the GIL after finalization began (a worker running a collective's
Python callback, or dropping the Python tensors of its last collective), Python ends that thread
with an unwinding ``pthread_exit`` that C++ turns into ``std::terminate``: the rank dies with SIGABRT
("terminate called without an active exception") after its results were written. Left to timing:
a 4-rank script that keeps its group and exits right after a collective aborted 1 run in 12
(destroying the group first, none); a collective a peer joins late aborts every time
(``tests/unit/harness/samples/sample_torchrun_exit.py``). ``destroy_process_group`` alone does not
free a group torch or the suite still holds (DTensor's caches, a kept exception's traceback), so the
session frees what it can (``harness.torchrun.groups.free_destroyed``) and, when gloo threads still
run after that, ends the rank without finalization, as spawn-mode ranks always do (``os._exit``
with pytest's exit status, after every exit handler registered since the session started has run).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys

# The names torch (pt_gloo_runloop: a process group's workers) and gloo (gloo_tcp_loop: a device's
# event loop) give their threads.
GLOO_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")


def gloo_threads() -> int:
    """How many of this process's threads gloo runs (by name, from /proc; 0 where unreadable)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() in GLOO_THREAD_NAMES
    return count


class HardExit:
    """Registered when the session starts, so that exit handlers registered later (a suite's, pytest's
    plugins') still run before it; does nothing unless armed."""

    def __init__(self) -> None:
        self.code: int | None = None
        atexit.register(self._run)

    def arm(self, code: int) -> None:
        self.code = code

    def _run(self) -> None:
        if self.code is None:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.code)
