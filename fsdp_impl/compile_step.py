"""``compile_train_step``: a whole train step (forward, ``loss.backward()``, ``optimizer.step()``)
of models in traceable mode (``fsdp_impl.traceable``) compiled as one ``torch.compile`` frame
with ``fullgraph=True``, each call counted so a silent eager fallback is an error.

Dynamo settings it applies around every call (and so around every trace):

* ``trace_autograd_ops=True``: Dynamo traces ``Tensor.backward()`` as ``torch.autograd.grad``
  plus gradient accumulation into the same graph (without it, ``backward()`` is a graph break);
* with ``exact_numerics`` (default), ``enable_dynamo_decompositions=False``: otherwise Dynamo
  rewrites ``addcmul_`` / ``addcdiv_`` / ``add_(alpha=tensor)`` into ``prims.fma``, which on CPU
  changes the optimizer's result in the last bit (measured: params off by up to 3e-8 after three
  AdamW steps), so an ``aot_eager`` step would no longer equal the eager engine bit for bit.

The step function must return detached tensors (``loss.detach()``): Dynamo refuses to return a
tensor whose graph its traced backward consumed.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .module import FullyShardedModule


@dataclass
class StepCompileStats:
    """Counts of one compiled step: its calls, the compiled graphs they ran, the graphs Dynamo
    built (a first step that creates optimizer state and a later one that finds it are two
    graphs of the same frame: a recompile, not a graph break)."""

    calls: int = 0
    compiled_calls: int = 0
    graphs_compiled: int = 0
    last_call_had_backward: bool = False  # the graph the last call ran holds a traced backward
    # functional collectives in the last graph built, by op name (its subgraphs included: a unit's
    # gather is an autograd function whose forward and backward Dynamo keeps as subgraphs)
    collectives: dict[str, int] = field(default_factory=dict)


class _CountingBackend:
    """The backend ``torch.compile`` would build from the options, counting compiles and calls."""

    def __init__(self, backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None,
                 dynamic: bool | None, stats: StepCompileStats) -> None:
        if backend == "inductor":
            self.inner: Callable[..., Any] = torch._TorchCompileInductorWrapper(mode, options, dynamic)
        else:
            self.inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
        self.stats = stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs)
        self.stats.graphs_compiled += 1
        stats = self.stats
        backward = any(n.op == "call_function" and n.target is torch.autograd.grad for n in gm.graph.nodes)
        self.stats.collectives = functional_collectives(gm)

        def run(*args: Any) -> Any:
            stats.compiled_calls += 1
            stats.last_call_had_backward = backward
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


def functional_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many of each ``_c10d_functional`` op the graph and its subgraphs call."""
    found: Counter[str] = Counter()
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and "_c10d_functional." in name:
                found[name.split("_c10d_functional.")[1].split(".")[0]] += 1
    return dict(found)


def backward_traceable() -> bool:
    """Whether this torch's Dynamo traces ``loss.backward()`` into DTensor params: 2.13 does,
    2.11 does not (2.12 was not checked, so it is refused too)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


class CompiledTrainStep:
    """``step_fn`` compiled with ``fullgraph=True``; calling it runs exactly one compiled graph
    (else it raises: Dynamo disabled, the recompile limit reached, or anything else that made
    the call run eagerly)."""

    def __init__(self, step_fn: Callable[..., Any], models: Sequence[FullyShardedModule],
                 backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None,
                 dynamic: bool | None, exact_numerics: bool, backward: bool) -> None:
        self.models = list(models)
        self._backward = backward
        self.stats = StepCompileStats()
        self._config: dict[str, Any] = {"trace_autograd_ops": True}
        if exact_numerics:
            self._config["enable_dynamo_decompositions"] = False
        self._backend = _CountingBackend(backend, mode, options, dynamic, self.stats)
        self._compiled = torch.compile(step_fn, fullgraph=True, backend=self._backend, dynamic=dynamic)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for model in self.models:
            if model._fsdp_engine.traceable is None:
                raise RuntimeError("compile_train_step: a model left traceable mode; call "
                                   "model.set_traceable(True) again before the compiled step")
        before = self.stats.compiled_calls
        with torch._dynamo.config.patch(self._config):
            out = self._compiled(*args, **kwargs)
        self.stats.calls += 1
        ran = self.stats.compiled_calls - before
        if ran != 1:
            raise RuntimeError(f"compile_train_step: call {self.stats.calls} ran {ran} compiled graphs, not one "
                               f"(graphs compiled so far: {self.stats.graphs_compiled}); with 0 it ran eagerly: "
                               "torch.compiler.set_stance('force_eager'), Dynamo disabled "
                               "(torch._dynamo.config.disable / TORCHDYNAMO_DISABLE=1) or the recompile limit "
                               "reached (torch._dynamo.config.recompile_limit)")
        if self._backward and not self.stats.last_call_had_backward:
            raise RuntimeError(
                "compile_train_step: the compiled step holds no backward: step_fn does not call loss.backward(), "
                "or Dynamo dropped it, which it does silently (torch 2.11 and 2.13) when the params were reached "
                "through an optimizer (opt.zero_grad(), opt.param_groups) before loss.backward() in the same "
                "compiled function; call opt.zero_grad() after opt.step() or outside the step "
                "(backward=False: a step without backward is intended)")
        return out


def compile_train_step(step_fn: Callable[..., Any], models: FullyShardedModule | Sequence[FullyShardedModule], *,
                       backend: str | Callable[..., Any] = "inductor", mode: str | None = None,
                       options: dict[str, Any] | None = None, dynamic: bool | None = None,
                       exact_numerics: bool = True, backward: bool = True) -> CompiledTrainStep:
    """Compile ``step_fn`` (forward, ``loss.backward()``, ``optimizer.step()`` of ``models``, which
    must be in traceable mode: ``model.set_traceable(True)``) as one graph. ``exact_numerics``
    turns Dynamo's numerics-changing decompositions off (see the module docstring); the backend's
    own passes (inductor's fusions) are the backend's: ``aot_eager`` keeps the eager arithmetic.
    ``backward``: every call must run a traced backward (else an error; False for a forward-only
    step, e.g. evaluation)."""
    if isinstance(models, FullyShardedModule):
        models = [models]
    if not models or not all(isinstance(m, FullyShardedModule) for m in models):
        raise TypeError("compile_train_step(models=...) takes the fully_shard-ed model(s) the step trains")
    for model in models:
        if model._fsdp_engine.traceable is None:
            raise ValueError("compile_train_step needs the model in traceable mode: call model.set_traceable(True) "
                             "first (the eager engine's hooks cannot be traced as one graph)")
    if not callable(step_fn):
        raise TypeError(f"compile_train_step(step_fn) must be callable, got {step_fn!r}")
    if mode is not None and options:
        raise ValueError("compile_train_step: pass mode or options, not both (torch.compile accepts one of them)")
    if backward and not backward_traceable():
        raise RuntimeError(f"compile_train_step with a backward needs torch >= 2.13 (this is {torch.__version__}): "
                           "torch 2.11's Dynamo fails tracing loss.backward() into DTensor params (AssertionError "
                           "in _collect_tensors_with_sources); a forward-only step (backward=False) compiles")
    return CompiledTrainStep(step_fn, models, backend, mode, options, dynamic, exact_numerics, backward)
