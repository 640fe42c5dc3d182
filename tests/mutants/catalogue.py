"""The mutation catalogue: one deliberately broken variant (mutant) per known bug class of
sharded data-parallel training and of its test harness.

Each public function below applies one mutant when called; the harness calls it at the start of
every process of a run named by ``HARNESS_MUTANT=tests.mutants.catalogue:<name>``. A mutant
patches by name through :func:`tests.mutants.patching.replace`, which raises when the target is
gone, so a stale mutant cannot pass for a killed one. ``MUTANTS`` lists them with the bug class,
the narrowest test selection expected to kill each (``python -m tests.mutants.runner --narrow``)
and, for a mutant that changes the numbers training produces, when it does (``numerics``): the
golden cells alone must kill each of those (``runner --golden``) on the platforms where it changes
them (``numerics_gpu_only``: not on CPU/gloo).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from tests.mutants.patching import replace


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug_class: str
    narrow: tuple[str, ...]  # pytest arguments selecting the tests that should kill it
    # When the mutant changes losses, grads or weights (None: traffic, timing, a crash or refusal,
    # or the harness; numbers equal up to rounding count as unchanged).
    numerics: str | None = None
    numerics_gpu_only: bool = False  # the numbers change only on GPUs (NCCL, CUDA graphs)


def _wrap_after(after: Callable[..., None]) -> Callable[[Any], Any]:
    """A ``make`` for :func:`replace`: call the original, then ``after`` with the same arguments."""
    def make(original: Any) -> Any:
        @functools.wraps(original)
        def mutated(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            after(*args, **kwargs)
            return result
        return mutated
    return make


# ----------------------------------------------------------------------------------- optimizer
def adam_dummy_step_on_load() -> None:
    """Loading a checkpoint runs a dummy optimizer step to create the state: Adam's step count
    ends one ahead of the saved run, so bias correction (and every later update) differs."""
    def advance(model: Any, optimizer: Any, *rest: Any, **kw: Any) -> None:
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] += 1
    replace("fsdp_impl.checkpoint._api:install_optimizer_state", _wrap_after(advance))


def optimizer_state_dropped_on_load() -> None:
    """Loading a checkpoint restores the weights and hyper-parameters but not the optimizer state
    (moments and step start from zero again)."""
    replace("fsdp_impl.checkpoint._api:install_optimizer_state",
            _wrap_after(lambda model, optimizer, *rest, **kw: optimizer.state.clear()))


def stale_weights_after_load() -> None:
    """After a checkpoint load the engine believes its compute weights are current, so ZeRO-0/1/2
    forwards keep using the weights from before the load."""
    def forget(model: Any, *rest: Any, **kw: Any) -> None:
        for unit in model._fsdp_engine.units:
            unit.synced_version = unit.version_signature()
    replace("fsdp_impl.checkpoint._api:_install_model_state", _wrap_after(forget))


def manifest_published_before_data() -> None:
    """A save publishes the manifest naming the new data directory before the data is written:
    a save that dies in between leaves a checkpoint that names missing or partial data (and the
    previous checkpoint is already gone)."""
    import torch

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def publish_first(data: Any, path: Any, state: Any, snapshot: Any, extra: Any) -> None:
            from fsdp_impl.checkpoint import _comm, _files, _layout
            if _comm.rank() == 0:
                _layout.commit(path, data, _files.new_manifest(snapshot.description, {}, _comm.world_size(),
                                                               torch.__version__))
            original(data, path, state, snapshot, extra)
        return publish_first
    replace("fsdp_impl.checkpoint._api:_write", make)


# ------------------------------------------------------------------------------ grad reduction
def zeroed_grad_overwritten_after_write() -> None:
    """The first reduction after ``zero_grad(set_to_none=False)`` overwrites the grad buffer even
    when something wrote into ``.grad`` since (a hand-added gradient is silently lost)."""
    def make(original: Any) -> Any:
        def take_zeroed(self: Any, token: object | None) -> bool:
            mark, self._zeroed = self._zeroed, None
            return mark is not None and mark[0] is token
        return take_zeroed
    replace("fsdp_impl.buffers:DataParallelBuffer.take_zeroed", make)


def refresh_prefetch_kept_across_steps() -> None:
    """A ZeRO-1/2 refresh gather prefetched in a forward that skipped its unit is finished after
    the next optimizer step: the unit computes with the weights of before that step."""
    replace("fsdp_impl.unit:FSDPUnit.drop_prefetched_refresh", lambda original: lambda self: None)


def root_prefetch_skipped() -> None:
    """The root's pre-forward and pre-backward start no all-gather (block 0 and the last block
    gather only when reached): correct numbers, one exposed gather per pass."""
    def make(original: Any) -> Any:
        def next_unit(self: Any, unit: Any, order: list, step: int) -> Any:
            return None if unit is self.root else original(self, unit, order, step)
        return next_unit
    replace("fsdp_impl.engine:FSDPEngine._next_unit", make)


def gather_cast_into_wrong_chunk() -> None:
    """Every rank casts its shard into chunk 0 of the gather output: gloo still gathers the right
    values (it reads the input before writing), NCCL would overwrite the input while reading it."""
    def make(original: Any) -> Any:
        def gather(self: Any) -> Any:
            import torch

            from fsdp_impl import comm
            group = self.ctx.gather_group or self.ctx.group
            layout = self.weight.layout
            out = torch.empty(layout.total_numel, dtype=self.dtypes.compute, device=self.ctx.device)
            local = out.narrow(0, 0, layout.segment_numel)
            local.copy_(self.weight.data)
            comm.all_gather(out, local, group)
            return out
        return gather
    replace("fsdp_impl.unit:FSDPUnit._gather_compute_dtype", make)


def grads_summed_not_averaged() -> None:
    """Gradients are summed across data-parallel ranks instead of averaged (world-size x too large;
    Adam hides much of it, SGD does not): the default pre-division by the dp size is skipped, and
    ``average_in_collective``'s AVG collectives become SUM."""
    import torch.distributed as dist

    replace("fsdp_impl.grad_reduce:GradScaling.prepare", lambda original: lambda self, full: None)
    replace("fsdp_impl.grad_reduce:GradScaling.op", lambda original: property(lambda self: dist.ReduceOp.SUM))


