"""Where the host time of a training step goes: cProfile over a few steps of chosen implementations.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m bench.host_profile --impls ours-z3,ours-fp8-te-current     # FP8 TE cells need TransformerEngine

A step is host-bound when the GPU waits for the launches; ``bench.trace`` shows the idle GPU
time, this shows which Python functions fill it. Per implementation (``bench.impls`` plus the FP8
cells of ``bench.fp8_bench``): ``--warmup`` steps, then ``--steps`` steps timed with a device
sync after each (wall ms per step), then the same number of steps under ``cProfile`` (which
slows Python, so compare functions with each other, not with the wall time), printed as the
``--top`` functions by own time and by cumulative time (rank 0). All implementations run in one
process, one after the other; for throughput and memory use ``bench.suite``, which isolates them.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

from bench import cli, fp8_bench, impls, runtime
from bench.runtime import Env


def _wall_ms(env: Env, trainee: impls.Trainee, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainee.step()
        runtime.sync(env)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def _stats(prof: cProfile.Profile, key: str, top: int, steps: int) -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats(key).print_stats(top)
    return f"-- sorted by {key} (totals over {steps} steps) --\n" + buf.getvalue().split("\n", 4)[-1]


def run_one(env: Env, name: str, size: str, micro_batch: int, warmup: int, steps: int, top: int) -> None:
    trainee = impls.build(name, impls.SIZES[size], env, micro_batch)
    for _ in range(warmup):
        trainee.step()
    runtime.sync(env)
    wall = _wall_ms(env, trainee, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        trainee.step()
    runtime.sync(env)
    prof.disable()
    if env.rank == 0:
        print(f"\n==== {name}, {size}, world {env.world}: wall ms/step median {statistics.median(wall):.2f} "
              f"(min {min(wall):.2f}, max {max(wall):.2f})", flush=True)
        print(_stats(prof, "tottime", top, steps), flush=True)
        print(_stats(prof, "cumulative", top, steps), flush=True)
    del trainee
    runtime.free_memory(env)


def main(argv: list[str] | None = None) -> int:
    fp8_bench.register()
    p = cli.parser(__doc__)
    p.add_argument("--impls", type=cli.csv_list(list(impls.IMPLS)), default=["ours-z3", "ours-fp8-te-current"])
    p.add_argument("--size", choices=list(impls.SIZES), default="1.3b")
    cli.add_step_flags(p, steps=3)
    p.add_argument("--top", type=int, default=40, help="functions listed per table")
    cli.add_run_flags(p, fake_world=False)
    args = p.parse_args(argv)

    def body(env: Env) -> None:
        for name in args.impls:
            run_one(env, name, args.size, args.micro_batch, args.warmup, args.steps, args.top)
    return cli.with_env(args.device, body)


if __name__ == "__main__":
    sys.exit(main())
