"""CPU-offload benchmark on one GPU (issues 28, 48): ours with ``OffloadPolicy(step="gpu")`` and
``step="cpu"``, ours without offload, FSDP2 with and without ``CPUOffloadPolicy``; each cell in a
fresh process, side by side in one run, ``--reps`` runs each (default 3; the table shows medians).

The anchor every row is put against (column "vs fsdp2-offload-fused") is FSDP2 offloading as its
informed users run it: ``CPUOffloadPolicy(pin_memory=True)`` with ``AdamW(fused=True)``. FSDP2 with
the default (single-tensor) CPU AdamW stays as a secondary row, ``fsdp2-offload``. The ``-clip``
cells clip the grad norm before every step and are put against the anchor clipping too
(``fsdp2-offload-fused-clip``) when that row ran. The ``-overlap`` cells run
``OffloadPolicy(overlap_step=...)``; their column "overlapped ms (hidden)" is the host time of the
units' overlapped steps (or norms, ``-overlap-clip``) and the share of it that ran before the
backward ended (host timestamps of the worker, ``OverlapTimes.busy``, against the time the
backward was done on the device); their JSON rows also give the worker's time per phase
(``worker_<phase>_ms``) and its host Adam's rate while the backward ran and after it ended
(``adam_gbs_during_bwd`` / ``adam_gbs_after_bwd``, 28 bytes a param; put them against
``--bandwidth``'s uncontended ``host_adam``). ``--trace DIR`` writes a torch.profiler Chrome trace per cell.

Usage, from the repository root on a machine with one GPU::

    python -m bench.offload_bench --size 1.3b                      # the default cells, 1.3B
    python -m bench.offload_bench --size 7b --cells ours-gpu,fsdp2-offload
    python -m bench.offload_bench --bandwidth                      # pinned H2D / D2H GB/s only
    python -m bench.offload_bench --sizes 7b,9b,13b --cells ours-gpu-lean,fsdp2-offload-fused
    python -m bench.offload_bench --size 1.3b --cells fsdp2-offload-fused,ours-cpu,ours-cpu-overlap --trace /tmp/tr
    python -m bench.offload_bench --size tiny --cells ours,ours-cpu,ours-cpu-overlap --reps 1   # CPU smoke

``--sizes`` steps each cell up through the sizes given until one does not train (out of memory,
an error or a timeout) and ends with the largest size each cell trained: the "largest model on
one GPU" comparison. Host memory bounds it too: fp32 main params, grads and Adam moments take
16 bytes per parameter on the host (98 GiB at 7B), ``ours-gpu-lean`` 10 (bf16 grads and moments:
87 GiB at 9B), and a cell killed for host memory is a row with its error like any other; each
row has the process's peak resident host memory.

Sizes are the suite's (``bench.impls.SIZES``); the offload cells are this module's, not the
suite's (the suite's cells run several ranks and compare with FSDP2 without offload).

Per cell: tokens/s over the measured steps, the step split into forward+backward and optimizer
step (host-synchronised at each boundary), peak device memory (``max_memory_allocated`` over the
measured steps), device memory at rest after ``zero_grad``, and first/last loss. With
``--bandwidth`` (or always, with ``--report-limit``) the pinned copy bandwidth and the host's
fused AdamW rate are measured, and each offloaded cell gets two floors: the bytes its step must
move over PCIe divided by that bandwidth (``offload_bytes``), and, where the optimizer steps on
the host, the bytes its host cores must move (the host Adam's and a host cast's, ``host_bytes``)
divided by the host's uncontended fused AdamW rate, which no overlap can beat. Results: one JSON
line per cell on stdout and a Markdown table; ``--out`` writes the JSON list.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench import cli, launch
from bench.gpt import GPT, Block, GPTConfig
from bench.impls import SIZES, num_params_of
from bench.offload_cells import (
    ADAM_BYTES,
    ANCHOR,
    CELLS,
    CLIP_NORM,
    DEFAULT_CELLS,
    base_cell,
    device_step_units,
    host_bytes,
    host_copy_mode,
    offload_bytes,
    overlap_mode,
    step_threads,
)

LR = 1e-4
GIB = 2**30


def _split(a: float, b: float, end: float) -> tuple[float, float]:
    """The seconds of the interval ``[a, b]`` before ``end`` and after it."""
    return max(0.0, min(b, end) - a), max(0.0, b - max(a, end))


def overlap_share(busy: list[tuple[float, float]], backward_end: float) -> tuple[float, float]:
    """(ms of the overlapped host work that lay before ``backward_end``, ms of all of it): the
    worker's busy intervals (``OverlapTimes.busy``) against the host time the backward ended."""
    total = sum(b - a for a, b in busy)
    hidden = sum(_split(a, b, backward_end)[0] for a, b in busy)
    return 1e3 * hidden, 1e3 * total


