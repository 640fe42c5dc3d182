"""TransformerEngine FP8 parameters under the FSDP engine (import-guarded: nothing here imports
TransformerEngine unless the model already did, i.e. holds TE modules).

A TE module built under ``te.quantized_model_init(recipe)`` holds its weights as quantized
tensors (``Float8Tensor`` for delayed/current scaling, ``Float8BlockwiseQTensor`` for block
scaling, ``MXFP8Tensor`` for MXFP8) with the bf16 init values on the side when
``preserve_high_precision_init_val=True``. The engine keeps the fp32 main shard itself (taken
from those init values), and each such tensor stays the module's compute parameter: its byte
planes (``_data``, or ``_rowwise_data`` [+ ``_columnwise_data`` for MXFP8], each ``(rows,
cols)`` uint8) are the storage the unit's FP8 gather fills and frees. Scales are written on every
rank by the sharded quantisation (partial amaxes, one MAX all-reduce over the shard group, local
casts into this rank's byte rows: ``TeQuantize``), so they never travel in the gather.
"""
from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .. import comm

if TYPE_CHECKING:  # param.py imports this module
    from ..param import ManagedParam

# class name -> (byte-plane attributes, index of the plane that is the backward's transposed
# form, or None when the transpose is derived from the row-wise bytes after a gather)
_PLANES: dict[str, tuple[tuple[str, ...], int | None]] = {
    "Float8Tensor": (("_data",), None),
    "Float8BlockwiseQTensor": (("_rowwise_data",), None),
    "MXFP8Tensor": (("_rowwise_data", "_columnwise_data"), 1),
}


def _quantized_tensor_class() -> type | None:
    """TE's ``QuantizedTensor`` if TE is already imported (a model with TE modules imported it)."""
    module = sys.modules.get("transformer_engine.pytorch.quantized_tensor")
    return getattr(module, "QuantizedTensor", None) if module is not None else None


def is_te_quantized(tensor: Any) -> bool:
    """True for a TE quantized tensor (an FP8 parameter of a TE module)."""
    cls = _quantized_tensor_class()
    return cls is not None and isinstance(tensor, cls)


def module_has_te_fp8_params(module: torch.nn.Module) -> bool:
    """True when a TE module was built under ``quantized_model_init`` (its weights are, or on the
    meta device will become, quantized tensors)."""
    return any(getattr(m, "primary_weights_in_fp8", False) for m in module.modules()) or any(
        is_te_quantized(p) for p in module.parameters())


def high_precision_value(param: torch.Tensor, fqn: str) -> torch.Tensor:
    """The value the fp32 main copy starts from: TE's preserved bf16 init value (on the param's
    device), else the dequantised FP8 value with a warning (its values are already rounded)."""
    getter = getattr(param, "get_high_precision_init_val", None)
    value = getter() if callable(getter) else None
    if value is None:
        warnings.warn(f"FP8 parameter {fqn!r} has no high-precision init value, so its fp32 main copy "
                      "starts from the dequantised FP8 weight; build TE modules under "
                      "te.quantized_model_init(..., preserve_high_precision_init_val=True)", stacklevel=3)
        return param.dequantize().detach()
    return value.to(param.device)


