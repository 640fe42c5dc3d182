"""What a torchrun-mode rank's main thread is doing, shared by the session and its watchdog thread."""
from __future__ import annotations

import dataclasses

import pytest

from harness.protocol import WireEnum


class Phase(WireEnum):
    """The main thread's phase. The watchdog may take over in any phase but FINISHING; once it has,
    the phase is ABANDONED and the main thread parks for good. The value travels in a rank's stack
    answer (``phase``)."""

    IDLE = "idle"
    RUNNING = "running"
    WAITING = "waiting"
    FINISHING = "finishing"
    ABANDONED = "abandoned"


class TakeOver(WireEnum):
    """Why rank 0's watchdog reports in place of the main thread."""

    TIMEOUT = "timeout"
    PEER_FAILED = "peer_failed"
    TERMINATED = "terminated"
    LOST = "lost"  # a rank that has not answered stopped beating (its node or agent is gone)


@dataclasses.dataclass(frozen=True)
class Running:
    """The test the main thread is in: its sequence number, item, start (monotonic) and timeout."""

    seq: int
    item: pytest.Item
    start: float
    timeout: float
