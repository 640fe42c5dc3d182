"""Faults under torchrun (self-test sample), chosen by ``HARNESS_SELFTEST_FAULT``: ``hang0``/``hang1``
(that rank sleeps in ``_hang_here``, the others finish), ``raise1`` (rank 1 raises while rank 0
blocks in a collective), ``crash0``/``crash1`` (that rank segfaults), ``sleep`` (every rank sleeps,
until the self-test sends SIGTERM to torchrun). Unmarked tests, as in a plain
suite whose module set-up initialises the process group."""
import ctypes
import os
import pathlib
import time

import torch
import torch.distributed as dist

FAULT = os.environ.get("HARNESS_SELFTEST_FAULT", "")


def setup_module():
    dist.init_process_group("gloo")
    where = os.environ.get("HARNESS_SELFTEST_PIDDIR")
    if where:
        (pathlib.Path(where) / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))


def teardown_module():
    dist.destroy_process_group()


def test_before():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def _hang_here() -> None:
    time.sleep(600)


def test_fault():
    rank = dist.get_rank()
    print(f"rank {rank} starts the faulty test", flush=True)
    where = os.environ.get("HARNESS_SELFTEST_PIDDIR")
    if where:
        (pathlib.Path(where) / f"rank{rank}.started").write_text("")
    if FAULT == f"hang{rank}" or FAULT == "sleep":
        _hang_here()
    elif FAULT == f"crash{rank}":
        ctypes.string_at(0)
    elif FAULT == "raise1":
        if rank == 1:
            raise ValueError("rank one raised before the collective")
        dist.all_reduce(torch.ones(1))


def test_after():
    dist.barrier()
