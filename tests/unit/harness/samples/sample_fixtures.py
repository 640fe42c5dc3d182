"""Fixtures and pytest features inside ranks (self-test sample)."""
import os

import pytest
import torch
import torch.distributed as dist

SETUPS: list[int] = []


@pytest.fixture(scope="module")
def module_resource():
    SETUPS.append(os.getpid())
    yield len(SETUPS)


@pytest.mark.distributed(world_size=3)
class TestInRanks:
    def test_shared_tmp_is_shared(self, dist_env, shared_tmp_path, tmp_path):
        assert list(shared_tmp_path.iterdir()) == [] or dist.get_rank() >= 0
        (shared_tmp_path / f"rank{dist_env.rank}").write_text("x")
        (tmp_path / "mine").write_text(str(dist_env.rank))
        dist.barrier()
        assert sorted(p.name for p in shared_tmp_path.iterdir()) == ["rank0", "rank1", "rank2"]
        paths = [None] * 3
        dist.all_gather_object(paths, (str(shared_tmp_path), str(tmp_path)))
        assert len({p[0] for p in paths}) == 1, paths
        assert len({p[1] for p in paths}) == 3, paths

    def test_shared_tmp_fresh_per_test(self, shared_tmp_path):
        assert list(shared_tmp_path.iterdir()) == []

    def test_module_fixture_once_per_rank(self, module_resource):
        assert module_resource == 1

    def test_module_fixture_again(self, module_resource):
        assert module_resource == 1 and len(SETUPS) == 1

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("tag", ["a", None, 3])
    def test_parametrized(self, dtype, tag, dist_env):
        t = torch.ones(2, dtype=dtype, device=dist_env.device) * (dist_env.rank + 1)
        dist.all_reduce(t)
        assert t.tolist() == [6.0, 6.0]

    def test_env(self, dist_env):
        assert dist_env.world_size == dist.get_world_size() == 3
        assert dist_env.rank == dist.get_rank()
        assert dist_env.local_rank == dist_env.rank
        assert isinstance(dist_env.device, torch.device)
        assert dist_env.backend == dist.get_backend()

    @pytest.mark.xfail(reason="expected to fail on every rank", strict=True)
    def test_xfail(self):
        raise AssertionError()

    def test_skip_everywhere(self):
        pytest.skip("skipped on every rank")

    def test_skip_on_one_rank_only(self, dist_env):
        if dist_env.rank == 1:
            pytest.skip("only rank 1 skips")

    def test_monkeypatch(self, monkeypatch):
        monkeypatch.setenv("HARNESS_SAMPLE_VAR", "1")
        assert os.environ["HARNESS_SAMPLE_VAR"] == "1"


@pytest.mark.distributed(world_size=2, bucket="ckpt-writer")
def test_session_shared_write(dist_env, session_shared_tmp_path):
    (session_shared_tmp_path / f"ckpt-{dist_env.rank}").write_text(str(os.getpid()))
    dist.barrier()


@pytest.mark.distributed(world_size=3, bucket="ckpt-reader")
def test_session_shared_read(dist_env, session_shared_tmp_path):
    pids = {(session_shared_tmp_path / f"ckpt-{r}").read_text() for r in range(2)}
    assert len(pids) == 2 and str(os.getpid()) not in pids


def test_plain_single_process():
    assert not dist.is_initialized()
