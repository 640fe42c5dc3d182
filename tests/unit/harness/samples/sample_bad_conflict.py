import pytest


@pytest.mark.forked
@pytest.mark.distributed(world_size=2)
def test_both(dist_env):
    pass
