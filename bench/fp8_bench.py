"""FP8 vs bf16 training of the bench GPT under our ZeRO-3, with FSDP2 bf16 in the same run.

    python -m bench.fp8_bench --nproc-per-node 2                 # ~3 min on 2 H200s
    python -m bench.fp8_bench --sizes 2.7b --reps 3                # world 1

The TE cells need TransformerEngine with its PyTorch extension, built for the installed torch and
CUDA (``pip install --no-build-isolation 'transformer_engine[pytorch]'``, see TE's installation
guide); without it they are skipped with the reason. Runs ``bench.suite`` (each cell in its own
process, implementations alternating inside each repetition, medians, peak memory, the same init
and data) with these implementations added:

- ``ours-fp8-te-current`` / ``ours-fp8-te-delayed``: the bench GPT whose block linears (qkv,
  proj, fc1, fc2) are ``te.Linear`` built under ``te.quantized_model_init`` with
  Float8CurrentScaling / DelayedScaling, so their weights are FP8 parameters that our ZeRO-3
  all-gathers as FP8 bytes (sharded quantisation, one amax all-reduce per step), with
  ``keep_fp8_transpose_cache=True``; forward under ``te.autocast``. The weights start from the
  bf16 model's values (TE's ``init_method`` copies them), embeddings, LayerNorms and the head stay
  bf16 (``bench/gpt.py`` ties the head to the embedding, which is no FP8 candidate);
- ``ours-fp8-te-current-bf16params``: the same TE modules with bf16 parameters (our ZeRO-3
  gathers bf16, TE quantises in every forward), to separate FP8 compute from the FP8 gather;
- ``ours-fp8-te-current-regather``: FP8 parameters without ``keep_fp8_transpose_cache`` (the
  backward gathers the FP8 bytes again instead of holding the transposes: less memory);
- ``ours-fp8-te-block``: the same with Float8BlockScaling (``Float8BlockwiseQTensor`` weights;
  TE's ``quantize_master_weights`` does the sharded requantisation, the column-wise copies are
  built after each forward gather);
- ``ours-fp8-native-current``: the torch-native path (``fsdp_impl.fp8.convert_to_fp8`` with
  ``fp8_params=True``, ``torch._scaled_mm``), also the CPU smoke path (``--device cpu --sizes tiny``);
- ``-fused`` variants (``ours-z3-fused``, ``ours-fp8-te-current-fused``, ``-delayed-fused``,
  ``-block-fused``): the same with torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``)
  instead of the suite's default foreach AdamW, so a comparison with ``te-fp8-ref`` (TE's fused
  Adam) does not measure the optimizer kernel; compare fused with fused (``ours-z3-fused``);
- ``te-fp8-ref`` (``-delayed``, ``-block``): the reference a user compares with, TE's own best
  case: the same ``te.Linear`` FP8-parameter model (``te.quantized_model_init``) trained as a plain
  module without FSDP or any data parallelism, with TE's ``FusedAdam(master_weights=True)`` (fp32
  master weights and moments in the optimizer, FP8 weights requantised by TE after each step).
  At world > 1 every rank trains its own copy (no communication); its numbers are per GPU as
  everywhere.

Default: ``ours-z3`` (bf16), ``fsdp2`` (bf16), the two TE FP8 runs and ``te-fp8-ref``; 1.3B, 2
repetitions, 8 timed steps. The summary after the table states the targets: TE
Float8CurrentScaling >= 1.2x the throughput of ``ours-z3`` at no higher peak memory, and >= 0.95x
``te-fp8-ref``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any

import torch
from torch import nn

from bench import impls, report
from bench.gpt import Block
from bench.runtime import Env

BLOCK_LINEARS = ("qkv", "proj", "fc1", "fc2")
# (implementation, reference, throughput ratio needed, peak memory no higher than the reference's):
# the targets for TE current scaling, then the same lines for the fused-optimizer variants
# and the delayed and block recipes (reported when both sides ran)
TARGETS = [("ours-fp8-te-current", "ours-z3", 1.2, True), ("ours-fp8-te-current", "te-fp8-ref", 0.95, False)]
TARGET = TARGETS[0][:3]
_REPORTED = [(f"ours-fp8-te-{kind}{fused}", ref, need, peak)
             for kind, suffix in (("current", ""), ("delayed", "-delayed"), ("block", "-block"))
             for fused in ("", "-fused")
             for ref, need, peak in ((f"ours-z3{fused}", 1.2, True), (f"te-fp8-ref{suffix}", 0.95, False))]
DEFAULT = ["ours-z3", "fsdp2", "ours-fp8-te-current", "ours-fp8-te-delayed", "te-fp8-ref"]


class TeAutocast(nn.Module):
    """Runs the wrapped model's forward under ``te.autocast(recipe)`` (the backward follows it)."""

    def __init__(self, model: nn.Module, recipe: Any) -> None:
        super().__init__()
        self.model, self.recipe = model, recipe

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import transformer_engine.pytorch as te
        with te.autocast(recipe=self.recipe):
            return self.model(tokens)


