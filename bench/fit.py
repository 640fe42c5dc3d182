"""The largest micro-batch each implementation trains on one device (issue 26), each probe a fresh process.

    python -m bench.fit --size 1.3b --impls ours-z3+ac,fsdp2+ac,ours-z3+sac,fsdp2+sac,ours-z3,fsdp2 \\
        [--start 4] [--max 256] [--granularity 1] [--steps 2 --warmup 1] \\
        [--cell-timeout-s S] [--time-budget-s S] --out fit.jsonl --md fit.md
    python -m bench.fit --device cpu --size tiny --impls ours-z3 --start 1 --max 4   # smoke run

The sequence is the size's (``bench.impls.SIZES``, 2048 from 0.35B up); the micro-batch is searched.
Per implementation: a probe at ``--start``, then doubling (capped at ``--max``) until a probe does
not train or ``--max`` trained, then bisection over the integers between the largest micro-batch
that trained and the smallest that did not (``--granularity G`` stops once they are at most G
apart; 1, the default, finds the exact limit). A start that does not fit bisects down from it.
Every probe is one ``bench.cell`` (the suite's cell, ``--steps`` timed steps after ``--warmup``
ones) in a process of its own, started as ``bench.suite`` starts its cells, so no probe sees the
memory, allocator or process group of another. The implementations take turns: each round gives
every unfinished search one probe, so a time budget cuts all of them short alike.

A probe is ``ok`` (its row: tokens/s, peak GiB), ``oom`` (the cell's error is an out-of-memory
one: torch's ``OutOfMemoryError``, "out of memory", cuBLAS failing to allocate), ``timeout`` (killed
after ``--cell-timeout-s``) or ``error`` (anything else, a process killed from outside included).
``oom`` and ``timeout`` bound the search from above; an ``error`` stops that implementation's
search and is reported as such (a crash says nothing about memory). ``--time-budget-s`` starts no
probe that would end after the budget (estimated from the slowest probe of that implementation so
far, as the suite estimates cells); the searches it cuts short are marked unfinished.

Output: ``--out`` gets JSON lines, flushed as they come: one ``meta`` row, one ``probe`` row per
probe (impl, size, seq, micro_batch, status, tokens_per_s, peak_gib, reason, process_s) and one
``fit`` row per implementation (the largest micro-batch that trained, its tokens/s and peak, the
first that failed and why, the probe count, whether the search finished). A line per probe goes to
stderr as it ends; the markdown (``--md``, and stdout) has one summary table, a row per
implementation, and each implementation's probes.
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import cli, impls, launch, suite
from bench.launch import World

DEFAULT_IMPLS = ("ours-z3+ac", "fsdp2+ac", "ours-z3+sac", "fsdp2+sac", "ours-z3", "fsdp2")
# Substrings of a cell's error reason that mean "does not fit in device memory".
OOM_MARKERS = ("OutOfMemoryError", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
BOUNDS = ("oom", "timeout")  # probe statuses that bound the search from above


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--size", choices=list(impls.SIZES), default="1.3b", help="model size (its seq is used)")
    p.add_argument("--impls", type=cli.csv_list(list(impls.IMPLS)), default=list(DEFAULT_IMPLS),
                   help="comma-separated implementations, probed in turns in this order")
    p.add_argument("--start", type=cli.positive, default=4, help="first micro-batch probed")
    p.add_argument("--max", type=cli.positive, default=256, help="largest micro-batch probed")
    p.add_argument("--granularity", type=cli.positive, default=1,
                   help="stop bisecting once the largest that trained and the smallest that did not are "
                        "at most this far apart (1: the exact limit)")
    cli.add_step_flags(p, steps=2, warmup=1, micro_batch=False)
    cli.add_run_flags(p)
    cli.add_driver_flags(p, "fit.jsonl", "probe", 600.0, "a timeout")
    args = p.parse_args(argv)
    if args.start > args.max:
        p.error(f"--start {args.start} is above --max {args.max}")
    return args


def next_micro_batch(ok: int, failed: int | None, start: int, maximum: int, granularity: int = 1) -> int | None:
    """The micro-batch to probe next, given the largest that trained (0: none yet) and the smallest
    that did not (None: none yet); None when the search is over."""
    if failed is None:
        if ok >= maximum:
            return None
        return start if ok == 0 else min(2 * ok, maximum)
    if failed - ok <= granularity:
        return None
    return (ok + failed) // 2


def status_of(done: launch.Finished, cell: dict) -> str:
    """ok / oom / timeout / error for a probe's process and the row it wrote (``suite.cell_row``)."""
    if cell.get("kind") == "cell":
        return "ok"
    if done.timed_out:
        return "timeout"
    reason = str(cell.get("reason", ""))
    return "oom" if any(m in reason for m in OOM_MARKERS) else "error"


