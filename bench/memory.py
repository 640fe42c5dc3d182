"""Where the memory of a training step goes: persistent state by dtype, and the transient part at the peak.

Two sources, both per rank (rank 0 is reported):

- the tensors themselves, at the end of backward: params, grads and optimizer state of the
  wrapped model (DTensor shards resolved to their local tensors), counted by storage so views into
  one flat buffer count once with their padding;
- the caching allocator's history for one step (``torch.cuda.memory._record_memory_history``):
  replaying its alloc/free events gives the peak (checked against ``max_memory_allocated``) and the
  blocks live at that moment, each attributed by its allocation stack to a category (``classify``):
  activations of the forward, autograd temporaries of the backward, gathered parameters, grad
  buffers and reduce staging of the FSDP engine, optimizer temporaries.

Without CUDA, or on a torch without the history API, the report says so and gives what it can.
The replay and the classification are pure Python (unit-tested on CPU).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30
ENGINE_PATHS = ("fsdp_impl/", "torch/distributed/fsdp/", "megatron_fsdp/", "torch/nn/parallel/",
                "torch/distributed/_composable/")
GATHERED = "gathered params (all-gather in flight)"
GRADS = "grad buffers + reduce staging"
ENGINE_OTHER = "FSDP engine, other"
ACTIVATIONS = "activations + logits (forward)"
BACKWARD = "autograd temporaries (backward)"
OPTIMIZER = "optimizer step temporaries"


def _engine_category(name: str, filename: str) -> str:
    # alloc_storage: FSDP2 (re)allocates an unsharded param's storage there before its all-gather
    if any(k in name.lower() for k in ("gather", "unshard", "prefetch", "alloc_storage")):
        return GATHERED
    text = f"{filename}:{name}".lower()
    if any(k in text for k in ("reduce", "scatter", "grad", "bucket")):
        return GRADS
    return ENGINE_OTHER


def classify(frames: Sequence[dict]) -> str:
    """Category of one allocation from its stack (innermost frame first, as torch records it)."""
    if not frames:
        return BACKWARD  # the autograd engine's device thread runs no Python
    for f in frames:
        filename, name = f.get("filename", ""), f.get("name", "")
        if any(p in filename for p in ENGINE_PATHS):
            return _engine_category(name, filename)
        if "torch/optim/" in filename or "fsdp_impl/optim/" in filename:
            return OPTIMIZER
        if filename.endswith("bench/gpt.py"):
            return ACTIVATIONS
        if filename.endswith("bench/impls.py"):
            return {"forward_loss": ACTIVATIONS, "backward": BACKWARD,
                    "optimizer_step": OPTIMIZER}.get(name, ENGINE_OTHER)
    inner = frames[0]
    return f"unattributed ({inner.get('filename', '?').rsplit('/', 1)[-1]}:{inner.get('name', '?')})"


def site(frames: Sequence[dict]) -> str:
    """``file:function`` of the innermost frame outside torch's own plumbing (for the top-sites list)."""
    skip = ("torch/nn/modules/module.py", "torch/utils/", "torch/autograd/", "contextlib.py", "torch/_tensor.py")
    for f in frames:
        if not any(s in f.get("filename", "") for s in skip):
            return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('name', '?')}"
    return "<no python frame>"


@dataclass
class PeakReplay:
    peak_bytes: int  # base + the largest running total
    live: list[dict]  # blocks allocated during the recording and live at the peak
    freed_before_peak: int  # bytes of blocks allocated before the recording, freed before the peak