def adam_rates(stepped: list[tuple[float, float, int]], backward_end: float,
               bytes_per_elem: int = ADAM_BYTES) -> tuple[float | None, float | None]:
    """(GB/s of the worker's host Adam while the backward ran, GB/s after it ended), from each
    unit's (start, end, elements) (``OverlapTimes.stepped``); an interval across the end counts
    its elements in proportion to its time on each side; None where no Adam ran on that side.
    Against ``--bandwidth``'s uncontended ``host_adam`` rates: what the overlap costs the kernel."""
    secs, elems = [0.0, 0.0], [0.0, 0.0]  # [during the backward, after it]
    for a, b, n in stepped:
        for side, part in enumerate(_split(a, b, backward_end)):
            secs[side] += part
            elems[side] += n * part / (b - a) if b > a else 0.0
    during, after = (e * bytes_per_elem / t / 1e9 if t > 0 else None for t, e in zip(secs, elems, strict=True))
    return during, after


# ----------------------------------------------------------------------------------- one cell
def _init() -> torch.device:
    """One rank: CUDA and NCCL, or (no GPU: the ``--size tiny`` smoke) the CPU and gloo."""
    import torch.distributed as dist

    port = int(os.environ.get("OFFLOAD_BENCH_PORT", "29561"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build(cell: str, cfg: GPTConfig, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import fsdp_impl

    torch.manual_seed(0)
    with torch.device(device):
        module = GPT(cfg)
    if cell.startswith("ours"):
        module = module.to(torch.bfloat16)
        kwargs: dict[str, Any] = {}
        base, pin, overlap = base_cell(cell), device.type == "cuda", overlap_mode(cell)
        if base in ("ours-gpu", "ours-gpu-lean"):
            kwargs["offload_policy"] = fsdp_impl.OffloadPolicy(pin_memory=pin, overlap_step=overlap)
        elif base == "ours-gpu-hostall":
            kwargs["offload_policy"] = fsdp_impl.OffloadPolicy(params=True, grads=True, pin_memory=pin,
                                                               overlap_step=overlap)
        elif base.startswith("ours-cpu"):  # -hostall: params=True, -lateup: no upload ahead, -hostcopy/-devcopy:
            # a host bf16 copy cast on the host / on the device, -wide / -narrow: the worker as wide as the caller /
            # one fewer throughout, -huge: host buffers in transparent huge pages
            kwargs["offload_policy"] = fsdp_impl.OffloadPolicy(step="cpu", params="hostall" in base,
                                                               pin_memory=pin, overlap_step=overlap,
                                                               huge_pages="-huge" in base,
                                                               upload_ahead="lateup" not in base,
                                                               compute_copy_on_host=host_copy_mode(base),
                                                               step_threads=step_threads(base),
                                                               device_step_units=device_step_units(base))
        lean = base == "ours-gpu-lean"
        policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                main_grads_dtype=torch.bfloat16 if lean else torch.float32)
        opt: torch.optim.Optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
        if lean:  # decoupled grads: bf16 grads of fp32 params would otherwise be cast into fp32 .grad tensors
            opt = fsdp_impl.optim.AdamW(module.parameters(), lr=LR, exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16, use_decoupled_grad=True)
            kwargs["use_decoupled_grad"] = True
        return fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3,
                                     mixed_precision_policy=policy, **kwargs)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if cell.startswith("fsdp2-offload") else OffloadPolicy()
    for blk in module.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fused = True if base_cell(cell) == "fsdp2-offload-fused" else None
    return module, torch.optim.AdamW(module.parameters(), lr=LR, fused=fused)


def _clip(cell: str, model: torch.nn.Module) -> None:
    """The -clip cells: the global grad norm clipped before every step."""
    if not cell.endswith("-clip"):
        return
    if cell.startswith("ours"):
        import fsdp_impl
        fsdp_impl.clip_grad_norm(model, CLIP_NORM)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)


