"""Host Adam then upload, per unit or chunk by chunk: does the upload read host memory again?

    python -m bench.upload_probe                     # CUDA only; 8 units of 201M params (a 6.6B block)
    python -m bench.upload_probe --units 4 --reps 3  # smaller, quicker

The overlapped offload step (``OffloadPolicy(params=True, overlap_step=True)``) runs each unit's
host Adam (28 bytes of host memory a param: p, g, m, v read, p, m, v written) and then uploads
the unit's new fp32 weights (the copy engine reads 4 more bytes a param). At 6.6B the step is
bound by the host, so those 4 bytes would be an eighth of the worker's traffic if the upload
competed with the Adam for memory. Uploading each chunk right after its Adam, while its lines may
still sit in the CPU's last-level cache, could let the copy engine read them from the cache
instead of DRAM. This measures both, on fp32 buffers shaped as the engine's (one flat buffer a
unit, ``torch._fused_adamw_`` as ``AdamW(fused=True)`` runs on the host), at the worker's width
(one thread fewer than the caller's). Measured on an H100 host (``bench/RESULTS.md``, 2026-12-06
fourth session): the upload costs the Adam nothing measurable, and chunking only slows it.

Modes are ``KIND:SPLIT``. KIND ``adam``: the Adam alone, no upload (the floor); ``up``: each
unit's upload after its Adam, or with N-MiB chunks each chunk's upload after its Adam. SPLIT
``unit``: one kernel call on the unit's flat buffer; ``block``: one call on the bench GPT block's
param views (what ``AdamW(fused=True)`` over a unit's params does, the engine's today: ``up:block``
is the overlapped step's order); ``N``: one call per N-MiB chunk (same bits: Adam is elementwise).

``--busy`` also keeps the link busy the other way (16 device-to-host copies of 1 GiB on another
stream, as the grads landing in the backward do). Each mode's median of ``--reps`` passes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.offload_bench import ADAM_BYTES


def _adam(p: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor]) -> None:
    steps = [torch.tensor(1.0) for _ in p]
    torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                        eps=1e-8, amsgrad=False, maximize=False)


def _pieces(n: int, split: str, hidden: int) -> list[tuple[int, int]]:
    """Ranges of a unit's flat buffer stepped by one kernel call each: ``unit`` (one), ``block``
    (the bench GPT block's params, as the engine's views; stepped by one call, see ``_pass``) or
    N-MiB chunks of fp32."""
    if split == "unit":
        return [(0, n)]
    if split == "block":
        h, bounds, a = hidden, [], 0
        for size in (3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h):
            bounds.append((a, min(n, a + size)))
            a += size
        return [(a, b) for a, b in bounds if b > a]
    chunk = int(split) * 2**20 // 4
    return [(a, min(n, a + chunk)) for a in range(0, n, chunk)]


def check_modes(text: str) -> list[str]:
    """``--modes``: comma-separated ``KIND:SPLIT``, KIND ``adam`` or ``up``, SPLIT ``unit``,
    ``block`` or a positive number of MiB; anything else raises naming what is allowed."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for mode in modes:
        kind, _, split = mode.partition(":")
        if kind not in ("adam", "up") or not (split in ("unit", "block") or (split.isdigit() and int(split) > 0)):
            raise ValueError(f"--modes: {mode!r} is not KIND:SPLIT with KIND 'adam' or 'up' and SPLIT 'unit', "
                             "'block' or a positive number of MiB (e.g. 'up:64')")
    if not modes:
        raise ValueError("--modes: give at least one KIND:SPLIT (e.g. 'adam:block,up:block')")
    return modes


def _pass(units: list[list[torch.Tensor]], dev: list[torch.Tensor], mode: str, stream: torch.cuda.Stream,
          hidden: int) -> float:
    """One pass over the units. ``mode`` is ``KIND:SPLIT``: KIND ``adam`` (no upload) or ``up``
    (the unit's upload after its Adam; with N-MiB chunks each chunk's upload after its Adam);
    ``block`` steps the block's param views in one call (as ``AdamW(fused=True)`` over a list)."""
    kind, split = mode.split(":")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for (p, g, m, v), d in zip(units, dev, strict=True):
        pieces = _pieces(p.numel(), split, hidden)
        calls = [pieces] if split == "block" else [[piece] for piece in pieces]  # each kernel call's pieces
        for call in calls:
            _adam(*([t[a:b] for a, b in call] for t in (p, g, m, v)))
            if kind == "up":  # what that call stepped, uploaded after it
                a, b = call[0][0], call[-1][1]
                with torch.cuda.stream(stream):
                    d[a:b].copy_(p[a:b], non_blocking=True)
    stream.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--unit-params", type=int, default=201_326_592, help="a 6.6B bench-GPT block's")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modes", default="adam:unit,adam:block,adam:64,adam:16,up:block,up:64,up:16")
    parser.add_argument("--hidden", type=int, default=4096, help="the block's width (block split)")
    parser.add_argument("--busy", action="store_true", help="also run each mode beside device-to-host copies")
    args = parser.parse_args(argv)
    try:
        modes = check_modes(args.modes)
    except ValueError as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        print("upload_probe needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads() - 1))  # the worker's width
    n = args.unit_params
    units = [[torch.empty(n, pin_memory=True).normal_()] + [torch.rand(n) * 1e-3 for _ in range(3)]
             for _ in range(args.units)]
    dev = [torch.empty(n, device="cuda") for _ in range(args.units)]
    stream, busy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    sink = torch.empty(2**28, pin_memory=True)  # 1 GiB
    src = torch.empty(2**28, device="cuda")
    rows = []
    for busy in ([False, True] if args.busy else [False]):
        for mode in modes:
            _pass(units, dev, mode, stream, args.hidden)  # warm-up
            times = []
            for _ in range(args.reps):
                if busy:
                    with torch.cuda.stream(busy_stream):
                        for _ in range(16):  # ~16 GiB: about one pass at ~50 GB/s
                            sink.copy_(src, non_blocking=True)
                times.append(_pass(units, dev, mode, stream, args.hidden))
                busy_stream.synchronize()
            t = statistics.median(times)
            params = n * args.units
            rows.append({"mode": mode, "busy": busy, "threads": torch.get_num_threads(), "s": round(t, 4),
                         "adam_gb_s": round(params * ADAM_BYTES / t / 1e9, 1),
                         "runs": [round(x, 4) for x in times]})
            print(json.dumps(rows[-1]), flush=True)
    base = {r["busy"]: r["s"] for r in rows if r["mode"] == "up:block"}
    for r in rows:
        print(f"{r['mode']:>9} busy={r['busy']!s:5} {r['s'] * 1e3:8.1f} ms  "
              f"{r['adam_gb_s']:6.1f} GB/s (Adam bytes)  vs up:block {base.get(r['busy'], r['s']) / r['s']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
