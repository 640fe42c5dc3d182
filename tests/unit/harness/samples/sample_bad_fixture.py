import pytest


@pytest.mark.distributed(world_size=2)
def test_pytester(dist_env, pytester):
    pass
