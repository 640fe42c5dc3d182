"""Rank 1 collects one test more than the others: torchrun mode must refuse to run."""
import os

import pytest


@pytest.mark.distributed(world_size=2)
def test_common(dist_env):
    pass


if os.environ.get("RANK") == "1":
    def test_only_on_rank1():
        pass