def planes_of(tensor: Any, fqn: str) -> tuple[tuple[str, ...], int | None]:
    """Byte-plane attributes of a TE quantized tensor; clear error for formats not supported."""
    name = type(tensor).__name__
    if name not in _PLANES:
        raise NotImplementedError(
            f"FP8 parameter {fqn!r} is a TransformerEngine {name}; fully_shard gathers FP8 parameters "
            f"of {', '.join(sorted(_PLANES))} only (NVFP4 parameters are not supported); build the "
            "module without quantized_model_init to keep bf16 parameters with FP8 compute")
    return _PLANES[name]


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory, keeping the tensor object (and its shape) for a later refill."""
    t.untyped_storage().resize_(0)


class TeFp8Param:
    """A TE quantized weight as one FP8 parameter of a unit (``fsdp_impl.fp8.params.Fp8Param``)."""

    kind = "te"

    def __init__(self, managed: ManagedParam, index: int) -> None:
        tensor: Any = managed.unsharded  # a TE QuantizedTensor (nn.Parameter)
        fields, transpose_plane = planes_of(tensor, managed.fqn)
        if len(managed.layout_shape) != 2:
            raise ValueError(f"FP8 parameter {managed.fqn!r} has shape {managed.layout_shape}; "
                             "fully_shard gathers 2-D FP8 weights only")
        self.managed, self.index, self.tensor = managed, index, tensor
        self.shape = (managed.layout_shape[0], managed.layout_shape[1])
        self.fields, self.transpose_plane = fields, transpose_plane
        self.storage: list[torch.Tensor] = []
        self.aliased = False  # the planes are views of the unit's FP8 segment (``alias``)
        for field in fields:
            data = getattr(tensor, field)
            if data is None or tuple(data.shape) != self.shape or data.dtype != torch.uint8:
                raise ValueError(f"FP8 parameter {managed.fqn!r}: {type(tensor).__name__}.{field} is "
                                 f"{None if data is None else (tuple(data.shape), data.dtype)}, expected "
                                 f"{self.shape} uint8 bytes")
            self.storage.append(data)
        # Row-wise scale inverses of block-scaled tensors: TE's ``update_usage`` drops them with the
        # row-wise bytes (keeping only the column-wise form for a backward); the next sharded
        # quantisation writes into them in place, so they are put back with the bytes.
        self.scale_invs = {name: value for name in ("_rowwise_scale_inv",)
                           if (value := getattr(tensor, name, None)) is not None and "_data" not in fields}
        clear = getattr(tensor, "clear_high_precision_init_val", None)
        if callable(clear):
            clear()  # the main copy holds it now

    def planes(self) -> list[torch.Tensor]:
        return self.storage

    def alias(self, planes: list[torch.Tensor]) -> None:
        """The byte planes become ``planes`` for good (``UnitFp8`` with one shard); the module's
        own bytes are freed, as a reshard freed them before (the requantisation writes the views
        before any forward; dropping the reference alone left 1.1 GiB of a 1.3B model alive)."""
        for old in self.storage:
            free_storage(old)
        self.storage, self.aliased = list(planes), True
        self.attach()

    def attach(self) -> None:
        """Point the tensor's byte planes at the engine's storage (freed or not)."""
        for field, data in zip(self.fields, self.storage, strict=True):
            setattr(self.tensor, field, data)
        for name, value in self.scale_invs.items():
            if getattr(self.tensor, name, None) is None:
                setattr(self.tensor, name, value)

    def filled(self, keep_transpose: bool) -> None:
        """New bytes landed: drop stale transposes; with ``keep_transpose`` build them now (what
        TE's ``post_all_gather_processing`` does: the transpose Hopper's GEMMs need)."""
        fill_te([self], keep_transpose)

    def release(self, keep_transpose: bool) -> None:
        """Free the gathered bytes (aliased planes stay: they are the persistent FP8 shard) and,
        without ``keep_transpose``, the transposes ``filled`` built."""
        for plane, (field, data) in enumerate(zip(self.fields, self.storage, strict=True)):
            if self.aliased or (keep_transpose and plane == self.transpose_plane):
                continue
            free_storage(data)
            setattr(self.tensor, field, None)
        if not keep_transpose:
            _invalidate_transpose(self.tensor)

    def has_rowwise(self) -> bool:
        """Whether the bytes the forward GEMM reads are in place (``release`` with
        ``keep_transpose`` keeps only the column-wise plane, for the backward)."""
        return all(getattr(self.tensor, field) is not None
                   for plane, field in enumerate(self.fields) if plane != self.transpose_plane)

    def has_transpose(self) -> bool:
        if self.transpose_plane is not None:
            data = self.storage[self.transpose_plane]
            return getattr(self.tensor, self.fields[self.transpose_plane]) is data and \
                data.untyped_storage().size() > 0
        if hasattr(self.tensor, "_transpose_invalid"):
            return self.tensor._transpose is not None and not self.tensor._transpose_invalid
        return getattr(self.tensor, "_columnwise_data", None) is not None


def _invalidate_transpose(tensor: Any) -> None:
    if hasattr(tensor, "_transpose_invalid"):  # Float8Tensor
        tensor._transpose = None
        tensor._transpose_invalid = True
    elif type(tensor).__name__ == "Float8BlockwiseQTensor":
        tensor._columnwise_data = None


def fill_te(params: list[TeFp8Param], keep_transpose: bool) -> None:
    """New bytes landed in ``params`` (one unit's TE weights): point each tensor at them and drop
    its stale transposes; with ``keep_transpose`` build them now with one call of TE's
    ``post_all_gather_processing`` for the whole list (it takes a list: per ``Float8Tensor``
    ``_create_transpose``, i.e. one ``tex.fp8_transpose``, where the GEMMs need the transposed
    bytes (Hopper), ``_create_columnwise`` for block scaling, nothing for MXFP8)."""
    for p in params:
        p.attach()
        _invalidate_transpose(p.tensor)
    if keep_transpose and params:
        from transformer_engine.pytorch.tensor.utils import post_all_gather_processing
        post_all_gather_processing([p.tensor for p in params])


class TeQuantize:
    """The sharded quantisation of a fixed list of TE weights, built once and run every step:
    every rank casts its main rows (as the compute dtype, as TE does) into its byte rows; per
    recipe one MAX all-reduce of the amaxes; empty shards still join the reduction.
    Current-scaling weights take ``CurrentScalingCast``, delayed-scaling ones
    ``DelayedScalingCast`` (TE's scale kernels and casts, batched host work, row-wise only); the
    other recipes TE's ``quantize_master_weights``.

    Built again when a weight's quantizer, its scale or amax, or its scale-inverse tensor was
    replaced since (TE rebinding them would otherwise leave the cached state writing into the
    old tensors)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self._build()

    def _build(self) -> None:
        for item in self.items:
            item.param.attach()
        self._bound = [_binding(item.param.tensor) for item in self.items]
        current = [it for it in self.items if _recipe_of(it.param.tensor) == "current"]
        delayed = [it for it in self.items if _recipe_of(it.param.tensor) == "delayed"]
        self.others = [it for it in self.items if _recipe_of(it.param.tensor) is None]
        self.casts: list[Any] = ([CurrentScalingCast(current)] if current else []) + (
            [DelayedScalingCast(delayed)] if delayed else [])
        if self.others:
            self.other_args = (
                [it.param.tensor for it in self.others],
                [it.shard.reshape(-1) if it.shard.numel() else None for it in self.others],
                [it.row_start * it.param.shape[1] for it in self.others],
                [it.out[0].reshape(-1) if len(it.out) == 1 else tuple(o.reshape(-1) for o in it.out)
                 for it in self.others])

    def __call__(self, group: torch.distributed.ProcessGroup) -> None:
        for item in self.items:
            item.param.attach()
        if not all(_bound_to(it.param.tensor, b) for it, b in zip(self.items, self._bound, strict=True)):
            self._build()
        for cast in self.casts:
            cast(group)
        if self.others:
            from transformer_engine.pytorch.tensor.utils import quantize_master_weights
            weights, masters, offsets, shards = self.other_args
            quantize_master_weights(weights, masters, offsets, group, fsdp_shard_model_weights=shards,
                                    manual_post_all_gather_processing=True)


def _binding(tensor: Any) -> tuple[Any, ...]:
    """What the cached quantisation state holds on to: the quantizer, its scale and amax, and the
    scale inverse."""
    quantizer = getattr(tensor, "_quantizer", None)
    return (quantizer, getattr(quantizer, "scale", None), getattr(quantizer, "amax", None),
            getattr(tensor, "_scale_inv", None))


def _bound_to(tensor: Any, binding: tuple[Any, ...]) -> bool:
    return all(a is b for a, b in zip(_binding(tensor), binding, strict=True))


def _recipe_of(tensor: Any) -> str | None:
    """``"current"`` / ``"delayed"`` for a plain ``Float8Tensor`` whose quantizer is
    ``Float8CurrentScalingQuantizer`` / ``Float8Quantizer``; ``None`` for the other formats."""
    if type(tensor).__name__ != "Float8Tensor":
        return None
    quantizer = getattr(tensor, "_get_quantizer", lambda: None)()
    return {"Float8CurrentScalingQuantizer": "current", "Float8Quantizer": "delayed"}.get(type(quantizer).__name__)


class _ComputeCasts:
    """The non-empty main shards cast to their weight's dtype (TE: ``master.to(model_weight.dtype)``
    before quantising): one ``torch._foreach_copy_`` per dtype into a scratch buffer whose storage
    lives only between ``fill`` and ``free``; ``views`` are the casts in ``nonempty`` order."""

    def __init__(self, items: list[Any], dtypes: list[torch.dtype], nonempty: list[int]) -> None:
        self.scratch: list[torch.Tensor] = []
        self.copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in nonempty:
            by_dtype.setdefault(dtypes[i], []).append(i)
        view_of: dict[int, torch.Tensor] = {}
        for dtype, members in by_dtype.items():
            sizes = [items[i].shard.numel() for i in members]
            scratch = torch.empty(sum(sizes), dtype=dtype, device=items[members[0]].shard.device)
            views = list(scratch.split(sizes))
            self.scratch.append(scratch)
            self.copies.append((views, [items[i].shard.reshape(-1) for i in members]))
            view_of.update(zip(members, views, strict=True))
        self.views = [view_of[i] for i in nonempty]
        self.free()

    def fill(self) -> None:
        for scratch in self.scratch:
            scratch.untyped_storage().resize_(scratch.numel() * scratch.element_size())
        for dsts, srcs in self.copies:
            torch._foreach_copy_(dsts, srcs)

    def free(self) -> None:
        for scratch in self.scratch:
            free_storage(scratch)


def _row_casts(items: list[Any], weights: list[Any], nonempty: list[int], views: list[torch.Tensor],
               quantizers: list[Any]) -> list[tuple[torch.Tensor, Any, Any]]:
    """Per non-empty shard: (its cast as one row, a row-wise-only ``Float8Quantizer``, a
    ``Float8Tensor`` around this rank's rows of the unit's persistent FP8 gather segment), the
    arguments of one ``tex.quantize`` (what ``Float8Quantizer.update_quantized`` calls)."""
    return [(view.view(1, -1), q, q.create_tensor_from_data(items[i].out[0].view(1, -1), weights[i].dtype))
            for i, view, q in zip(nonempty, views, quantizers, strict=True)]


class CurrentScalingCast:
    """TE's current-scaling master-weight cast (``quantize_master_weights`` for
    ``Float8CurrentScalingQuantizer``, TE 2.20.2 ``tensor/utils.py``) step for step, with the
    per-weight Python done once at construction:

    1. cast each main shard to the weight's dtype (``_ComputeCasts``);
    2. amaxes of those casts: one ``torch._foreach_norm(ord=inf)`` (the max magnitude, exact in
       any order, as TE's ``compute_amax`` per weight), stacked into a persistent buffer
       (empty shards stay 0, as TE leaves them);
    3. one MAX all-reduce of that buffer over the shard group;
    4. ``multi_tensor_compute_scale_and_scale_inv`` into persistent scales and each weight's
       ``_scale_inv`` (the argument lists are built once; the op is called as
       ``multi_tensor_applier`` calls it);
    5. per non-empty shard ``tex.quantize`` with a ``Float8Quantizer`` built once around that
       weight's persistent scale, row-wise only, ``amax=torch.Tensor()`` as TE passes (``_row_casts``).

    TE's own cast uses column-wise usage too, which also transposes every shard: on the H200
    that cast took 1.2-1.7 ms per 16.8M-element weight, the row-wise one 15 us. Same bytes: the
    tests compare the gathered bytes with TE's own full-tensor quantisation. Per step the host
    runs a fixed number of batched calls plus one ``tex.quantize`` per weight, and nothing
    waits for the device. One difference from ``compute_amax``: a NaN in a main shard makes the
    amax NaN here (torch's max propagates it), where TE's kernel skips it."""

    def __init__(self, items: list[Any]) -> None:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        weights = [item.param.tensor for item in items]
        quantizers = [w._get_quantizer() for w in weights]
        first = quantizers[0]
        for q in quantizers:
            if (q.dtype, q.force_pow_2_scales, q.amax_epsilon) != (first.dtype, first.force_pow_2_scales,
                                                                   first.amax_epsilon):
                raise ValueError("FP8 current-scaling weights of one model must share fp8 dtype, "
                                 "force_pow_2_scales and amax_epsilon (one recipe)")
        from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier

        self.tex = tex
        # called directly with the applier's chunk size: ``MultiTensorApply.__call__`` only drops
        # DTensor wrappers and empty slots (none here) and rebuilds the lists in Python each call
        self.chunk_size = multi_tensor_applier.chunk_size
        self.max_fp8 = {tex.DType.kFloat8E4M3: 448.0, tex.DType.kFloat8E5M2: 57344.0}[first.dtype]
        self.pow2, self.epsilon = first.force_pow_2_scales, first.amax_epsilon
        device = items[0].shard.device
        n = len(items)
        self.packed = torch.zeros(n, dtype=torch.float32, device=device)
        scales = torch.empty(n, dtype=torch.float32, device=device)
        self.noop = torch.zeros(1, dtype=torch.int, device=device)
        self.lists = [[self.packed[i:i + 1] for i in range(n)], [scales[i:i + 1] for i in range(n)],
                      [w._scale_inv.view(1) for w in weights]]
        nonempty = [i for i, item in enumerate(items) if item.shard.numel()]
        self.all_nonempty = len(nonempty) == n
        self.amax_slots = [self.packed[i] for i in nonempty]  # 0-dim, as the norms
        self.cast = _ComputeCasts(items, [w.dtype for w in weights], nonempty)
        self.views = self.cast.views
        row_quantizers = [Float8Quantizer(scale=scales[i:i + 1], amax=torch.Tensor(), fp8_dtype=first.dtype,
                                          rowwise=True, columnwise=False) for i in nonempty]
        self.casts = _row_casts(items, weights, nonempty, self.views, row_quantizers)

    def __call__(self, group: torch.distributed.ProcessGroup) -> None:
        self.cast.fill()
        if self.views:
            amaxes = torch._foreach_norm(self.views, ord=float("inf"), dtype=torch.float32)
            if self.all_nonempty:
                torch.stack(amaxes, out=self.packed)
            else:
                self.packed.zero_()
                torch._foreach_copy_(self.amax_slots, amaxes)
        else:
            self.packed.zero_()
        comm.all_reduce_max(self.packed, group)  # one rank: nothing to reduce, no launch
        self.tex.multi_tensor_compute_scale_and_scale_inv(self.chunk_size, self.noop, self.lists, self.max_fp8,
                                                          self.pow2, self.epsilon)
        quantize = self.tex.quantize
        for src, cast, rows in self.casts:
            quantize(src, cast, rows, None)
        self.cast.free()


class DelayedScalingCast:
    """TE's delayed-scaling master-weight cast (``_cast_master_weights_to_fp8_delayed_scaling``,
    TE 2.20.2 ``tensor/utils.py``) step for step, the per-weight Python done once:

    1. cast each main shard to the weight's dtype (``_ComputeCasts``);
    2. per non-empty shard ``tex.quantize`` with a row-wise-only ``Float8Quantizer`` around the
       weight quantizer's own ``scale`` and ``amax`` (the scale is known before the cast; the
       kernel folds the shard's amax into the quantizer's amax, as TE's cast does);
    3. the amaxes packed (``_foreach_copy_``: TE's ``multi_tensor_scale`` by 1.0 is a copy), one
       MAX all-reduce over the shard group, copied back;
    4. the scales packed, ``torch.reciprocal`` in place, copied into each weight's ``_scale_inv``.

    TE casts with the weight's quantizer, row-wise and column-wise, which also transposes each
    shard (the slow cast ``CurrentScalingCast`` avoids too); the transposes are dropped anyway,
    ``fill_te`` builds them after the gather. Same bytes, amaxes and scale inverses as TE's:
    ``tests/functional/test_fp8_te_cast.py``."""

    def __init__(self, items: list[Any]) -> None:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        self.tex = tex
        weights = [item.param.tensor for item in items]
        quantizers = [w._get_quantizer() for w in weights]
        device = items[0].shard.device
        n = len(items)
        self.amaxes = [q.amax.view(1) for q in quantizers]
        self.scales = [q.scale.view(1) for q in quantizers]
        self.scale_invs = [w._scale_inv.view(1) for w in weights]
        self.packed_amax = torch.empty(n, dtype=torch.float32, device=device)
        self.packed_scale = torch.empty(n, dtype=torch.float32, device=device)
        self.amax_views = [self.packed_amax[i:i + 1] for i in range(n)]
        self.scale_views = [self.packed_scale[i:i + 1] for i in range(n)]
        nonempty = [i for i, item in enumerate(items) if item.shard.numel()]
        self.cast = _ComputeCasts(items, [w.dtype for w in weights], nonempty)
        row_quantizers = [Float8Quantizer(scale=quantizers[i].scale, amax=quantizers[i].amax,
                                          fp8_dtype=quantizers[i].dtype, rowwise=True, columnwise=False)
                          for i in nonempty]
        self.casts = _row_casts(items, weights, nonempty, self.cast.views, row_quantizers)

    def __call__(self, group: torch.distributed.ProcessGroup) -> None:
        self.cast.fill()
        quantize = self.tex.quantize
        for src, cast, rows in self.casts:
            quantize(src, cast, rows, None)
        self.cast.free()
        torch._foreach_copy_(self.amax_views, self.amaxes)
        comm.all_reduce_max(self.packed_amax, group)
        torch._foreach_copy_(self.amaxes, self.amax_views)
        torch._foreach_copy_(self.scale_views, self.scales)
        torch.reciprocal(self.packed_scale, out=self.packed_scale)
        torch._foreach_copy_(self.scale_invs, self.scale_views)


def _quantize_current(items: list[Any], group: torch.distributed.ProcessGroup) -> None:
    """``CurrentScalingCast`` once (what ``tests/functional/test_fp8_te_cast.py`` compares with TE)."""
    CurrentScalingCast(items)(group)


def _quantize_delayed(items: list[Any], group: torch.distributed.ProcessGroup) -> None:
    """``DelayedScalingCast`` once (what ``tests/functional/test_fp8_te_cast.py`` compares with TE)."""
    DelayedScalingCast(items)(group)


def reset_te_fp8_state() -> None:
    """Reset TransformerEngine's process-global FP8 state (a no-op until TE is imported).

    TE registers every delayed-scaling module's amax buffers there and, at each FP8 autocast exit
    and first-module backward, all-reduces all of them (world size > 1), also those of models
    built earlier in the process: a later model then pays extra all-reduces and keeps the old
    buffers alive (TE 2.20.2, ``quantization.py``). Processes that build many TE models one after
    another (test buckets, benchmarks) call it between them, when no TE model is in use."""
    module = (sys.modules.get("transformer_engine.pytorch.quantization")
              or sys.modules.get("transformer_engine.pytorch.fp8"))
    manager = getattr(module, "FP8GlobalStateManager", None)
    if manager is not None:
        manager.reset()
