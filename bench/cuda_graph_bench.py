"""Eager vs CUDA-graph replay step time of ours ZeRO-3, on a launch-bound model and on the bench GPT.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc-per-node 2 -m bench.cuda_graph_bench --configs small,1.3b --md graph.md
    python -m bench.cuda_graph_bench --configs small,1.3b --md graph.md      # world 1

Per config, fresh builds from the same init and data (seed 0):

- ``eager``: ``fsdp_impl.fully_shard`` as in the suite (torch AdamW, torch's default foreach step);
- ``eager-fused``: the same with ``torch.optim.AdamW(fused=True)``;
- ``eager-graph-mode``: ``fully_shard(..., cuda_graph_mode=True)`` with
  ``fsdp_impl.optim.AdamW(capturable=True, fused=True)``, stepped eagerly with
  ``zero_grad(set_to_none=False)``;
- ``graph``: the same, captured with ``fsdp_impl.cuda_graph.capture_train_step(model, optimizer,
  step_fn, static_inputs, warmup=3)`` and timed by ``.replay()``. ``step_fn(inputs, target)`` runs
  forward, loss and backward and returns the loss; the captured step owns the optimizer step and
  the grad reset (the optimizer is handed to it);
- ``graph-foreach``: replay with ``fsdp_impl.optim.AdamW(capturable=True)`` (multi-tensor step);
- ``fp8-eager``, ``fp8-eager-fused``, ``fp8-graph`` (not run by default; need TransformerEngine):
  ``eager``, ``eager-fused`` and ``graph`` with the block linears as ``te.Linear`` FP8 parameters
  (Float8CurrentScaling, ``keep_fp8_transpose_cache=True``, forward under ``te.autocast``), as
  ``bench.fp8_bench`` builds them.

Peak GiB: the most allocated during the timed steps (a captured graph's private pool counts),
max over ranks and repetitions. ``--trace DIR`` also profiles 3 steps of each mode (``bench.trace_summary`` table in
``DIR/graph_trace.md``), to see where the GPU time of each goes.

The small config (8 layers, hidden 512, micro-batch 2, seq 256, vocab 8192) is launch-bound: its
eager step is mostly host time, which replay removes. If ``capture_train_step`` (or the
graph-mode wrap) is not there, the script says so, writes that into ``--md`` and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench import cli, impls, runtime, trace
from bench.gpt import GPT, Block, GPTConfig
from bench.runtime import Env

CONFIGS: dict[str, tuple[GPTConfig, int]] = {  # name -> (model, micro-batch)
    "small": (GPTConfig(vocab=8192, hidden=512, layers=8, heads=8, seq=256), 2),
    **{k: (v, 4) for k, v in impls.SIZES.items() if k != "tiny"},
}


def capture_api() -> tuple[Callable | None, str]:
    """``fsdp_impl.cuda_graph.capture_train_step`` or the reason it is missing."""
    try:
        mod = importlib.import_module("fsdp_impl.cuda_graph")
    except ImportError as err:
        return None, f"fsdp_impl.cuda_graph is not importable ({err})"
    fn = getattr(mod, "capture_train_step", None)
    if fn is None:
        return None, "fsdp_impl.cuda_graph has no capture_train_step"
    return fn, ""


# mode -> (graph-mode wrap, optimizer factory, FP8 parameters: None or the TE recipe)
MODES: dict[str, tuple[bool, str, str | None]] = {
    "eager": (False, "torch", None), "eager-fused": (False, "torch-fused", None),
    "eager-graph-mode": (True, "fused", None), "graph": (True, "fused", None), "graph-foreach": (True, "foreach", None),
    "fp8-eager": (False, "torch", "current"), "fp8-eager-fused": (False, "torch-fused", "current"),
    "fp8-graph": (True, "fused", "current"),
}
REPLAYED = ("graph", "graph-foreach", "fp8-graph")  # captured with capture_train_step, timed by replay()
DEFAULT_MODES = [m for m, (_, _, fp8) in MODES.items() if fp8 is None]


def _build(cfg: GPTConfig, env: Env, mode: str):
    """The wrapped model, its optimizer and the context its forward runs in (``te.autocast`` for
    the FP8 modes: block linears as ``te.Linear`` FP8 parameters, as ``bench.fp8_bench``)."""
    import fsdp_impl

    graph_mode, optim, fp8 = MODES[mode]
    torch.manual_seed(0)
    with torch.device(env.device):
        module = GPT(cfg).to(torch.bfloat16)
    autocast: Callable[[], Any] = contextlib.nullcontext
    if fp8 is not None:
        import transformer_engine.pytorch as te

        from bench import te_modules
        recipe = te_modules.te_recipe(fp8)
        te_modules.te_linears(module, recipe, fp8_params=True)
        autocast = functools.partial(te.autocast, recipe=recipe)
    opt: torch.optim.Optimizer
    if optim == "torch":
        opt = torch.optim.AdamW(module.parameters(), lr=impls.LR)
    elif optim == "torch-fused":
        opt = torch.optim.AdamW(module.parameters(), lr=impls.LR, fused=True)
    else:
        opt = fsdp_impl.optim.AdamW(module.parameters(), lr=impls.LR, capturable=True, fused=optim == "fused")
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    model, opt = fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
                                       mixed_precision_policy=policy, cuda_graph_mode=graph_mode,
                                       keep_fp8_transpose_cache=fp8 is not None, **impls.flat_mesh(env))
    return model, opt, autocast


def _data(cfg: GPTConfig, env: Env, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=env.device).manual_seed(1234 + env.rank)
    tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), device=env.device, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _timed(env: Env, step: Callable[[], torch.Tensor], warmup: int, steps: int) -> tuple[float, list[float]]:
    """Median step seconds (max over ranks) and the losses; the allocator's peak is reset after
    the warm-up, so ``runtime.peak_allocated`` then gives the timed steps' peak."""
    losses = [float(step()) for _ in range(warmup)]
    runtime.reset_peak(env)
    timer = runtime.StepTimer(env)
    timer.mark()
    for _ in range(steps):
        loss = step()
        timer.mark()
    durations = timer.durations()
    losses.append(float(loss))
    return runtime.all_max(env, [statistics.median(durations)])[0], losses


