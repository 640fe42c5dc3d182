"""Checkpoint save / load times and peak device memory (issue 49), on the bench GPT.

Usage, from the repository root::

    python -m bench.ckpt_bench --size 1.3b --dir /local/scratch/ckpt        # one GPU
    torchrun --nproc-per-node 8 -m bench.ckpt_bench --size 1.3b --dir /shared/ckpt
    python -m bench.ckpt_bench --device cpu --size tiny --dir /tmp/ckpt     # CPU smoke run

The model trains ``--warmup`` steps as the suite's ``ours-z3`` cell does (bf16 module, fp32 main
params and grads, ZeRO-3, AdamW); the peak device memory of a training step is the reference.
Then, each timed with the device synchronised and ranks barriered, its peak memory measured
from a reset (``max_memory_allocated``; 0 on CPU):

* ``save`` / ``load``: ``fsdp_impl.checkpoint`` in its default layout;
* ``save_torch_dcp`` / ``load_torch_dcp``: ``format="torch_dcp"`` (FSDP2's layout);
* ``export_hf``: ``save_hf`` (fp32, ``--hf-shard-size`` files), the training model still in memory;
* ``import_hf``: the training model and optimizer freed, a fresh model built on the meta device
  and wrapped with ``init_model_with_meta_device=True``, then ``load_hf``; its peak includes the
  meta init.

The issue's bound: every peak at most 1.1x the training peak (no full-model materialisation).
Each row says the ratio and whether it holds, the seconds (the slowest rank's) and the bytes
written. Results: one JSON line per operation on stdout, a Markdown table at the end; ``--out``
writes the JSON list. Every directory it creates under ``--dir`` is removed at the end unless
``--keep``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import cli, runtime
from bench.gpt import GPT, Block
from bench.impls import SIZES, num_params_of
from bench.runtime import Env

LR = 1e-4
BOUND = 1.1  # the limit on the peak during a checkpoint operation, relative to training
OPS = ("save", "load", "save_torch_dcp", "load_torch_dcp", "export_hf", "import_hf")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = cli.parser(__doc__)
    cli.add_run_flags(p, fake_world=False)
    p.add_argument("--size", choices=sorted(SIZES), default="1.3b")
    p.add_argument("--dir", type=Path, required=True, help="a directory every rank sees (created; emptied at the end)")
    p.add_argument("--ops", type=cli.csv_list(OPS), default=list(OPS), help=f"any of {','.join(OPS)}")
    p.add_argument("--hf-shard-size", default="5GB", help="save_hf's max_shard_size")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON list here")
    cli.add_step_flags(p, steps=1, warmup=3)
    return p.parse_args(argv)


def build(env: Env, size: str, meta: bool = False) -> tuple[Any, Any]:
    import fsdp_impl

    cfg = SIZES[size]
    torch.manual_seed(0)
    with torch.device("meta" if meta else env.device):
        module = GPT(cfg).to(torch.bfloat16)
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    return fsdp_impl.fully_shard(module, torch.optim.AdamW(module.parameters(), lr=LR), fsdp_unit_modules=[Block],
                                 zero_dp_strategy=3, mixed_precision_policy=policy,
                                 init_model_with_meta_device=meta, device=env.device)


def train(env: Env, model: Any, opt: Any, size: str, steps: int, micro_batch: int) -> float:
    """``steps`` steps; returns the last loss."""
    cfg = SIZES[size]
    gen = torch.Generator(device=env.device).manual_seed(1234 + env.rank)
    loss = torch.zeros(())
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), device=env.device, generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).float().view(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss)


def measured(env: Env, fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds of the slowest rank, this rank's peak bytes allocated from a reset)."""
    runtime.free_memory(env)
    runtime.reset_peak(env)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    runtime.sync(env)
    seconds = time.perf_counter() - t0
    dist.barrier()
    return runtime.all_max(env, [seconds])[0], int(runtime.all_max(env, [float(runtime.peak_allocated(env))])[0])


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run(env: Env, args: argparse.Namespace) -> list[dict[str, Any]]:
    from fsdp_impl import checkpoint

    model, opt = build(env, args.size)
    train(env, model, opt, args.size, args.warmup, args.micro_batch)
    train_s, train_peak = measured(env, lambda: train(env, model, opt, args.size, args.steps, args.micro_batch))
    root = args.dir / f"ckpt-bench-{args.size}"
    if env.rank == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
    rows: list[dict[str, Any]] = [_row(env, args, "train_step", train_s, train_peak, train_peak, 0)]
    actions: dict[str, tuple[Callable[[], Any], Path]] = {
        "save": (lambda: checkpoint.save(root / "ours", model, opt), root / "ours"),
        "load": (lambda: checkpoint.load(root / "ours", model, opt), root / "ours"),
        "save_torch_dcp": (lambda: checkpoint.save(root / "dcp", model, opt, format="torch_dcp"), root / "dcp"),
        "load_torch_dcp": (lambda: checkpoint.load(root / "dcp", model, opt), root / "dcp"),
        "export_hf": (lambda: checkpoint.save_hf(root / "hf", model, max_shard_size=args.hf_shard_size), root / "hf"),
    }
    try:
        for op in [o for o in args.ops if o in actions]:
            fn, where = actions[op]
            seconds, peak = measured(env, fn)
            rows.append(_row(env, args, op, seconds, peak, train_peak, _bytes(where) if env.rank == 0 else 0))
        if "import_hf" in args.ops:
            del model, opt
            holder: list[Any] = []

            def import_hf() -> None:
                fresh, _ = build(env, args.size, meta=True)
                checkpoint.load_hf(root / "hf", fresh)
                holder.append(fresh)

            seconds, peak = measured(env, import_hf)
            rows.append(_row(env, args, "import_hf", seconds, peak, train_peak, 0))
    finally:
        dist.barrier()
        if env.rank == 0 and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def _row(env: Env, args: argparse.Namespace, op: str, seconds: float, peak: int, train_peak: int,
         written: int) -> dict[str, Any]:
    ratio = peak / train_peak if train_peak else None
    return {"op": op, "size": args.size, "params": num_params_of(SIZES[args.size]), "world": env.world,
            "device": runtime.device_name(env), "seconds": round(seconds, 3), "peak_gib": peak / runtime.GIB,
            "peak_vs_train": None if ratio is None else round(ratio, 3),
            "within_bound": None if ratio is None else ratio <= BOUND, "bytes_written": written}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| op | seconds | peak GiB | peak / training peak | <= 1.1x | bytes written |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "n/a (CPU)" if r["peak_vs_train"] is None else f"{r['peak_vs_train']:.3f}"
        ok = "n/a" if r["within_bound"] is None else ("yes" if r["within_bound"] else "NO")
        lines.append(f"| {r['op']} | {r['seconds']:.3f} | {r['peak_gib']:.2f} | {ratio} | {ok} "
                     f"| {r['bytes_written']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def body(env: Env) -> int:
        rows = run(env, args)
        if env.rank == 0:
            for r in rows:
                print(json.dumps(r), flush=True)
            print(markdown(rows), flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps(rows, indent=1) + "\n")
        return 0

    return cli.with_env(args.device, body)


if __name__ == "__main__":
    raise SystemExit(main())
