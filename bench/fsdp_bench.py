"""Throughput and peak-memory benchmark: fsdp_impl ZeRO-3 vs PyTorch FSDP2 vs a no-DP ceiling.

Run one implementation per process (so peak-memory numbers do not mix), e.g.
    torchrun --nproc-per-node 2 bench/fsdp_bench.py --impl ours
    torchrun --nproc-per-node 2 bench/fsdp_bench.py --impl fsdp2
    python bench/fsdp_bench.py --impl ceiling
`bench/run_all.sh` runs all three in one go and prints a table. Each run appends one JSON line to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpt import GPT, Block, GPTConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["ours", "fsdp2", "ceiling"], required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", type=Path, default=None, help="append a JSON line with the result here")
    return p.parse_args()


def build(args: argparse.Namespace, device: torch.device):
    """Returns (model, optimizer) for the chosen implementation."""
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)
    torch.manual_seed(0)
    if args.impl == "ceiling":
        model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg
    if args.impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = GPT(cfg).to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg
    import fsdp_impl

    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fsdp_impl.fully_shard(
        model,
        opt,
        fsdp_unit_modules=[Block],
        zero_dp_strategy="optim_grads_params",
        mixed_precision_policy=fsdp_impl.MixedPrecisionPolicy(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32
        ),
    )
    return model, opt, cfg


def main() -> None:
    args = parse_args()
    distributed = args.impl != "ceiling"
    if distributed:
        dist.init_process_group("nccl")
        local = int(os.environ.get("LOCAL_RANK", 0))
    else:
        local = 0
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0

    model, opt, cfg = build(args, device)
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    tokens = torch.randint(0, cfg.vocab, (args.micro_batch, cfg.seq + 1), device=device, generator=g)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        logits = model(inp)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab), tgt.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tok_s = args.micro_batch * cfg.seq * args.steps / dt
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    result = {
        "impl": args.impl, "world": world, "tok_s_per_gpu": round(tok_s, 1), "peak_gib": round(peak, 2),
        "step_s": round(dt / args.steps, 4), "last_loss": float(losses[-1].detach()),
        "hidden": cfg.hidden, "layers": cfg.layers, "seq": cfg.seq, "micro_batch": args.micro_batch,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
