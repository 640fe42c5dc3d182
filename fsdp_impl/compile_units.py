"""``fully_shard(..., compile_units=)``: compile each unit's forward, keep the engine's hooks eager.

The engine's hooks are ``torch.compiler.disable``d, so ``torch.compile(model)`` graph-breaks at
every unit, and on torch 2.11 Dynamo then skipped every frame (a graph break inside the hook loop
of ``nn.Module._call_impl``): no compiled graph ran at all, silently. Compiling each unit
module's own ``forward`` (what torchtitan does per transformer block with FSDP2) leaves the
module's ``__call__`` and so the FSDP pre/post-forward hooks eager around the compiled code, on
every torch we support.

No silent eager fallback: every unit's compiled forward runs through a counting backend (one per
set of options for the whole process, so a second model of the same classes reuses the graphs
instead of recompiling against a new backend), and ``CompileStats`` records per unit the forward
calls, the graphs compiled, the calls of compiled graphs and Dynamo's graph breaks. After a
forward of the wrapped model, a unit that ran but called no compiled graph is an error naming
the cause where it can be found.
"""
from __future__ import annotations

import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from .module import FullyShardedModule

COMPILE_UNITS_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CompileUnits = bool | dict[str, Any] | None  # what fully_shard(compile_units=) takes
_ALLOWED = ("None/False (off), True (torch.compile's defaults: inductor), or a dict with keys "
            f"{', '.join(COMPILE_UNITS_KEYS)} (torch.compile's arguments)")


@dataclass(frozen=True)
class CompileOptions:
    """The ``torch.compile`` arguments each unit's forward is compiled with (checked)."""

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None


def check_compile_units_fits(opts: CompileOptions | None, module: nn.Module,
                             fine_grained_gather: bool) -> None:
    """Before the wrap: refuse what ``compile_units`` cannot keep as documented.

    * ``fullgraph=True`` with ``enable_fine_grained_param_gather``: that mode hooks every
      submodule holding params, inside the unit's compiled forward; the hooks are eager engine
      code, so Dynamo would have to break the graph there (with ``fullgraph=False`` it does, and
      the numbers equal eager's: tested).
    * TransformerEngine modules: TE's modules run their own fused kernels and FP8 state; compiling
      them per unit was never verified here (TE 2.20), so it is refused rather than run untested.
    """
    if opts is None:
        return
    if opts.fullgraph and fine_grained_gather:
        raise ValueError("compile_units={'fullgraph': True} cannot be combined with enable_fine_grained_param_gather="
                         "True: that mode hooks every submodule holding params inside each unit's compiled forward, "
                         "where Dynamo must break the graph; pass compile_units with fullgraph=False (the graph "
                         "breaks at each such submodule) or enable_fine_grained_param_gather=False")
    te = [(name, type(m)) for name, m in module.named_modules() if type(m).__module__.startswith("transformer_engine")]
    if te:
        name, cls = te[0]
        raise ValueError(f"compile_units with TransformerEngine modules ({len(te)}, e.g. {name or 'the model'!r}: "
                         f"{cls.__module__}.{cls.__qualname__}) is not supported: TE's modules run their own fused "
                         "kernels and FP8 state and were not verified under torch.compile here; wrap without "
                         "compile_units (TE's modules are fused already), or use torch-native FP8 (fsdp_impl.fp8)")


def parse_compile_units(value: Any) -> CompileOptions | None:
    """``compile_units=`` as passed to ``fully_shard``: None when off, else the checked options.
    Runs before the wrap, so a bad value fails before any buffer or collective exists."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if not isinstance(value, dict):
        raise TypeError(f"compile_units must be {_ALLOWED}; got {value!r}")
    unknown = sorted(str(k) for k in value if k not in COMPILE_UNITS_KEYS)
    if unknown:
        raise ValueError(f"compile_units has unknown key(s) {unknown}; allowed: {list(COMPILE_UNITS_KEYS)}")
    opts = CompileOptions(**value)
    if not (isinstance(opts.backend, str) or callable(opts.backend)):
        raise TypeError(f"compile_units['backend'] must be a backend name (str) or a callable, got {opts.backend!r}")
    if isinstance(opts.backend, str):
        try:
            torch._dynamo.lookup_backend(opts.backend)
        except Exception as e:  # InvalidBackend: torch lists the registered names
            raise ValueError(f"compile_units['backend']={opts.backend!r} is not a torch.compile backend: {e}") from None
    if opts.mode not in _MODES:
        raise ValueError(f"compile_units['mode'] must be one of {list(_MODES)}, got {opts.mode!r}")
    if not isinstance(opts.fullgraph, bool):
        raise TypeError(f"compile_units['fullgraph'] must be True or False, got {opts.fullgraph!r}")
    if opts.dynamic is not None and not isinstance(opts.dynamic, bool):
        raise TypeError(f"compile_units['dynamic'] must be None, True or False, got {opts.dynamic!r}")
    if opts.options is not None and not (isinstance(opts.options, dict)
                                         and all(isinstance(k, str) for k in opts.options)):
        raise TypeError(f"compile_units['options'] must be None or a dict with str keys, got {opts.options!r}")
    if opts.mode is not None and opts.options:
        raise ValueError("compile_units: pass 'mode' or 'options', not both (torch.compile accepts one of them)")
    return opts


@dataclass
class UnitCompileStats:
    """One unit's counts. ``compiled_calls`` counts calls of compiled graphs made inside the unit's
    forward (so ``compiled_calls / calls`` graphs per call: 1 without graph breaks);
    ``graph_breaks`` and ``break_reasons`` are what Dynamo recorded while tracing it (a unit whose
    graphs came from Dynamo's cache, e.g. the second of two same-class units, adds none)."""

    name: str
    calls: int = 0
    graphs_compiled: int = 0
    compiled_calls: int = 0
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)
    checked: bool = False  # its first forward was checked to have run compiled code


