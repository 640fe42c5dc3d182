"""Process-tree hygiene: nothing a test starts may outlive the rank process that ran it.

A rank makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): a descendant whose parent
exits, including one that called ``setsid`` or double-forked to leave the rank's process group, is
re-parented to the rank instead of to init. The rank's subtree in ``/proc`` therefore stays complete,
and ``kill_tree`` can stop and kill all of it, whether the rank itself does so before it exits or the
controller does so before it kills the rank. Elsewhere than Linux these functions find nothing and
callers fall back to process-group kills.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import signal

_PR_SET_CHILD_SUBREAPER = 36
_PROC = pathlib.Path("/proc")


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux >= 3.4); False where the call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks after boot) of one process; None if gone or unreadable."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), None if it is gone."""
    st = _stat(pid)
    return None if st is None else st[2]


def _children_map() -> dict[int, list[tuple[int, int]]]:
    """ppid -> [(pid, start ticks)] of every live (non-zombie) process; {} without /proc."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = [e.name for e in _PROC.iterdir() if e.name.isdigit()]
    except OSError:
        return {}
    for name in entries:
        st = _stat(name)
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append((int(name), st[2]))
    return children


def adopted_children(since_ticks: int, exclude: set[int]) -> list[int]:
    """Live children of this process started at or after ``since_ticks``, except ``exclude``.

    For a subreaper whose own children are known: anything else that became its child since a
    point in time was adopted, i.e. orphaned by a descendant that died.
    """
    return [pid for pid, start in _children_map().get(os.getpid(), [])
            if start >= since_ticks and pid not in exclude]


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of ``root``, parents before children; [] without /proc."""
    children = {ppid: [pid for pid, _ in kids] for ppid, kids in _children_map().items()}
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int, include_root: bool, rounds: int = 10) -> list[int]:
    """SIGKILL every descendant of ``root`` (and ``root`` itself when ``include_root``).

    Everything is stopped (SIGSTOP) first, rescanning until no new process appears, so nothing can
    fork its way out between the scan and the kill. Returns the pids that were killed.
    """
    stopped: list[int] = []
    if include_root:
        _signal(root, signal.SIGSTOP)
        stopped.append(root)
    for _ in range(rounds):
        new = [p for p in descendants(root) if p not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped.extend(new)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    return stopped


def reap_children() -> None:
    """Collect the exit status of every finished child (orphans adopted as subreaper); never blocks."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
