"""Throughput and memory of every implementation, each cell in a fresh process, with alternating repetitions.

    python -m bench.suite --sizes 1.3b --reps 3 --out suite.jsonl                  # world 1
    python -m bench.suite --nproc-per-node 2 --sizes 1.3b --reps 3 --out suite.jsonl
    torchrun --standalone --nproc-per-node 2 -m bench.suite ...                     # the same (one node)
    python -m bench.suite --fake-world 2 --sizes 1.3b                               # world 2, no communication

This process is the driver: it holds no GPU and no process group. For each size, repetition 1
runs every implementation once (A B C ...), then repetition 2 (A B C ...), and so on, so slow
drifts (clocks, temperature, the neighbour's traffic) hit all implementations alike; the table
shows the median over repetitions and its min–max. Every (size, repetition, implementation) cell
is its own process (``bench.cell``; a ``torchrun`` of it when the world has several ranks):
alternation needs the implementations interleaved, and isolation needs no two engines alive in
one process or at one time, so a repetition cannot share a process with the next one. The
start-up (about 5-15 s per cell: interpreter, imports, process group) is outside the timed steps.
The cell writes its JSON row to a file; a cell that crashes, runs out of memory or time becomes
an ``error`` row with the reason and the run goes on.

``--source-tree LABEL=PATH`` with ``--impls NAME,NAME@LABEL`` alternates cells of another copy of
the sources with this one's, an A/B inside one run (``bench.source_trees``: two device runs may
land on hosts of different speed).

``--time-budget-s`` starts no cell that would not finish in time (estimated from the cells
measured so far, start-up included) and says which were skipped. ``--device cpu --sizes tiny``
runs the whole loop on CPU/gloo (a smoke test; the numbers mean nothing there).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import cli, impls, launch, report, source_trees
from bench.launch import World

START = time.monotonic()
CELL_FLAGS = ("steps", "warmup", "micro_batch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--sizes", type=cli.csv_list(list(impls.SIZES)), default=["1.3b"],
                   help="comma-separated model sizes, run in this order (default 1.3b)")
    p.add_argument("--impls", type=source_trees.impl_list(list(impls.IMPLS)), default=list(impls.DEFAULT_IMPLS),
                   help="comma-separated implementations, alternated in this order (default: all); "
                        "NAME@LABEL: NAME from the tree --source-tree LABEL=PATH (bench.source_trees)")
    p.add_argument("--source-tree", type=source_trees.tree, action="append", default=[], metavar="LABEL=PATH",
                   help="another copy of the sources (bench/, fsdp_impl/) whose cells --impls names as "
                        "NAME@LABEL, for an A/B inside one run; repeatable")
    p.add_argument("--reps", type=cli.positive, default=3, help="repetitions per cell (median reported)")
    cli.add_step_flags(p)
    cli.add_run_flags(p)
    p.add_argument("--nproc-per-node", type=cli.positive, default=None, metavar="N",
                   help="ranks per cell (a torchrun of N per cell); default: torchrun's world, else 1")
    cli.add_driver_flags(p, "suite.jsonl", "cell", 1200.0, "an error")
    p.add_argument("--trace-impls", type=cli.csv_list(list(impls.IMPLS)), default=[],
                   help="after the cells, profile these impls (bench.trace), each in its own process")
    p.add_argument("--trace-size", choices=list(impls.SIZES), default="1.3b")
    p.add_argument("--trace-dir", type=Path, default=Path("."), help="where trace.md, timeline.png go")
    args = p.parse_args(argv)
    args.source_trees = dict(args.source_tree)
    error = source_trees.check(args.impls, args.source_trees)
    if error is not None:
        p.error(error)
    return args


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


class Writer:
    """JSON lines, flushed per row (a killed driver keeps what was measured), and progress lines."""

    def __init__(self, path: Path) -> None:
        self.rows: list[dict] = []
        self.file = path.open("w")

    def write(self, row: dict) -> None:
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def say(self, text: str) -> None:
        print(f"[suite {time.monotonic() - START:6.1f}s] {text}", flush=True)

    def close(self) -> None:
        self.file.close()


def skip_reason(name: str, size: str, world: World, info: dict, micro_batch: int, budget: Budget) -> str | None:
    """Why this cell is not started (None: start it): unavailable here, too big, or out of time."""
    base = source_trees.split(name)[0]
    reason = impls.unavailable_reason(base, world.size, bool(world.fake_world))
    if reason is None and info.get("total_memory"):
        need = impls.estimated_bytes(base, impls.SIZES[size], micro_batch, world.size)
        if need > 0.92 * info["total_memory"]:
            reason = f"would not fit: about {need / 2**30:.0f} GiB needed"
    if reason is None and not budget.fits(size, name):
        reason = (f"time budget: {budget.elapsed():.0f}s elapsed + about {budget.estimate(size, name):.0f}s "
                  f"> {budget.limit_s:.0f}s")
    return reason


def cell_row(done: launch.Finished, result: Path, size: str, name: str, rep: int) -> dict:
    """The cell's own row when it wrote one (labelled ``name``: a cell from another source tree
    wrote its plain implementation name), else an error row saying how its process ended."""
    if result.exists():
        return dict(json.loads(result.read_text()), impl=name)
    return {"kind": "error", "size": size, "impl": name, "rep": rep, "reason": f"cell process {done.why()}"}


CellRunner = Callable[[str, str, int, Path], launch.Finished]


def cell_runner(world: World, args: argparse.Namespace) -> CellRunner:
    """Starts ``bench.cell`` for (size, impl, rep) writing to a result path, in ``world``; an
    ``NAME@LABEL`` impl from its source tree (``bench.source_trees``)."""
    env = launch.child_env(world)

    def start(size: str, name: str, rep: int, result: Path) -> launch.Finished:
        base, label = source_trees.split(name)
        argv = ["--impl", base, "--size", size, "--rep", str(rep), "--result", str(result),
                *cli.forward(args, CELL_FLAGS)]
        root = launch.REPO if label is None else args.source_trees[label]
        cell_env = env if label is None else source_trees.cell_env(env, launch.REPO, root)
        return launch.run(launch.command(world, "bench.cell", argv), cell_env, args.cell_timeout_s,
                          prefix=f"  [{size} {name} r{rep}] ", cwd=root)
    return start


def run_cells(args: argparse.Namespace, world: World, info: dict, out: Writer, start: CellRunner) -> None:
    budget = Budget(args.time_budget_s)
    with tempfile.TemporaryDirectory(prefix="bench-cells-") as tmp:
        for i, (size, rep, name) in enumerate(plan(args.sizes, args.impls, args.reps)):
            where = f"{size} {name} rep {rep}/{args.reps}"
            reason = skip_reason(name, size, world, info, args.micro_batch, budget)
            if reason is not None:
                out.write({"kind": "skip", "size": size, "impl": name, "rep": rep, "reason": reason})
                out.say(f"{where}: skipped ({reason})")
                continue
            result = Path(tmp) / f"cell{i}.json"
            done = start(size, name, rep, result)
            row = cell_row(done, result, size, name, rep)
            row["process_s"] = round(done.seconds, 2)
            budget.record(size, name, done.seconds)
            out.write(row)
            if row["kind"] != "cell":
                out.say(f"{where}: ERROR {row['reason']}")
                continue
            out.say(f"{where}: {row['tok_s_per_gpu']:,.0f} tok/s/GPU, step {1e3 * row['step_s']:.1f} ms, "
                    f"peak {row['peak_gib']:.2f} GiB, loss {row['loss_first']:.3f}->{row['loss_last']:.3f} "
                    f"(cell {row['cell_s']:.1f}s, process {done.seconds:.1f}s)")


def budget_text(seconds: float) -> str:
    return "none" if math.isinf(seconds) else f"{seconds:.0f}s"


def meta_row(args: argparse.Namespace, world: World, info: dict) -> dict:
    return {"kind": "meta", "world": world.size, "fake": bool(world.fake_world), "device": info["device"],
            "torch": info["torch"], "versions": info, "isolation": "one process per cell",
            "sizes": args.sizes, "impls": args.impls, "reps": args.reps, "steps": args.steps,
            "warmup": args.warmup, "micro_batch": args.micro_batch, "setups": setups(args),
            "source_trees": {label: str(root) for label, root in args.source_trees.items()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def setups(args: argparse.Namespace) -> dict[str, str]:
    """One line per implementation; a cell from another source tree says which."""
    lines = impls.setups([source_trees.split(n)[0] for n in args.impls])
    out = {}
    for name in args.impls:
        base, label = source_trees.split(name)
        out[name] = lines[base] + ("" if label is None else f" (source tree {label}: {args.source_trees[label]})")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = launch.driver_world(args.nproc_per_node, args.fake_world, args.device)
    if world is None:
        return 0  # a torchrun rank other than 0: rank 0 drives the cells
    launch.stop_children_on_signal()
    info = launch.probe(world.device)
    out = Writer(args.out)
    try:
        out.write(meta_row(args, world, info))
        out.say(f"{world.describe()} on {info['device']}; {len(plan(args.sizes, args.impls, args.reps))} "
                f"cells, each in its own process, budget {budget_text(args.time_budget_s)}")
        run_cells(args, world, info, out, cell_runner(world, args))
        text = report.markdown(out.rows)
        print(text, flush=True)
        if args.md is not None:
            args.md.write_text(text)
    finally:
        out.close()
    if args.trace_impls:
        from bench import trace

        trace.drive(world, args.trace_size, args.trace_impls, args.trace_dir, args.micro_batch, say=out.say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
