"""Run multi-rank GPU test functions as N processes sharing ONE GPU, for when no multi-GPU machine is lent.

NCCL refuses two ranks on one GPU, so the ranks use gloo, and the four collectives the engine
calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, ``broadcast``) are
replaced by versions that stage CUDA tensors through host memory; ``DTensor.full_tensor`` (which
tests use, and whose functional collectives crash gloo on CUDA tensors) gathers on the host too,
and meshes ``fully_shard`` builds itself are put on CUDA. This is a development probe, not a
substitute for the NCCL run: it checks what does not depend on the transport (collective counts
and groups, losses, grads, errors), never speed, and it swaps module attributes of
``torch.distributed``, which nothing in the product may do.

    python -m tests.tools.world2_on_one_gpu [--world 2] CASE [CASE ...]

A CASE is ``module.function[:arg...]`` or ``module.Class.method[:arg...]`` under
``tests/functional``; the ``dist_env`` fixture is passed last (first for methods, as pytest's
``self, dist_env`` order), args are names in ``NAMED``, Python literals, or bare words (strings). Every case runs on
every rank; each prints ``[rN] PASS|FAIL|SKIP case``. A crash (segfault, CUDA error) poisons
the processes: run suspicious cases in their own invocation. Exit status 1 if any case failed.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STAGED_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")
NAMED: dict[str, Any] = {
    "torch.float32": torch.float32,
    "EAGER": dict(fp32_main=False, meta=False, compile=False),
    "META_COMPILE": dict(fp32_main=True, meta=True, compile=True),
}


def staged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with CUDA tensor arguments copied to the host, and results copied back, synchronously."""
    def call(*args: Any, **kwargs: Any) -> None:
        host_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        host_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        host_kwargs.pop("async_op", None)  # done when it returns; callers here only use the sync form
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
    from torch.distributed.tensor import DTensor

    import fsdp_impl.mesh
    for op in STAGED_OPS:
        setattr(dist, op, staged(getattr(dist, op)))
    DTensor.full_tensor = host_full_tensor  # type: ignore[method-assign]
    fsdp_impl.mesh.default_device_type = lambda: "cuda"  # type: ignore[attr-defined]


def resolve(case: str) -> tuple[Callable[..., Any], list[Any], bool]:
    """(callable, args, is_method) for ``module.function:arg...`` / ``module.Class.method:arg...``."""
    name, *raw = case.split(":")
    module, *path = name.split(".")
    obj: Any = importlib.import_module("tests.functional." + module)
    is_method = False
    for part in path:
        obj = getattr(obj, part)
        if isinstance(obj, type):
            obj, is_method = obj(), True
    return obj, [parse_arg(a) for a in raw], is_method


def parse_arg(text: str) -> Any:
    """A name in ``NAMED``, a Python literal, or else the text itself (bare words stay strings)."""
    if text in NAMED:
        return NAMED[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def run_cases(rank: int, world: int, port: int, cases: list[str], failures: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_emulation()
    from harness.context import DistEnv
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cuda", 0), backend="gloo")
    for case in cases:
        try:
            fn, args, is_method = resolve(case)
            fn(env, *args) if is_method else fn(*args, env)
            print(f"[r{rank}] PASS {case}", flush=True)
        except pytest.skip.Exception as e:
            print(f"[r{rank}] SKIP {case}: {e}", flush=True)
        except Exception as e:  # report and go on: one case's failure is its own
            failures.value += 1
            print(f"[r{rank}] FAIL {case}: {''.join(traceback.format_exception_only(e)).strip()[:3000]}", flush=True)
            if os.environ.get("WORLD2_TRACEBACK"):
                traceback.print_exc()
        dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks sharing the GPU (default 2)")
    parser.add_argument("--port", type=int, default=29611, help="rendezvous port (default 29611)")
    parser.add_argument("cases", nargs="+", help="module.function[:arg...] under tests/functional")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the point is to share one between ranks)")
    failures = mp.get_context("spawn").Value("i", 0)
    mp.spawn(run_cases, args=(opts.world, opts.port, opts.cases, failures), nprocs=opts.world)
    return 1 if failures.value else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
