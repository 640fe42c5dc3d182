"""Host time of the flat-buffer copy ops a unit issues, idle GPU vs behind queued work.

    python -m bench.copy_probe            # CUDA only; a 1.3B bench-GPT block's 12 params

For each op: the host microseconds of one call with the GPU idle, and with ~0.2 s of matmuls
queued ahead (an op that waited for the GPU would take that long). Why: ``FlatLayout`` picks
between ``torch._chunk_cat`` / ``split_with_sizes_copy`` (one kernel each, metadata uploaded
through a pinned host buffer) and ``_foreach_copy_`` into per-parameter views (addresses as
kernel arguments); on a host-bound step the cheaper host call wins.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch


def _block(hidden: int) -> list[tuple[int, ...]]:
    h = hidden
    return [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,), (h,)]


def _host_us(op: Callable[[], object], busy: Callable[[], None], queued: bool) -> float:
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        if queued:
            busy()
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.copy_probe needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in _block(args.hidden)]
    n = sum(g.numel() for g in grads)
    out32 = torch.empty(1, n, device=dev)
    out16 = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    views32 = list(out32.view(-1).split([g.numel() for g in grads]))
    views32 = [v.view_as(g) for v, g in zip(views32, grads, strict=True)]
    fulls = [torch.empty_like(g) for g in grads]
    views16 = [v.view_as(f) for v, f in zip(out16.view(-1).split([f.numel() for f in fulls]), fulls, strict=True)]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy() -> None:
        for _ in range(60):
            torch.mm(a, a)

    ops: dict[str, Callable[[], object]] = {
        "_chunk_cat bf16 -> fp32 (pack, casting)": lambda: torch._chunk_cat(grads, dim=0, num_chunks=1, out=out32),
        "_chunk_cat bf16 -> bf16 (pack)": lambda: torch._chunk_cat(grads, dim=0, num_chunks=1, out=out16),
        "_foreach_copy_ bf16 -> fp32 views (pack, casting)": lambda: torch._foreach_copy_(views32, grads),
        "split_with_sizes_copy bf16 (unpack)": lambda: torch.split_with_sizes_copy(
            out16, [f.numel() for f in fulls], dim=1, out=[f.view(1, -1) for f in fulls]),
        "_foreach_copy_ bf16 views -> params (unpack)": lambda: torch._foreach_copy_(fulls, views16),
    }
    for op in ops.values():  # warm up (kernels, pinned buffers)
        op()
    print(f"| op ({len(grads)} params, hidden {args.hidden}) | host us, GPU idle | host us, GPU behind |")
    print("| --- | ---: | ---: |")
    for name, op in ops.items():
        print(f"| {name} | {_host_us(op, busy, False):.0f} | {_host_us(op, busy, True):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
