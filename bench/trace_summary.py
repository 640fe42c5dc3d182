"""Per-step summary of a torch.profiler chrome trace: where the GPU time of a training step goes.

Pure Python over the trace JSON (no torch), so it is unit-tested on CPU with synthetic traces.

GPU events (``kernel``, ``gpu_memcpy``, ``gpu_memset``) are classified as:

- comm: NCCL kernels by name (``nccl...AllGather``, ``ReduceScatter``, ``AllReduce``; anything
  else NCCL is ``other_comm``), whatever label or stream they ran under;
- compute: every other kernel; copy: memcpy/memset.

Each GPU event belongs to the profiler step (``ProfilerStep#N`` host range) during which it was
launched (``args.correlation`` links it to its ``cuda_runtime``/``cuda_driver`` launch); events
without a known launch fall back to their own start time. Per step, over that step's events:

- ``step``: first start to last end on the GPU;
- ``compute``, ``copy``, ``<comm>``: length of the union of those events' intervals;
- ``<comm>_exposed``: the part of that union not covered by any compute kernel (on any stream):
  communication the step waits for instead of hiding it behind compute;
- ``comm_exposed``: the same for all NCCL kernels together;
- ``idle``: ``step`` minus the union of all GPU events (no stream busy: host gaps, syncs);
- per host label (``Optimizer.step#...``, ``FSDP::...`` and any other ``record_function``
  range): host time inside the ranges and the union of the GPU events launched inside them.

Times are milliseconds. ``python -m bench.trace_summary trace.json [more.json] [--png out.png]``
prints the side-by-side table.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Interval = tuple[float, float]
# Chrome-trace categories, compared lower-cased. Kineto writes ``kernel``, ``gpu_memcpy``,
# ``gpu_memset`` and ``cuda_runtime``/``cuda_driver`` (torch 2.x, ``libkineto/include/ActivityType.h``);
# older exports wrote ``Kernel``, ``Memcpy``, ``Memset`` and ``Runtime``. Both are read.
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime")
HOST_CATS = ("user_annotation",)
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other_comm")
STEP_PREFIX = "ProfilerStep#"
DEFAULT_LABELS = ("Optimizer.step", "Optimizer.zero_grad", "FSDP::", "MegatronFSDP", "DDP", "nccl:", "gloo:")


# ---------------------------------------------------------------- interval arithmetic
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, merged, non-empty intervals."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(merged: Sequence[Interval]) -> float:
    return sum(b - a for a, b in merged)


def overlap(x: Sequence[Interval], y: Sequence[Interval]) -> float:
    """Length of the intersection of two merged interval lists (two pointers)."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed(x: Sequence[Interval], cover: Sequence[Interval]) -> float:
    """Length of x not covered by ``cover`` (both merged)."""
    return length(x) - overlap(x, cover)


# ---------------------------------------------------------------- trace model
def category(ev: dict) -> str:
    return str(ev.get("cat", "")).lower()


def gpu_class(ev: dict) -> str:
    """compute, copy, or a comm kind (from the kernel name, not from labels or streams)."""
    if category(ev) != "kernel":
        return "copy"
    name = ev.get("name", "").lower().replace("_", "")
    if "nccl" not in name:
        return "compute"
    for kind, key in (("all_gather", "allgather"), ("reduce_scatter", "reducescatter"), ("all_reduce", "allreduce")):
        if key in name:
            return kind
    return "other_comm"


@dataclass(frozen=True)
class GpuEvent:
    start: float  # microseconds, as in the trace
    end: float
    stream: str
    cls: str
    name: str
    launch: float | None  # host timestamp of its launch call
    launch_tid: object


@dataclass(frozen=True)
class HostRange:
    name: str
    start: float
    end: float
    tid: object


@dataclass
class Trace:
    gpu: list[GpuEvent]
    steps: list[HostRange]  # ProfilerStep#N ranges, in time order
    labels: list[HostRange]  # other record_function ranges
    device: object = None
    categories: dict[str, int] = field(default_factory=dict)  # complete events per category, for diagnosis

    def streams(self) -> list[str]:
        return sorted({e.stream for e in self.gpu})