def probe_row(done: launch.Finished, cell: dict, size: str, name: str, micro_batch: int) -> dict:
    """The JSON row of one probe, from how its process ended and the cell's own row."""
    status = status_of(done, cell)
    ok = status == "ok"
    return {"kind": "probe", "impl": name, "size": size, "seq": impls.SIZES[size].seq, "micro_batch": micro_batch,
            "status": status, "tokens_per_s": cell["tok_s_per_gpu"] if ok else None,
            "peak_gib": cell["peak_gib"] if ok else None, "step_s": cell["step_s"] if ok else None,
            "reason": None if ok else str(cell.get("reason", "")), "process_s": round(done.seconds, 2)}


Prober = Callable[[str, str, int], dict]  # (size, impl, micro_batch) -> probe row


def prober(world: World, args: argparse.Namespace) -> Prober:
    """Runs one probe as the suite runs a cell (``suite.cell_runner``, ``suite.cell_row``)."""
    def probe(size: str, name: str, micro_batch: int) -> dict:
        start = suite.cell_runner(world, argparse.Namespace(**{**vars(args), "micro_batch": micro_batch}))
        with tempfile.TemporaryDirectory(prefix="bench-fit-") as tmp:
            result = Path(tmp) / "cell.json"
            done = start(size, name, 1, result)
            return probe_row(done, suite.cell_row(done, result, size, name, 1), size, name, micro_batch)
    return probe


@dataclass
class Search:
    """One implementation's search: its probes so far and why it ended (None while it runs)."""

    name: str
    rows: list[dict] = field(default_factory=list)
    ended: str | None = None
    finished: bool = False

    def best(self) -> dict | None:
        return max((r for r in self.rows if r["status"] == "ok"), key=lambda r: r["micro_batch"], default=None)

    def first_failure(self) -> dict | None:
        bounds = [r for r in self.rows if r["status"] in BOUNDS]
        return min(bounds, key=lambda r: r["micro_batch"], default=None)

    def next(self, start: int, maximum: int, granularity: int) -> int | None:
        best, fail = self.best(), self.first_failure()
        return next_micro_batch(best["micro_batch"] if best else 0, fail["micro_batch"] if fail else None,
                                start, maximum, granularity)

    def end(self, text: str, finished: bool) -> None:
        self.ended, self.finished = text, finished

    def summary(self, size: str) -> dict:
        """The ``fit`` row; "first failed" is the error that stopped the search, if one did."""
        best = self.best()
        fail = next((r for r in self.rows if r["status"] == "error"), None) or self.first_failure()
        return {"kind": "fit", "impl": self.name, "size": size, "seq": impls.SIZES[size].seq,
                "largest_micro_batch": best["micro_batch"] if best else None,
                "tokens_per_s": best["tokens_per_s"] if best else None,
                "peak_gib": best["peak_gib"] if best else None,
                "first_failed_micro_batch": fail["micro_batch"] if fail else None,
                "first_failed_status": fail["status"] if fail else None,
                "first_failed_reason": fail["reason"] if fail else None,
                "probes": len(self.rows), "finished": self.finished, "search": self.ended}


class Writer(suite.Writer):
    """The suite's JSON-lines writer, with the progress lines on stderr."""

    def say(self, text: str) -> None:
        print(f"[fit {time.monotonic() - suite.START:6.1f}s] {text}", file=sys.stderr, flush=True)


def _ended_text(s: Search, maximum: int, granularity: int) -> str:
    best, fail = s.best(), s.first_failure()
    if fail is None:
        return f"reached --max {maximum}"
    if best is None:
        return "nothing fits"
    gap = fail["micro_batch"] - best["micro_batch"]
    return "exact" if gap == 1 else f"within {gap} (--granularity {granularity})"


def _progress(s: Search, row: dict) -> str:
    if row["status"] == "ok":
        what = f"ok, {row['tokens_per_s']:,.0f} tok/s, peak {row['peak_gib']:.2f} GiB"
    else:
        what = f"{row['status'].upper()}: {str(row['reason'])[:160]}"
    best, fail = s.best(), s.first_failure()
    known = (f"{best['micro_batch'] if best else 'none'} fits"
             + (f", {fail['micro_batch']} does not" if fail else ""))
    return (f"{row['impl']} micro-batch {row['micro_batch']} (probe {len(s.rows)}): {what}; "
            f"process {row['process_s']:.1f}s; so far {known}")


