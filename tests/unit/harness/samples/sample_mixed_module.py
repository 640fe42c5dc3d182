"""A module whose local test comes before its distributed one (self-test sample). The controller
never runs the distributed item's setup or teardown itself, yet the local module scope must be torn
down after it, as pytest does after every item: ``sample_mixed_next.py`` checks that it was."""
import os

import pytest


@pytest.fixture(scope="module")
def local_module_resource():
    os.environ["HARNESS_SAMPLE_MIXED_TORN_DOWN"] = "no"
    yield
    os.environ["HARNESS_SAMPLE_MIXED_TORN_DOWN"] = "yes"


def test_mixed_local_first(local_module_resource):
    assert os.environ["HARNESS_SAMPLE_MIXED_TORN_DOWN"] == "no"


@pytest.mark.distributed(world_size=2)
def test_mixed_distributed_last(dist_env):
    assert dist_env.world_size == 2