class _CopyInit:
    """A TE ``init_method`` that starts the weight from the bf16 model's value, then lets go of
    it (TE keeps its init methods, which would keep the old weights alive)."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source: torch.Tensor | None = source

    def __call__(self, weight: torch.Tensor) -> None:
        if self.source is None:
            raise RuntimeError("this init method copies its source once (build a fresh model instead)")
        with torch.no_grad():
            weight.copy_(self.source)
        self.source = None


def te_linears(module: nn.Module, recipe: Any, fp8_params: bool) -> None:
    """Swap each block's linears for ``te.Linear`` with the same weights and biases."""
    import transformer_engine.pytorch as te
    init = (te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True) if fp8_params
            else contextlib.nullcontext())
    with init:
        for block in module.blocks:  # type: ignore[union-attr]
            for name in BLOCK_LINEARS:
                old: nn.Linear = getattr(block, name)
                new = te.Linear(old.in_features, old.out_features, params_dtype=old.weight.dtype,
                                device=old.weight.device, init_method=_CopyInit(old.weight.detach()))
                with torch.no_grad():
                    new.bias.copy_(old.bias)
                setattr(block, name, new)


def te_recipe(kind: str) -> Any:
    from transformer_engine.common import recipe as r
    return {"current": r.Float8CurrentScaling, "delayed": r.DelayedScaling, "block": r.Float8BlockScaling}[kind]()


