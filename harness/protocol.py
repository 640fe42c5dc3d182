"""Store keys, values and environment variables shared by the controller, rank processes and torchrun mode.

Spawn mode: the controller hosts one TCPStore per bucket (on port 0, so concurrent buckets never
collide). It writes ``cmd/<seq>`` to tell every rank which test to run next; each rank answers
``res/<seq>/<rank>`` and bumps ``done/<seq>``; the last one sets ``all/<seq>``. Ranks therefore agree
on each test's end through the store, never through the process group.

torchrun mode: the ranks share torchrun's rendezvous store under ``harness-torchrun/``. Each rank posts
``collect/<rank>`` (its collected test ids); per test rank 0 writes ``go/<seq>``, every rank answers
``res/<seq>/<rank>`` and rank 0 writes ``verdict/<seq>``; ``dir/<tag>`` holds shared directory paths
and ``end`` counts the ranks that finished the session.

Values are JSON text. ``json.dumps`` escapes every non-ASCII character, so the text is ASCII and
``Store.set`` (typed ``str``) stores exactly its bytes; ``Store.get`` returns them as ``bytes``.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

ENV_RANK_PROCESS = "HARNESS_RANK_PROCESS"
ENV_STORE_HOST = "HARNESS_STORE_HOST"
ENV_STORE_PORT = "HARNESS_STORE_PORT"
ENV_BACKEND = "HARNESS_BACKEND"
ENV_DEVICE_TYPE = "HARNESS_DEVICE_TYPE"
ENV_FAULT_FILE = "HARNESS_FAULT_FILE"
ENV_SESSION_SHARED = "HARNESS_SESSION_SHARED_DIR"
ENV_CONTROLLER_PID = "HARNESS_CONTROLLER_PID"
ENV_PYTEST_ARGS = "HARNESS_PYTEST_ARGS"
ENV_BUCKET = "HARNESS_BUCKET"

PG_PREFIX = "pg/"
TORCHRUN_PREFIX = "harness-torchrun/"
RANK_STORE_TIMEOUT_S = 24 * 3600.0
KEY_END = "end"


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` the protocol needs (no torch import here)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def key_cmd(seq: int) -> str:
    return f"cmd/{seq}"


def key_res(seq: int, rank: int) -> str:
    return f"res/{seq}/{rank}"


def key_done(seq: int) -> str:
    return f"done/{seq}"


def key_all(seq: int) -> str:
    return f"all/{seq}"


def key_go(seq: int) -> str:
    return f"go/{seq}"


def key_verdict(seq: int) -> str:
    return f"verdict/{seq}"


def key_collected(rank: int) -> str:
    return f"collect/{rank}"


def key_dir(tag: str) -> str:
    return f"dir/{tag}"


def encode(obj: Any) -> str:
    """JSON text (ASCII); anything JSON cannot hold is written as its ``repr``."""
    return json.dumps(obj, default=repr)


def decode(raw: bytes | str) -> Any:
    return json.loads(raw)


def put(store: KeyValueStore, key: str, obj: Any) -> None:
    store.set(key, encode(obj))


def get(store: KeyValueStore, key: str) -> Any:
    """The decoded value of ``key``; blocks until it is set (up to the store's timeout)."""
    return decode(store.get(key))


def collect_answers(store: KeyValueStore, seq: int, ranks: Iterable[int], answers: dict[int, Any]) -> None:
    """Add to ``answers`` every ``res/<seq>/<rank>`` that is set by now; never blocks."""
    for rank in ranks:
        key = key_res(seq, rank)
        if rank not in answers and store.check([key]):
            answers[rank] = get(store, key)
