"""Bucket A of the xdist concurrency self-test: it waits until bucket B is up at the same time."""
import os
import pathlib
import time

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=2, timeout=450)


def meet(me: str, other: str, where: pathlib.Path, record_property, dist_env) -> None:
    record_property("store_port", dist_env.store_port)
    record_property("controller_pid", os.getppid())
    record_property("pid", os.getpid())
    record_property("cuda_visible_devices", os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))
    (where / f"{me}-rank{dist_env.rank}").write_text(str(dist_env.store_port))
    deadline = time.monotonic() + float(os.environ.get("HARNESS_SELFTEST_MEET_S", "400"))  # start-up is slow under load
    while not all((where / f"{other}-rank{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, f"bucket {other} never ran concurrently with bucket {me}"
        time.sleep(0.05)
    dist.barrier()


def test_bucket_a(dist_env, session_shared_tmp_path, record_property):
    meet("a", "b", session_shared_tmp_path, record_property, dist_env)