def replay_peak(trace: Iterable[dict], base: int) -> PeakReplay:
    """Replay alloc/free events from a known starting total ``base`` and find the peak.

    Frees count at ``free_requested`` (when ``memory_allocated`` drops), or ``free_completed``
    when the history has no ``free_requested`` entries. A free of a block allocated before the
    recording lowers the total by its size (it was part of ``base``).
    """
    events = list(trace)
    free = "free_requested" if any(e.get("action") == "free_requested" for e in events) else "free_completed"

    def walk(stop: int | None):
        live: dict[int, dict] = {}
        cur = best = freed = best_freed = 0
        best_i = -1
        for i, e in enumerate(events if stop is None else events[:stop + 1]):
            action = e.get("action")
            if action == "alloc":
                live[e["addr"]] = e
                cur += e["size"]
            elif action == free:
                if e["addr"] in live:
                    cur -= live.pop(e["addr"])["size"]
                else:
                    cur -= e["size"]
                    freed += e["size"]
            if cur > best:
                best, best_i, best_freed = cur, i, freed
        return live, best, best_i, best_freed

    _, best, best_i, freed = walk(None)
    live = walk(best_i)[0] if best_i >= 0 else {}
    return PeakReplay(base + best, list(live.values()), freed)


def transient_by_category(live: Iterable[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in live:
        key = classify(b.get("frames", []))
        out[key] = out.get(key, 0) + b["size"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def top_sites(live: Iterable[dict], n: int = 8) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for b in live:
        key = site(b.get("frames", []))
        out[key] = out.get(key, 0) + b["size"]
    return sorted(out.items(), key=lambda kv: -kv[1])[:n]


@dataclass
class MemoryReport:
    impl: str
    storages: dict[tuple[str, str], int] = field(default_factory=dict)  # (category, dtype) -> bytes
    numbers: dict[str, int] = field(default_factory=dict)  # rest, end_of_backward, peak, peak_replay
    transient: dict[str, int] = field(default_factory=dict)
    sites: list[tuple[str, int]] = field(default_factory=list)
    freed_before_peak: int = 0
    notes: list[str] = field(default_factory=list)


def to_dict(rep: MemoryReport) -> dict:
    """JSON-ready form (a profile child hands its report to the driver through a file)."""
    return {"impl": rep.impl, "storages": [[c, d, b] for (c, d), b in rep.storages.items()],
            "numbers": rep.numbers, "transient": rep.transient, "sites": [list(s) for s in rep.sites],
            "freed_before_peak": rep.freed_before_peak, "notes": rep.notes}


def from_dict(d: dict) -> MemoryReport:
    return MemoryReport(d["impl"], {(c, t): b for c, t, b in d["storages"]}, dict(d["numbers"]),
                        dict(d["transient"]), [(s, b) for s, b in d["sites"]], d["freed_before_peak"],
                        list(d["notes"]))


def _gib(b: int) -> str:
    return f"{b / GIB:.3f}"


def markdown(reports: list[MemoryReport]) -> str:
    """Side-by-side memory tables (GiB, rank 0) for the given implementations."""
    names = [r.impl for r in reports]
    head = ["| GiB (rank 0) | " + " | ".join(names) + " |", "|" + " --- |" * (len(names) + 1)]
    lines = ["Memory of one step after warm-up (GiB allocated on rank 0, everything counted).", "", *head]
    numbers = (("after_build", "after build (no optimizer state yet)"), ("rest", "at rest (after zero_grad)"),
               ("end_of_backward", "at the end of backward"),
               ("peak", "peak (max_memory_allocated)"),
               ("peak_replay", "peak (allocator history replay, requested sizes)"))
    for key, text in numbers:
        lines.append(f"| {text} | " + " | ".join(_gib(r.numbers[key]) if key in r.numbers else "–"
                                                 for r in reports) + " |")
    keys = sorted({k for r in reports for k in r.storages})
    for cat, dtype in keys:
        lines.append(f"| tensors: {cat} ({dtype}) | " + " | ".join(
            _gib(r.storages[(cat, dtype)]) if (cat, dtype) in r.storages else "–" for r in reports) + " |")
    lines.append("| end of backward − tensors above (held elsewhere: unsharded params, engine buffers) | " + " | ".join(
        _gib(r.numbers["end_of_backward"] - sum(r.storages.values())) if "end_of_backward" in r.numbers else "–"
        for r in reports) + " |")
    cats = list(dict.fromkeys(k for r in reports for k in r.transient))
    for cat in cats:
        lines.append(f"| at peak, allocated in the step: {cat} | " + " | ".join(
            _gib(r.transient[cat]) if cat in r.transient else "–" for r in reports) + " |")
    lines.append("| at peak, pre-step blocks freed before it | " + " | ".join(
        f"-{_gib(r.freed_before_peak)}" for r in reports) + " |")
    for r in reports:
        if r.sites:
            lines += ["", f"Largest allocation sites live at the peak, {r.impl}: " + "; ".join(
                f"{s} {b / GIB:.3f}" for s, b in r.sites)]
        lines += [f"- {r.impl}: {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- torch side (GPU)
def storages(model, optimizer, device=None) -> dict[tuple[str, str], int]:
    """Bytes by (category, dtype) of params, grads and optimizer state on ``device`` (all devices
    when None), each storage counted once: views into one flat buffer count it whole, padding too."""
    import torch

    seen: set[int] = set()
    out: dict[tuple[str, str], int] = {}

    def add(cat: str, t) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        if device is not None and local.device.type != torch.device(device).type:
            return  # e.g. AdamW's host-side step counters
        st = local.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return
        seen.add(st.data_ptr())
        key = (cat, str(local.dtype).replace("torch.", ""))
        out[key] = out.get(key, 0) + st.nbytes()

    params = list(model.parameters())
    for p in params:
        add("params", p)
    for p in params:
        add("grads", p.grad)
        add("grads", getattr(p, "decoupled_grad", None))
    for state in optimizer.state.values():
        for v in state.values():
            add("optimizer state", v)
    for b in model.buffers():
        add("module buffers", b)
    return out


def _start_history(rep: MemoryReport, env) -> Any:
    """The recorder function when the allocator history is now on, else None (with a note why)."""
    import torch

    recorder: Any = getattr(torch.cuda.memory, "_record_memory_history", None)
    if not env.is_cuda:
        rep.notes.append("no CUDA: allocator numbers and history not available")
        return None
    if recorder is None:
        rep.notes.append("this torch has no torch.cuda.memory._record_memory_history")
        return None
    try:
        recorder(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    except (TypeError, RuntimeError) as err:
        rep.notes.append(f"memory history not recorded: {err}")
        return None
    return recorder


def _add_replay(rep: MemoryReport, snap: dict, env, base: int) -> None:
    traces = snap.get("device_traces") or []
    index = env.device.index if env.device.index is not None else 0
    replay = replay_peak(traces[index] if index < len(traces) else [], base)
    rep.numbers["peak_replay"] = replay.peak_bytes
    rep.transient = transient_by_category(replay.live)
    rep.sites = top_sites(replay.live)
    rep.freed_before_peak = replay.freed_before_peak
    gap = rep.numbers.get("peak", replay.peak_bytes) - replay.peak_bytes
    if abs(gap) > 0.05 * max(replay.peak_bytes, 1):
        rep.notes.append(f"history replay and max_memory_allocated differ by {gap / GIB:.3f} GiB (over 5%): "
                         "history ring buffer full, or frees recorded late")


def measure(name: str, trainee, env) -> MemoryReport:
    """One recorded step of an already warmed-up trainee (this rank's numbers).

    The history's sizes are the requested ones; ``max_memory_allocated`` counts blocks rounded up
    (512 B, or a whole unsplit block), so the replayed peak is a little lower.
    """
    import torch

    from bench import runtime

    rep = MemoryReport(name)
    runtime.sync(env)
    rep.numbers["rest"] = runtime.allocated(env)
    recorder = _start_history(rep, env)
    try:
        runtime.reset_peak(env)
        base = runtime.allocated(env)
        loss = trainee.forward_loss()
        trainee.backward(loss)
        runtime.sync(env)
        rep.numbers["end_of_backward"] = runtime.allocated(env)
        rep.storages = storages(trainee.model, trainee.optimizer, env.device)
        trainee.optimizer_step()
        runtime.sync(env)
        if env.is_cuda:
            rep.numbers["peak"] = runtime.peak_allocated(env)
        snap = torch.cuda.memory._snapshot() if recorder is not None else None
    finally:
        if recorder is not None:
            recorder(enabled=None)
    if snap is not None:
        _add_replay(rep, snap, env, base)
    return rep