def _fsdp(module: nn.Module, env: Env, keep_transpose: bool, fused: bool = False
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    import fsdp_impl
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    optimizer = torch.optim.AdamW(module.parameters(), lr=impls.LR, fused=fused or None)  # None: torch's default
    return fsdp_impl.fully_shard(module, optimizer,
                                 fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
                                 mixed_precision_policy=policy, keep_fp8_transpose_cache=keep_transpose,
                                 **impls.flat_mesh(env))


def _ours_te(kind: str, fp8_params: bool, keep: bool, module: nn.Module, env: Env, fused: bool = False
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    recipe = te_recipe(kind)
    te_linears(module, recipe, fp8_params)
    model, opt = _fsdp(module, env, keep_transpose=keep, fused=fused)
    return TeAutocast(model, recipe), opt


def _ours_bf16_fused(module: nn.Module, env: Env) -> tuple[nn.Module, torch.optim.Optimizer]:
    return _fsdp(module, env, keep_transpose=False, fused=True)


def _te_reference(kind: str, module: nn.Module, env: Env) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TE's own FP8 model without data parallelism: ``te.Linear`` FP8 parameters, a plain module,
    TE's ``FusedAdam`` keeping fp32 master weights (AdamW, the suite's lr, torch's default weight
    decay 0.01)."""
    from transformer_engine.pytorch.optimizers import FusedAdam
    recipe = te_recipe(kind)
    te_linears(module, recipe, fp8_params=True)
    for p in module.parameters():  # the optimizer's master copies start from the FP8 values
        clear = getattr(p, "clear_high_precision_init_val", None)
        if callable(clear):
            clear()
    opt = FusedAdam(module.parameters(), lr=impls.LR, weight_decay=0.01, adam_w_mode=True, master_weights=True,
                    master_weight_dtype=torch.float32)
    return TeAutocast(module, recipe), opt


def ours_native(module: nn.Module, env: Env, keep: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Torch-native ``Float8Linear`` FP8 params (current scaling) in the blocks, ZeRO-3
    (``keep``: ``keep_fp8_transpose_cache``); also ``bench.fp8_host_cpu``'s model."""
    from fsdp_impl.fp8 import CurrentScaling, convert_to_fp8
    convert_to_fp8(module, CurrentScaling(), module_filter=lambda name, m: name.startswith("blocks."), fp8_params=True)
    return _fsdp(module, env, keep_transpose=keep)


_FP8 = "ZeRO-3, bf16 module, fp32 main params + grads, units = blocks, block linears"
FP8_IMPLS = [
    impls.Impl("ours-fp8-te-current", f"fsdp_impl {_FP8} te.Linear FP8 params (Float8CurrentScaling), keep transposes",
               functools.partial(_ours_te, "current", True, True), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    impls.Impl("ours-fp8-te-current-regather", f"fsdp_impl {_FP8} te.Linear FP8 params (Float8CurrentScaling), "
               "FP8 bytes gathered again for the backward", functools.partial(_ours_te, "current", True, False),
               torch.bfloat16, False, needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    impls.Impl("ours-fp8-te-delayed", f"fsdp_impl {_FP8} te.Linear FP8 params (DelayedScaling), keep transposes",
               functools.partial(_ours_te, "delayed", True, True), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    impls.Impl("ours-fp8-te-block", f"fsdp_impl {_FP8} te.Linear FP8 params (Float8BlockScaling), keep transposes",
               functools.partial(_ours_te, "block", True, True), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    *[impls.Impl(f"ours-fp8-te-{kind}-fused", f"fsdp_impl {_FP8} te.Linear FP8 params ({name}), keep transposes, "
                 "torch AdamW fused=True", functools.partial(_ours_te, kind, True, True, fused=True), torch.bfloat16,
                 False, needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w)
      for kind, name in (("current", "Float8CurrentScaling"), ("delayed", "DelayedScaling"),
                         ("block", "Float8BlockScaling"))],
    impls.Impl("ours-z3-fused", "fsdp_impl ZeRO-3 (optim_grads_params), bf16 module, fp32 main params + grads, "
               "units = blocks, torch AdamW fused=True", _ours_bf16_fused, torch.bfloat16, False,
               persistent_bytes=lambda w: 16.0 / w),
    impls.Impl("ours-fp8-te-current-bf16params", f"fsdp_impl {_FP8} te.Linear bf16 params, FP8 compute (current)",
               functools.partial(_ours_te, "current", False, False), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    impls.Impl("ours-fp8-native-current", f"fsdp_impl {_FP8} Float8Linear FP8 params (torch-native current)",
               ours_native, torch.bfloat16, False, persistent_bytes=lambda w: 16.0 / w),
    *[impls.Impl(f"te-fp8-ref{suffix}", f"TransformerEngine alone, no FSDP / data parallelism: bf16 module, block "
                 f"linears te.Linear FP8 params ({name}), te.FusedAdam(master_weights=True) fp32 master + moments",
                 functools.partial(_te_reference, kind), torch.bfloat16, False, needs_module="transformer_engine",
                 persistent_bytes=lambda w: 16.0)
      for suffix, kind, name in (("", "current", "Float8CurrentScaling"), ("-delayed", "delayed", "DelayedScaling"),
                                 ("-block", "block", "Float8BlockScaling"))],
]


def register() -> None:
    """Add the FP8 implementations to the suite's table (done in ``main`` only, so importing this
    module leaves the suite's defaults alone)."""
    for impl in FP8_IMPLS:
        impls.IMPLS.setdefault(impl.name, impl)


def target_line(rows: list[dict]) -> str:
    """The acceptance targets, per measured size: throughput ratio (and peak memory where it counts)."""
    cells = report.summarise(rows)
    lines = []
    for size in dict.fromkeys(c.size for c in cells):
        for impl, ref, need, peak in TARGETS + [t for t in _REPORTED if t not in TARGETS]:
            a = next((c for c in cells if c.size == size and c.impl == impl), None)
            b = next((c for c in cells if c.size == size and c.impl == ref), None)
            if a is None or b is None:
                if (impl, ref, need, peak) in TARGETS:
                    lines.append(f"- {size}: {impl} vs {ref}: n/a (not both measured)")
                continue
            r = a.tok_s / b.tok_s
            ok = r >= need and (not peak or a.peak_gib <= b.peak_gib)
            lines.append(f"- {size}: {impl} / {ref} throughput {r:.3f}x (target >= {need}x), peak "
                         f"{a.peak_gib:.2f} vs {b.peak_gib:.2f} GiB{'' if peak else ' (not part of this target)'}: "
                         f"{'met' if ok else 'NOT met'}")
    return "\n".join(["", "FP8 targets:", *lines])


def main(argv: list[str] | None = None) -> int:
    register()
    argv = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=")[0] for a in argv}
    defaults = {"--impls": ",".join(DEFAULT), "--reps": "2", "--steps": "8", "--out": "fp8_bench.jsonl"}
    for flag, value in defaults.items():
        if flag not in given:
            argv += [flag, value]
    from bench import suite

    args = suite.parse_args(argv)
    code = suite.main(argv)
    if os.environ.get("RANK", "0") == "0" and args.out.exists():
        text = target_line(report.load(args.out))
        print(text, flush=True)
        if args.md is not None:
            with args.md.open("a") as f:
                f.write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())

