"""Host time of the FP8-parameter hooks on CPU (gloo): a GPT of many small units, so Python dominates.

    python -m bench.fp8_host_cpu [--layers 24] [--hidden 64] [--steps 20] [--regather]
    torchrun --nproc-per-node 2 -m bench.fp8_host_cpu            # world 2

The torch-native path of ``bench.fp8_bench`` ``ours-fp8-native-current`` (``Float8Linear`` FP8
params, current scaling, ZeRO-3, units = blocks, ``keep_fp8_transpose_cache=True``; ``--regather``:
False) at a small hidden size, timed per hook with ``bench.host_profile.hook_table`` (medians
over the timed steps of the training thread's CPU time and wall time).
"""
from __future__ import annotations

import sys

import torch

from bench import cli, host_profile, impls
from bench.gpt import GPTConfig
from bench.runtime import Env


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--layers", type=cli.positive, default=24)
    p.add_argument("--hidden", type=cli.positive, default=64)
    p.add_argument("--regather", action="store_true", help="keep_fp8_transpose_cache=False")
    cli.add_step_flags(p, steps=20, micro_batch=True)
    args = p.parse_args(argv)

    def body(env: Env) -> None:
        name = "ours-fp8-native-cpu-bench"
        impls.IMPLS[name] = impls.Impl(name, "native FP8 params",
                                       lambda m, e: impls.ours_native(m, e, keep=not args.regather),
                                       torch.bfloat16, False)
        cfg = GPTConfig(vocab=256, hidden=args.hidden, layers=args.layers, heads=4, seq=32)
        trainee = impls.build(name, cfg, env, args.micro_batch)
        for _ in range(args.warmup):
            trainee.step()
        table = host_profile.hook_table(env, trainee, args.steps)
        if env.rank == 0:
            print(f"layers {args.layers}, hidden {args.hidden}, world {env.world}, "
                  f"keep_transpose {not args.regather}, {args.steps} steps\n{table}", flush=True)
    return cli.with_env("cpu", body)


if __name__ == "__main__":
    sys.exit(main())
