import pytest


@pytest.mark.distributed(world_size=2, ranks=3)
def test_unknown(dist_env):
    pass
