"""Profile a few training steps of chosen implementations: where the step time and the memory go.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc-per-node 2 bench/trace.py --impls ours-z3,fsdp2 --size 1.3b --out-dir out

Per implementation, in one process group: build (``bench.impls``), ``--warmup`` steps, one step
with the allocator history on (``bench.memory``), then ``torch.profiler`` over 1 + ``--steps``
steps (the first discarded) with CPU and CUDA activities on every rank (same overhead
everywhere); rank 0 exports its chrome trace (``trace_<impl>.json.gz``). Rank 0 then writes
``trace.md`` (per-step table side by side, ``bench.trace_summary``; memory tables) and
``timeline.png`` (the last profiled step of each, one row per stream). ``bench/suite.py
--trace-impls`` runs the same after its cells without a second start-up.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import impls, memory, runtime, trace_summary
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


def _one(env: Env, name: str, size: str, micro_batch: int, warmup: int, steps: int,
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


def write_report(out_dir: Path, header: str, traces: dict[str, Path], mems: list[memory.MemoryReport]) -> str:
    """trace.md and timeline.png from rank 0's traces; returns the markdown."""
    loaded = {n: trace_summary.load(p) for n, p in traces.items()}
    steps = {n: trace_summary.summarise(t) for n, t in loaded.items()}
    text = [header, "", trace_summary.markdown(steps) if any(steps.values()) else
            "No GPU events in the traces (CPU run).\n", memory.markdown(mems) if mems else ""]
    last = {n: split[-1][1] for n, t in loaded.items() if (split := trace_summary.split_steps(t))}
    try:
        if last and not trace_summary.timeline_png(last, out_dir / "timeline.png", title=header.lstrip("# ")):
            text.append("timeline.png not drawn: matplotlib is not installed\n")
    except Exception as err:  # a drawing problem must not cost the tables
        text.append(f"timeline.png not drawn: {type(err).__name__}: {err}\n")
    md = "\n".join(text)
    (out_dir / "trace.md").write_text(md)
    return md


def run(env: Env, size: str, names: list[str], out_dir: Path, micro_batch: int = 4, warmup: int = 3,
        steps: int = 2, say: Callable[[str], None] = print) -> None:
    """Profile ``names`` at ``size`` one after the other; rank 0 writes the report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mems: list[memory.MemoryReport] = []
    traces: dict[str, Path] = {}
    for name in names:
        reason = impls.unavailable_reason(name, env.world, env.fake)
        if reason is not None:
            say(f"trace {size} {name}: skipped ({reason})")
            continue
        t0 = time.monotonic()
        error = None
        try:
            mem, path = _one(env, name, size, micro_batch, warmup, steps, out_dir)
        except Exception as err:  # record it and go on with the next impl
            error = f"{type(err).__name__}: {err}"
        runtime.free_memory(env)
        if runtime.all_max(env, [1.0 if error else 0.0])[0] > 0:
            say(f"trace {size} {name}: ERROR {error or 'on another rank'}")
            continue
        mems.append(mem)
        if path is not None:
            traces[name] = path
        say(f"trace {size} {name}: done in {time.monotonic() - t0:.1f}s")
    if env.rank == 0:
        world = f"{'fake ' if env.fake else ''}world {env.world}"
        header = (f"# Step profile, {size}, {world}, {runtime.device_name(env)}, micro-batch "
                  f"{micro_batch}, {steps} profiled steps after {warmup + 2} (rank 0)")
        print(write_report(out_dir, header, traces, mems), flush=True)


def main(argv: list[str] | None = None) -> int:
    from bench.suite import csv_list

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", type=csv_list(list(impls.IMPLS)), default=["ours-z3", "fsdp2"])
    p.add_argument("--size", choices=list(impls.SIZES), default="1.3b")
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="profiled steps (after one discarded)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--fake-world", type=int, default=0, metavar="N",
                   help="one process as rank 0 of N >= 2 with no-op collectives (see bench/suite.py)")
    args = p.parse_args(argv)
    env = runtime.init(args.device, fake_world=args.fake_world)
    try:
        run(env, args.size, args.impls, args.out_dir, args.micro_batch, args.warmup, args.steps)
    finally:
        runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
