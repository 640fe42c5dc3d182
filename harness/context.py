"""What a test running inside a rank can learn about its distributed environment.

Lives in ``config.stash`` of the rank-side pytest session (no module globals); the plugin's fixtures
read it from there.
"""
from __future__ import annotations

import dataclasses
import pathlib

import pytest


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Returned by the ``dist_env`` fixture."""

    rank: int
    world_size: int
    local_rank: int
    device: object  # a torch.device; typed loosely so importing this module does not import torch
    backend: str
    store_port: int | None = None


@dataclasses.dataclass
class RankState:
    """Per-rank-process state: the environment plus the directories of the current test."""

    env: DistEnv
    session_shared_dir: pathlib.Path
    shared_tmp: pathlib.Path | None = None
    unshared_reason: str | None = None  # torchrun across nodes: why the shared directories are not shared


RANK_STATE_KEY = pytest.StashKey[RankState]()
