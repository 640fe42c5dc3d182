"""Ranks sharing ONE GPU: the collective emulation, and the world-N memory breakdown built on it.

NCCL refuses two ranks on one GPU, so here the ranks use gloo, and the four collectives the
engines call (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
``broadcast``) are replaced by versions that stage CUDA tensors through host memory;
``DTensor.full_tensor`` (whose functional collectives crash gloo on CUDA tensors) gathers on the
host, and meshes ``fsdp_impl.fully_shard`` builds itself are put on CUDA. It swaps module
attributes of ``torch.distributed``, which nothing in the product may do: it is for development
on a machine with one GPU only. What it measures holds where the transport does not matter:
collective counts and groups, losses, grads, errors, and *per-process* allocations (every rank's
``max_memory_allocated`` is its own). Never timing.

    python -m bench.shared_gpu [--world 2] [--size 1.3b] [--impls ours-z3,fsdp2]

prints ``bench.memory``'s breakdown of one step after two warm-up steps (rank 0), per impl, as
``bench.trace`` does at a real world size. ``tests/tools/world2_on_one_gpu.py`` runs test
functions the same way.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

STAGED_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")


def staged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with CUDA tensor arguments copied to the host, and results copied back, synchronously."""
    def call(*args: Any, **kwargs: Any) -> None:
        host_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        host_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        host_kwargs.pop("async_op", None)  # finished on return; the None work handle is
        # what our engine ignores and what FSDP2 skips waiting on (it waits only on a real Work)
        fn(*host_args, **host_kwargs)
        for a, h in zip(args, host_args, strict=True):
            if isinstance(a, torch.Tensor) and a.is_cuda:
                a.copy_(h)
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.copy_(host_kwargs[k])
    return call


def host_full_tensor(self: Any, *, grad_placements: Any = None) -> torch.Tensor:
    """``DTensor.full_tensor`` through ``all_gather_object`` (shards of any size, one mesh dim at a time)."""
    local, mesh = self.to_local(), self.device_mesh
    for dim, placement in enumerate(self.placements):
        if mesh.size(dim) == 1 or placement.is_replicate():
            continue
        if not placement.is_shard():
            raise NotImplementedError(f"host full_tensor: placement {placement} on mesh dim {dim}")
        parts: list[Any] = [None] * mesh.size(dim)
        dist.all_gather_object(parts, local.detach().cpu(), group=mesh.get_group(dim))
        local = torch.cat(parts, dim=placement.dim).to(self.device)
    return local


def install_emulation() -> None:
    """Swap in the staged collectives, the host ``full_tensor`` and CUDA default meshes (per process)."""
    from torch.distributed.tensor import DTensor

    import fsdp_impl.mesh
    for op in STAGED_OPS:
        setattr(dist, op, staged(getattr(dist, op)))
    DTensor.full_tensor = host_full_tensor  # type: ignore[method-assign]
    fsdp_impl.mesh.default_device_type = lambda: "cuda"  # type: ignore[attr-defined]


def init_rank(rank: int, world: int, port: int) -> None:
    """Join the gloo group of ranks sharing GPU 0 and install the emulation (in each spawned rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_emulation()


def _measure(rank: int, world: int, port: int, size: str, names: list[str]) -> None:
    init_rank(rank, world, port)
    from bench import impls, memory, runtime
    env = runtime.Env(rank, world, 0, torch.device("cuda", 0))
    reports = []
    for name in names:
        trainee = impls.build(name, impls.SIZES[size], env, 4)
        for _ in range(2):
            trainee.step()
        reports.append(memory.measure(name, trainee, env))
        del trainee
        runtime.free_memory(env)
        dist.barrier()
    if rank == 0:
        print(f"# Memory, {size}, world {world} as ranks sharing one GPU (bench.shared_gpu)\n", flush=True)
        print(memory.markdown(reports), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from bench import cli, impls

    p = cli.parser(__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks sharing the GPU (default 2)")
    p.add_argument("--size", choices=list(impls.SIZES), default="1.3b")
    p.add_argument("--impls", type=cli.csv_list(list(impls.IMPLS)), default=["ours-z3", "fsdp2"])
    p.add_argument("--port", type=int, default=29631)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the point is to share one between ranks)")
    mp.spawn(_measure, args=(args.world, args.port, args.size, args.impls), nprocs=args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
