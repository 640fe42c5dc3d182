"""Single-process fixtures for the checkpoint unit tests (no process group: DCP runs in no-dist mode)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _quiet_dcp_no_dist_warning() -> Iterator[None]:
    """DCP warns that it runs without a process group; that is the point of these tests."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield
