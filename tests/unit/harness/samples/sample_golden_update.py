"""Pinned numerics in rank processes, and ``--golden-update`` that writes only what passed on every rank
(run by tests/unit/harness/test_golden_ranks.py with --golden-update --golden-dir <tmp>)."""
import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
@pytest.mark.pinned_numerics
def test_pinned(dist_env):
    from harness import numerics

    assert os.environ["ATEN_CPU_CAPABILITY"] == "default" and os.environ["MKL_CBWR"] == "COMPATIBLE"
    assert str(torch.backends.cpu.get_cpu_capability()) == "DEFAULT"
    assert not torch.backends.mkldnn.enabled and torch.get_num_threads() == 1
    assert numerics.mode() == "pinned" and numerics.cpu_fingerprint()["numerics"] == "pinned"


@pytest.mark.distributed(world_size=2)
def test_unpinned(dist_env):
    from harness import numerics

    assert numerics.mode() == "default" and torch.backends.mkldnn.enabled
    assert os.environ.get("ATEN_CPU_CAPABILITY") != "default"


@pytest.mark.distributed(world_size=2)
def test_update_then_rank1_fails(dist_env, golden):
    golden.check("failing", {"loss": [1.0, 2.0]})
    assert dist.get_rank() == 0, "rank 1 fails after the update"


@pytest.mark.distributed(world_size=2)
def test_update_passes(dist_env, golden):
    golden.check("passing", {"loss": [1.0, 2.0]})
