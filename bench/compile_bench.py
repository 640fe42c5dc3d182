"""torch.compile with FSDP (issue 50): our per-unit compile (``fully_shard(..., compile_units=)``)
against FSDP2 with per-block ``torch.compile`` (torchtitan's way), with and without full
activation recompute, each beside its eager run, and our torch-native FP8 + compile against
TransformerEngine alone; each cell in a fresh process, ``--reps`` interleaved rounds, medians.

    python -m bench.compile_bench --size 1.3b --reps 3 --out compile_1.3b.json --md compile_1.3b.md
    python -m bench.compile_bench --size 2.7b --reps 1 --cells ours+compile,fsdp2+compile,ours,fsdp2
    python -m bench.compile_bench --model llama --size 1.3b --cells ours+compile,fsdp2+compile,ours,fsdp2
    python -m bench.compile_bench --device cpu --size tiny --backend aot_eager --reps 1   # CPU smoke

The cells and their setups are ``bench.compile_cells`` (AdamW(fused=True) for every engine, the
bench GPT or, ``--model llama``, the torchtitan-style Llama block of ``bench.llama``, one unit per
block; with recompute the checkpoint wrapper is the unit). Per cell: the warm-up steps run first, each synchronised and
timed on the host (the first one holds Dynamo's tracing and the backend's compile of the
forward and backward graphs: ``first_step_s``, reported, not in the throughput); then
``--steps`` steps timed with CUDA events: tokens/s, step time, the device's peak allocated memory
over the timed steps (``peak_all_gib`` includes the warm-up, where the compile ran). The compile
is counted, and a compiled cell that ran no compiled graph in its timed steps is an error row,
not a number: graphs compiled (the engine's count), graphs Dynamo captured and graph breaks
(``torch._dynamo.utils.counters``), calls of compiled forward graphs per step (ours:
``model.compile_stats``; FSDP2: a counting backend around the same backend; one per block, two
for ``ours+compile+ac``, whose checkpoint reruns the unit's compiled forward in the backward, where
FSDP2's compiled graph holds the checkpoint itself), graphs compiled
during the timed steps (a recompile there would be in the time), and Inductor's FX graph cache
hits / misses (the cache lives on disk: after the first cell of a configuration the later ones
reuse its kernels, so their ``first_step_s`` is the warm-cache compile a user's second run sees).

Rounds alternate the cells (round 1 runs every cell once, then round 2, ...), so a drift of the
host's speed falls on all alike; the table shows each cell's median run and its min-max, its
ratio to its counterpart (FSDP2 with the same compile and recompute; TE alone for FP8) and to its
own eager run, and the issue's targets. ``--time-budget-s`` starts no cell that would not end in
time (estimated from the cells measured so far). ``--out`` writes every run and the medians as
JSON, rewritten after each run.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import cli, compile_cells, launch, runtime
from bench.compile_cells import CELLS, DEFAULT_CELLS
from bench.impls import SIZES
from bench.runtime import GIB, Env
from bench.suite import Budget

# (cell, reference, ratio needed, peak memory no higher than the reference's): issue 50's
# per-unit targets (stated at 1.3B on one H200), the same bars with full recompute, then
# informational lines (need 0: no target).
TARGETS = [("ours+compile", "fsdp2+compile", 1.0, True), ("ours+compile", "ours", 1.1, False),
           ("ours+compile+ac", "fsdp2+compile+ac", 1.0, True), ("ours+compile+ac", "ours+ac", 1.1, False),
           ("fsdp2+compile", "fsdp2", 0.0, False), ("fsdp2+compile+ac", "fsdp2+ac", 0.0, False),
           ("ours-fp8+compile", "te-fp8-ref", 0.0, False), ("ours-fp8+compile", "ours+compile", 0.0, False)]


# ----------------------------------------------------------------------------------- one cell
def _timed_step(trainee: Any, env: Env) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = float(trainee.step())
    runtime.sync(env)
    return time.perf_counter() - t0, loss


def measure(env: Env, cell: str, size: str, micro_batch: int, warmup: int, steps: int,
            backend: str, model: str = "gpt") -> dict[str, Any]:
    """Build, warm up (compile), time, count: one cell; numbers max over ranks."""
    cfg = SIZES[size]
    base = runtime.allocated(env)
    t0 = time.perf_counter()
    built = compile_cells.build(cell, cfg, env, micro_batch, backend, model_name=model)
    runtime.sync(env)
    build_s = time.perf_counter() - t0
    start = built.counts()
    runtime.reset_peak(env)
    warm = [_timed_step(built.trainee, env) for _ in range(warmup)]
    after_warmup = built.counts()
    peak_warm = runtime.peak_allocated(env) - base
    runtime.reset_peak(env)
    timer = runtime.StepTimer(env)
    timer.mark()
    for _ in range(steps):
        loss = built.trainee.step()
        timer.mark()
    step_s = timer.durations()
    last = float(loss)
    end = built.counts()
    peak = runtime.peak_allocated(env) - base
    timed = end.minus(after_warmup)
    compiled = CELLS[cell].compiled
    if compiled and timed.calls == 0:
        raise RuntimeError(f"{cell}: no compiled graph ran in the timed steps (counts {end}): it ran eagerly")
    # TE compiles small fused functions of its own (its jit_fuser is torch.compile): not a check for it
    if not compiled and CELLS[cell].engine != "te" and end.minus(start).dynamo_graphs:
        raise RuntimeError(f"{cell}: an eager cell compiled {end.minus(start).dynamo_graphs} Dynamo graph(s)")
    total = sum(step_s)
    m = runtime.all_max(env, [total, peak, max(peak, peak_warm), warm[0][0], sum(w for w, _ in warm), build_s])
    setup = end.minus(start)
    return {
        "cell": cell, "size": size, "model": model, "status": "ok", "world": env.world,
        "params": compile_cells.params_of(model, cfg),
        "micro_batch": micro_batch, "seq": cfg.seq, "warmup": warmup, "steps": steps, "backend": backend,
        "tokens_per_s": micro_batch * cfg.seq * steps / m[0], "step_ms": 1e3 * m[0] / steps,
        "step_ms_median_rank0": 1e3 * statistics.median(step_s),
        "peak_gib": m[1] / GIB, "peak_all_gib": m[2] / GIB, "first_step_s": m[3], "warmup_s": m[4], "build_s": m[5],
        "graphs": setup.graphs, "dynamo_graphs": setup.dynamo_graphs, "graph_breaks": setup.breaks,
        "compiled_calls_per_step": timed.calls / steps, "graphs_compiled_timed": timed.graphs,
        "fx_cache_hits": setup.fx_cache_hits, "fx_cache_misses": setup.fx_cache_misses,
        "loss_first": warm[0][1], "loss_last": last, "finite": all(math.isfinite(x) for _, x in warm) and
        math.isfinite(last), "torch": torch.__version__, "device": runtime.device_name(env),
    }


def run_one(env: Env, args: argparse.Namespace) -> int:
    """The child: one cell; rank 0 prints its row (an error row when any rank failed) as the last line."""
    error = None
    row: dict[str, Any] = {}
    try:
        row = measure(env, args.one, args.size, args.micro_batch, args.warmup, args.steps, args.backend, args.model)
    except Exception as err:  # an OOM, a compile failure or an eager fallback: the row says so
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    if runtime.all_max(env, [1.0 if error else 0.0])[0] > 0:
        text = error or "failed on another rank"
        status = "OOM" if "OutOfMemoryError" in text or "out of memory" in text else "error"
        row = {"cell": args.one, "size": args.size, "status": status, "detail": text[:2000]}
    row["pid"] = os.getpid()
    if env.rank == 0:
        print(json.dumps(row), flush=True)
    return 0


# ----------------------------------------------------------------------------------- driver
Spawn = Callable[[str, argparse.Namespace], dict[str, Any]]


def spawn(cell: str, args: argparse.Namespace) -> dict[str, Any]:
    """One cell in fresh processes of the run's world (``bench.launch``: its own session, killed
    on a timeout); its row is the last JSON line rank 0 printed."""
    world = launch.World(args.nproc_per_node, 0, args.device)
    argv = ["--one", cell, "--size", args.size, "--backend", args.backend, "--model", args.model,
            *cli.forward(args, ("steps", "warmup", "micro_batch"))]
    done = launch.run(launch.command(world, "bench.compile_bench", argv), launch.child_env(world),
                      args.timeout, prefix=f"  [{cell}] ")
    for line in reversed(done.tail):
        if line.startswith("{"):
            return dict(json.loads(line), process_s=round(done.seconds, 1))
    status = "timeout" if done.timed_out else "error"
    return {"cell": cell, "size": args.size, "status": status, "detail": done.why(), "process_s": done.seconds}


def rounds(cells: list[str], args: argparse.Namespace, start: Spawn = spawn, budget: Budget | None = None,
           saved: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """``args.reps`` rounds, each running every cell once in the given order; a cell that cannot
    run here (TE missing) or would not end within the budget is a skip row; one row per run,
    handed to ``saved`` as it ends (a driver killed later keeps what was measured)."""
    budget = budget or Budget(args.time_budget_s, time.monotonic())
    rows: list[dict[str, Any]] = []
    for rep in range(1, args.reps + 1):
        for cell in cells:
            reason = compile_cells.unavailable_reason(cell, args.model)
            if reason is None and not budget.fits(args.size, cell):
                reason = f"time budget: {budget.elapsed():.0f}s elapsed + about " \
                         f"{budget.estimate(args.size, cell):.0f}s > {budget.limit_s:.0f}s"
            if reason is not None:
                row: dict[str, Any] = {"cell": cell, "size": args.size, "status": "skip", "detail": reason}
            else:
                t0 = time.monotonic()
                row = start(cell, args)
                budget.record(args.size, cell, time.monotonic() - t0)
            row["rep"] = rep
            rows.append(row)
            print(json.dumps(row), flush=True)
            saved(rows)
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell in first-seen order: its median ok run by tokens/s (that run's other
    figures; of an even count the slower middle one), ``runs`` and ``tokens_per_s_runs`` (in run
    order); a cell without an ok run is its first row."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["cell"], []).append(r)
    out = []
    for runs in groups.values():
        ok = sorted((r for r in runs if r.get("status") == "ok"), key=lambda r: r["tokens_per_s"])
        if not ok:
            out.append(runs[0])
            continue
        failed = [r.get("status") for r in runs if r.get("status") != "ok"]
        out.append({**ok[(len(ok) - 1) // 2], "runs": len(ok), "failed_runs": failed,
                    "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in runs if r.get("status") == "ok"]})
    return out


def ratio(rows: list[dict[str, Any]], cell: str, ref: str | None) -> float | None:
    """Median tokens/s of ``cell`` over ``ref``'s (None when either has no ok run)."""
    ok = {r["cell"]: r for r in rows if r.get("status") == "ok"}
    if ref is None or cell not in ok or ref not in ok:
        return None
    return float(ok[cell]["tokens_per_s"] / ok[ref]["tokens_per_s"])


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each comparison of ``TARGETS`` both sides of which ran: ratio, peaks, met / NOT met (or
    'no target'); the issue's two 1.3B targets are listed as n/a when a side is missing."""
    ok = {r["cell"]: r for r in rows if r.get("status") == "ok"}
    lines = []
    for cell, ref, need, peak in TARGETS:
        x = ratio(rows, cell, ref)
        if x is None:
            if need and not cell.endswith("+ac"):
                lines.append(f"- {cell} / {ref}: n/a (not both measured)")
            continue
        a, b = ok[cell]["peak_gib"], ok[ref]["peak_gib"]
        if need:
            met = x >= need and (not peak or a <= b)
            verdict = f"target >= {need}x{' at equal or lower peak' if peak else ''}: {'met' if met else 'NOT met'}"
        else:
            verdict = "no target"
        lines.append(f"- {cell} / {ref}: {x:.3f}x, peak {a:.2f} vs {b:.2f} GiB ({verdict})")
    return lines


