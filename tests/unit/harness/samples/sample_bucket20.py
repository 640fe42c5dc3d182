"""Twenty trivial 4-rank tests: one bucket, one set of rank processes (self-test sample)."""
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=4)


@pytest.mark.parametrize("i", range(20))
def test_trivial(i, dist_env, record_property):
    record_property("pid", os.getpid())
    record_property("controller_pid", os.getppid())
    record_property("omp", f"{os.environ.get('OMP_NUM_THREADS')}/{torch.get_num_threads()}")
    t = torch.tensor([float(dist_env.rank + i)], device=dist_env.device)
    dist.all_reduce(t)
    assert t.item() == 6.0 + 4 * i