def _replay_step(graph) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        graph.replay()
        return graph.static_loss.detach().clone()
    return step


def _eager_step(step_fn: Callable, opt: torch.optim.Optimizer, inputs: torch.Tensor, target: torch.Tensor,
                set_to_none: bool) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = step_fn(inputs, target)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach()
    return step


def run_config(env: Env, name: str, capture: Callable, warmup: int, steps: int,
               trace_dir: Path | None = None, modes: list[str] | None = None, rep: int = 1) -> list[dict]:
    cfg, mb = CONFIGS[name]
    inputs, target = _data(cfg, env, mb)
    rows = []
    for mode in modes or list(MODES):
        model, opt, autocast = _build(cfg, env, mode)

        def step_fn(x: torch.Tensor, y: torch.Tensor, model=model, autocast=autocast) -> torch.Tensor:
            with autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab), y.reshape(-1))
            loss.backward()
            return loss

        step = (_replay_step(capture(model, opt, step_fn, (inputs, target), warmup=3)) if mode in REPLAYED
                else _eager_step(step_fn, opt, inputs, target, set_to_none=not MODES[mode][0]))
        step_s, losses = _timed(env, step, warmup, steps)
        peak = runtime.all_max(env, [runtime.peak_allocated(env) / runtime.GIB])[0]
        rows.append({"config": name, "mode": mode, "rep": rep, "step_ms": 1e3 * step_s, "peak_gib": peak,
                     "loss_first": losses[0],
                     "loss_last": losses[-1], "finite": all(math.isfinite(x) for x in losses)})
        if trace_dir is not None and rep == 1:
            trace.profile(env, step, trace_dir / f"graph_{name}_{mode}.json.gz" if env.rank == 0 else None, 3)
        del model, opt, step
        runtime.free_memory(env)
    return rows


