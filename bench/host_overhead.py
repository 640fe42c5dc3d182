"""Host time the FSDP engine spends in its hooks per training step, on CPU (gloo, world size 1).

    python -m bench.host_overhead [--layers 24] [--steps 20] [--strategy optim_grads_params]

A tiny GPT (hidden 64, so the math is cheap and the hooks dominate) wrapped with ``fully_shard``
(bf16 module, fp32 main params and grads, units = blocks, as ``bench.impls`` ours-z3). Every engine
entry point the hooks call is timed (``--clock wall``: ``time.perf_counter``; ``thread``:
``time.thread_time``, the CPU time of the training thread, which a busy machine disturbs less);
the table gives milliseconds per step (median over the timed steps) per entry point, and the
whole step for scale. Numbers are host time only (CPU kernels included), so compare runs on the
same machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import fsdp_impl
from bench import cli
from bench.gpt import GPT, Block, GPTConfig
from bench.runtime import Env

ENTRY_POINTS = ("pre_forward", "post_forward", "pre_backward", "grad_ready", "finish_backward",
                "zero_grad_buffers")


def _timed(fn: Callable[..., Any], totals: dict[str, float], name: str,
           clock: Callable[[], float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += clock() - t0
    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--layers", type=cli.positive, default=24)
    p.add_argument("--steps", type=cli.positive, default=20)
    p.add_argument("--warmup", type=cli.positive, default=3)
    p.add_argument("--strategy", default="optim_grads_params")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall")
    p.add_argument("--foreach", action="store_true",
                   help="AdamW(foreach=True), the multi-tensor path torch picks on a GPU (CPU default: per-tensor)")
    p.add_argument("--dtensor-step", action="store_true",
                   help="step the optimizer on the DTensor params (as before local-shard steps) for comparison")
    return p.parse_args(argv)


def measure(env: Env, args: argparse.Namespace) -> None:
    """Wrap the tiny GPT, time every hook entry point per step, print the table."""
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, hidden=64, layers=args.layers, heads=4, seq=32)
    module = GPT(cfg).to(torch.bfloat16)
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    adamw = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True if args.foreach else None)
    model, opt = fsdp_impl.fully_shard(module, adamw, fsdp_unit_modules=[Block], zero_dp_strategy=args.strategy,
                                       mixed_precision_policy=policy)
    if args.dtensor_step:
        opt._fsdp_local_step = None
    engine = model._fsdp_engine
    totals: dict[str, float] = defaultdict(float)
    for name in ENTRY_POINTS:
        setattr(engine, name, _timed(getattr(engine, name), totals, name, clock))
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(0))
    per_step: dict[str, list[float]] = defaultdict(list)
    for step in range(args.warmup + args.steps):
        totals.clear()
        t0 = clock()
        loss = F.cross_entropy(model(tokens).float().view(-1, cfg.vocab), tokens.view(-1))
        loss.backward()
        t1 = clock()
        opt.step()
        totals["optimizer_step"] = clock() - t1
        opt.zero_grad()
        totals["step"] = clock() - t0
        if step >= args.warmup:
            for name in (*ENTRY_POINTS, "optimizer_step", "step"):
                per_step[name].append(totals[name])
    hooks = [sum(per_step[n][i] for n in ENTRY_POINTS) for i in range(args.steps)]
    print(f"strategy {args.strategy}, {args.layers} layers, {args.steps} steps, {args.clock} clock, "
          f"foreach {args.foreach}, {'DTensor' if args.dtensor_step else 'local-shard'} optimizer step, "
          f"torch {torch.__version__}")
    print("| entry point | ms/step (median) |\n|---|---:|")
    for name in ENTRY_POINTS:
        print(f"| {name} | {1e3 * statistics.median(per_step[name]):.2f} |")
    print(f"| all hooks | {1e3 * statistics.median(hooks):.2f} |")
    print(f"| optimizer step | {1e3 * statistics.median(per_step['optimizer_step']):.2f} |")
    print(f"| whole step | {1e3 * statistics.median(per_step['step']):.2f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli.with_env("cpu", lambda env: measure(env, args))


if __name__ == "__main__":
    sys.exit(main())