def run_cell(cell: str, size: str, micro_batch: int, warmup: int, steps: int,
             trace: Path | None = None) -> dict[str, Any]:
    """One cell in this process. With ``trace``, the measured steps run under torch.profiler and
    its Chrome trace is written to ``trace/<cell>-<size>.json`` (the host step, copies and compute)."""
    from fsdp_impl.offload.optim import overlap_of

    device = _init()
    cfg = SIZES[size]
    model, opt = _build(cell, cfg, device)
    overlap = overlap_of(opt)
    gen = torch.Generator(device=device).manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), device=device, generator=gen)
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    losses: list[float] = []
    fwd_bwd: list[float] = []
    step_times: list[float] = []
    totals: list[float] = []
    hidden: list[tuple[float, float]] = []  # per measured step: (ms hidden under the backward, ms in all)
    phases: list[dict[str, float]] = []  # per measured step: the worker's seconds per phase (OverlapTimes.phases)
    rates: list[tuple[float | None, float | None]] = []  # per measured step: adam_rates
    last_t1 = 0.0
    profiler = None
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if trace is not None:
                profiler = _start_profiler(device)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(inputs).float().view(-1, cfg.vocab), target.reshape(-1))
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        _clip(cell, model)
        opt.step()
        opt.zero_grad()
        _sync(device)
        t2 = time.perf_counter()
        losses.append(loss.item())
        if i >= warmup:
            fwd_bwd.append(t1 - t0)
            step_times.append(t2 - t1)
            totals.append(t2 - t0)
            if overlap is not None and overlap.last_times is not None:
                # "forward": the cycle joined now is the last step's (its worker ran on into this forward)
                backward_end = last_t1 if overlap.runs_on else t1
                hidden.append(overlap_share(overlap.last_times.busy, backward_end))
                phases.append(dict(overlap.last_times.phases))
                rates.append(adam_rates(overlap.last_times.stepped, backward_end))
        last_t1 = t1
    if profiler is not None and trace is not None:
        profiler.stop()
        trace.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace / f"{cell}-{size}.json"))

    cuda = device.type == "cuda"
    row = {
        "cell": cell, "size": size, "params": num_params_of(cfg), "micro_batch": micro_batch, "seq": cfg.seq,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens_per_s": micro_batch * cfg.seq / _median(totals), "step_ms": 1e3 * _median(totals),
        "fwd_bwd_ms": 1e3 * _median(fwd_bwd), "opt_ms": 1e3 * _median(step_times),
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
        "rest_gib": torch.cuda.memory_allocated() / GIB if cuda else 0.0,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,  # Linux: KiB
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses, "status": "ok",
    }
    if hidden:
        row.update(_overlap_stats(hidden, phases, rates))
    return row


