"""A 2-rank bucket whose tests are interleaved with skip-marked ones (self-test sample): the
skipped tests never reach the bucket, so they must not tear it down either."""
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=2, bucket="skips")


def _check(dist_env, record_property) -> None:
    record_property("pid", os.getpid())
    t = torch.ones(1, device=dist_env.device)
    dist.all_reduce(t)
    assert t.item() == 2.0


def test_a(dist_env, record_property):
    _check(dist_env, record_property)


@pytest.mark.skip(reason="sample: skipped between two runnable tests")
def test_b(dist_env, record_property):
    raise AssertionError("skipped tests never run")


@pytest.mark.skip(reason="sample: two skips in a row")
def test_c(dist_env, record_property):
    raise AssertionError("skipped tests never run")


def test_d(dist_env, record_property):
    _check(dist_env, record_property)


@pytest.mark.skip(reason="sample: skipped last")
def test_e(dist_env, record_property):
    raise AssertionError("skipped tests never run")
