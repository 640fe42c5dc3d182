"""The cells of ``bench.compile_bench`` (issue 50): our per-unit compile against FSDP2 with per-block
``torch.compile`` (torchtitan's way), each built fresh on the bench GPT, with the compile counted.

Every cell trains ``bench.gpt.GPT`` from the same init (seed 0) on the same tokens with
``torch.optim.AdamW(lr=1e-4, fused=True)`` (what an informed user of either engine runs), bf16
compute and fp32 main params, grads and optimizer state, one unit per transformer block:

- ``ours``: ``fsdp_impl.fully_shard`` ZeRO-3 on the bf16 module, ``MixedPrecisionPolicy(main_params_dtype=fp32,
  main_grads_dtype=fp32)`` (``bench.impls``' ``ours-z3`` with the fused AdamW); ``+compile`` adds
  ``compile_units={"backend": B, "fullgraph": True}``: each block's forward compiled, the engine's
  hooks eager around it; the counts are ``model.compile_stats``.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per block and the root on the fp32 module,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``bench.impls``' ``fsdp2``);
  ``+compile`` is torchtitan's recipe: ``torch.compile(block, fullgraph=True)`` for each block,
  put back in place of the block, then ``fully_shard`` of each compiled block and of the root, so
  FSDP2's hooks run eagerly around the compiled block (the counts come from a counting backend
  around the same backend, ``CountingBackend``).
- ``+ac``: full activation recompute of every block, applied before the wrap
  (``bench.gpt.apply_recompute("full")``: torch's ``checkpoint_wrapper`` around each block, non
  reentrant). For FSDP2 + compile the compiled module is the ``checkpoint_wrapper`` (torchtitan's
  order: recompute, compile, shard), so the checkpoint is inside the compiled graph; ours compiles
  the unit (the block inside the wrapper), so the checkpoint stays eager around the compiled
  forward, which the backward runs again.
- ``ours-fp8`` (``+compile``): the torch-native FP8 path, ``fsdp_impl.fp8.convert_to_fp8`` with
  ``CurrentScaling`` and FP8 params on the block linears, ``keep_fp8_transpose_cache=True``
  (``bench.impls``' ``ours-fp8-native-current`` with the fused AdamW). Not ``fullgraph``:
  ``Float8Linear``'s autograd function breaks the graph, so the count of breaks is reported.
- ``te-fp8-ref``: TransformerEngine alone, no FSDP (``bench.impls``' ``te-fp8-ref``: ``te.Linear``
  FP8 params, Float8CurrentScaling, TE's ``FusedAdam(master_weights=True)``); needs TE.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from bench import impls
from bench.gpt import GPT, Block, GPTConfig, apply_recompute
from bench.impls import LR, Trainee, flat_mesh, num_params_of
from bench.llama import Llama, LlamaBlock, llama_params
from bench.runtime import Env


class CountingBackend:
    """A ``torch.compile`` backend that builds what ``torch.compile(backend=name)`` would and
    counts the graphs it compiles and the calls of their compiled forwards (the backward graphs
    AOTAutograd runs are not routed through here)."""

    def __init__(self, name: str) -> None:
        if name == "inductor":
            self.inner: Callable[..., Any] = torch._TorchCompileInductorWrapper(None, None, None)
        else:
            self.inner = torch._TorchCompileWrapper(name, None, None, None)
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs)
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


@dataclass(frozen=True)
class CompileCounts:
    """What was compiled and run so far in this process: graphs compiled and calls of compiled
    forward graphs (the engine's own count), Dynamo's graph breaks and the graphs Dynamo captured
    (``torch._dynamo.utils.counters``, the same source for every engine: its ``frames`` counter
    stays empty under ``fullgraph=True``), Inductor's FX graph cache hits and misses."""

    graphs: int = 0
    calls: int = 0
    breaks: int = 0
    dynamo_graphs: int = 0
    fx_cache_hits: int = 0
    fx_cache_misses: int = 0

    def minus(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                                     strict=True)))


