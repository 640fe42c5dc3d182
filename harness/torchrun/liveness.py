"""Heartbeats: telling a lost rank on another node from a slow one.

A rank on another node cannot be checked by pid. Every rank's watchdog thread (not its main
thread, which may be busy in a long test) bumps ``beat/<rank>`` in the store every ``BEAT_EVERY_S``;
rank 0's watchdog reads every counter as often and notes, on its own monotonic clock, when each
last changed (no clocks of other machines are compared). A rank whose counter has not moved for
``--harness-heartbeat-timeout`` seconds is lost: its node, its torchrun agent or the process itself
is gone. A slow rank keeps beating, however long its test runs, and is never declared lost; so is
one whose main thread blocks in a collective. What does stop a beat without the rank being dead
is native code that holds the GIL for longer than the timeout (hence a generous default).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

BEAT_EVERY_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
# A rank silent this long may be lost: at the end of a grace period rank 0 waits to know.
SILENT_AFTER_S = 3 * BEAT_EVERY_S


def key_beat(rank: int) -> str:
    return f"beat/{rank}"


class Beater:
    """The sending side, called from a rank's watchdog loop."""

    def __init__(self, rank: int) -> None:
        self.key = key_beat(rank)
        self._last = float("-inf")

    def beat(self, store: Store, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= BEAT_EVERY_S:
            store.add(self.key, 1)
            self._last = now


class Liveness:
    """Rank 0's view of every other rank's heartbeat. ``poll`` runs in its watchdog thread; the
    other methods may be called from any thread."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        start = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {r: (-1, start) for r in range(1, world_size)}
        self._polled = float("-inf")
        self._lock = threading.Lock()

    def poll(self, store: Store) -> None:
        """Read every counter (throttled to once per ``BEAT_EVERY_S``)."""
        now = time.monotonic()
        if now - self._polled < BEAT_EVERY_S:
            return
        self._polled = now
        for r in list(self._seen):
            value = int(store.add(key_beat(r), 0))
            with self._lock:
                if value != self._seen[r][0]:
                    self._seen[r] = (value, time.monotonic())

    def silent_s(self, rank: int) -> float:
        """Seconds since ``rank``'s counter last moved (0 for rank 0, which is the observer)."""
        with self._lock:
            seen = self._seen.get(rank)
        return 0.0 if seen is None else time.monotonic() - seen[1]

    def lost(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if self.silent_s(r) > self.timeout_s]

    def silent(self, ranks: list[int]) -> list[int]:
        """Ranks that may be lost: no beat for a few periods, not yet for the whole timeout."""
        return [r for r in ranks if SILENT_AFTER_S < self.silent_s(r) <= self.timeout_s]

    def settle_since(self, ranks: list[int], since: float, poll: Callable[[], None]) -> list[int]:
        """Wait until each of ``ranks`` has beaten after ``since`` (a monotonic time) or is lost;
        return the lost ones. Alive ranks, also those blocked in a collective, beat within a
        period or two; only lost ones take the whole timeout."""
        def undecided() -> list[int]:
            with self._lock:
                fresh = {r for r in ranks if r in self._seen and self._seen[r][1] > since}
            return [r for r in ranks if r not in fresh and r in self._seen and r not in self.lost([r])]

        while undecided():
            poll()
            time.sleep(0.1)
        return self.lost(ranks)

    def settle(self, ranks: list[int], limit_s: float, poll: Callable[[], None]) -> list[int]:
        """Wait (at most ``limit_s``, and never past the timeout) until each silent rank among ``ranks``
        either beats again or is lost; return the lost ones. ``poll`` reads the counters (the
        watchdog's poll when it runs, the caller's own when the caller is the watchdog)."""
        deadline = time.monotonic() + limit_s
        while self.silent(ranks) and time.monotonic() < deadline:
            poll()
            time.sleep(0.1)
        return self.lost(ranks)
