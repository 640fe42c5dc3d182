"""A plain torchrun suite, written as Megatron's unit tests are: no harness markers, ``setup_class``
initialises the default process group itself and ``teardown_class`` destroys it. Run by the
self-tests under ``torchrun --nproc-per-node 2 -m pytest`` with and without the harness plugin: the
outcomes must be the same.

The group is initialised once only: a second ``init_process_group`` through ``env://`` after a
destroy may read the first group's stale gloo addresses from the store (plain pytest as well)."""
import os

import pytest
import torch
import torch.distributed as dist


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


class TestPlainSuite:
    @classmethod
    def setup_class(cls):
        dist.init_process_group("gloo")

    @classmethod
    def teardown_class(cls):
        dist.destroy_process_group()

    def test_all_reduce(self):
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        assert t.item() == _world() * (_world() + 1) / 2

    def test_fails_on_last_rank_only(self):
        dist.barrier()
        assert dist.get_rank() != _world() - 1, "the last rank disagrees"

    def test_collectives_pair_up_after_a_one_rank_failure(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == _world()

    @pytest.mark.parametrize("n", [1, 3])
    def test_parametrized(self, n):
        t = torch.full((2,), float(n))
        dist.all_reduce(t)
        assert t.tolist() == [n * _world()] * 2

    def test_skipped_everywhere(self):
        pytest.skip("skipped on every rank")

    @pytest.mark.xfail(reason="fails on every rank", strict=True)
    def test_xfail(self):
        dist.barrier()
        raise AssertionError("expected")


def test_after_the_class_no_process_group_is_left():
    assert not dist.is_initialized()
