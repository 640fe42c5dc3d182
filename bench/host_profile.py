"""Where the host time of a training step goes: cProfile over a few steps of chosen implementations.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m bench.host_profile --impls ours-z3,ours-fp8-te-current     # FP8 TE cells need TransformerEngine
    python -m bench.host_profile --impls ours-fp8-te-current --hooks     # per-hook host ms per step, no cProfile
    python -m bench.host_profile --impls ours-z3,te-fp8-ref --phases     # host ms per phase: host-bound or not
    python -m bench.host_profile --impls ours-fp8-te-current-fused,te-fp8-ref --ops   # host ms per operator

A step is host-bound when the GPU waits for the launches; ``bench.trace`` shows the idle GPU
time, this shows which Python functions fill it. Per implementation (``bench.impls`` plus the FP8
cells of ``bench.fp8_bench``): ``--warmup`` steps, then ``--steps`` steps timed with a device
sync after each (wall ms per step), then the same number of steps under ``cProfile`` (which
slows Python, so compare functions with each other, not with the wall time), printed as the
``--top`` functions by own time and by cumulative time (rank 0). cProfile sees the main thread
only: on CUDA the backward, with the engine's grad and pre-backward hooks, runs on autograd's
device thread, which ``--hooks`` (timing wrappers) and ``--ops`` cover.

``--ops`` replaces it with ``torch.profiler``'s CPU table: per operator the self and total host ms
per step and the calls (autograd's threads included; an op's self time includes Python that runs inside it
without ops of its own, e.g. the post-accumulate-grad hooks inside ``AccumulateGrad``). All implementations run in one
process, one after the other; for throughput and memory use ``bench.suite``, which isolates them.

``--phases`` replaces it with the host time to issue the forward, the backward and the optimizer
step of a step started on an idle device (a sync before it), the forward's main-thread CPU time
and the step's wall time to a sync after it (medians over ``--steps``): a step whose host time
comes near its wall time is host-bound, so its speed follows the machine's CPU (two H200
machines took 83 and 50 ms to issue the same 1.3B FP8 forward).

``--hooks`` replaces the cProfile pass with a table of the engine's FP8 hooks (and its hook entry
points, for scale): per step the calls and the host milliseconds spent inside each (wall clock and
the training thread's CPU time; medians over ``--steps`` steps, a device sync between steps and
outside the timed calls, nothing else added). Rows: ``ModelFp8.requantize`` (the sharded
requantisation, once per step; of it the current-scaling cast), ``UnitFp8.gather`` (send segment,
collective launch), ``UnitFp8.unpack`` (FP8 bytes into the weights and, with
``keep_fp8_transpose_cache``, the transposes; of it TE's post-gather call), ``UnitFp8.release``,
and their sum: the "host time in our FP8 hooks" of issue 29. The entry points include the FP8
hooks they call (FP8 work sits in ``pre_forward`` / ``pre_backward`` and the release in
``post_forward`` / ``grad_ready``).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bench import cli, impls, runtime
from bench.runtime import Env

ENGINE_ENTRY_POINTS = ("pre_forward", "submodule_pre_forward", "post_forward", "pre_backward", "grad_ready",
                       "finish_backward", "zero_grad_buffers")
FP8_TOP = ("requantize", "gather", "unpack", "release")  # "all FP8 hooks" sums these (none nests in another)


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


class _Clock:
    """Calls and host seconds (wall, thread CPU) per name over one step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w0
                self.cpu[name] += time.thread_time() - c0
                self.calls[name] += 1
        return run


@contextmanager
def _patched(clock: _Clock, engine: Any, trainee: Any = None) -> Iterator[list[tuple[str, str]]]:
    """Time the FP8 hooks (class attributes, restored after) and the engine's entry points
    (instance attributes, removed after); yields (name, what) rows in table order."""
    from fsdp_impl.fp8 import params as fp8_params
    from fsdp_impl.fp8 import te as fp8_te

    rows: list[tuple[str, str]] = []
    undo: list[Callable[[], None]] = []

    def patch(owner: Any, attr: str, name: str, what: str, instance: bool = False) -> None:
        if owner is None or (attr not in owner if isinstance(owner, dict) else not hasattr(owner, attr)):
            return  # another version of the engine (e.g. a baseline run): no such hook
        original = owner[attr] if isinstance(owner, dict) else getattr(owner, attr)
        wrapped = clock.timed(name, original)
        if isinstance(owner, dict):
            owner[attr] = wrapped
            undo.append(lambda: owner.__setitem__(attr, original))
        else:
            setattr(owner, attr, wrapped)
            undo.append((lambda: delattr(owner, attr)) if instance else (lambda: setattr(owner, attr, original)))
        rows.append((name, what))

    patch(fp8_params.ModelFp8, "requantize", "requantize", "ModelFp8.requantize: sharded requantisation")
    patch(getattr(fp8_te, "CurrentScalingCast", None), "__call__", "current_cast",
          "  of it: CurrentScalingCast (current scaling)")
    patch(getattr(fp8_te, "TeQuantize", None), "__call__", "te_quantize", "  of it: TeQuantize (all TE weights)")
    patch(fp8_te, "_quantize_current", "quantize_current", "  of it: _quantize_current (one-off cast)")
    patch(fp8_params.UnitFp8, "gather", "gather", "UnitFp8.gather: send segment + all-gather launch")
    patch(fp8_params.UnitFp8, "unpack", "unpack", "UnitFp8.unpack: FP8 bytes + transposes")
    patch(getattr(fp8_params, "FILL", None), "te", "fill_te", "  of it: fill_te (TE post_all_gather_processing)")
    patch(fp8_te.TeFp8Param, "filled", "te_filled", "  of it: TeFp8Param.filled (one weight)")
    patch(fp8_params.UnitFp8, "release", "release", "UnitFp8.release: free FP8 bytes")
    if engine is not None:
        for name in ENGINE_ENTRY_POINTS:
            if hasattr(engine, name):
                patch(engine, name, f"engine.{name}", f"engine.{name} (includes the FP8 hooks it calls)",
                      instance=True)
    if trainee is not None:
        patch(trainee, "optimizer_step", "engine.optimizer", "optimizer.step + zero_grad", instance=True)
    try:
        yield rows
    finally:
        for fn in reversed(undo):
            fn()


