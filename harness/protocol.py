"""The controller <-> rank protocol: environment variables and TCPStore keys.

The controller hosts one TCPStore per bucket (on port 0, so concurrent buckets never collide). It
writes ``cmd/<seq>`` to tell every rank which test to run next; each rank answers ``res/<seq>/<rank>``
and bumps ``done/<seq>``; the last one sets ``all/<seq>``. Ranks therefore agree on each test's end
through the store, never through the process group.
"""
from __future__ import annotations

import json
from typing import Any

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
RANK_STORE_TIMEOUT_S = 24 * 3600.0


def key_cmd(seq: int) -> str:
    return f"cmd/{seq}"


def key_res(seq: int, rank: int) -> str:
    return f"res/{seq}/{rank}"


def key_done(seq: int) -> str:
    return f"done/{seq}"


def key_all(seq: int) -> str:
    return f"all/{seq}"


def key_ready(rank: int) -> str:
    return f"ready/{rank}"


def encode(obj: Any) -> bytes:
    return json.dumps(obj, default=repr).encode()


def decode(raw: bytes) -> Any:
    return json.loads(raw.decode())