def dynamo_counts(graphs: int = 0, calls: int = 0) -> CompileCounts:
    return CompileCounts(graphs, calls, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                         counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])


@dataclass(frozen=True)
class Cell:
    """One configuration. ``counterpart``: the row it is put against (FSDP2 with the same compile
    and recompute; TE alone for FP8); ``eager``: the same cell without compile."""

    name: str
    setup: str
    engine: str  # ours | fsdp2 | te
    compiled: bool = False
    recompute: bool = False
    fp8: bool = False
    counterpart: str | None = None
    eager: str | None = None

    @property
    def needs_module(self) -> str | None:
        return "transformer_engine" if self.engine == "te" else None


def _cell(engine: str, compiled: bool, recompute: bool) -> Cell:
    name = engine + ("+compile" if compiled else "") + ("+ac" if recompute else "")
    base = ("fsdp_impl ZeRO-3, bf16 module, fp32 main params + grads" if engine == "ours" else
            "torch fully_shard per block + root, fp32 module, param bf16 / reduce fp32, blocks reshard")
    how = ""
    if compiled:
        how = ("; compile_units (each block's forward compiled, fullgraph, hooks eager)" if engine == "ours" else
               "; torch.compile(block, fullgraph=True) per block before fully_shard (torchtitan)")
    ac = ("; full recompute: checkpoint_wrapper per block" + (", the wrapper is the unit" if engine == "ours" else "")
          if recompute else "")
    other = "fsdp2" if engine == "ours" else None
    twin = (other + name[len(engine):]) if other else None
    eager = name.replace("+compile", "") if compiled else None
    return Cell(name, base + how + ac + "; AdamW(fused=True)", engine, compiled, recompute,
                counterpart=twin, eager=eager)


CELLS: dict[str, Cell] = {c.name: c for c in (
    *[_cell(e, c, r) for r in (False, True) for c in (True, False) for e in ("ours", "fsdp2")],
    Cell("ours-fp8+compile", "fsdp_impl ZeRO-3, bf16 module, fp32 main, block linears torch-native Float8Linear FP8 "
         "params (current scaling), keep transposes; compile_units (fullgraph); "
         "AdamW(fused=True)", "ours", compiled=True, fp8=True, counterpart="te-fp8-ref", eager="ours-fp8"),
    Cell("ours-fp8", "as ours-fp8+compile, eager", "ours", fp8=True, counterpart="te-fp8-ref"),
    Cell("te-fp8-ref", impls.IMPLS["te-fp8-ref"].setup, "te", fp8=True),
)}
DEFAULT_CELLS = ("ours+compile", "fsdp2+compile", "ours", "fsdp2", "ours+compile+ac", "fsdp2+compile+ac",
                 "ours+ac", "fsdp2+ac", "ours-fp8+compile", "te-fp8-ref")


def unavailable_reason(name: str, model: str = "gpt") -> str | None:
    """Why cell ``name`` cannot run on this machine for ``model`` (None: it can)."""
    if CELLS[name].engine == "te" and model != "gpt":
        return f"TE's reference is built on bench.gpt only, not model {model!r}"
    need = CELLS[name].needs_module
    if need and importlib.util.find_spec(need) is None:
        return f"python module {need!r} not installed"
    return None


def _adamw(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=LR, fused=True)


# --model: the model class and its block class (the FSDP unit, what compile and recompute wrap)
MODELS: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {"gpt": (GPT, Block), "llama": (Llama, LlamaBlock)}
MODEL_NOTES = {"gpt": "bench.gpt: LayerNorm, GELU, tied head", "llama": "bench.llama: RMSNorm, RoPE, SwiGLU"}


def params_of(model: str, cfg: GPTConfig) -> int:
    """Parameter count of ``model`` (a ``MODELS`` key) at ``cfg``."""
    return num_params_of(cfg) if model == "gpt" else llama_params(cfg)