def _engine_of(model: Any) -> Any:
    return next((m._fsdp_engine for m in model.modules() if hasattr(m, "_fsdp_engine")), None)


def hook_table(env: Env, trainee: impls.Trainee, steps: int) -> str:
    """Per-hook host ms per step (medians over ``steps``; a device sync before each step)."""
    per_step: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    whole: list[float] = []
    clock = _Clock()
    with _patched(clock, _engine_of(trainee.model), trainee) as rows:
        for _ in range(steps):
            runtime.sync(env)
            clock.reset()
            t0 = time.perf_counter()
            trainee.step()
            whole.append(time.perf_counter() - t0)
            for name, _what in rows:
                per_step[name].append((clock.calls[name], clock.wall[name], clock.cpu[name]))
            per_step["all"].append((sum(clock.calls[n] for n in FP8_TOP), sum(clock.wall[n] for n in FP8_TOP),
                                    sum(clock.cpu[n] for n in FP8_TOP)))
        runtime.sync(env)

    def line(label: str, name: str) -> str:
        calls = statistics.median(c for c, _, _ in per_step[name])
        wall = 1e3 * statistics.median(w for _, w, _ in per_step[name])
        cpu = 1e3 * statistics.median(c for _, _, c in per_step[name])
        return f"| {label} | {calls:g} | {wall:.2f} | {cpu:.2f} |"

    out = ["| hook | calls/step | host wall ms/step | host CPU ms/step |", "| --- | ---: | ---: | ---: |"]
    fp8_rows = [r for r in rows if not r[0].startswith("engine.")]
    out += [line(what, name) for name, what in fp8_rows]
    out.append(line("**all FP8 hooks** (requantize + gather + unpack + release)", "all"))
    out += [line(what, name) for name, what in rows if name.startswith("engine.")]
    out.append(f"| whole step (host, no sync inside) | 1 | {1e3 * statistics.median(whole):.2f} | |")
    return "\n".join(out)


@dataclass(frozen=True)
class Phases:
    """Medians over steps, in ms: host time to issue each phase with the launch queue empty at the
    start of the step (a device sync before it), the main thread's CPU time in the forward, and
    the step's wall time up to a device sync after it."""

    forward: float
    forward_cpu: float
    backward: float
    optimizer: float
    host: float  # the three phases together (median of the per-step sums)
    step: float

    def line(self, name: str) -> str:
        bound = ("host-bound: the device waits for launches" if self.host >= 0.9 * self.step
                 else "device-bound" if self.host <= 0.6 * self.step else "in between")
        return (f"| {name} | {self.forward:.1f} | {self.forward_cpu:.1f} | {self.backward:.1f} | "
                f"{self.optimizer:.1f} | {self.host:.1f} | {self.step:.1f} | {bound} |")


PHASE_HEADER = ("| implementation | forward | of it main-thread CPU | backward | optimizer | host, all | "
                "step to sync | reading |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")


def phase_times(env: Env, trainee: impls.Trainee, steps: int) -> Phases:
    """Host issue time of forward, backward and optimizer step, each step started on an idle
    device. A forward whose main-thread CPU time equals its wall time computed all along (Python
    and launches); less means it waited (a sync, a lock). Host time near the synchronised step
    means the device waited for the host; compare machines by it, since host-bound steps follow
    the host's speed."""
    rows = []
    for _ in range(steps):
        runtime.sync(env)
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = trainee.forward_loss()
        t1, c1 = time.perf_counter(), time.thread_time()
        trainee.backward(loss)
        t2 = time.perf_counter()
        trainee.optimizer_step()
        t3 = time.perf_counter()
        runtime.sync(env)
        rows.append((t1 - t0, c1 - c0, t2 - t1, t3 - t2, t3 - t0, time.perf_counter() - t0))
    med = [1e3 * statistics.median(col) for col in zip(*rows, strict=True)]
    return Phases(*med)


