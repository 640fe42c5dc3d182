"""GPU-only requirements on a CPU machine skip with a reason naming what is missing."""
import pytest


@pytest.mark.requires_cuda
@pytest.mark.distributed(world_size=2)
def test_needs_cuda(dist_env):
    assert dist_env.device.type == "cuda"


@pytest.mark.requires_gpu_arch("sm90")
@pytest.mark.distributed(world_size=2)
def test_needs_hopper(dist_env):
    pass


@pytest.mark.requires_module("transformer_engine")
@pytest.mark.distributed(world_size=2)
def test_needs_te(dist_env):
    pass


@pytest.mark.requires_module("json")
@pytest.mark.distributed(world_size=2)
def test_has_json(dist_env):
    # gloo on CPU, or NCCL with one GPU per rank where enough GPUs are visible (the device run)
    assert (dist_env.backend, dist_env.device.type) in {("gloo", "cpu"), ("nccl", "cuda")}
