"""Run by the self-tests under ``torchrun --nproc-per-node 2 -m pytest`` (issue 52, item 19): a test whose
checkpoint load is refused, on every rank, and that goes on; the refused load's error is kept (as a
check that reports it later would), and with it the state dict, its DTensors, their mesh and the gloo
group under it. So that group is alive when pytest has finished, and its gloo threads run into
interpreter finalization.

A gloo thread that needs the GIL after finalization began (a worker running a collective's Python
callback, or dropping the Python tensors of its last collective) makes the rank die with SIGABRT,
"terminate called without an active exception", after its results were written. Left to timing, that
happened in about 1 run in 10; here it is made certain: at exit rank 0 leaves a collective on that
group pending with a Python callback, and rank 1 joins it ``LATE_S`` later, so the callback runs on
rank 0's worker while rank 0 finalizes. Each rank also prints how many threads it runs at exit.
Another test leaves a mesh over the harness's own group in DTensor's caches; the harness frees that
group itself when the session ends.

``SAMPLE_EXIT_FAIL=1`` adds a failing test, so the run's status is 1 (pytest's), not 0."""
import atexit
import os
import pathlib
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

LATE_S = 2.0
AT_IMPORT = len(os.listdir("/proc/self/task"))  # the main thread and the harness's watchdog
KEPT: list = []  # the refused load's error (its traceback holds the state dict, so the group)


@pytest.mark.distributed(world_size=2)
def test_refused_load_then_goes_on(dist_env, shared_tmp_path):
    group = dist.new_group(backend="gloo")
    mesh = DeviceMesh.from_group(group, "cpu")
    state = {"w": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])}
    (shared_tmp_path / "empty").mkdir(exist_ok=True)
    with pytest.raises(dcp.CheckpointException) as refused:  # no .metadata: refused on every rank
        dcp.load(state, checkpoint_id=str(shared_tmp_path / "empty"))
    KEPT.append((refused.value, state, group))
    assert float((state["w"] * 2).sum().full_tensor()) == 12.0  # the group still works after the refusal


@pytest.mark.distributed(world_size=2)
def test_dtensor_on_the_harness_group(dist_env):
    """DTensor's caches keep a mesh over the harness's own group: the harness frees that one itself."""
    x = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (2,)), [Shard(0)])
    assert float((x * 2).sum().full_tensor()) == 12.0


@pytest.mark.distributed(world_size=2)
@pytest.mark.skipif(os.environ.get("SAMPLE_EXIT_FAIL") != "1", reason="SAMPLE_EXIT_FAIL=1 makes the run fail")
def test_fails_on_purpose(dist_env):
    assert dist_env.rank < 0, "failing on purpose: the run's status is 1"


def _every_rank_got_here(timeout_s: float = 60.0) -> None:
    """A file barrier in ``HARNESS_SHARED_DIR``: once one rank has failed and ended, torchrun stops
    the others, so a rank still in pytest's teardown would never print its line (seen on a loaded
    2-core machine: rank 1 stopped before its exit handler ran). No rank goes on until all arrived."""
    shared = os.environ.get("HARNESS_SHARED_DIR")
    if not shared:
        return
    marks = [pathlib.Path(shared) / f"sample-exit-rank{r}" for r in range(int(os.environ["WORLD_SIZE"]))]
    marks[int(os.environ["RANK"])].touch()
    deadline = time.monotonic() + timeout_s
    while not all(m.exists() for m in marks) and time.monotonic() < deadline:
        time.sleep(0.05)


def _at_exit() -> None:
    """Runs after pytest has finished and before the harness's own exit handler."""
    print(f"[sample-exit] rank {os.environ['RANK']}: {len(os.listdir('/proc/self/task'))} thread(s) at exit, "
          f"{AT_IMPORT} at import", file=sys.stderr, flush=True)
    _every_rank_got_here()
    if not KEPT:
        return
    group = KEPT[0][2]  # the harness has destroyed the default group: the group's own methods only
    if group.rank() == 0:
        work = group.allreduce([torch.ones(2)])
        KEPT.append(work.get_future().then(lambda fut: fut.value()))  # runs on a gloo worker thread
        return
    time.sleep(LATE_S)
    try:
        group.allreduce([torch.ones(2)]).wait()
        print("[sample-exit] rank 1 joined rank 0's collective", file=sys.stderr, flush=True)
    except RuntimeError:  # rank 0 has ended already (without finalization): nobody to join
        print("[sample-exit] rank 1 found rank 0 ended", file=sys.stderr, flush=True)


atexit.register(_at_exit)
