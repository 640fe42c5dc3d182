"""Run multi-rank GPU test functions as N processes sharing ONE GPU, for when no multi-GPU machine is lent.

The ranks use gloo with collectives staged through host memory (``bench/shared_gpu.py`` says how
and what that can show). This is a development probe, not a substitute for the NCCL run: it
checks what does not depend on the transport (collective counts and groups, losses, grads,
errors), never speed.

    python -m tests.tools.world2_on_one_gpu [--world 2] CASE [CASE ...]

A CASE is ``module.function[:arg...]`` or ``module.Class.method[:arg...]`` under
``tests/functional``; the ``dist_env`` fixture is passed last (first for methods, as pytest's
``self, dist_env`` order), args are names in ``NAMED``, Python literals, or bare words (strings).
Every case runs on every rank; each prints ``[rN] PASS|FAIL|SKIP case``. A crash (segfault, CUDA error) poisons
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

NAMED: dict[str, Any] = {
    "torch.float32": torch.float32,
    "EAGER": dict(fp32_main=False, meta=False, compile=False),
    "META_COMPILE": dict(fp32_main=True, meta=True, compile=True),
}


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
    from bench.shared_gpu import init_rank
    from harness.context import DistEnv

    init_rank(rank, world, port)
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