@dataclass
class CompileStats:
    """``model.compile_stats`` of a model wrapped with ``compile_units``: per-unit counts, in
    unit order, keyed by the unit's qualified name (``""``: the root, compiled only when the
    model has no other unit)."""

    options: CompileOptions
    units: dict[str, UnitCompileStats] = field(default_factory=dict)

    @property
    def compiled_calls(self) -> int:
        return sum(u.compiled_calls for u in self.units.values())

    @property
    def graphs_compiled(self) -> int:
        return sum(u.graphs_compiled for u in self.units.values())

    @property
    def graph_breaks(self) -> int:
        return sum(u.graph_breaks for u in self.units.values())


class _CountingBackend:
    """The backend every compiled unit forward uses: the one ``torch.compile`` would build from
    the options, with each compile and each call of a compiled graph credited to the unit whose
    forward is running (a per-thread stack; our eager wrapper pushes it)."""

    def __init__(self, opts: CompileOptions) -> None:
        if opts.backend == "inductor":
            self.inner: Callable[..., Any] = torch._TorchCompileInductorWrapper(opts.mode, opts.options,
                                                                                 opts.dynamic)
        else:
            self.inner = torch._TorchCompileWrapper(opts.backend, opts.mode, opts.options, opts.dynamic)
        self._local = threading.local()

    def current(self) -> UnitCompileStats | None:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    @contextmanager
    def crediting(self, stats: UnitCompileStats) -> Iterator[None]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(stats)
        try:
            yield
        finally:
            stack.pop()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs)
        owner = self.current()
        if owner is not None:
            owner.graphs_compiled += 1

        def run(*args: Any) -> Any:
            target = self.current()
            if target is not None:
                target.compiled_calls += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


# One counting backend per distinct options for the process: Dynamo guards on the backend's
# identity, so a new backend per wrap would recompile every unit class (toward the recompile limit).
_BACKENDS: list[tuple[CompileOptions, _CountingBackend]] = []
_BACKENDS_LOCK = threading.Lock()


def _backend_for(opts: CompileOptions) -> _CountingBackend:
    with _BACKENDS_LOCK:
        for known, backend in _BACKENDS:
            if known == opts:
                return backend
        backend = _CountingBackend(opts)
        _BACKENDS.append((opts, backend))
        return backend


class _CompiledForward:
    """A unit's ``forward``: the compiled bound forward, called eagerly with the unit credited."""

    def __init__(self, module: nn.Module, opts: CompileOptions, backend: _CountingBackend,
                 stats: UnitCompileStats) -> None:
        self.code = type(module).forward.__code__
        self.compiled = torch.compile(type(module).forward.__get__(module), backend=backend,
                                      fullgraph=opts.fullgraph, dynamic=opts.dynamic)
        self.backend = backend
        self.stats = stats

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stats = self.stats
        stats.calls += 1
        before = Counter(counters["graph_break"])
        # Dynamo runs a frame (or a nested frame after a graph break) eagerly, with a warning,
        # once it hit the recompile limit: inside a unit that is an error (set, not patched: ~5 us)
        config = torch._dynamo.config
        fail_before = config.fail_on_recompile_limit_hit
        config.fail_on_recompile_limit_hit = True
        try:
            with self.backend.crediting(stats):
                return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(f"compile_units: unit {stats.name!r} hit Dynamo's recompile limit (torch._dynamo."
                               f"config.recompile_limit = {_recompile_limit()}), past which Dynamo runs the frame "
                               "eagerly; raise the limit (one entry per distinct shape/guard of the unit's frames) "
                               f"or make the unit's code shape-stable; graph breaks seen: {stats.graph_breaks}") from e
        finally:
            config.fail_on_recompile_limit_hit = fail_before
            new = Counter(counters["graph_break"])
            new.subtract(before)
            for reason, n in new.items():
                if n > 0:
                    stats.graph_breaks += n
                    if reason not in stats.break_reasons:
                        stats.break_reasons.append(reason)


