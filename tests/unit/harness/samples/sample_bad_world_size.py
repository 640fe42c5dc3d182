import pytest


@pytest.mark.distributed(world_size=0)
def test_zero(dist_env):
    pass