def _fmt(x: float | None, ref: str | None) -> str:
    return f"{x:.3f}x {ref}" if x is not None and ref else ""


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the median rows (failed and skipped cells with their reason)."""
    head = ("| cell | tok/s (median) | runs min-max | step ms | peak GiB | peak incl. warm-up GiB | vs counterpart "
            "| vs own eager | first step s (compile) | graphs / Dynamo graphs / breaks | compiled calls/step | "
            "FX cache hit/miss | loss first->last |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        cell = CELLS.get(r["cell"])
        if r.get("status") != "ok":
            lines.append(f"| {r['cell']} | {r.get('status')} | {str(r.get('detail', ''))[:120]} |" + " |" * 10)
            continue
        runs = r.get("tokens_per_s_runs", [r["tokens_per_s"]])
        recompiled = r.get("graphs_compiled_timed", 0)
        timed = f" (+{recompiled} compiled in the timed steps)" if recompiled else ""
        counter = cell.counterpart if cell else None
        eager = cell.eager if cell else None
        lines.append(
            f"| {r['cell']} | {r['tokens_per_s']:,.0f} | {min(runs):,.0f}-{max(runs):,.0f} ({len(runs)}) | "
            f"{r['step_ms']:.1f} | {r['peak_gib']:.2f} | {r['peak_all_gib']:.2f} | "
            f"{_fmt(ratio(rows, r['cell'], counter), counter)} | {_fmt(ratio(rows, r['cell'], eager), eager)} | "
            f"{r['first_step_s']:.1f} | {r['graphs']} / {r['dynamo_graphs']} / {r['graph_breaks']}{timed} | "
            f"{r['compiled_calls_per_step']:g} | {r['fx_cache_hits']}/{r['fx_cache_misses']} | "
            f"{r['loss_first']:.3f}->{r['loss_last']:.3f} |")
    return "\n".join(lines)


def configuration(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One line naming what every cell shares (device, torch, world, batch, steps, backend)."""
    ok = next((r for r in rows if r.get("status") == "ok"), {})
    cfg = SIZES[args.size]
    return (f"Configuration: {ok.get('device', args.device)}, torch {ok.get('torch', torch.__version__)}, world "
            f"{args.nproc_per_node}, model {args.model} ({compile_cells.MODEL_NOTES[args.model]}), size {args.size} "
            f"({compile_cells.params_of(args.model, cfg) / 1e9:.2f}B params, hidden {cfg.hidden}, "
            f"{cfg.layers} layers), micro-batch {args.micro_batch} x seq {cfg.seq}, {args.warmup} warm-up + "
            f"{args.steps} timed steps, {args.reps} round(s), medians; backend {args.backend} (fullgraph), "
            "AdamW(lr 1e-4, fused=True), bf16 compute, fp32 main params / grads / optimizer state.")


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = medians(runs)
    setups = [f"- {name}: {CELLS[name].setup}" for name in dict.fromkeys(r["cell"] for r in rows)]
    return "\n".join([configuration(runs, args), "", table(rows), "", "Targets (issue 50, per-unit compile):",
                      *target_lines(rows), "", "Cells:", *setups])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; bad sizes, cells and counts are refused naming the allowed values."""
    p = cli.parser(__doc__)
    p.add_argument("--size", default="1.3b", choices=list(SIZES))
    p.add_argument("--model", default="gpt", choices=list(compile_cells.MODELS),
                   help="gpt: bench.gpt (LayerNorm, GELU, fused eager kernels); llama: bench.llama (torchtitan's "
                        "Llama 3 block: RMSNorm, rotary embeddings, SwiGLU in plain tensor ops)"),
    p.add_argument("--cells", type=cli.csv_list(list(CELLS)), default=list(DEFAULT_CELLS),
                   help="comma-separated cells, alternated in this order in each round")
    p.add_argument("--reps", type=cli.positive, default=3, help="rounds (fresh-process runs per cell; median shown)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of every compiled cell "
                   "(inductor; aot_eager for a CPU smoke)")
    cli.add_step_flags(p, steps=5, warmup=2)
    cli.add_run_flags(p, fake_world=False)
    p.add_argument("--nproc-per-node", type=cli.positive, default=1, metavar="N", help="ranks per cell (torchrun)")
    p.add_argument("--timeout", type=cli.positive, default=900, help="seconds per cell (killed, an error row)")
    p.add_argument("--time-budget-s", type=float, default=math.inf,
                   help="start no cell that would end later than this many seconds after start-up")
    p.add_argument("--out", type=Path, help="JSON: configuration, every run, the medians, the target lines")
    p.add_argument("--md", type=Path, help="also write the markdown report here (rewritten after each run)")
    p.add_argument("--one", choices=list(CELLS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        torch._dynamo.lookup_backend(args.backend)
    except Exception as err:
        p.error(f"--backend {args.backend!r} is not a torch.compile backend: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        return cli.with_env(args.device, lambda env: run_one(env, args))
    launch.stop_children_on_signal()  # a signalled driver stops the running cell too
    runs = rounds(args.cells, args, saved=lambda rows: save(rows, args))
    print(report(runs, args), flush=True)
    return 0


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """``--out`` and ``--md``, rewritten whole (write, then rename) after every run."""
    rows = medians(runs)
    if args.out is not None:
        _replace(args.out, json.dumps({"configuration": configuration(runs, args), "size": args.size,
                                       "reps": args.reps, "cells": rows, "runs": runs,
                                       "targets": target_lines(rows)}, indent=2))
    if args.md is not None:
        _replace(args.md, report(runs, args) + "\n")


if __name__ == "__main__":
    sys.exit(main())