def _median(values: list[float]) -> float:
    """The upper median (an element of ``values``: the step that ran, not a mean of two)."""
    return sorted(values)[len(values) // 2]


def _overlap_stats(hidden: list[tuple[float, float]], phases: list[dict[str, float]],
                   rates: list[tuple[float | None, float | None]]) -> dict[str, float]:
    """The overlapped host work over the measured steps: its median ms and the share of it hidden
    under the backward, the worker's ms per phase, its host Adam's GB/s during / after the backward."""
    row = {"overlap_hidden_ms": _median([h for h, _ in hidden]), "overlap_total_ms": _median([t for _, t in hidden]),
           "overlap_share": _median([h / t if t > 0 else 0.0 for h, t in hidden])}
    for phase in sorted({k for p in phases for k in p}):  # where the worker's time went
        row[f"worker_{phase}_ms"] = 1e3 * _median([p.get(phase, 0.0) for p in phases])
    for key, side in (("adam_gbs_during_bwd", 0), ("adam_gbs_after_bwd", 1)):  # the host Adam's rate
        values = [v for v in (r[side] for r in rates) if v is not None]
        if values:
            row[key] = _median(values)
    return row


def _start_profiler(device: torch.device) -> Any:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # every thread: the overlap worker's FSDP::overlap_step ranges (host step) show beside the compute
    profiler = profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    profiler.start()
    return profiler


# -------------------------------------------------------------------------------- bandwidth
def bandwidth(gib: float = 1.0, repeat: int = 5) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth in GB/s: H2D, D2H, and both at once on two streams."""
    n = int(gib * GIB) // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    dev2 = torch.empty(n, dtype=torch.float32, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / repeat

    def both() -> None:
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)

    nbytes = n * 4
    return {"h2d_gbps": nbytes / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9,
            "d2h_gbps": nbytes / timed(lambda: host2.copy_(dev2, non_blocking=True)) / 1e9,
            "duplex_each_gbps": nbytes / timed(both) / 1e9, **host_bandwidth(host, host2, repeat)}


def host_bandwidth(a: torch.Tensor, b: torch.Tensor, repeat: int = 5) -> dict[str, float]:
    """Host memory bandwidth in GB/s (bytes read + written), at the caller's intra-op width and one
    thread narrower (the overlapped step's worker): a plain copy, and fused CPU AdamW (28 bytes a
    param: param, grad, two moments read; param, two moments written). What bounds an offloaded step
    whose host work outruns its transfers."""
    n = a.numel() // 4
    p, g, m, v = (a[i * n:(i + 1) * n] for i in range(4))
    step = torch.ones(())  # the kernel divides by 1 - beta ** step: step 0 would make NaNs

    def adam() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-9, beta1=0.9, beta2=0.95,  # type: ignore[attr-defined]
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    def timed(fn: Any) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t) / repeat

    a.zero_()  # zero moments: the step's arithmetic stays finite
    width = torch.get_num_threads()
    out: dict[str, float] = {}
    for threads, tag in ((width, ""), (max(1, width - 1), "_spare")):
        torch.set_num_threads(threads)
        out[f"host_copy{tag}_gbps"] = 2 * a.numel() * 4 / timed(lambda: b.copy_(a)) / 1e9
        out[f"host_adam{tag}_gbps"] = ADAM_BYTES * n / timed(adam) / 1e9
    torch.set_num_threads(width)
    return out


# ----------------------------------------------------------------------------------- driver
def _spawn(cell: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    """One cell in a child of its own session (``bench.launch.run``: killed with its children on
    a timeout or when the driver is signalled); its result is the last JSON line it prints."""
    cmd = [sys.executable, "-m", "bench.offload_bench", "--one", cell, "--size", size,
           "--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if getattr(args, "trace", None) is not None:
        cmd += ["--trace", str(args.trace)]
    done = launch.run(cmd, dict(os.environ, PYTHONUNBUFFERED="1"), args.timeout, prefix=f"[{cell} {size}] ")
    if done.timed_out:
        return {"cell": cell, "size": size, "status": "timeout", "detail": f"over {args.timeout} s"}
    for line in reversed(done.tail):
        if line.startswith("{"):
            return dict(json.loads(line))
    text = "\n".join(done.tail)
    status = "OOM" if "OutOfMemoryError" in text or "out of memory" in text else "error"
    return {"cell": cell, "size": size, "status": status, "detail": done.why()}


def sweep(cells: list[str], sizes: list[str], args: argparse.Namespace,
          spawn: Callable[[str, str, argparse.Namespace], dict[str, Any]] = _spawn,
          on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Each size in order; at each size ``args.reps`` rounds, each running every cell still in the
    race once in a fresh process (rounds alternate the cells, so a drift of the host's speed falls
    on all of them alike). A cell leaves at its first failed run (the larger sizes are not tried).
    One row per run (``rep``: its round), printed as it ends and passed with the rows so far to
    ``on_row`` (``--out`` keeps what ran if the sweep is stopped); ``medians`` folds them."""
    rows: list[dict[str, Any]] = []
    alive = list(cells)
    for size in sizes:
        for rep in range(getattr(args, "reps", 1)):
            for cell in list(alive):
                row = spawn(cell, size, args)
                row["rep"] = rep
                rows.append(row)
                print(json.dumps(row), flush=True)
                if on_row is not None:
                    on_row(rows)
                if row.get("status") != "ok":
                    alive.remove(cell)
        if not alive:
            break
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (cell, size), in first-seen order: the median run by tokens/s (its other
    figures are that run's), ``runs`` and ``tokens_per_s_runs`` listing every run; a cell with a
    failed run at that size is that failed run."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["cell"], r.get("size", "")), []).append(r)
    out = []
    for runs in groups.values():
        failed = [r for r in runs if r.get("status") != "ok"]
        if failed:
            out.append(failed[0])
            continue
        ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
        out.append({**ranked[(len(ranked) - 1) // 2], "runs": len(runs),
                    "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in runs]})
    return out


def versus_anchor(rows: list[dict[str, Any]], anchor_cell: str = ANCHOR) -> dict[tuple[str, str], float]:
    """tokens/s of each ok (median) row over the anchor's at the same size (no anchor row: absent)."""
    anchor = {r["size"]: r["tokens_per_s"] for r in rows if r["cell"] == anchor_cell and r.get("status") == "ok"}
    return {(r["cell"], r["size"]): r["tokens_per_s"] / anchor[r["size"]]
            for r in rows if r.get("status") == "ok" and r["size"] in anchor}


def largest(rows: list[dict[str, Any]], cells: list[str], sizes: list[str]) -> str:
    """Per cell the largest size that trained (sizes in the order given), with its tokens/s."""
    out = []
    for cell in cells:
        ok = [r for r in rows if r["cell"] == cell and r.get("status") == "ok"]
        best = max(ok, key=lambda r: sizes.index(r["size"]), default=None)
        out.append(f"- {cell}: " + (f"{best['size']} ({best['tokens_per_s']:.0f} tokens/s, peak "
                                      f"{best['peak_gib']:.2f} GiB)" if best else "none of " + ",".join(sizes)))
    return "\n".join(["Largest size trained:", *out])


def _table(rows: list[dict[str, Any]], bw: dict[str, float] | None) -> str:
    """The Markdown table. A -clip cell is put against the anchor clipping too when that row
    exists (``fsdp2-offload-fused-clip``, the ratio marked ``c``); "hidden" is the share of the
    overlapped host work (the units' steps or norms) that ran before the backward ended."""
    head = (f"| cell | size | tokens/s | vs {ANCHOR} | step ms | fwd+bwd ms | opt ms | peak GiB | rest GiB "
            "| host peak GiB | loss first/last | step's host<->device bytes / duplex bandwidth, ms "
            "| step's host Adam bytes / host AdamW bandwidth, ms | overlapped ms (hidden) |")
    lines = [head, "|" + "---|" * 14]
    ratio = versus_anchor(rows)
    clip_ratio = versus_anchor(rows, f"{ANCHOR}-clip")
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['cell']} | {r.get('size', '')} | {r.get('status')} | | | | | | | | | "
                         f"{r.get('detail', '')[:80]} | | |")
            continue
        key = (r["cell"], r["size"])
        if r["cell"].endswith("-clip") and key in clip_ratio:
            vs = f"{clip_ratio[key]:.2f}x c"
        else:
            vs = f"{ratio[key]:.2f}x" if key in ratio else ""
        bound, floor = _bounds(r["cell"], r["params"], bw)
        lines.append(f"| {r['cell']} | {r['size']} | {r['tokens_per_s']:.0f} | {vs} | {r['step_ms']:.0f} | "
                     f"{r['fwd_bwd_ms']:.0f} | {r['opt_ms']:.0f} | {r['peak_gib']:.2f} | {r['rest_gib']:.2f} | "
                     f"{r.get('host_peak_gib', float('nan')):.1f} | "
                     f"{r['loss_first']:.3f}/{r['loss_last']:.3f} | {bound} | {floor} | {_overlap_cell(r)} |")
    return "\n".join(lines)


def _bounds(cell: str, n: int, bw: dict[str, float] | None) -> tuple[str, str]:
    """A row's two floors in ms ("" where unknown or not offloaded): its step's host<->device
    bytes over the duplex bandwidth (the link), and its host cores' bytes over the host's
    uncontended fused AdamW rate, the faster of the two widths measured: however well the rest
    overlaps, the host's own work cannot run faster than that."""
    if bw is None:
        return "", ""
    h2d, d2h = offload_bytes(cell, n)
    link = f"{1e3 * max(h2d, d2h) / (bw['duplex_each_gbps'] * 1e9):.0f}" if h2d or d2h else ""
    host = host_bytes(cell, n)
    rate = max(bw.get("host_adam_gbps", 0.0), bw.get("host_adam_spare_gbps", 0.0))
    memory = f"{1e3 * host / (rate * 1e9):.0f}" if host and rate else ""
    return link, memory


def _overlap_cell(row: dict[str, Any]) -> str:
    if "overlap_share" not in row:
        return ""
    return f"{row['overlap_total_ms']:.0f} ({100 * row['overlap_share']:.0f} %)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; bad sizes, cells and counts are refused naming the allowed values."""
    parser = cli.parser(__doc__)
    parser.add_argument("--size", default="1.3b", choices=list(SIZES))
    parser.add_argument("--sizes", type=cli.csv_list(list(SIZES)), default=None,
                        help="step each cell up through these sizes until one does not train (replaces --size)")
    parser.add_argument("--cells", type=cli.csv_list(list(CELLS)), default=list(DEFAULT_CELLS),
                        help="comma-separated offload cells")
    cli.add_step_flags(parser, steps=5, warmup=2)
    parser.add_argument("--timeout", type=cli.positive, default=1800, help="seconds per cell")
    parser.add_argument("--reps", type=cli.positive, default=3,
                        help="fresh-process runs per cell and size; the table shows the median (default 3)")
    parser.add_argument("--bandwidth", action="store_true", help="only measure pinned copy bandwidth")
    parser.add_argument("--report-limit", action="store_true", help="also measure bandwidth and the PCIe bound")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--trace", type=Path, default=None,
                        help="write a torch.profiler Chrome trace of each cell's measured steps into this directory")
    parser.add_argument("--one", choices=list(CELLS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_cell(args.one, args.size, args.micro_batch, args.warmup, args.steps, args.trace)),
              flush=True)
        return
    launch.stop_children_on_signal()  # a signalled driver (timeout, Ctrl-C) stops the running cell too
    bw = bandwidth() if args.bandwidth or args.report_limit else None
    if bw is not None:
        print(json.dumps({"bandwidth": bw}), flush=True)
    if args.bandwidth:
        return
    sizes = args.sizes or [args.size]

    def save(runs: list[dict[str, Any]], complete: bool) -> None:
        if args.out is not None:
            write_results(args.out, {"bandwidth": bw, "anchor": ANCHOR, "cells": medians(runs), "runs": runs,
                                     "complete": complete})
    runs = sweep(args.cells, sizes, args, on_row=lambda rows: save(rows, False))
    rows = medians(runs)
    print(f"Medians of {args.reps} fresh-process run(s) per cell; anchor: {ANCHOR}")
    print(_table(rows, bw))
    if args.sizes:
        print(largest(rows, args.cells, sizes))
    for cell in args.cells:
        print(f"- {cell}: {CELLS[cell]}")
    save(runs, True)


def write_results(path: Path, results: dict[str, Any]) -> None:
    """``results`` as JSON at ``path``, replaced whole (a stopped driver leaves the last full file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    tmp.replace(path)


if __name__ == "__main__":
    main()