def hsdp_outer_reduce_every_microbatch() -> None:
    """HSDP all-reduces grads across dp_outer on every microbatch instead of once per
    optimisation cycle (numerically equal, AVG being linear; only the traffic shows it)."""
    def make(original: Any) -> Any:
        @functools.wraps(original)
        def finish(self: Any) -> None:
            original(self)
            if not self.sync and self.outer_reducer is not None:
                self.outer_reducer.reduce([u.grad for u in self.units])
        return finish
    replace("fsdp_impl.engine:FSDPEngine._finish_backward", make)


def hsdp_outer_reduce_never() -> None:
    """HSDP never averages grads across the dp_outer replicas: each replica trains on its own data."""
    replace("fsdp_impl.grad_reduce:OuterGradReducer.reduce", lambda original: lambda self, grad_buffers: None)


def accumulation_syncs_every_microbatch() -> None:
    """``set_model_auto_sync(False)`` is ignored: every microbatch reduces and installs grads."""
    def make(original: Any) -> Any:
        def set_model_auto_sync(self: Any, sync: bool) -> None:
            original(self, True)
        return set_model_auto_sync
    replace("fsdp_impl.module:FullyShardedModule.set_model_auto_sync", make)


# ----------------------------------------------------------------------------- decoupled grads
def decoupled_grad_none_on_empty_shards() -> None:
    """Ranks whose shard of a parameter is empty get ``decoupled_grad = None`` instead of an empty
    DTensor (what crashed fused clipping kernels)."""
    def drop(unit: Any, decoupled: bool) -> None:
        if decoupled:
            for p in unit.trainable:
                if p.sharded_local().numel() == 0:
                    p.sharded.decoupled_grad = None
    replace("fsdp_impl.unit:FSDPUnit.install_grads", _wrap_after(drop))


def optimizer_reads_grad_not_decoupled_grad() -> None:
    """The buffer writes ``decoupled_grad`` while the optimizer reads ``.grad`` (None): every step
    is a silent no-op."""
    replace("fsdp_impl.optim.adam:read_grad", lambda original: lambda param, use_decoupled_grad: param.grad)


def clip_grad_norm_local_only() -> None:
    """Gradient clipping uses each rank's local shard norm instead of the global norm."""
    replace("fsdp_impl.clip_grad:_reduce", lambda original: lambda partial, group, norm_type: partial)


