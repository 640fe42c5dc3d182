"""Entry point of one rank process: ``python -m harness.spawn.rank_main``.

Sets up crash forensics, joins the bucket's process group through the controller's TCPStore, then
runs an in-process pytest session driven by :class:`harness.spawn.rank_session.RankSession`.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import sys


def _device(device_type: str) -> object:
    import torch

    if device_type == "cuda":
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds exactly this rank's GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def main() -> int:
    from harness import protocol
    from harness.spawn import rank_faults

    env = os.environ
    rank_faults.install(env[protocol.ENV_FAULT_FILE], int(env.get(protocol.ENV_CONTROLLER_PID, "0")))

    import pytest
    import torch.distributed as dist

    from harness import numerics
    from harness.context import DistEnv, RankState
    from harness.spawn.rank_session import RankSession

    numerics.apply_from_env()  # pinned numerics' in-process part, before any test computes
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    port = int(env[protocol.ENV_STORE_PORT])
    store = dist.TCPStore(
        env[protocol.ENV_STORE_HOST], port, is_master=False,
        timeout=datetime.timedelta(seconds=protocol.RANK_STORE_TIMEOUT_S),
    )
    backend = env[protocol.ENV_BACKEND]
    device = _device(env[protocol.ENV_DEVICE_TYPE])
    pg_store = dist.PrefixStore(protocol.PG_PREFIX, store)
    dist.init_process_group(backend, store=pg_store, rank=rank, world_size=world_size)
    dist_env = DistEnv(rank=rank, world_size=world_size, local_rank=int(env["LOCAL_RANK"]),
                       device=device, backend=backend, store_port=port)
    state = RankState(env=dist_env, session_shared_dir=pathlib.Path(env[protocol.ENV_SESSION_SHARED]))
    session = RankSession(store, state)
    args = protocol.decode(env[protocol.ENV_PYTEST_ARGS])
    code = pytest.main(args, plugins=[session])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # the bucket is ending; a broken group must not turn a pass into a hang
        print(f"[harness] rank {rank}: destroy_process_group failed: {exc!r}", file=sys.stderr)
    return int(code)


def _end() -> None:
    """Nothing the tests started outlives the rank (it is their subreaper, see ``harness.proc_tree``)."""
    from harness import proc_tree

    proc_tree.kill_tree(os.getpid(), include_root=False)
    proc_tree.reap_children()
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    _real_exit = os._exit  # main() wraps os._exit for forensics; a normal end must not dump a stack
    try:
        _rc = main()
    finally:
        _end()
    _real_exit(0 if _rc in (0, 5) else _rc)
