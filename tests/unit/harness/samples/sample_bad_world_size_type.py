import pytest


@pytest.mark.distributed(world_size="2")
def test_str(dist_env):
    pass
