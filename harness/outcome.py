"""What one distributed test produced, in either mode: the per-rank answers and, if any, a fault.

A rank's answer (a *payload*) is the JSON dict it posts to the store: ``rank``, ``t`` (wall-clock
time it finished), ``error`` (a message when the rank could not run the test at all) and
``reports`` (its serialised pytest reports).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

FaultKind = Literal["died", "timeout", "peer_failed"]


@dataclasses.dataclass
class Fault:
    """Why a test could not finish normally; ``sections`` are (title, text) pairs for the report."""

    kind: FaultKind
    summary: str
    cause_rank: int | None
    sections: list[tuple[str, str]]
    dead_ranks: tuple[int, ...] = ()  # every rank known dead or lost (``cause_rank`` is one of them)


@dataclasses.dataclass
class TestOutcome:
    """Per-rank payloads that arrived, and the fault if the test did not finish on every rank."""

    __test__ = False  # not a pytest test class despite the name

    payloads: dict[int, dict[str, Any]]
    fault: Fault | None
    duration: float


def payload_failed(payload: Mapping[str, Any]) -> bool:
    """True when the rank reported an error or any failed phase."""
    return bool(payload.get("error")) or any(r.get("outcome") == "failed" for r in payload.get("reports", []))


def first_failed_rank(payloads: Mapping[int, Mapping[str, Any]]) -> int | None:
    """The rank whose failing answer has the earliest finish time (the likely cause), or None."""
    failed = sorted((p.get("t", 0.0), r) for r, p in payloads.items() if payload_failed(p))
    return failed[0][1] if failed else None
