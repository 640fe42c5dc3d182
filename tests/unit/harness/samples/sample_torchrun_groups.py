"""Run by the self-tests under ``torchrun --nproc-per-node 2 -m pytest``: a plain suite written as
Megatron's ``test_mfsdp_fully_shard.py`` is. Every test builds a ``DeviceMesh`` (and a subgroup) and
drops it without destroying its process groups; each gloo group keeps an event-loop thread that wakes
every 10 ms, so in one long session they pile up until the ranks starve (issue 52, item 18). The
harness destroys what no test can reach any more between tests; groups the suite still holds (a module
global, a mesh kept by the class, even one that holds its groups by name only) must keep working."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

N_TESTS = 12
N_DTENSOR_TESTS = 4  # each leaves its mesh's one size-1 group per rank, held by DTensor's caches only
SUITE_GROUPS = 2  # per rank: KEPT's group and the class mesh's "tp" group
PER_TEST = 3  # per rank: the mesh's two size-1 dimensions and the test's own subgroup
KEPT: dict = {}


def live_groups() -> list:
    """This rank's process groups other than the default one."""
    return [pg for pg in c10d._world.pg_map if pg is not c10d.GroupMember.WORLD]


class TestMeshPerTest:
    @classmethod
    def setup_class(cls):
        dist.init_process_group("gloo")
        KEPT["group"] = dist.new_group([0, 1])
        cls.mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        # Stand in for a mesh that holds its groups by name only (and resolves them when used).
        getattr(cls.mesh, "_pg_registry", {}).clear()

    @classmethod
    def teardown_class(cls):
        dist.destroy_process_group()

    @pytest.mark.parametrize("i", range(N_TESTS))
    def test_mesh_per_test(self, i):
        mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("outer", "shard", "tp"))
        mesh[("outer", "shard")]._flatten("dp")
        sub = dist.new_group([0, 1])
        gathered = [None, None]
        dist.all_gather_object(gathered, (i, dist.get_rank()), group=sub)
        assert gathered == [(i, 0), (i, 1)]
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh["tp"].get_group())  # a size-1 group of its own
        dist.barrier()
        del mesh, sub  # as Megatron's destroy_device_mesh: the groups stay registered

    @pytest.mark.parametrize("i", range(N_DTENSOR_TESTS))
    def test_dtensor_op_per_test(self, i):
        """After the test only torch's DTensor caches (sharding propagation, mesh topology) still hold
        its mesh: the harness empties them before it looks, so the mesh's group goes too."""
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("outer", "shard"))
        x = distribute_tensor(torch.arange(4.0).reshape(4, 1), mesh, [Replicate(), Shard(0)])
        assert float((x * 2 + i).sum().full_tensor()) == 12.0 + 4 * i
        del mesh, x

    def test_groups_the_suite_holds_still_work(self):
        t = torch.ones(1)
        dist.all_reduce(t, group=KEPT["group"])
        assert t.item() == 2.0
        t = torch.ones(1)
        dist.all_reduce(t, group=self.mesh.get_group("tp"))
        assert t.item() == 1.0

    def test_groups_left_behind_do_not_pile_up(self):
        live = live_groups()
        threads = len(os.listdir("/proc/self/task"))
        assert len(live) <= SUITE_GROUPS + PER_TEST, (
            f"{len(live)} process groups alive on rank {dist.get_rank()} after {N_TESTS + N_DTENSOR_TESTS} tests "
            f"that each left some behind ({threads} threads): the harness did not destroy what no test can reach")
