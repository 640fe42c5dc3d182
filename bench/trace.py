"""Profile a few training steps of chosen implementations: where the step time and the memory go.

    python -m bench.trace --impls ours-z3,fsdp2 --size 1.3b --out-dir out                  # world 1
    python -m bench.trace --nproc-per-node 2 --impls ours-z3,fsdp2 --size 1.3b --out-dir out
    python -m bench.trace --fake-world 2 --impls ours-z3,fsdp2 --size 1.3b --out-dir out

This process is the driver; each implementation is profiled in a fresh process (``--part``; a
``torchrun`` of it when the world has several ranks), as the suite's cells are, so one engine's
leftovers neither shrink the memory another is profiled with nor make it run out. In it: build
(``bench.impls``), ``--warmup`` steps, one step with the allocator history on
(``bench.memory``), then ``torch.profiler`` over 1 + ``--steps`` steps (the first discarded)
with CPU and CUDA activities on every rank (same overhead everywhere); rank 0 exports its chrome
trace (``trace_<impl>.json.gz``) and its memory report. The driver then writes ``trace.md``
(per-step table side by side, ``bench.trace_summary``; memory tables; what failed and why) and
``timeline.png`` (the last profiled step of each, one row per stream). ``python -m bench.suite
--trace-impls`` runs the same after its cells.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import cli, impls, launch, memory, runtime, trace_summary
from bench.launch import World
from bench.runtime import Env


def profile(env: Env, step: Callable[[], object], path: Path | None, steps: int) -> None:
    """Profile 1 + ``steps`` calls of ``step`` (the first is the profiler's warm-up); export to ``path``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.is_cuda else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 record_shapes=False, with_stack=False, profile_memory=False) as prof:
        for i in range(1 + steps):
            step()
            if i == 0:
                # Drain the warm-up step first: a host running ahead of the GPU would otherwise leave
                # its kernels (e.g. the whole optimizer step) executing inside the recorded window.
                runtime.sync(env)
            prof.step()
        runtime.sync(env)
    if path is not None:
        prof.export_chrome_trace(str(path))


def profile_one(env: Env, name: str, size: str, micro_batch: int, warmup: int, steps: int,
         out_dir: Path) -> tuple[memory.MemoryReport, Path | None]:
    trainee = impls.build(name, impls.SIZES[size], env, micro_batch)
    runtime.sync(env)
    after_build = runtime.allocated(env)
    for _ in range(warmup):
        trainee.step()
    mem = memory.measure(name, trainee, env)
    mem.numbers["after_build"] = after_build
    path = out_dir / f"trace_{name}.json.gz" if env.rank == 0 else None
    profile(env, trainee.step, path, steps)
    del trainee
    runtime.free_memory(env)
    return mem, path


def part_path(out_dir: Path, name: str) -> Path:
    return out_dir / f"trace_{name}.part.json"


def run_part(env: Env, args: argparse.Namespace) -> int:
    """The child: profile one implementation; rank 0 writes the trace and a part file for the driver."""
    [name] = args.impls
    args.out_dir.mkdir(parents=True, exist_ok=True)
    error, mem, path = None, None, None
    try:
        mem, path = profile_one(env, name, args.size, args.micro_batch, args.warmup, args.steps, args.out_dir)
    except Exception as err:  # an OOM or an impl's error: the report says so
        error = f"{type(err).__name__}: {err}"
    runtime.free_memory(env)
    failed = runtime.all_max(env, [1.0 if error else 0.0])[0] > 0
    if env.rank == 0:
        part = {"impl": name, "device": runtime.device_name(env), "world": env.world, "fake": env.fake,
                "error": (error or "failed on another rank") if failed else None,
                "memory": memory.to_dict(mem) if mem is not None and not failed else None,
                "trace": path.name if path is not None and not failed else None}
        part_path(args.out_dir, name).write_text(json.dumps(part))
    return 0


def write_report(out_dir: Path, header: str, traces: dict[str, Path], mems: list[memory.MemoryReport],
                 problems: dict[str, str] | None = None) -> str:
    """trace.md and timeline.png from rank 0's traces; returns the markdown. ``problems``: impl ->
    why it has no trace (error, skip); a trace without GPU events says what it holds instead."""
    loaded = {n: trace_summary.load(p) for n, p in traces.items()}
    steps = {n: trace_summary.summarise(t) for n, t in loaded.items()}
    notes = [f"- {n}: {why}" for n, why in (problems or {}).items()]
    notes += [f"- {n}: {trace_summary.explain_empty(loaded[n])}" for n, s in steps.items() if not s]
    text = [header, ""]
    if any(steps.values()):
        text.append(trace_summary.markdown(steps))
    if notes:
        text += ["No step table for:" if any(steps.values()) else "No step table:", "", *notes, ""]
    text.append(memory.markdown(mems) if mems else "")
    last = {n: split[-1][1] for n, t in loaded.items() if (split := trace_summary.split_steps(t))}
    try:
        if last and not trace_summary.timeline_png(last, out_dir / "timeline.png", title=header.lstrip("# ")):
            text.append("timeline.png not drawn: matplotlib is not installed\n")
    except Exception as err:  # a drawing problem must not cost the tables
        text.append(f"timeline.png not drawn: {type(err).__name__}: {err}\n")
    md = "\n".join(text)
    (out_dir / "trace.md").write_text(md)
    return md


def _profile_child(world: World, name: str, size: str, out_dir: Path, options: list[str],
                   timeout_s: float) -> tuple[dict | None, str | None]:
    """Run the ``--part`` child of ``name``: (its part file, None) or (None, why it has none)."""
    part = part_path(out_dir, name)
    part.unlink(missing_ok=True)
    argv = ["--part", "--impls", name, "--size", size, "--out-dir", str(out_dir.resolve()), *options]
    done = launch.run(launch.command(world, "bench.trace", argv), launch.child_env(world), timeout_s,
                      prefix=f"  [trace {name}] ")
    if not part.exists():
        return None, f"profile process {done.why()}"
    data = json.loads(part.read_text())
    part.unlink()
    return (None, f"ERROR {data['error']}") if data["error"] else (data, None)


def drive(world: World, size: str, names: list[str], out_dir: Path, micro_batch: int = 4, warmup: int = 3,
          steps: int = 2, say: Callable[[str], None] = print, timeout_s: float = 1200.0) -> str:
    """Profile ``names`` at ``size``, each in its own process of ``world``; write the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    options = ["--micro-batch", str(micro_batch), "--warmup", str(warmup), "--steps", str(steps)]
    mems: list[memory.MemoryReport] = []
    traces: dict[str, Path] = {}
    problems: dict[str, str] = {}
    device = "?"
    for name in names:
        reason = impls.unavailable_reason(name, world.size, bool(world.fake_world))
        if reason is not None:
            problems[name] = f"skipped ({reason})"
            say(f"trace {size} {name}: skipped ({reason})")
            continue
        t0 = time.monotonic()
        data, why = _profile_child(world, name, size, out_dir, options, timeout_s)
        if data is None:
            problems[name] = why or "?"
            say(f"trace {size} {name}: {why}")
            continue
        device = data["device"]
        mems.append(memory.from_dict(data["memory"]))
        if data["trace"]:
            traces[name] = out_dir / data["trace"]
        say(f"trace {size} {name}: done in {time.monotonic() - t0:.1f}s")
    header = (f"# Step profile, {size}, {world.describe()}, {device}, micro-batch {micro_batch}, "
              f"{steps} profiled steps after {warmup + 2}, each implementation in its own process (rank 0)")
    md = write_report(out_dir, header, traces, mems, problems)
    print(md, flush=True)
    return md


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--impls", type=cli.csv_list(list(impls.IMPLS)), default=["ours-z3", "fsdp2"])
    p.add_argument("--size", choices=list(impls.SIZES), default="1.3b")
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--micro-batch", type=cli.positive, default=4)
    p.add_argument("--warmup", type=cli.positive, default=3)
    p.add_argument("--steps", type=cli.positive, default=2, help="profiled steps (after one discarded)")
    cli.add_run_flags(p)
    p.add_argument("--nproc-per-node", type=cli.positive, default=None, metavar="N",
                   help="ranks per profile (a torchrun of N each); default: torchrun's world, else 1")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per implementation")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # the child of one implementation
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part:
        return cli.with_env(args.device, lambda env: run_part(env, args), fake_world=args.fake_world)
    world = launch.driver_world(args.nproc_per_node, args.fake_world, args.device)
    if world is None:
        return 0  # a torchrun rank other than 0: rank 0 drives
    launch.stop_children_on_signal()
    drive(world, args.size, args.impls, args.out_dir, args.micro_batch, args.warmup, args.steps,
          timeout_s=args.timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