# ----------------------------------------------------------------------------------- meta init
def meta_init_same_rng_per_shard() -> None:
    """Meta-device init draws each rank's shard from the same RNG state: every shard of a
    parameter holds the values of the first one instead of its slice of one full tensor."""
    import torch

    def make(original: Any) -> Any:
        def reset_fn(module: Any) -> Any:
            reset = original(module)
            if reset is None:
                return None

            def same_values_per_shard() -> None:
                reset()
                world = torch.distributed.get_world_size()
                with torch.no_grad():
                    for param in module.parameters(recurse=False):
                        rows = param.shape[0] if param.dim() else 0
                        step = -(-rows // world) if rows else 0
                        for start in range(step, rows, step):
                            n = min(step, rows - start)
                            param[start:start + n].copy_(param[:n])
            return same_values_per_shard
        return reset_fn
    replace("fsdp_impl.meta_init:_reset_fn", make)


def meta_init_rng_not_synchronised() -> None:
    """Meta-device init starts every rank's RNG from its own state, so the ranks' shards come from
    different full tensors."""
    import torch

    def make(original: Any) -> Any:
        def own_rng(device: Any, group: Any) -> None:
            torch.manual_seed(1000 + torch.distributed.get_rank())
        return own_rng
    replace("fsdp_impl.assembly:sync_rng_from_rank0", make)


# ---------------------------------------------------------------------------------- zero_grad
def zero_grad_drops_grad_views() -> None:
    """``zero_grad(set_to_none=False)`` frees the grad buffers as ``set_to_none=True`` does, so the
    ``.grad`` views a captured CUDA graph (or any holder) keeps are dropped and replaced."""
    replace("fsdp_impl.unit:FSDPUnit.zero_grad_buffers",
            lambda original: lambda self, free=False: original(self, True))


# -------------------------------------------------------------------------------- CUDA graphs
def graph_mode_zero_grad_set_to_none_allowed() -> None:
    """With ``cuda_graph_mode=True``, ``zero_grad(set_to_none=True)`` frees the grad buffers instead
    of being refused: the ``.grad`` views a captured graph writes into are dropped, and replays
    silently stop delivering gradients."""
    replace("fsdp_impl.engine:FSDPEngine.check_zero_grad", lambda original: lambda self, free: None)


# -------------------------------------------------------------------------------------- FP8
def fp8_amax_not_reduced() -> None:
    """FP8 parameters are quantised with each rank's local amax (of its shard) instead of the
    full tensor's: the MAX all-reduces of the requantisation and of delayed scaling are skipped,
    so the ranks' shards of one weight get different scales."""
    import types

    def make(original: Any) -> Any:
        local = types.SimpleNamespace(**{n: getattr(original, n) for n in dir(original) if not n.startswith("__")})
        local.all_reduce_max = lambda tensor, group: None
        return local
    replace("fsdp_impl.fp8.params:comm", make)


def optimizer_step_not_noted() -> None:
    """The engine is not told that the optimizer stepped: a fused optimizer (which bumps no
    version counter) leaves ZeRO-1/2 forwards on the compute weights of before the step."""
    replace("fsdp_impl.engine:FSDPEngine.note_optimizer_step", lambda original: lambda self: None)


def local_step_partial_grad_stepped_locally() -> None:
    """The local-shard optimizer step takes every grad's local tensor as the shard of the update,
    also a ``Partial`` grad's (a summand, not the shard): that param moves by one rank's part."""
    replace("fsdp_impl.local_step:LocalShardStep._grads_match", lambda original: staticmethod(lambda params: True))


def local_step_state_left_local() -> None:
    """The local-shard optimizer step keeps the state it created as plain local tensors instead of
    DTensors with the param's placements: ``state_dict`` and DCP then see unsharded, wrong-shaped
    moments (training numbers unchanged)."""
    def make(original: Any) -> Any:
        def write_back(state: Any, p: Any, local: dict) -> None:
            state[p] = dict(local)
        return write_back
    replace("fsdp_impl.local_step:_write_back", make)


def fp8_held_unit_kept_into_the_next_forward() -> None:
    """At one rank with kept FP8 transposes a unit keeps its params from its forward to its
    backward; a forward whose backward never runs leaves it gathered, and here the next root
    pre-forward does not reshard it: after an optimizer step its norms and biases still compute
    with their values of before the step."""
    from fsdp_impl.unit import TrainingState

    def make(original: Any) -> Any:
        def reshard(self: Any) -> None:
            if self.state == TrainingState.IDLE and self.holds_through_backward():
                return
            original(self)
        return reshard
    replace("fsdp_impl.unit:FSDPUnit.reshard", make)


def fp8_stale_transpose_kept() -> None:
    """When new FP8 bytes land, a TE weight that still has a valid transpose keeps it instead of
    building it from the new bytes: after a forward whose backward never ran and an optimizer
    step, the next backward reads the old bytes' transpose."""
    def make(original: Any) -> Any:
        te_fill = original["te"]

        def fill(params: list, keep_transpose: bool) -> None:
            te_fill([p for p in params if not p.has_transpose()], keep_transpose)
            for p in params:
                p.attach()
        return dict(original, te=fill)
    replace("fsdp_impl.fp8.params:FILL", make)


def nccl_ub_registration_order_per_rank() -> None:
    """NCCL user buffers are registered with the model's groups in an order that depends on the
    rank (odd ranks reversed): registration is collective per group, so ranks would wait for
    each other in different groups and hang."""
    def make(original: Any) -> Any:
        def per_rank(groups: Any) -> Any:
            import torch.distributed as dist
            found = original(groups)
            return found[::-1] if dist.get_rank() % 2 else found
        return per_rank
    replace("fsdp_impl.assembly:registration_groups", make)


# ---------------------------------------------------------------------------- activation recompute
def recompute_pre_backward_keeps_sharded_params() -> None:
    """A unit's pre-backward leaves the sharded DTensor params on the module (the original
    recompute bug): a recompute inside the unit's forward code mixes DTensors and plain tensors."""
    def make(original: Any) -> Any:
        def pre_backward(self: Any, unit: Any) -> None:
            original(self, unit)
            unit.swap_out()
        return pre_backward
    replace("fsdp_impl.engine:FSDPEngine.pre_backward", make)


def recompute_runs_as_a_forward() -> None:
    """The recompute of a checkpointed unit is taken for a new forward: the next unit's gather is
    prefetched for nothing, and after a reentrant recompute the unit is resharded before the
    backward that reads it and gathered once more (a non-reentrant recompute stops early, before
    the unit's post-forward hook, so only the prefetch shows there)."""
    replace("fsdp_impl.engine:FSDPEngine.in_recompute", lambda original: lambda self: False)


def recompute_unit_gathered_twice() -> None:
    """A unit recomputed before its pre-backward (a region of several units) is gathered again
    by its pre-backward: one extra all-gather per unit and step (numerics unchanged)."""
    def make(original: Any) -> Any:
        def pre_backward(self: Any, unit: Any) -> None:
            if unit is not self.root:
                unit.reshard()
            original(self, unit)
        return pre_backward
    replace("fsdp_impl.engine:FSDPEngine.pre_backward", make)


# ------------------------------------------------------------------------------- CPU offload
def offload_step_skips_a_d2h() -> None:
    """The streamed optimizer step of ``OffloadPolicy(step="gpu")`` never copies its second
    chunk's updated params and moments back to host memory: that chunk's update is lost on the
    host every step (the device compute shard still got it, so the first forward after the step
    looks right; the next step starts from the stale host params and moments)."""
    def make(original: Any) -> Any:
        def copy(self: Any, chunk: list, entries: list, window: dict, base: int, to_host: bool) -> None:
            if to_host and len(self.last_plan) > 1 and chunk is self.last_plan[1]:
                return
            original(self, chunk, entries, window, base, to_host)
        return copy
    replace("fsdp_impl.offload.step:StreamedStep._copy", make)


def offload_overlap_steps_on_stale_grads() -> None:
    """``OffloadPolicy(overlap_step=...)``: a unit's task starts as its grads land, but its
    reduced grads are never copied into host memory first, so the unit steps (or, with "clip",
    is normed) on the host grads the previous step left (zeros at the first step), and so does
    ``.grad``: the step runs before the unit's grads have landed where it reads them."""
    def make(original: Any) -> Any:
        def unit_landed(self: Any, engine: Any, unit: Any) -> None:
            offload = unit.offload
            if offload is None:
                return original(self, engine, unit)
            offload.grads_to_host = lambda grad: offload.host_grad  # the copy is skipped
            try:
                original(self, engine, unit)
            finally:
                del offload.grads_to_host
        return unit_landed
    replace("fsdp_impl.offload.overlap:OverlappedStep.unit_landed", make)


# ------------------------------------------------------------------------------------- harness
def harness_rank0_outcome_only() -> None:
    """The harness reports a distributed test by rank 0's outcome alone: a failure on another
    rank passes."""
    def make(original: Any) -> Any:
        def rank0_phase(self: Any, when: str, props: Any) -> Any:
            saved = self.per_rank, self.errors, self.world_size
            self.per_rank = {0: self.per_rank.get(0, {})}
            self.errors = {r: e for r, e in self.errors.items() if r == 0}
            self.world_size = 1
            try:
                return original(self, when, props)
            finally:
                self.per_rank, self.errors, self.world_size = saved
        return rank0_phase
    replace("harness.combine:ReportBuilder._merge_phase", make)


F = "tests/functional/"
MUTANTS = (
    Mutant("adam_dummy_step_on_load", "optimizer dummy step advances Adam's step count",
           (F + "test_checkpoint_resume.py", "-k", "test_resume_is_bit_exact and ws2"),
           numerics="after a checkpoint load"),
    Mutant("optimizer_state_dropped_on_load", "optimizer state dropped on load",
           (F + "test_checkpoint_resume.py", "-k", "test_resume_is_bit_exact and ws2"),
           numerics="after a checkpoint load"),
    Mutant("stale_weights_after_load", "stale compute weights after checkpoint load",
           (F + "test_checkpoint_resume.py", "-k", "test_resume_is_bit_exact and ws2"),
           numerics="after a checkpoint load (ZeRO-0/1/2)"),
    Mutant("manifest_published_before_data", "checkpoint manifest published before its data is written",
           ("tests/unit/checkpoint/test_checkpoint_crash_safety.py", "-k", "test_killed_save_leaves_a_complete")),
    Mutant("grads_summed_not_averaged", "grads summed instead of averaged",
           (F + "test_mesh_world2.py", "-k", "test_plain_fsdp_world2"),
           numerics="every step at world > 1"),
    Mutant("zeroed_grad_overwritten_after_write", "zeroed grad buffer overwritten after a write into .grad",
           ("tests/unit/fsdp/test_graph_mode_cpu.py", "-k", "test_zeroed_grad_buffers_are_overwritten"),
           numerics="when .grad is written between zero_grad(set_to_none=False) and the backward"),
    Mutant("refresh_prefetch_kept_across_steps", "ZeRO-1/2 prefetched refresh gather used after the next step",
           ("tests/unit/fsdp/test_refresh_prefetch.py", "-k", "test_unused_prefetch"),
           numerics="ZeRO-1/2, when a forward skips a unit"),
    Mutant("root_prefetch_skipped", "ZeRO-3 root starts no prefetch (first/last unit gathered late)",
           (F + "test_engine_features.py", "-k", "test_zero3_root_prefetches_first_and_last_unit")),
    Mutant("gather_cast_into_wrong_chunk", "shard cast into chunk 0, not this rank's, for an in-place gather",
           (F + "test_engine_features.py", "-k", "test_cast_shards_are_gathered_in_place"),
           numerics="NCCL at world > 1 (gloo reads the input before writing)", numerics_gpu_only=True),
    Mutant("hsdp_outer_reduce_every_microbatch", "HSDP outer reduce on every microbatch",
           (F + "test_mesh_world2.py", "-k", "test_hsdp_world2")),
    Mutant("hsdp_outer_reduce_never", "HSDP outer reduce never",
           (F + "test_mesh_world2.py", "-k", "test_hsdp_world2"),
           numerics="HSDP, every step"),
    Mutant("accumulation_syncs_every_microbatch", "grad accumulation ignores no-sync microbatches",
           (F + "test_engine_features.py", "-k", "test_accumulation_grads_absent_until_sync")),
    Mutant("decoupled_grad_none_on_empty_shards", "decoupled_grad None on empty shards",
           (F + "test_decoupled_grad.py", "-k", "test_decoupled_grads_present_after_sync and ws2")),
    Mutant("optimizer_reads_grad_not_decoupled_grad", "optimizer reads .grad while the buffer writes decoupled_grad",
           (F + "test_decoupled_grad.py", "-k", "test_losses_match_reference and ws2"),
           numerics="decoupled grads: every step is a no-op"),
    Mutant("clip_grad_norm_local_only", "grad clipping by the local instead of the global norm",
           (F + "test_decoupled_grad.py", "-k", "test_clip_norm_matches_reference and ws2"),
           numerics="whenever grads are clipped at world > 1"),
    Mutant("meta_init_same_rng_per_shard", "meta init with the same RNG on every rank",
           (F + "test_engine_features.py", "-k", "test_meta_init_equals_eager_init"),
           numerics="meta-device init"),
    Mutant("meta_init_rng_not_synchronised", "meta init with a different RNG state per rank",
           (F + "test_engine_features.py", "-k", "test_meta_init_equals_eager_init"),
           numerics="meta-device init"),
    Mutant("zero_grad_drops_grad_views", "zero_grad(set_to_none=True) semantics drop captured grad views",
           (F + "test_engine_features.py", "-k", "test_zero_grad_keep_views"),
           numerics="CUDA-graph replay (eager numbers unchanged)", numerics_gpu_only=True),
    Mutant("graph_mode_zero_grad_set_to_none_allowed", "zero_grad(set_to_none=True) allowed in CUDA-graph mode",
           ("tests/unit/fsdp/test_graph_mode_cpu.py", "-k", "test_zero_grad_set_to_none_is_refused")),
    Mutant("fp8_amax_not_reduced", "FP8 scales from each rank's local amax",
           (F + "test_fp8.py", "-k", "test_training_matches_reference and delayed-fsdp2-eager"),
           numerics="FP8 parameters at world > 1"),
    Mutant("fp8_held_unit_kept_into_the_next_forward", "a unit held through a backward that never ran keeps "
           "stale compute params into the next forward",
           (F + "test_fp8.py", "-k", "test_one_rank_fp8_units_hold_their_params_through_backward"),
           numerics="one rank, FP8 params with kept transposes, after a forward whose backward never ran"),
    Mutant("fp8_stale_transpose_kept", "a TE FP8 weight keeps the transpose of its previous bytes",
           (F + "test_fp8_te_host_work.py", "-k", "test_transposes_of_old_bytes_are_rebuilt"),
           numerics="TE FP8 parameters with kept transposes, after a forward whose backward never ran",
           numerics_gpu_only=True),
    Mutant("optimizer_step_not_noted", "fused optimizer step leaves ZeRO-1/2 compute weights stale",
           (F + "test_engine_features.py", "-k", "test_fused_optimizer_step_reaches_the_next_forward"),
           numerics="every step with a fused optimizer (ZeRO-1/2)"),
    Mutant("local_step_partial_grad_stepped_locally", "optimizer stepped on a Partial grad's local summand",
           (F + "test_engine_features.py", "-k", "test_local_step_takes_a_partial_grad_as_its_sum")),
    Mutant("local_step_state_left_local", "optimizer state left as local tensors after a local-shard step",
           (F + "test_engine_features.py", "-k", "test_optimizer_steps_on_local_shards_bit_identical")),
    Mutant("nccl_ub_registration_order_per_rank", "NCCL user buffers registered in a rank-dependent group order",
           (F + "test_nccl_ub.py", "-k", "test_nccl_ub_hsdp_registers_every_group_in_one_order")),
    Mutant("recompute_pre_backward_keeps_sharded_params", "recompute inside a unit reads its sharded params",
           (F + "test_activation_recompute.py", "-k", "test_recompute_is_bit_identical_world2 and z3-resize")),
    Mutant("recompute_runs_as_a_forward", "recompute reshards the unit before its backward reads it",
           (F + "test_activation_recompute.py", "-k", "test_recompute_gathers_nothing_extra and wrapper")),
    Mutant("recompute_unit_gathered_twice", "a unit gathered for its recompute and again for its backward",
           (F + "test_activation_recompute.py", "-k", "test_recompute_gathers_nothing_extra and region")),
    Mutant("offload_step_skips_a_d2h", "the streamed offload step loses one chunk's update on the host",
           (F + "test_offload.py", "-k", "test_offload_matches_no_offload and gpu-zero3"),
           numerics="OffloadPolicy(step='gpu'), every step"),
    Mutant("offload_overlap_steps_on_stale_grads",
           "an overlapped offload step (or its clip norm) reads a unit's host grads before its reduced grads land",
           (F + "test_offload_overlap.py", "-k", "test_overlapped_step_equals_the_step_after and cpu-zero3"),
           numerics="OffloadPolicy(overlap_step=True or 'clip'), every step"),
    Mutant("harness_rank0_outcome_only", "the harness aggregates only rank 0's outcome",
           ("tests/unit/reports/test_signoff_harness_contract.py",)),
)
BY_NAME = {m.name: m for m in MUTANTS}
