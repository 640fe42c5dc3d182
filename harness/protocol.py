"""Store keys, values and environment variables shared by the controller, rank processes and torchrun mode.

Spawn mode: the controller hosts one TCPStore per bucket (on port 0, so concurrent buckets never
collide). It writes ``cmd/<seq>`` to tell every rank which test to run next; each rank answers
``res/<seq>/<rank>`` and bumps ``done/<seq>``; the last one sets ``all/<seq>``. Ranks therefore agree
on each test's end through the store, never through the process group. Each rank bumps ``ready``
once it has joined the process group and collected, so the first test's timeout starts only then.

torchrun mode: the ranks share torchrun's rendezvous store under ``harness-torchrun/<restart>/``.
Each rank posts ``info/<rank>`` (pid, host) and ``collect/<rank>`` (its collected test ids); per test
rank 0 writes ``go/<seq>`` (run or stop), every rank answers ``res/<seq>/<rank>`` and bumps
``failed/<seq>`` if its answer is a failure. Rank 0 bumps ``dump`` to ask every rank's watchdog
thread for its stacks, answered in ``stack/<dump>/<rank>``; ``dir/<tag>`` holds shared directory
paths, ``end`` counts the ranks that finished the session, and rank 0 sets ``final`` once its
results are written (a rank still stuck in a test exits then).

Values are JSON text. ``json.dumps`` escapes every non-ASCII character, so the text is ASCII and
``Store.set`` (typed ``str``) stores exactly its bytes; ``Store.get`` returns them as ``bytes``.
"""
from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable
from typing import Any, Protocol

# set by the controller on the KeyboardInterrupt a SIGTERM raises; the sidecar names the signal from it
SIGNAL_NAME_ATTR = "signal_name"
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
ENV_SPILL_DIR = "HARNESS_SPILL_DIR"

PG_PREFIX = "pg/"
TORCHRUN_PREFIX = "harness-torchrun/"
RANK_STORE_TIMEOUT_S = 24 * 3600.0
KEY_END = "end"
KEY_READY = "ready"
KEY_DUMP = "dump"
KEY_FINAL = "final"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


class WireEnum(str, enum.Enum):
    """A ``str`` enum that prints as its value on every Python version, so messages, store values
    and JSON keep the plain words (``enum.StrEnum`` needs 3.11)."""

    def __str__(self) -> str:
        return str(self.value)


class RunMode(WireEnum):
    """The role of this pytest process, chosen once at configure time."""

    RANK = "rank"  # a rank process the spawn-mode controller started (harness.spawn.rank_main)
    TORCHRUN = "torchrun"  # one rank of ``torchrun -m pytest``
    CONTROLLER = "controller"  # plain pytest, or an xdist worker: spawns the buckets


def run_mode() -> RunMode:
    """RANK inside a spawned rank, TORCHRUN under torchrun, else CONTROLLER."""
    if os.environ.get(ENV_RANK_PROCESS) == "1":
        return RunMode.RANK
    if os.environ.get("TORCHELASTIC_RUN_ID") or all(k in os.environ for k in TORCHRUN_ENV):
        return RunMode.TORCHRUN
    return RunMode.CONTROLLER


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


def key_failed(seq: int) -> str:
    return f"failed/{seq}"


def key_stack(dump: int, rank: int) -> str:
    return f"stack/{dump}/{rank}"


def key_info(rank: int) -> str:
    return f"info/{rank}"


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