def op_table(env: Env, trainee: impls.Trainee, steps: int, top: int) -> str:
    """Host time per operator over ``steps`` steps (``torch.profiler``, CPU activity only): self
    and total ms per step and calls per step of the ``top`` operators by self time, from this
    thread and autograd's (on CUDA the backward, with the engine's grad and pre-backward hooks,
    runs on autograd's device thread: the profiler's state travels there with each backward,
    ``cProfile``'s does not). A recorded op's self time includes the
    Python that runs inside it without recording ops of its own, e.g. a post-accumulate-grad hook
    inside ``torch::autograd::AccumulateGrad``."""
    from torch.profiler import ProfilerActivity, profile

    runtime.sync(env)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainee.step()
        runtime.sync(env)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    out = [f"| op ({steps} steps) | self ms/step | total ms/step | calls/step | self us/call |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for e in events:
        name = e.key if len(e.key) <= 70 else e.key[:67] + "..."
        out.append(f"| {name} | {e.self_cpu_time_total / 1e3 / steps:.2f} | {e.cpu_time_total / 1e3 / steps:.2f} | "
                   f"{e.count / steps:g} | {e.self_cpu_time_total / max(e.count, 1):.1f} |")
    return "\n".join(out)


def _report(env: Env, trainee: impls.Trainee, name: str, steps: int, top: int, hooks: bool, phases: bool,
            ops: bool = False) -> str:
    """What ``run_one`` prints for one implementation (every rank runs the same steps)."""
    if ops:
        return f"host time per operator, {steps} steps\n{op_table(env, trainee, steps, top)}"
    if phases:
        line = phase_times(env, trainee, steps).line(name)
        return f"host ms per phase, medians of {steps} steps\n{PHASE_HEADER}\n{line}"
    wall = _wall_ms(env, trainee, steps)
    head = f"wall ms/step median {statistics.median(wall):.2f} (min {min(wall):.2f}, max {max(wall):.2f})"
    if hooks:
        return f"{head}; host time per hook, {steps} steps\n{hook_table(env, trainee, steps)}"
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        trainee.step()
    runtime.sync(env)
    prof.disable()
    return f"{head}\n{_stats(prof, 'tottime', top, steps)}\n{_stats(prof, 'cumulative', top, steps)}"


def run_one(env: Env, name: str, size: str, micro_batch: int, warmup: int, steps: int, top: int,
            hooks: bool = False, dtensor_step: bool = False, phases: bool = False, ops: bool = False) -> None:
    trainee = impls.build(name, impls.SIZES[size], env, micro_batch)
    if dtensor_step and hasattr(trainee.optimizer, "_fsdp_local_step"):
        trainee.optimizer._fsdp_local_step = None  # the DTensor optimizer step, for comparison
        name += " (DTensor optimizer step)"
    for _ in range(warmup):
        trainee.step()
    runtime.sync(env)
    text = _report(env, trainee, name, steps, top, hooks, phases, ops)
    if env.rank == 0:
        print(f"\n==== {name}, {size}, world {env.world}: {text}", flush=True)
    del trainee
    runtime.free_memory(env)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--impls", type=cli.csv_list(list(impls.IMPLS)), default=["ours-z3", "ours-fp8-te-current"])
    p.add_argument("--size", choices=list(impls.SIZES), default="1.3b")
    cli.add_step_flags(p, steps=3)
    p.add_argument("--top", type=int, default=40, help="functions listed per table")
    p.add_argument("--hooks", action="store_true",
                   help="instead of cProfile: host ms per step in each FP8 hook and engine entry point")
    p.add_argument("--phases", action="store_true",
                   help="instead of cProfile: host ms to issue forward, backward and optimizer step from an idle "
                        "device, against the synchronised step (is the step host-bound on this machine?)")
    p.add_argument("--ops", action="store_true",
                   help="instead of cProfile: host ms per step of the top operators (torch.profiler; also "
                        "the backward's hooks on autograd's device thread)")
    p.add_argument("--dtensor-step", action="store_true",
                   help="also run each implementation with its optimizer stepping on DTensors (no local-shard step)")
    cli.add_run_flags(p, fake_world=False)
    args = p.parse_args(argv)

    def body(env: Env) -> None:
        for name in args.impls:
            for dtensor_step in (False, True) if args.dtensor_step else (False,):
                run_one(env, name, args.size, args.micro_batch, args.warmup, args.steps, args.top, args.hooks,
                        dtensor_step, args.phases, args.ops)
    return cli.with_env(args.device, body)


if __name__ == "__main__":
    sys.exit(main())
