"""Throughput and memory of every implementation, in ONE process group, with alternating repetitions.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc-per-node 2 bench/suite.py --sizes 1.3b --reps 3 --out suite.jsonl

Order: for each size, repetition 1 runs every implementation once (A B C ...), then repetition 2
(A B C ...), and so on, so slow drifts (clocks, temperature, the neighbour's traffic) hit all
implementations alike; the table shows the median over repetitions and its min–max.

Each cell builds its model fresh (``bench.impls``), runs ``--warmup`` steps, then times ``--steps``
steps with CUDA events (one synchronise at the end) and frees everything before the next cell.
Memory is measured relative to what was allocated before the build: after build (params, grads
buffers, no optimizer state yet: torch's AdamW allocates it lazily), at rest after the warm-up
steps (optimizer state included, grads dropped by ``zero_grad``), and the peak during the timed
steps (``peak_all_gib`` in the JSON also covers the warm-up). Every number is the max over ranks.

``--time-budget-s`` stops starting cells that would not finish in time (estimated from the cells
measured so far) and says which were skipped. ``--device cpu --sizes tiny`` runs the whole loop on
CPU/gloo (smoke test; the numbers mean nothing there).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

START = time.monotonic()

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import impls, report, runtime  # noqa: E402
from bench.runtime import GIB, Env  # noqa: E402


def csv_list(choices: list[str]):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; allowed values: {','.join(choices)}")
        return items
    return parse


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=csv_list(list(impls.SIZES)), default=["1.3b"],
                   help="comma-separated model sizes, run in this order (default 1.3b)")
    p.add_argument("--impls", type=csv_list(list(impls.IMPLS)), default=list(impls.DEFAULT_IMPLS),
                   help="comma-separated implementations, alternated in this order (default: all)")
    p.add_argument("--reps", type=_positive, default=3, help="repetitions per cell (median reported)")
    p.add_argument("--steps", type=_positive, default=8, help="timed steps per cell")
    p.add_argument("--warmup", type=_positive, default=3, help="untimed steps per cell before timing")
    p.add_argument("--micro-batch", type=_positive, default=4)
    p.add_argument("--out", type=Path, default=Path("suite.jsonl"), help="JSON lines (overwritten)")
    p.add_argument("--md", type=Path, default=None, help="also write the markdown table here")
    p.add_argument("--time-budget-s", type=float, default=math.inf,
                   help="start no cell that would end later than this many seconds after start-up")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--fake-world", type=_positive, default=None, metavar="N",
                   help="one process as rank 0 of N >= 2 whose collectives move nothing (torch's fake "
                        "backend; no torchrun): each engine's step without communication at world N")
    p.add_argument("--trace-impls", type=csv_list(list(impls.IMPLS)), default=[],
                   help="after the cells, profile these impls (bench/trace.py) in the same process group")
    p.add_argument("--trace-size", choices=list(impls.SIZES), default="1.3b")
    p.add_argument("--trace-dir", type=Path, default=Path("."), help="where trace.md, timeline.png go")
    return p.parse_args(argv)


def plan(sizes: list[str], names: list[str], reps: int) -> list[tuple[str, int, str]]:
    """(size, repetition, impl): size-major, implementations alternating inside each repetition."""
    return [(s, r, n) for s in sizes for r in range(1, reps + 1) for n in names]


class Budget:
    """Predicts a cell's wall time from the cells measured so far (same size and impl, else the
    slowest cell of that size, else the slowest cell scaled by parameter count)."""

    def __init__(self, limit_s: float, start: float = START) -> None:
        self.limit_s, self.start = limit_s, start
        self.seconds: dict[tuple[str, str], float] = {}

    def record(self, size: str, impl: str, seconds: float) -> None:
        self.seconds[(size, impl)] = max(seconds, self.seconds.get((size, impl), 0.0))

    def estimate(self, size: str, impl: str) -> float:
        if (size, impl) in self.seconds:
            return self.seconds[(size, impl)]
        same = [t for (s, _), t in self.seconds.items() if s == size]
        if same:
            return max(same)
        if not self.seconds:
            return 0.0
        n = impls.num_params_of(impls.SIZES[size])
        return max(t * n / impls.num_params_of(impls.SIZES[s]) for (s, _), t in self.seconds.items())

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def fits(self, size: str, impl: str) -> bool:
        return self.elapsed() + self.estimate(size, impl) <= self.limit_s


def measure(env: Env, size: str, name: str, args: argparse.Namespace) -> dict:
    """Build, warm up, time, free: one cell. Returns the JSON row (numbers already max over ranks)."""
    cfg = impls.SIZES[size]
    base = runtime.allocated(env)  # the previous cell freed its memory (its leak_mib says how well)
    t0 = time.monotonic()
    trainee = impls.build(name, cfg, env, args.micro_batch)
    runtime.sync(env)
    build_s = time.monotonic() - t0
    after_build = runtime.allocated(env) - base
    runtime.reset_peak(env)
    losses = [float(trainee.step()) for _ in range(args.warmup)]
    runtime.sync(env)
    rest = runtime.allocated(env) - base
    peak_warm = runtime.peak_allocated(env) - base
    runtime.reset_peak(env)
    timer = runtime.StepTimer(env)
    timer.mark()
    for _ in range(args.steps):
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
    tokens = args.micro_batch * cfg.seq * args.steps
    return {
        "kind": "cell", "size": size, "impl": name, "world": env.world,
        "tok_s_per_gpu": round(tokens / m[0], 1), "step_s": round(m[0] / args.steps, 5),
        "step_s_max": round(m[1], 5), "step_s_min": round(-m[2], 5),
        "step_s_median_rank": round(statistics.median(step_s), 5),
        "peak_gib": round(m[3] / GIB, 3), "peak_all_gib": round(m[4] / GIB, 3),
        "build_gib": round(m[5] / GIB, 3), "rest_gib": round(m[6] / GIB, 3),
        "reserved_peak_gib": round(m[7] / GIB, 3), "leak_mib": round(m[8] / 2**20, 1),
        "cell_s": round(m[9], 2), "build_s": round(m[10], 2),
        "loss_first": losses[0], "loss_last": losses[-1],
        "finite": all(math.isfinite(x) for x in losses),
        "n_params": impls.num_params_of(cfg), "seq": cfg.seq, "micro_batch": args.micro_batch,
        "steps": args.steps, "warmup": args.warmup,
    }


class Writer:
    """Rank 0 writes JSON lines (flushed per row, so a crash keeps what was measured) and prints."""

    def __init__(self, env: Env, path: Path) -> None:
        self.env = env
        self.rows: list[dict] = []
        self.file = path.open("w") if env.rank == 0 else None

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def say(self, text: str) -> None:
        if self.env.rank == 0:
            print(f"[suite {time.monotonic() - START:6.1f}s] {text}", flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _skip_reason(env: Env, size: str, name: str, args: argparse.Namespace, budget: Budget) -> str | None:
    reason = impls.unavailable_reason(name, env.world, env.fake)
    if reason is None and env.is_cuda:
        need = impls.estimated_bytes(name, impls.SIZES[size], args.micro_batch, env.world)
        if need > 0.92 * runtime.total_memory(env):
            reason = f"would not fit: about {need / GIB:.0f} GiB needed"
    if reason is None and not runtime.rank0_decides(env, budget.fits(size, name)):
        reason = (f"time budget: {budget.elapsed():.0f}s elapsed + about {budget.estimate(size, name):.0f}s "
                  f"> {budget.limit_s:.0f}s")
    return reason


def run_cells(env: Env, args: argparse.Namespace, out: Writer) -> None:
    budget = Budget(args.time_budget_s)
    for size, rep, name in plan(args.sizes, args.impls, args.reps):
        where = f"{size} {name} rep {rep}/{args.reps}"
        reason = _skip_reason(env, size, name, args, budget)
        if reason is not None:
            out.write({"kind": "skip", "size": size, "impl": name, "rep": rep, "reason": reason})
            out.say(f"{where}: skipped ({reason})")
            continue
        error = None
        try:
            row = measure(env, size, name, args)
        except Exception as err:  # an OOM or an impl's own error: record it, keep going
            error = f"{type(err).__name__}: {err}"
            if env.rank == 0:
                traceback.print_exc()
        failed = runtime.all_max(env, [1.0 if error else 0.0])[0] > 0
        if failed:
            runtime.free_memory(env)
            out.write({"kind": "error", "size": size, "impl": name, "rep": rep,
                       "reason": error or "failed on another rank"})
            out.say(f"{where}: ERROR {error or 'on another rank'}")
            continue
        row["rep"] = rep
        budget.record(size, name, row["cell_s"])
        out.write(row)
        out.say(f"{where}: {row['tok_s_per_gpu']:,.0f} tok/s/GPU, step {1e3 * row['step_s']:.1f} ms, "
                f"peak {row['peak_gib']:.2f} GiB, loss {row['loss_first']:.3f}->{row['loss_last']:.3f} "
                f"(cell {row['cell_s']:.1f}s)")


def meta_row(env: Env, args: argparse.Namespace) -> dict:
    import torch

    return {"kind": "meta", "world": env.world, "fake": env.fake, "device": runtime.device_name(env),
            "torch": torch.__version__,
            "sizes": args.sizes, "impls": args.impls, "reps": args.reps, "steps": args.steps,
            "warmup": args.warmup, "micro_batch": args.micro_batch, "setups": impls.setups(args.impls),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = runtime.init(args.device, fake_world=args.fake_world or 0)
    out = Writer(env, args.out)
    out.write(meta_row(env, args))
    out.say(f"world {env.world} on {runtime.device_name(env)}; {len(plan(args.sizes, args.impls, args.reps))} "
            f"cells, budget {args.time_budget_s:.0f}s")
    try:
        run_cells(env, args, out)
        if env.rank == 0:
            text = report.markdown(out.rows)
            print(text, flush=True)
            if args.md is not None:
                args.md.write_text(text)
        if args.trace_impls:
            from bench import trace

            trace.run(env, args.trace_size, args.trace_impls, args.trace_dir, args.micro_batch, say=out.say)
    finally:
        out.close()
        runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