def units_inside_checkpoint_wrappers(inner: nn.Module, units: list[nn.Module]) -> list[str]:
    """Names of the ``checkpoint_wrapper``s (torch's ``CheckpointWrapper``) of ``inner`` whose
    wrapped module is one of ``units``: the recompute there re-runs the unit's compiled forward
    from eager code instead of being compiled with it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    ids = {id(u) for u in units}
    return [name for name, m in inner.named_modules()
            if isinstance(m, CheckpointWrapper) and id(m._checkpoint_wrapped_module) in ids]


CHECKPOINT_WRAPPER_ADVICE = (
    "compile_units: {n} unit(s) sit inside a checkpoint_wrapper (e.g. {first!r}): its activation "
    "recompute runs outside the compiled code and calls each unit's compiled forward a second time "
    "in the backward (2 compiled calls per unit per step; on an H100, GPT 1.3B, that ran at 0.81x the "
    "eager speed with the same recompute). Make the wrapper the unit (fsdp_unit_modules=[CheckpointWrapper], "
    "or apply_activation_checkpointing before fully_shard and name the wrapped blocks): Dynamo then "
    "traces the checkpoint with the block, as FSDP2's per-block compile of the wrapper does.")


class _CheckAfterForward:
    """Forward hook on the wrapper: after a forward, every unit that ran for the first time must
    have called compiled code; removed once every unit passed. The first forward also warns about
    units a ``checkpoint_wrapper`` holds (``CHECKPOINT_WRAPPER_ADVICE``; also when the wrapper
    was applied after ``fully_shard``)."""

    def __init__(self, stats: CompileStats, forwards: dict[str, _CompiledForward],
                 inner: nn.Module, units: list[nn.Module]) -> None:
        self.stats = stats
        self.forwards = forwards
        self.handle: Any = None
        self.inner = inner
        self.units: list[nn.Module] | None = units  # None once the wrapper check ran

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.units is not None:
            wrapped, self.units = units_inside_checkpoint_wrappers(self.inner, self.units), None
            if wrapped:
                warnings.warn(CHECKPOINT_WRAPPER_ADVICE.format(n=len(wrapped), first=wrapped[0]), stacklevel=2)
        for name, unit in self.stats.units.items():
            if unit.checked or unit.calls == 0:
                continue
            if unit.compiled_calls == 0:
                raise RuntimeError(no_compiled_code_error(name, unit, self.forwards[name].code))
            unit.checked = True
        if all(u.checked for u in self.stats.units.values()) and self.handle is not None:
            self.handle.remove()


def _recompile_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or config.cache_size_limit)


def no_compiled_code_error(name: str, unit: UnitCompileStats, code: Any) -> str:
    """The message for a unit whose forward ran without any compiled graph, with the cause."""
    label = repr(name) if name else "the root (the model has no other unit)"
    causes = []
    if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        causes.append("Dynamo is disabled (torch._dynamo.config.disable / TORCHDYNAMO_DISABLE=1)")
    if not torch._dynamo.is_dynamo_supported():
        causes.append("Dynamo does not support this Python version")
    limit = _recompile_limit()
    entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
    if entries >= limit:
        causes.append(f"{code.co_name} hit Dynamo's recompile limit ({entries} cached graphs >= "
                      f"torch._dynamo.config.recompile_limit {limit}); call torch._dynamo.reset() between "
                      "models or raise the limit")
    if unit.break_reasons:
        causes.append("graph breaks while tracing it: " + " | ".join(r.splitlines()[0] for r in unit.break_reasons[:3]))
    if not causes:
        causes.append("not found here (a forward without tensor operations compiles to no graph); "
                      "torch._dynamo.explain(type(module).forward)(module, *args) shows what Dynamo does with it")
    return (f"compile_units: unit {label} ran {unit.calls} forward call(s) and no compiled graph "
            f"(graphs compiled {unit.graphs_compiled}), so it ran eagerly; cause: {'; '.join(causes)}")


def compile_units(model: FullyShardedModule, opts: CompileOptions) -> CompileStats:
    """Compile the forward of every non-root unit of the wrapped ``model`` (the root unit's
    module when the model has no other unit: it then holds no engine hook), attach the counts as
    ``model.compile_stats`` and the first-forward check as a forward hook of the wrapper."""
    engine = model._fsdp_engine
    inner = model.module
    names = [u.name for u in engine.units if u is not engine.root] or [""]
    backend = _backend_for(opts)
    stats = CompileStats(opts)
    forwards: dict[str, _CompiledForward] = {}
    for name in names:
        module = inner.get_submodule(name)
        if "forward" in vars(module):
            raise ValueError(f"compile_units: unit {name!r} ({type(module).__name__}) already has its own "
                             "instance forward (compiled by hand?); use compile_units or your own "
                             "per-unit compile, not both")
        stats.units[name] = UnitCompileStats(name)
        forwards[name] = _CompiledForward(module, opts, backend, stats.units[name])
    for name, forward in forwards.items():
        setattr(inner.get_submodule(name), "forward", forward)  # noqa: B010 (nn.Module.__setattr__ is typed for tensors)
    check = _CheckAfterForward(stats, forwards, inner, [inner.get_submodule(name) for name in forwards])
    check.handle = model.register_forward_hook(check)
    setattr(model, "compile_stats", stats)  # noqa: B010 (nn.Module's __setattr__ is typed for tensors)
    return stats
