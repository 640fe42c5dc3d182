"""``FSDPConfig``: every switch of one ``fully_shard_model`` call, checked once and passed down.

``fully_shard_model`` builds it by keyword from its arguments; nothing below the API reads those
arguments any other way (the PyTorch FSDP2 policies and Megatron-FSDP's
``DistributedDataParallelConfig`` play the same part). What each Megatron-FSDP switch becomes:

* ``overlap_grad_reduce`` / ``overlap_param_gather``: collectives on side streams (CUDA), or on
  the compute stream, in order with the compute, when off; ``overlap_param_gather=False`` also
  stops ZeRO-3 from prefetching the next unit's all-gather.
* ``average_in_collective`` / ``calculate_per_token_loss``: ``grad_reduce.GradScaling``.
* ``fsdp_double_buffer`` / ``maxpool_double_buffer``: ZeRO-3 units gather into a fixed pool
  sized for the largest unit instead of allocating per unit (``unshard_storage``). The pool fits
  every unit, so ``fsdp_db_use_persist_buf_on_alloc_fail`` (Megatron's fallback for a unit that
  does not fit) never has anything to do. With ZeRO-0/1/2 the compute params persist already.
* ``disable_bucketing``: the params outside every unit form one bucket (the root unit) either
  way, which is what Megatron-FSDP's ``fully_shard`` does for both values.
* ``preproc_state_dict_for_dcp_ckpt``: the model's state dict is DCP-ready as it is (uneven
  shards are ordinary ``Shard(0)`` DTensors); for the optimizer see ``dcp_optim_state``.
* ``enable_fine_grained_param_gather``: Megatron-FSDP 0.6.1's per-submodule unshard hooks. Every
  submodule of a unit that holds params gets a pre-forward hook that unshards what its own params
  need (here: its unit, the gather bucket, as Megatron-FSDP's buckets are per unit and dtype), so
  a ZeRO-3 unit is gathered when its first submodule with params runs rather than when the unit
  is entered, and a submodule recomputed on its own inside the backward finds its params.
* ``nccl_ub``: the engine's communication buffers come from an NCCL memory pool registered with
  its process groups (``nccl_ub.py``); implies ``fsdp_double_buffer`` as in Megatron-FSDP 0.6.1.
  ``disable_symmetric_registration`` turns the symmetric (window) registration into a local one.
* ``offload_policy`` (keyword-only, after Megatron-FSDP's arguments): CPU offload
  (``fsdp_impl.offload.OffloadPolicy``); ``None`` keeps everything on the device.
* ``init_model_with_meta_device``, ``sync_model_each_microbatch``, ``report_nan_in_param_grad``,
  ``keep_fp8_transpose_cache``, ``use_decoupled_grad``, ``cuda_graph_mode``: as Megatron-FSDP
  documents them (``fsdp_impl/README.md``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from .offload.host import OffloadPolicy, checked_policy
from .policy import MixedPrecisionPolicy, ShardingStrategy, check_bool
from .unshard_storage import UnshardStorage


@dataclass(frozen=True)
class FSDPConfig:
    """The resolved configuration of one wrapped model (``fully_shard_model``'s switches, in its
    order; strategies parsed, the unshard storage resolved). Every bool is checked to be one."""

    strategy: ShardingStrategy
    outer_strategy: ShardingStrategy
    mixed_precision_policy: MixedPrecisionPolicy
    init_model_with_meta_device: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    sync_model_each_microbatch: bool = True
    preproc_state_dict_for_dcp_ckpt: bool = True
    report_nan_in_param_grad: bool = False
    average_in_collective: bool = False
    disable_bucketing: bool = False
    calculate_per_token_loss: bool = False
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    disable_symmetric_registration: bool = False
    enable_fine_grained_param_gather: bool = False
    use_decoupled_grad: bool = False
    cuda_graph_mode: bool = False
    maxpool_double_buffer: bool = False
    offload_policy: OffloadPolicy | None = None  # keyword-only extension (fsdp_impl.offload)
    # Where ZeRO-3 compute params live while unsharded: derived from the double-buffer switches;
    # ``with_unshard`` puts the resolved kind (graph mode, the mesh's device) in its place.
    unshard: UnshardStorage = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mixed_precision_policy, MixedPrecisionPolicy):
            raise TypeError(f"mixed_precision_policy must be a fsdp_impl.MixedPrecisionPolicy, "
                            f"got {self.mixed_precision_policy!r}")
        checked_policy(self.offload_policy)
        for name in BOOL_SWITCHES:
            check_bool(name, getattr(self, name))
        if self.nccl_ub and self.offload_policy is not None:
            raise ValueError("nccl_ub=True cannot be combined with offload_policy: NCCL registers device memory, "
                             "and offloaded shards live in host memory; pass one of them")
        object.__setattr__(self, "unshard", UnshardStorage.from_megatron_args(
            self.fsdp_double_buffer or self.nccl_ub, self.maxpool_double_buffer))

    def with_unshard(self, unshard: UnshardStorage) -> FSDPConfig:
        """The same configuration with the unshard storage resolved (never AUTO)."""
        resolved = dataclasses.replace(self)
        object.__setattr__(resolved, "unshard", unshard)
        return resolved

    def switches(self) -> dict[str, bool]:
        """Every boolean switch by name (what ranks must agree on, besides the rest)."""
        return {name: getattr(self, name) for name in BOOL_SWITCHES}


BOOL_SWITCHES = tuple(f.name for f in fields(FSDPConfig)
                      if f.name not in ("strategy", "outer_strategy", "mixed_precision_policy", "unshard",
                                        "offload_policy"))
# The fields ``fully_shard_model`` passes by the name of its own argument (the strategies are parsed).
CONFIG_ARGUMENTS = tuple(f.name for f in fields(FSDPConfig)
                         if f.init and f.name not in ("strategy", "outer_strategy"))
