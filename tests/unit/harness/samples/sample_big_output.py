"""Tests that print megabytes on one rank (self-test sample): output must never fail a test."""
import os
import sys

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=2)
LINE = "0123456789" * 10 + "\n"  # 101 characters


def _flood(rank: int, marker: str) -> None:
    if dist.get_rank() == rank:
        sys.stdout.write(LINE * 50_000)  # about 5 MB
        print(f"last line {marker}", flush=True)


def test_prints_5mb_and_passes(record_property):
    record_property("pid", os.getpid())
    _flood(1, "of the passing test")
    dist.barrier()


def test_prints_5mb_and_fails():
    _flood(0, "of the failing test")
    assert dist.get_rank() != 0, "rank zero fails after printing"


def test_next_test_same_bucket(record_property):
    record_property("pid", os.getpid())
    dist.barrier()
