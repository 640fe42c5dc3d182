"""One cell of the suite (one implementation, one size, one repetition) in a process of its own.

    python -m bench.cell --impl ours-z3 --size 1.3b --rep 1 --result row.json [--steps 8 --warmup 3]
    torchrun --standalone --nproc-per-node 2 -m bench.cell --impl ours-z3 ...

``bench.suite`` starts one of these per (size, repetition, implementation), so the cell sees a
fresh CUDA context, allocator and process group: what one engine leaves allocated (Megatron-FSDP
kept 12 GiB at 1.3B and 25 GiB at 2.7B in a shared process) cannot make a later cell run out of
memory or change its numbers. The cell builds the implementation (``bench.impls``), runs
``--warmup`` steps, times ``--steps`` steps with CUDA events (one synchronise at the end) and
measures memory relative to what was allocated before the build: after build (params, grad
buffers, no optimizer state yet: torch's AdamW allocates it lazily), at rest after the warm-up
(optimizer state included, grads dropped by ``zero_grad``), the peak during the timed steps
(``peak_all_gib`` also covers the warm-up), and what is still allocated after everything was
deleted (``leak_mib``: the engine's own leftovers, which no other cell sees). Every number is
the max over ranks. Rank 0 writes the JSON row to ``--result``: ``"kind": "cell"``, or
``"kind": "error"`` with the exception (an OOM included) when any rank failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from bench import cli, impls, runtime
from bench.runtime import GIB, Env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--impl", choices=list(impls.IMPLS), required=True)
    p.add_argument("--size", choices=list(impls.SIZES), required=True)
    p.add_argument("--rep", type=cli.positive, default=1, help="repetition number, copied into the row")
    p.add_argument("--result", type=Path, required=True, help="where rank 0 writes the JSON row")
    cli.add_step_flags(p)
    cli.add_run_flags(p)
    return p.parse_args(argv)


def measure(env: Env, size: str, name: str, steps: int, warmup: int, micro_batch: int) -> dict:
    """Build, warm up, time, free: one cell. Returns the JSON row (numbers already max over ranks)."""
    cfg = impls.SIZES[size]
    base = runtime.allocated(env)
    t0 = time.monotonic()
    trainee = impls.build(name, cfg, env, micro_batch)
    runtime.sync(env)
    build_s = time.monotonic() - t0
    after_build = runtime.allocated(env) - base
    runtime.reset_peak(env)
    losses = [float(trainee.step()) for _ in range(warmup)]
    runtime.sync(env)
    rest = runtime.allocated(env) - base
    peak_warm = runtime.peak_allocated(env) - base
    runtime.reset_peak(env)
    timer = runtime.StepTimer(env)
    timer.mark()
    for _ in range(steps):
        loss = trainee.step()
        timer.mark()
    step_s = timer.durations()
    losses.append(float(loss))
    peak = runtime.peak_allocated(env) - base
    reserved = runtime.peak_reserved(env)
    del trainee, loss
    runtime.free_memory(env)
    leak = runtime.allocated(env) - base
    total = sum(step_s)
    m = runtime.all_max(env, [total, max(step_s), -min(step_s), peak, max(peak, peak_warm), after_build,
                              rest, reserved, leak, time.monotonic() - t0, build_s])
    tokens = micro_batch * cfg.seq * steps
    return {
        "kind": "cell", "size": size, "impl": name, "world": env.world,
        "tok_s_per_gpu": round(tokens / m[0], 1), "step_s": round(m[0] / steps, 5),
        "step_s_max": round(m[1], 5), "step_s_min": round(-m[2], 5),
        "step_s_median_rank": round(statistics.median(step_s), 5),
        "peak_gib": round(m[3] / GIB, 3), "peak_all_gib": round(m[4] / GIB, 3),
        "build_gib": round(m[5] / GIB, 3), "rest_gib": round(m[6] / GIB, 3),
        "reserved_peak_gib": round(m[7] / GIB, 3), "leak_mib": round(m[8] / 2**20, 1),
        "cell_s": round(m[9], 2), "build_s": round(m[10], 2),
        "loss_first": losses[0], "loss_last": losses[-1],
        "finite": all(math.isfinite(x) for x in losses),
        "n_params": impls.num_params_of(cfg), "seq": cfg.seq, "micro_batch": micro_batch,
        "steps": steps, "warmup": warmup,
    }


def write_row(path: Path, row: dict) -> None:
    """Write-then-rename: the driver reads a whole row or none."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(row))
    tmp.replace(path)


def run(env: Env, args: argparse.Namespace) -> int:
    error = None
    try:
        row = measure(env, args.size, args.impl, args.steps, args.warmup, args.micro_batch)
    except Exception as err:  # an OOM or an impl's own error: the row says so
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    if runtime.all_max(env, [1.0 if error else 0.0])[0] > 0:
        row = {"kind": "error", "size": args.size, "impl": args.impl, "reason": error or "failed on another rank"}
    row.update(rep=args.rep, pid=os.getpid(), device=runtime.device_name(env))
    if env.rank == 0:
        write_row(args.result, row)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli.with_env(args.device, lambda env: run(env, args), fake_world=args.fake_world)


if __name__ == "__main__":
    sys.exit(main())