def search_all(names: list[str], size: str, start: int, maximum: int, probe: Prober, budget: suite.Budget,
               out: Writer, granularity: int = 1, world_size: int = 1, fake: bool = False) -> list[Search]:
    """Every implementation's search, one probe each per round, until all ended or the budget is out."""
    searches = [Search(n) for n in names]
    for s in searches:
        reason = impls.unavailable_reason(s.name, world_size, fake)
        if reason is not None:
            s.end(f"not run: {reason}", finished=False)
    while live := [s for s in searches if s.ended is None]:
        for s in live:
            mb = s.next(start, maximum, granularity)
            if mb is None:
                s.end(_ended_text(s, maximum, granularity), finished=True)
                continue
            if not budget.fits(size, s.name):
                text = (f"unfinished: time budget ({budget.elapsed():.0f}s elapsed + about "
                        f"{budget.estimate(size, s.name):.0f}s per probe > {budget.limit_s:.0f}s)")
                for rest in live:
                    if rest.ended is None:
                        rest.end(text, finished=False)
                out.say(f"time budget: {text}; stopping")
                break
            row = probe(size, s.name, mb)
            budget.record(size, s.name, row["process_s"])
            s.rows.append(row)
            out.write(row)
            out.say(_progress(s, row))
            if row["status"] == "error":
                s.end(f"stopped: error at micro-batch {mb}", finished=False)
    for s in searches:
        out.write(s.summary(size))
    return searches


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def markdown(meta: dict, summaries: list[dict], probes: list[dict]) -> str:
    """The summary table (a row per implementation) and each implementation's probes."""
    mem = f", {meta['total_gib']:.1f} GiB" if meta.get("total_gib") else ""
    lines = [f"## bench.fit: {meta['size']} (seq {meta['seq']}), largest micro-batch that trains, "
             f"{meta['device']}{mem}, world {meta['world']}",
             "",
             f"Each probe a fresh process: {meta['warmup']} warm-up + {meta['steps']} timed steps; doubling from "
             f"{meta['start']} up to {meta['max']}, then bisection (granularity {meta['granularity']}). "
             f"tokens/s and peak GiB are the largest fitting micro-batch's.",
             "",
             "| impl | largest micro-batch | tokens/s | peak GiB | first failed | why | probes | search |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for f in summaries:
        why = "" if f["first_failed_status"] is None else f"{f['first_failed_status']}: {f['first_failed_reason']}"
        lines.append(f"| {f['impl']} | {_num(f['largest_micro_batch'], 'd')} | {_num(f['tokens_per_s'], ',.0f')} "
                     f"| {_num(f['peak_gib'], '.2f')} | {_num(f['first_failed_micro_batch'], 'd')} "
                     f"| {why[:100].replace('|', '/')} | {f['probes']} | {f['search']} |")
    for f in summaries:
        rows = [r for r in probes if r["impl"] == f["impl"]]
        if not rows:
            continue
        lines += ["", f"### {f['impl']}", "", "| micro-batch | status | tokens/s | peak GiB | process s | reason |",
                  "|---:|---|---:|---:|---:|---|"]
        lines += [f"| {r['micro_batch']} | {r['status']} | {_num(r['tokens_per_s'], ',.0f')} "
                  f"| {_num(r['peak_gib'], '.2f')} | {r['process_s']:.1f} "
                  f"| {(r['reason'] or '')[:100].replace('|', '/')} |" for r in rows]
    return "\n".join(lines) + "\n"


def meta_row(args: argparse.Namespace, world: World, info: dict) -> dict:
    total = info.get("total_memory")
    return {"kind": "meta", "size": args.size, "seq": impls.SIZES[args.size].seq, "impls": args.impls,
            "start": args.start, "max": args.max, "granularity": args.granularity, "steps": args.steps,
            "warmup": args.warmup, "world": world.size, "fake": bool(world.fake_world), "device": info["device"],
            "total_gib": total / 2**30 if total else None, "torch": info["torch"],
            "time_budget_s": None if math.isinf(args.time_budget_s) else args.time_budget_s,
            "cell_timeout_s": args.cell_timeout_s, "isolation": "one process per probe",
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = launch.driver_world(None, args.fake_world, args.device)
    if world is None:
        return 0  # a torchrun rank other than 0: rank 0 drives the probes
    launch.stop_children_on_signal()
    budget = suite.Budget(args.time_budget_s)
    info = launch.probe(world.device)
    out = Writer(args.out)
    try:
        meta = meta_row(args, world, info)
        out.write(meta)
        out.say(f"{world.describe()} on {info['device']}; {args.size} seq {meta['seq']}, {len(args.impls)} "
                f"implementations, micro-batch {args.start}..{args.max}, "
                f"budget {suite.budget_text(args.time_budget_s)}")
        searches = search_all(args.impls, args.size, args.start, args.max, prober(world, args), budget, out,
                              args.granularity, world.size, bool(world.fake_world))
        text = markdown(meta, [s.summary(args.size) for s in searches], [r for s in searches for r in s.rows])
        print(text, flush=True)
        if args.md is not None:
            args.md.write_text(text)
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
