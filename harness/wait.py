"""Wait for every rank's answer to one test, in either mode.

The store is polled with a back-off from 0.5 ms to 10 ms, so a finished test is noticed within
10 ms without spinning. The wait ends when every rank answered, when the caller says waiting is
pointless (a rank process died), when the grace period after the first failing answer has passed
(the other ranks are probably blocked in a collective with the failed one), or at the deadline.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal

from harness.outcome import payload_failed

POLL_MIN_S = 0.0005
POLL_MAX_S = 0.01

WaitEnd = Literal["answered", "stopped", "grace_expired", "timed_out"]
Payloads = dict[int, dict[str, Any]]


@dataclasses.dataclass
class WaitResult:
    """How the wait ended, the answers that arrived, and when it ended (``time.monotonic()``)."""

    end: WaitEnd
    payloads: Payloads
    at: float


def wait_for_answers(collect: Callable[[Payloads], bool], start: float, budget_s: float, grace_s: float,
                     stopped: Callable[[], bool] | None = None) -> WaitResult:
    """Poll until one of the ends above.

    ``collect(payloads)`` adds the answers that arrived since the last call and returns True once
    every rank answered; ``stopped()`` returns True when no more answers can come (answers that
    arrived meanwhile are still collected). ``budget_s`` counts from ``start`` (``time.monotonic()``).
    """
    payloads: Payloads = {}
    first_failure: float | None = None
    pause = POLL_MIN_S
    while True:
        if collect(payloads):
            return WaitResult("answered", payloads, time.monotonic())
        if stopped is not None and stopped():
            collect(payloads)
            return WaitResult("stopped", payloads, time.monotonic())
        now = time.monotonic()
        if first_failure is None and any(payload_failed(p) for p in payloads.values()):
            first_failure = now
        if first_failure is not None and now - first_failure > grace_s:
            return WaitResult("grace_expired", payloads, now)
        if now - start > budget_s:
            return WaitResult("timed_out", payloads, now)
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)
