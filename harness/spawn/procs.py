"""Rank process bookkeeping on the controller side: start, describe an exit, dump stacks, reap.

Each rank runs in its own session (process group) and is a child subreaper, so its process tree holds
everything its tests started, even what left the group with ``setsid``; reaping kills that tree. The
controller is a subreaper too (``adopt_orphans``): what a rank that died abruptly left behind becomes
the controller's child and is killed when the bucket is reaped. Nothing here knows about pytest.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

from harness import proc_tree

TAIL_LINES = 40
_TAIL_BYTES = 16384


@dataclasses.dataclass
class RankProcess:
    """One rank: its Popen handle plus the log and fault files the controller tails."""

    rank: int
    popen: subprocess.Popen
    log_path: pathlib.Path
    fault_path: pathlib.Path
    start_ticks: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def describe_exit(self) -> str:
        """``killed by signal SIGSEGV (11)`` or ``exited with code 3``."""
        rc = self.popen.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"killed by signal {name} ({-rc})"
        return f"exited with code {rc}"

    def fault_size(self) -> int:
        try:
            return self.fault_path.stat().st_size
        except OSError:
            return 0

    def fault_text(self, offset: int) -> str:
        """Fault-file content written since ``offset`` (faulthandler dumps, os._exit stacks)."""
        try:
            with open(self.fault_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of the rank's combined stdout/stderr."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - _TAIL_BYTES))
                data = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(data.splitlines()[-lines:])

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def start_rank(rank: int, workdir: pathlib.Path, cwd: pathlib.Path, env: dict[str, str]) -> RankProcess:
    """Start ``python -m harness.spawn.rank_main`` for one rank in a new session."""
    log_path = workdir / f"rank{rank}.log"
    fault_path = workdir / f"rank{rank}.fault"
    fault_path.touch()
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "harness.spawn.rank_main"], cwd=str(cwd), env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return RankProcess(rank=rank, popen=popen, log_path=log_path, fault_path=fault_path,
                       start_ticks=proc_tree.start_ticks(popen.pid))


def adopt_orphans() -> None:
    """Make the controller a subreaper (once per process), so a dead rank's orphans come to it."""
    global _ADOPTING
    if not _ADOPTING:
        _ADOPTING = proc_tree.become_subreaper()


_ADOPTING = False


def dump_stacks(procs: list[RankProcess], dump_signal: int, settle_s: float = 2.0) -> dict[int, int]:
    """Ask every live rank for an all-threads stack dump; wait until the fault files stop growing.

    Returns the fault-file sizes before the request so callers can show only the new dump.
    """
    before = {p.rank: p.fault_size() for p in procs}
    live = [p for p in procs if p.alive()]
    for p in live:
        try:
            os.kill(p.pid, dump_signal)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + settle_s
    last = {p.rank: -1 for p in live}
    while live and time.monotonic() < deadline:
        sizes = {p.rank: p.fault_size() for p in live}
        if all(sizes[r] > before[r] and sizes[r] == last[r] for r in sizes):
            break
        last = sizes
        time.sleep(0.1)
    return before


def reap(procs: list[RankProcess], graceful_s: float) -> None:
    """Wait up to ``graceful_s`` for a clean exit, then SIGKILL each rank's process tree and group,
    reap, and kill what ranks that died abruptly left behind (adopted by the controller)."""
    deadline = time.monotonic() + graceful_s
    for p in procs:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            try:
                p.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        if p.alive():
            proc_tree.kill_tree(p.pid, include_root=True)
        p.signal_group(signal.SIGKILL)
    for p in procs:
        try:
            p.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a D-state process; nothing more we can do
            pass
    _kill_adopted(procs)


def _kill_adopted(procs: list[RankProcess]) -> None:
    """Kill the controller's children that appeared since the ranks started and are not ranks."""
    starts = [p.start_ticks for p in procs if p.start_ticks is not None]
    if not _ADOPTING or not starts:
        return
    adopted = proc_tree.adopted_children(min(starts), exclude={p.pid for p in procs})
    for pid in adopted:
        proc_tree.kill_tree(pid, include_root=True)
    deadline = time.monotonic() + 10
    while adopted and time.monotonic() < deadline:
        adopted = [pid for pid in adopted if not _reaped(pid)]
        time.sleep(0.01)


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def gpu_env(gpu_id: int) -> str:
    """The CUDA_VISIBLE_DEVICES value for physical index ``gpu_id`` under the controller's own mask."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:
        ids = [s for s in parent.split(",") if s.strip()]
        if gpu_id < len(ids):
            return ids[gpu_id]
    return str(gpu_id)