def write_trace_report(trace_dir: Path, configs: list[str]) -> None:
    """``graph_trace.md``: the per-step GPU table of every mode profiled, per config."""
    from bench import trace_summary

    parts = []
    for name in configs:
        named = {mode: trace_summary.summarise(trace_summary.load(path)) for mode in MODES
                 if (path := trace_dir / f"graph_{name}_{mode}.json.gz").exists()}
        if named:
            parts.append(f"## {name}\n\n" + trace_summary.markdown(named, top_kernels=15))
    (trace_dir / "graph_trace.md").write_text("# CUDA-graph bench profiles\n\n" + "\n".join(parts))


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (config, mode): the median step time over repetitions, min–max kept."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["config"], r["mode"])
        agg = out.setdefault(key, {**r, "times": []})
        agg["times"].append(r["step_ms"])
        agg["finite"] = agg["finite"] and r["finite"]
        agg["peak_gib"] = max(agg["peak_gib"], r["peak_gib"])
    for agg in out.values():
        agg["step_ms"] = statistics.median(agg["times"])
    return list(out.values())


def markdown(rows: list[dict], header: str) -> str:
    rows = median_rows(rows)
    eager = {r["config"]: r["step_ms"] for r in rows if r["mode"] == "eager"}
    lines = [header, "", "| config | mode | reps | step ms (median) | min–max | eager / this | peak GiB "
             "| loss first → last |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        flag = "" if r["finite"] else " NON-FINITE"
        ratio = f"{eager[r['config']] / r['step_ms']:.2f}×" if r["config"] in eager else "–"
        lines.append(f"| {r['config']} | {r['mode']} | {len(r['times'])} | {r['step_ms']:.2f} | "
                     f"{min(r['times']):.2f}–{max(r['times']):.2f} | {ratio} | {r['peak_gib']:.2f} "
                     f"| {r['loss_first']:.4f} → {r['loss_last']:.4f}{flag} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--configs", type=cli.csv_list(list(CONFIGS)), default=["small", "1.3b"])
    cli.add_step_flags(p, steps=10, micro_batch=False)  # each config has its micro-batch (CONFIGS)
    p.add_argument("--md", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, help="directory for per-mode profiles and graph_trace.md")
    p.add_argument("--modes", type=cli.csv_list(list(MODES)), default=DEFAULT_MODES,
                   help="fp8-* modes (TE Float8CurrentScaling FP8 parameters) need TransformerEngine")
    p.add_argument("--reps", type=cli.positive, default=1, help="repetitions; modes alternate inside each (median)")
    return p.parse_args(argv)


def _write(md: Path | None, text: str) -> None:
    print(text, flush=True)
    if md is not None:
        md.write_text(text)


def run(env: Env, args: argparse.Namespace, capture: Callable) -> None:
    rows: list[dict] = []
    for name, rep in ((n, r) for n in args.configs for r in range(1, args.reps + 1)):
        try:
            rows += run_config(env, name, capture, args.warmup, args.steps, args.trace, args.modes, rep)
        except Exception as err:  # a capture failure: report it, try the next config
            if env.rank == 0:
                print(f"[graph] {name}: ERROR {type(err).__name__}: {err}", flush=True)
            runtime.free_memory(env)
    if env.rank == 0:
        header = f"# CUDA-graph bench, world {env.world}, {runtime.device_name(env)}, ours ZeRO-3"
        _write(args.md, markdown(rows, header) if rows else header + "\n\nNo config completed.\n")
        if args.trace is not None:
            write_trace_report(args.trace, args.configs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    capture, why = capture_api()
    if capture is None or not torch.cuda.is_available():
        _write(args.md, f"# CUDA-graph bench\n\nSKIP: {why or 'needs CUDA'}; nothing measured.\n")
        return 0
    return cli.with_env("cuda", lambda env: run(env, args, capture))


if __name__ == "__main__":
    sys.exit(main())
