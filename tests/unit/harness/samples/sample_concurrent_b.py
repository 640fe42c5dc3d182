"""Bucket B of the xdist concurrency self-test."""
import pytest
from sample_concurrent_a import meet

pytestmark = pytest.mark.distributed(world_size=2, timeout=450)


def test_bucket_b(dist_env, session_shared_tmp_path, record_property):
    meet("b", "a", session_shared_tmp_path, record_property, dist_env)