def _build_ours(cell: Cell, module: nn.Module, env: Env, backend: str,
                block: type[nn.Module] = Block) -> tuple[nn.Module, Any, Callable[[], int]]:
    import fsdp_impl

    extra: dict[str, Any] = {}
    if cell.fp8:
        from fsdp_impl.fp8 import CurrentScaling, convert_to_fp8
        convert_to_fp8(module, CurrentScaling(), module_filter=lambda name, m: name.startswith("blocks."),
                       fp8_params=True)
        extra["keep_fp8_transpose_cache"] = True
    if cell.compiled:
        extra["compile_units"] = {"backend": backend, "fullgraph": True}
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    model, opt = fsdp_impl.fully_shard(module, _adamw(module), fsdp_unit_modules=[block],
                                       zero_dp_strategy="optim_grads_params", mixed_precision_policy=policy,
                                       **flat_mesh(env), **extra)
    stats = getattr(model, "compile_stats", None)
    return model, opt, (lambda: stats.graphs_compiled) if stats else (lambda: 0)


def compiled_calls(model: nn.Module, backend: CountingBackend | None) -> int:
    stats = getattr(model, "compile_stats", None)
    if stats is not None:
        return int(stats.compiled_calls)
    return backend.calls if backend is not None else 0


def _build_fsdp2(cell: Cell, module: nn.Module, env: Env, counting: CountingBackend | None) -> tuple[nn.Module, Any]:
    """torchtitan's order: recompute (already applied), compile each block in place, shard each block, the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks: nn.ModuleList = module.blocks  # type: ignore[assignment]
    if counting is not None:
        for i, blk in enumerate(list(blocks)):
            blocks[i] = torch.compile(blk, backend=counting, fullgraph=True)  # type: ignore[assignment]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = impls._mesh(env.device.type, (env.world,), ("dp",))
    for blk in blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    return module, _adamw(module)


@dataclass
class Built:
    """A built cell: the trainee and how to read its compile counts."""

    trainee: Trainee
    counts: Callable[[], CompileCounts]


def build(name: str, cfg: GPTConfig, env: Env, micro_batch: int, backend: str = "inductor",
          data_seed: int = 1234, model_name: str = "gpt") -> Built:
    """Fresh module (``model_name``: a ``MODELS`` key; seed 0, on the device), wrapped as the
    cell says, with this rank's tokens (the same tokens as ``bench.impls.build``)."""
    cell = CELLS[name]
    if model_name not in MODELS:
        raise ValueError(f"model {model_name!r}; allowed: {', '.join(MODELS)}")
    if cell.engine == "te" and model_name != "gpt":
        raise ValueError(f"{name} builds TE's version of bench.gpt.GPT only; got model {model_name!r}")
    model_cls, block = MODELS[model_name]
    torch.manual_seed(0)
    with torch.device(env.device):
        module = model_cls(cfg)
    if cell.engine != "fsdp2":
        module = module.to(torch.bfloat16)
    if cell.recompute:
        apply_recompute(module, "full", block)
    counting = CountingBackend(backend) if cell.compiled and cell.engine == "fsdp2" else None
    model: nn.Module
    graphs: Callable[[], int] = lambda: 0  # noqa: E731
    if cell.engine == "ours":  # with recompute the wrapper is the unit, as FSDP2 shards it (see compile_units)
        model, opt, graphs = _build_ours(cell, module, env, backend, CheckpointWrapper if cell.recompute else block)
    elif cell.engine == "fsdp2":
        model, opt = _build_fsdp2(cell, module, env, counting)
        if counting is not None:
            graphs = functools.partial(getattr, counting, "graphs")
    else:
        model, opt = impls.IMPLS["te-fp8-ref"].build(module, env)
    g = torch.Generator(device=env.device).manual_seed(data_seed + env.rank)
    tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), device=env.device, generator=g)
    trainee = Trainee(model, opt, tokens[:, :-1], tokens[:, 1:], cfg.vocab, autocast=False)
    return Built(trainee, lambda: dynamo_counts(graphs(), compiled_calls(model, counting)))
