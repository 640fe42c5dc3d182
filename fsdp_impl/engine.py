"""Runtime state of one wrapped model and the transitions the hooks trigger.

``FSDPEngine`` is the explicit state object every hook is bound to (no closures sharing
attributes): which units exist, whether this backward syncs, which comm dtype is in force, and
whether the end-of-backward callback is queued.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.autograd.graph import increment_version
from torch.utils._pytree import tree_flatten

from . import comm
from .grad_reduce import OuterGradReducer
from .param import ManagedParam
from .unit import FSDPUnit, TrainingState
from .unit_context import UnitContext
from .unshard_storage import GatherPhase

if TYPE_CHECKING:
    from .config import FSDPConfig
    from .fp8.params import ModelFp8
    from .offload.host import ModelOffload
    from .traceable import TraceableState


# Attribute on each sharded param: a weakref to its model's engine, so an optimizer built on
# ``model.parameters()`` can find the engines whose buffers its ``zero_grad`` must reset (and
# ``clip_grad_norm`` the engines whose ``offload_policy`` overlaps the step).
ENGINE_REF_ATTR = "_fsdp_engine_ref"


def phase_label(phase: str, unit: FSDPUnit) -> str:
    """The profiler label of one unit's phase, ``FSDP::pre_forward (blocks.3)``: a trace shows
    which unit each gather, reduction and wait belongs to (``bench.trace_summary`` groups the
    phases without the unit)."""
    return f"FSDP::{phase} ({unit.name})"


def traced_phase(phase: str, unit: FSDPUnit) -> contextlib.AbstractContextManager[object]:
    """``comm.traced(phase_label(...))``, the label string built only while a profiler records."""
    return comm.traced(phase_label(phase, unit)) if comm.profiling() else contextlib.nullcontext()


def outside_forward_error(unit: FSDPUnit, module: nn.Module) -> RuntimeError:
    """The error for ``module`` (holding ``unit``'s params) called while they are sharded: it
    names the module, the unit and what to do (torch's own error names an aten op)."""
    where = next((p.fqn.rpartition(".")[0] for p in unit.params if p.locations[0][0] is module), None)
    named = f"module {where or '<root>'!r}" if where is not None else "it"
    if unit.name.startswith("<root>"):
        how = ("call it from the forward of the model fully_shard returned (which gathers the root's params), "
               "or make it a unit of its own (add its class to fsdp_unit_modules)")
    else:
        how = (f"call it from the unit's forward (run {unit.name!r} itself), or make it a unit of its own "
               f"(add its class to fsdp_unit_modules; units are the outermost matches, so in place of the "
               f"class of {unit.name!r})")
    return RuntimeError(f"{type(module).__name__} holds params of FSDP unit {unit.name!r} but ran outside that "
                        f"unit's forward: {named} was called while its params are sharded DTensors; {how}")


class FSDPEngine:
    """Drives the units of one model through forward, backward and grad sync."""

    def __init__(self, units: list[FSDPUnit], root: FSDPUnit, ctx: UnitContext,
                 outer_reducer: OuterGradReducer | None = None, fp8: ModelFp8 | None = None,
                 offload: ModelOffload | None = None) -> None:
        self.units = units  # fixed order, identical on every rank; root is last
        self.root = root
        self.ctx = ctx  # the ordinary units' context; its config is the model's (``config``)
        self.sync = self.config.sync_model_each_microbatch  # set_model_auto_sync changes it
        self.outer_reducer = outer_reducer  # HSDP: averages grads across dp_outer once per cycle
        self.fp8 = fp8  # FP8 params / delayed scaling (fp8/params.py)
        self.offload = offload  # CPU offload (offload/host.py)
        self.comm_dtype_override: torch.dtype | None = None
        self._callback_queued = False
        # From the first pre-backward (or grad) of a backward until its end-of-backward callback:
        # a unit forward that runs then, inside autograd's backward, is an activation recompute.
        self._backward_active = False
        # ZeRO-0/1/2: units whose compute params must be rebuilt before their forward
        self._stale: dict[FSDPUnit, bool] = dict.fromkeys(units, True)
        # Non-root units in the order their forwards ran: this iteration's (for backward
        # prefetch) and the previous one's (for forward prefetch). Identical on all ranks as long
        # as the model's control flow is, which keeps the prefetch collectives in lockstep.
        self._order: list[FSDPUnit] = []
        self._prev_order: list[FSDPUnit] = []
        # Traceable mode (fsdp_impl.traceable, for a whole-step torch.compile): set while on; the
        # wrapper's forward and the bound optimizer then take the traceable path, the hooks are off
        self.traceable: TraceableState | None = None

    # ------------------------------------------------------------------- forward
    @property
    def config(self) -> FSDPConfig:
        """The model's configuration (``fully_shard``'s switches under their own names)."""
        return self.ctx.config

    def comm_dtype(self, unit: FSDPUnit) -> torch.dtype:
        return self.comm_dtype_override or unit.dtypes.grad_comm

    def _agree_on_stale_units(self) -> None:
        """ZeRO-1/2: decide which units' compute params need a refresh, identically on all ranks
        (a rank-local version check alone could make ranks disagree on issuing an all-gather).

        CUDA-graph mode refreshes every unit on every forward instead: no version counters, no
        collective, no host sync, so an eager step takes exactly the path a replay does."""
        if self.config.cuda_graph_mode:
            self._stale = dict.fromkeys(self.units, True)
            return
        changed = [u.weights_changed() for u in self.units]
        if self.ctx.refreshes:
            flags = torch.tensor(changed, dtype=torch.int32, device=self.ctx.device)
            comm.all_reduce_max(flags, self.ctx.group)
            changed = [bool(x) for x in flags.tolist()]
        self._stale = dict(zip(self.units, changed, strict=True))

    def pre_forward(self, unit: FSDPUnit) -> None:
        with traced_phase("pre_forward", unit):
            self._pre_forward(unit)

    def in_recompute(self) -> bool:
        """Whether a unit forward now is the recompute of a checkpointed region (reentrant or not:
        ``torch.utils.checkpoint``, ``checkpoint_wrapper``, selective recompute): it runs inside
        this model's backward, i.e. inside an autograd graph task after a pre-backward fired."""
        return self._backward_active and torch._C._current_graph_task_id() != -1

    def _pre_forward(self, unit: FSDPUnit) -> None:
        if self.in_recompute():
            self._recompute_pre_forward(unit)
            return
        zero3 = self.ctx.zero3
        if unit is self.root:
            if self.offload is not None and self.offload.overlap is not None:
                self.offload.overlap.before_forward(self)  # overlap_step=True: optimizer.step() came first
            if self._backward_active:  # the last backward raised before its end-of-backward callback
                self._abandon_backward()
            if zero3:  # a forward without backward (eval) may have left units gathered/prefetched
                for other in self.units:
                    other.reshard()
            else:
                for other in self.units:
                    other.drop_prefetched_refresh()
            if not zero3 or self.fp8 is not None:  # ZeRO-3 re-gathers every unit anyway
                self._agree_on_stale_units()
            if self.fp8 is not None:  # FP8 params of changed units: one sharded requantisation
                self.fp8.requantize([u for u in self.units if self._stale[u]])
            if self._order:
                self._prev_order = self._order
            self._order = []
        else:
            self._order.append(unit)
        unit.state = TrainingState.FORWARD
        # fine-grained: its first submodule with params gathers it
        if zero3 and self.config.enable_fine_grained_param_gather and unit is not self.root:
            return
        if zero3:
            unit.unshard()
            self._prefetch_after(unit, self._prev_order, +1)
        else:
            if self._stale[unit]:
                unit.refresh()
                self._stale[unit] = False
            self._prefetch_refresh_after(unit)
        unit.swap_in()

    def submodule_pre_forward(self, unit: FSDPUnit, module: nn.Module) -> None:
        """``module`` (holding params of ``unit``, ``FSDPUnit.hooked_submodules``) is about to run;
        its params must be the compute params (ZeRO-3 fine-grained: the unit's deferred gather;
        in a recompute: the FP8 row-wise bytes too)."""
        if self.in_recompute():
            self._recompute_pre_forward(unit)
            return
        if unit.state != TrainingState.FORWARD:
            raise outside_forward_error(unit, module)
        if self.ctx.zero3 and not unit.is_unsharded:
            with traced_phase("pre_forward", unit):
                unit.unshard()
                self._prefetch_after(unit, self._prev_order, +1)
            unit.swap_in()

    def _recompute_pre_forward(self, unit: FSDPUnit) -> None:
        """A recompute reads the very compute params the forward used: ZeRO-0/1/2 kept them (the
        main weights do not change inside a step), ZeRO-3 has them from the unit's pre-backward,
        or gathers them now when the recompute comes first (a region of several units, or a
        reentrant checkpoint around the unit, whose forward registered no pre-backward); they stay
        until the unit's post-backward. The forward order, prefetch and refresh are left alone."""
        if self.ctx.zero3:
            if not unit.is_unsharded:
                with traced_phase("recompute_unshard", unit):
                    unit.unshard(GatherPhase.RECOMPUTE)
            unit.regather_fp8_rowwise()
        unit.swap_in()

    def _abandon_backward(self) -> None:
        """Forget a backward that never finished (it raised): units back to their sharded params."""
        self._backward_active = False
        self._callback_queued = False
        for unit in self.units:
            unit.swap_out()

    def _prefetch_refresh_after(self, unit: FSDPUnit) -> None:
        """ZeRO-1/2: start the refresh gather of the unit that ran after ``unit`` in the previous
        forward (the first one after the root), when it is stale. Stale flags are agreed on every
        rank and the forward order is the same everywhere, so all ranks issue the same gathers."""
        nxt = self._next_unit(unit, self._prev_order, +1)
        if nxt is not None and self.config.overlap_param_gather and self._stale.get(nxt, False):
            nxt.prefetch_refresh()

    def post_forward(self, unit: FSDPUnit, output: Any) -> None:
        """Swap the DTensor params back; ZeRO-3 frees non-root units until their backward."""
        with traced_phase("post_forward", unit):
            self._post_forward(unit, output)

    def _post_forward(self, unit: FSDPUnit, output: Any) -> None:
        if self.in_recompute():  # keep the params for the unit's backward, which comes next
            if torch.is_grad_enabled():  # a reentrant recompute's inner backward: prefetch from here
                self._register_pre_backward(unit, output)
            return
        unit.state = TrainingState.IDLE
        unit.swap_out()
        hooked = torch.is_grad_enabled() and self._register_pre_backward(unit, output)
        if unit is self.root:  # the root stays gathered for its backward
            if not hooked:
                unit.reshard()
        elif not (hooked and unit.holds_through_backward()):
            unit.reshard()  # (a held unit is resharded after its backward, or by the next forward)

    def _register_pre_backward(self, unit: FSDPUnit, output: Any) -> bool:
        """Hook the unit's pre-backward on the output tensors that need a grad (False: none)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(tensors) == 1:  # the usual unit output: a plain tensor hook (a multi-grad hook is
            tensors[0].register_hook(_PreBackward(self, unit))  # ~20x the host time to register)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, _PreBackward(self, unit), mode="any")
        return bool(tensors)

    # ------------------------------------------------------------------ backward
    def _ensure_callback(self) -> None:
        self._backward_active = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def pre_backward(self, unit: FSDPUnit) -> None:
        """The unit's backward is next: ZeRO-3 re-gathers it (and prefetches the unit whose
        backward follows); every strategy registers the compute params on the module again, so a
        recompute inside the unit's forward code reads them, as the forward did."""
        self._ensure_callback()
        if unit.state != TrainingState.POST_BACKWARD:
            unit.state = TrainingState.PRE_BACKWARD
        if self.ctx.zero3:
            with traced_phase("pre_backward", unit):
                unit.storage.on_pre_backward()
                unit.unshard(GatherPhase.BACKWARD)
                self._prefetch_after(unit, self._order, -1)
        unit.swap_in()

    def _prefetch_after(self, unit: FSDPUnit, order: list[FSDPUnit], step: int) -> None:
        """ZeRO-3: start the all-gather of the unit that runs after ``unit`` (forward: next in
        the previous forward order; backward: previous in this forward's order)."""
        nxt = self._next_unit(unit, order, step)
        if nxt is not None and self.config.overlap_param_gather:
            nxt.prefetch()

    def _next_unit(self, unit: FSDPUnit, order: list[FSDPUnit], step: int) -> FSDPUnit | None:
        """The unit after ``unit`` in pass direction ``step``. The root opens both passes: the
        first unit of ``order`` follows it in forward, the last in backward (its pre-backward
        fires when the output's grad arrives, so the last unit's gather overlaps the backward
        of the root's own layers after it, e.g. the LM head; FSDP2 does the same)."""
        if unit is self.root:
            return (order[0] if step > 0 else order[-1]) if order else None
        return self._neighbour(unit, order, step)

    @staticmethod
    def _neighbour(unit: FSDPUnit, order: list[FSDPUnit], step: int) -> FSDPUnit | None:
        """The unit ``step`` places after ``unit`` in ``order`` (None: not there, or past an end)."""
        try:
            j = order.index(unit) + step  # one scan (units compare by identity)
        except ValueError:  # not in this order
            return None
        return order[j] if 0 <= j < len(order) else None

    def grad_ready(self, unit: FSDPUnit, param: ManagedParam) -> None:
        """Post-accumulate-grad hook target: stash the grad; reduce when the unit is complete."""
        self._ensure_callback()
        if unit.accept_grad(param):
            with traced_phase("post_backward", unit):
                unit.reduce_grads(self.sync, self.comm_dtype(unit))
                if self.sync and self.offload is not None and self.offload.overlap is not None:
                    self.offload.overlap.unit_landed(self, unit)  # overlap_step: its copy and step start
                if unit is not self.root:
                    unit.reshard()
                    unit.swap_out()

    def finish_backward(self) -> None:
        """End of backward: reduce units whose grads never all arrived, reshard, install grads."""
        with comm.traced("FSDP::finish_backward"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self._backward_active = False
        for unit in reversed(self.units):
            unit.reduce_grads(self.sync, self.comm_dtype(unit))
            unit.reshard()
            unit.swap_out()
            unit.end_backward()
        if self.sync:
            if self.fp8 is not None:  # delayed scaling: one amax reduction per step
                self.fp8.after_sync_backward()
            if self.outer_reducer is not None:
                self.outer_reducer.reduce([u.grad for u in self.units])
            self.install_grads()
            if self.offload is not None and self.offload.overlap is not None:
                self.offload.overlap.backward_done(self)  # overlap_step: the units that did not land yet
            if self.ctx.user_buffers is not None:  # every buffer of a step exists now: register once
                self.ctx.user_buffers.register()

    def install_grads(self) -> None:
        if self.config.report_nan_in_param_grad:
            bad = self._nan_grad_names()
            if bad:
                raise RuntimeError(f"NaN found in the gradient of parameter(s) {bad} "
                                   "(report_nan_in_param_grad=True)")
        if self.offload is not None:
            for unit in self.units:
                if unit.offload is None or not unit.offload.landed:  # overlap_step: copied as they landed
                    unit.grads_to_host()
            # Wait for the device-to-host copies before anything reads the host grads: a grad
            # whose dtype differs from its param's is installed as a cast copy, read right now.
            self.offload.after_grads_to_host()
        for unit in self.units:
            unit.install_grads(self.config.use_decoupled_grad)

    def _nan_grad_names(self) -> list[str]:
        """FQNs whose synced grad holds a NaN on *any* rank (one MAX all-reduce of per-param
        flags over the whole mesh, which covers the world), so every rank raises the same error
        instead of only those holding the shard: TP ranks hold different grads, so the shard
        group alone could leave a TP peer running on into a collective nobody joins."""
        names = [p.fqn for u in self.units for p in u.trainable]
        per_param = [f for u in self.units for f in u.nan_grad_flags()]
        if not per_param:
            return []
        flags = torch.stack(per_param)  # one device->host sync below, not one per param
        comm.all_reduce_max(flags, None)
        return [n for n, f in zip(names, flags.tolist(), strict=True) if f]

    def zero_grad_buffers(self, free: bool = False) -> None:
        self.check_zero_grad(free)
        for unit in self.units:
            unit.zero_grad_buffers(free)

    def note_optimizer_step(self) -> None:
        """An optimizer stepped this model's params: bump every weight buffer's version counter.
        Fused kernels (``torch._fused_adam_``, TE's FusedAdam) update params in place without
        bumping any counter, so without this the ZeRO-1/2 refresh and the FP8 requantisation,
        which key on those counters, would keep the compute weights of before the step."""
        for unit in self.units:
            if unit.params:
                increment_version(unit.weight.data)

    def grad_buffer_ptrs(self) -> set[int]:
        """Storage addresses of the allocated grad buffers (``hide_buffer_grads`` matches views)."""
        buffers = [u.grad for u in self.units] + [u.offload.host_grad for u in self.units if u.offload is not None]
        return {b.data.untyped_storage().data_ptr() for b in buffers
                if b is not None and b.is_allocated and b.data.numel()}

    def check_zero_grad(self, free: bool) -> None:
        """Refuse ``zero_grad(set_to_none=True)`` in graph mode, and ``zero_grad`` between an
        ``overlap_step=True`` backward and its ``optimizer.step()`` (before anything is reset)."""
        if self.offload is not None and self.offload.overlap is not None:
            self.offload.overlap.before_zero_grad(free)
        if free and self.config.cuda_graph_mode:
            raise ValueError(
                "zero_grad(set_to_none=True) is not allowed with cuda_graph_mode=True: it would drop the "
                ".grad views of the gradient buffer that a captured graph writes into, so replays would "
                "silently stop delivering gradients to the optimizer; call zero_grad(set_to_none=False)")


class _PreBackward:
    """Tensor hook (or ``register_multi_grad_hook`` target): the unit's pre-backward transition."""

    def __init__(self, engine: FSDPEngine, unit: FSDPUnit) -> None:
        self.engine = engine
        self.unit = unit

    def __call__(self, grads: Any) -> None:  # returns None: the grads pass on unchanged
        self.engine.pre_backward(self.unit)