def _events(doc: dict | list) -> list[dict]:
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def parse(doc: dict | list) -> Trace:
    """Pick rank 0's GPU (the device with the most kernels) and the host ranges of the trace."""
    events = [e for e in _events(doc) if e.get("ph") == "X"]
    categories: dict[str, int] = {}
    for e in events:
        categories[str(e.get("cat"))] = categories.get(str(e.get("cat")), 0) + 1
    launches = {e["args"]["correlation"]: (float(e["ts"]), e.get("tid")) for e in events
                if category(e) in LAUNCH_CATS and "correlation" in e.get("args", {})}
    gpu_raw = [e for e in events if category(e) in GPU_CATS]
    counts: dict = {}
    for e in gpu_raw:
        dev = e.get("args", {}).get("device", e.get("pid"))
        counts[dev] = counts.get(dev, 0) + 1
    device = max(counts, key=lambda d: counts[d]) if counts else None
    gpu = []
    for e in gpu_raw:
        args = e.get("args", {})
        if args.get("device", e.get("pid")) != device:
            continue
        launch = launches.get(args.get("correlation"))
        start = float(e["ts"])
        gpu.append(GpuEvent(start, start + float(e.get("dur", 0.0)), str(args.get("stream", e.get("tid"))),
                            gpu_class(e), e.get("name", ""), launch[0] if launch else None,
                            launch[1] if launch else None))
    host = [HostRange(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid"))
            for e in events if category(e) in HOST_CATS]
    steps = sorted((h for h in host if h.name.startswith(STEP_PREFIX)), key=lambda h: h.start)
    labels = [h for h in host if not h.name.startswith(STEP_PREFIX)]
    return Trace(sorted(gpu, key=lambda g: g.start), steps, labels, device, categories)


def load(path: Path) -> Trace:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return parse(json.load(f))


def split_steps(trace: Trace) -> list[tuple[HostRange | None, list[GpuEvent]]]:
    """GPU events per profiler step (by launch time; by start time without a launch). Without
    step ranges, or when no GPU event falls in one, all GPU events are one step ("all")."""
    if not trace.steps:
        return [(None, list(trace.gpu))] if trace.gpu else []
    starts = [s.start for s in trace.steps]
    buckets: list[list[GpuEvent]] = [[] for _ in trace.steps]
    for ev in trace.gpu:
        t = ev.launch if ev.launch is not None else ev.start
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and (ev.launch is None or t <= trace.steps[i].end):
            buckets[i].append(ev)
    split = [(s, b) for s, b in zip(trace.steps, buckets, strict=True) if b]
    return split or ([(None, list(trace.gpu))] if trace.gpu else [])


def explain_empty(trace: Trace) -> str:
    """Why a trace gives no step table: what it holds instead (event categories and counts)."""
    if trace.gpu:
        return f"{len(trace.gpu)} GPU events but none summarised"
    seen = ", ".join(f"{c} {n}" for c, n in sorted(trace.categories.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"
    return f"no GPU events (complete events by category: {seen})"


# ---------------------------------------------------------------- per-step numbers
@dataclass
class StepSummary:
    name: str
    ms: dict[str, float] = field(default_factory=dict)
    labels: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # name -> (count, host ms, gpu ms)
    kernels: dict[str, tuple[int, float]] = field(default_factory=dict)  # short name -> (count, summed ms)


class RangeSet:
    """Host ranges of one label, merged per thread, for fast 'launched inside?' lookups."""

    def __init__(self, ranges: list[HostRange]) -> None:
        self.by_tid: dict[object, list[Interval]] = {}
        for r in ranges:
            self.by_tid.setdefault(r.tid, []).append((r.start, r.end))
        self.by_tid = {k: union(v) for k, v in self.by_tid.items()}
        self.starts = {k: [a for a, _ in v] for k, v in self.by_tid.items()}

    def contains(self, t: float, tid: object) -> bool:
        keys = [tid] if tid in self.by_tid else list(self.by_tid)  # unknown thread: any thread's range
        for k in keys:
            i = bisect.bisect_right(self.starts[k], t) - 1
            if i >= 0 and t <= self.by_tid[k][i][1]:
                return True
        return False


def label_key(name: str, prefixes: Sequence[str]) -> str | None:
    """``Optimizer.step#AdamW.step`` -> ``Optimizer.step``; names under a prefix ending in ``:``
    (``FSDP::all_gather``, ``nccl:all_gather``) stay whole, except a trailing unit name
    (``FSDP::pre_forward (blocks.3)`` -> ``FSDP::pre_forward``: one row per phase)."""
    for p in prefixes:
        if name.startswith(p):
            return name.split(" (", 1)[0] if p.endswith(":") else p
    return None


def summarise_step(step: HostRange | None, events: list[GpuEvent], labels: list[HostRange],
                   prefixes: Sequence[str] = DEFAULT_LABELS) -> StepSummary:
    u = {cls: union((e.start, e.end) for e in events if e.cls == cls)
         for cls in ("compute", "copy", *COMM_KINDS)}
    comm = union(i for k in COMM_KINDS for i in u[k])
    busy = union((e.start, e.end) for e in events)
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    ms = {"step": t1 - t0, "compute": length(u["compute"]), "copy": length(u["copy"]),
          "comm": length(comm), "comm_exposed": exposed(comm, u["compute"]), "idle": (t1 - t0) - length(busy)}
    for k in COMM_KINDS:
        ms[k] = length(u[k])
        ms[f"{k}_exposed"] = exposed(u[k], u["compute"])
    out = StepSummary(step.name if step else "all", {k: v / 1e3 for k, v in ms.items()})
    groups: dict[str, list[HostRange]] = {}
    for r in labels:
        key = label_key(r.name, prefixes)
        if key is not None and (step is None or (r.start >= step.start and r.start <= step.end)):
            groups.setdefault(key, []).append(r)
    for key in sorted(groups):
        rs = groups[key]
        inside = RangeSet(rs)
        gpu = union((e.start, e.end) for e in events
                    if e.launch is not None and inside.contains(e.launch, e.launch_tid))
        out.labels[key] = (len(rs), length(union((r.start, r.end) for r in rs)) / 1e3, length(gpu) / 1e3)
    for e in events:
        name = short_name(e.name)
        count, total = out.kernels.get(name, (0, 0.0))
        out.kernels[name] = (count + 1, total + (e.end - e.start) / 1e3)
    return out


def short_name(name: str, width: int = 90) -> str:
    """A kernel name without its argument list and template noise, cut to ``width``."""
    base = name.split("(")[0].removeprefix("void ").strip() or name
    return base if len(base) <= width else base[:width - 1] + "…"


def summarise(trace: Trace, prefixes: Sequence[str] = DEFAULT_LABELS) -> list[StepSummary]:
    return [summarise_step(s, evs, trace.labels, prefixes) for s, evs in split_steps(trace)]


def mean_step(steps: list[StepSummary]) -> StepSummary:
    """Average of the steps' numbers (labels and kernels: mean count and times)."""
    n = len(steps)
    out = StepSummary(f"mean of {n}")
    for k in steps[0].ms:
        out.ms[k] = sum(s.ms[k] for s in steps) / n
    for k in sorted({k for s in steps for k in s.labels}):
        vals = [s.labels.get(k, (0, 0.0, 0.0)) for s in steps]
        out.labels[k] = (round(sum(v[0] for v in vals) / n), sum(v[1] for v in vals) / n, sum(v[2] for v in vals) / n)
    for k in {k for s in steps for k in s.kernels}:
        kv = [s.kernels.get(k, (0, 0.0)) for s in steps]
        out.kernels[k] = (round(sum(v[0] for v in kv) / n), sum(v[1] for v in kv) / n)
    return out


# ---------------------------------------------------------------- reports
ROWS = (("step", "step (GPU first start → last end)"), ("compute", "compute kernels (union)"),
        ("copy", "memcpy/memset (union)"), ("comm", "NCCL (union)"), ("comm_exposed", "NCCL exposed"),
        ("all_gather", "all-gather"), ("all_gather_exposed", "all-gather exposed"),
        ("reduce_scatter", "reduce-scatter"), ("reduce_scatter_exposed", "reduce-scatter exposed"),
        ("all_reduce", "all-reduce"), ("all_reduce_exposed", "all-reduce exposed"),
        ("other_comm_exposed", "other NCCL exposed"), ("idle", "GPU idle (host gaps)"))


def markdown(named: dict[str, list[StepSummary]], top_kernels: int = 12) -> str:
    """Side-by-side table (mean over the profiled steps) plus a label table per implementation."""
    names = [n for n, steps in named.items() if steps]
    means = {n: mean_step(named[n]) for n in names}
    head = "| ms per step | " + " | ".join(names) + " |"
    lines = [head, "|" + " --- |" * (len(names) + 1)]
    for key, text in ROWS:
        cells = []
        for n in names:
            v, step = means[n].ms[key], means[n].ms["step"]
            cells.append(f"{v:.2f}" + (f" ({100 * v / step:.1f}%)" if key != "step" and step > 0 else ""))
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    lines += ["", "Exposed: not covered by any compute kernel. The exposed times of different collectives can "
              "overlap each other; 'NCCL exposed' counts each moment once."]
    for n in names:
        if not means[n].labels:
            continue
        lines += ["", f"Host ranges, {n} (per step: count, host ms, GPU ms of the kernels launched inside):", "",
                  "| label | count | host ms | GPU ms |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {k} | {c} | {h:.2f} | {g:.2f} |" for k, (c, h, g) in means[n].labels.items()]
    for n in names:
        top = sorted(means[n].kernels.items(), key=lambda kv: -kv[1][1])[:top_kernels]
        lines += ["", f"Top GPU kernels, {n} (per step; summed durations, overlaps counted twice):", "",
                  "| kernel | count | ms |", "| --- | ---: | ---: |"]
        lines += [f"| `{k}` | {c} | {ms:.2f} |" for k, (c, ms) in top]
    lines += ["", "Steps profiled: " + "; ".join(f"{n}: {len(named[n])}" for n in named)]
    return "\n".join(lines) + "\n"


COLOURS = {"compute": "#4c72b0", "copy": "#8c8c8c", "all_gather": "#55a868", "reduce_scatter": "#dd8452",
           "all_reduce": "#c44e52", "other_comm": "#8172b3"}


def timeline_png(named: dict[str, list[GpuEvent]], path: Path, title: str = "one training step") -> bool:
    """One panel per implementation, one row per stream, coloured by class; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    items = [(n, evs) for n, evs in named.items() if evs]
    if not items:
        return False
    fig, axes = plt.subplots(len(items), 1, figsize=(16, 1.2 + 1.1 * sum(len({e.stream for e in v}) for _, v in items)),
                             squeeze=False)
    span = max(max(e.end for e in v) - min(e.start for e in v) for _, v in items) / 1e3
    for ax, (name, evs) in zip(axes[:, 0], items, strict=True):
        t0 = min(e.start for e in evs)
        streams = sorted({e.stream for e in evs}, key=lambda x: (not x.isdigit(), int(x) if x.isdigit() else 0, x))
        for row, s in enumerate(streams):
            for cls, colour in COLOURS.items():
                bars = [((e.start - t0) / 1e3, max((e.end - e.start) / 1e3, 1e-4)) for e in evs
                        if e.stream == s and e.cls == cls]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, linewidth=0)
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
        ax.set_xlim(0, span)
        ax.set_title(name, loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("ms from the step's first GPU event")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", ncol=6)
    fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", type=Path, nargs="+", help="chrome traces (.json or .json.gz), one per impl")
    p.add_argument("--png", type=Path, default=None, help="timeline of each trace's last step")
    args = p.parse_args(argv)
    traces = {t.name.split(".")[0]: load(t) for t in args.traces}
    print(markdown({n: summarise(t) for n, t in traces.items()}))
    if args.png is not None:
        last = {n: split_steps(t)[-1][1] for n, t in traces.items() if split_steps(t)}
        timeline_png(last, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
