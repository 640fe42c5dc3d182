"""One managed parameter: where the user's module refers to it and its two FSDP forms.

``sharded`` is the DTensor ``nn.Parameter`` the optimizer and ``model.parameters()`` see (a view
into the unit's weight buffer); ``unsharded`` is the full-size compute parameter that is
registered on the module only while a forward runs: a plain tensor, or for a tensor-parallel
param a TP DTensor whose local tensor is the full TP-local tensor.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .fp8.te import high_precision_value, is_te_quantized
from .placement import TPSpec, local_tensor


class ManagedParam:
    """Static facts about one parameter plus its sharded / unsharded tensors."""

    def __init__(self, fqn: str, orig: nn.Parameter, locations: list[tuple[nn.Module, str]]) -> None:
        if orig.dim() == 0:
            raise ValueError(f"parameter {fqn!r} is 0-dimensional; fully_shard needs params with at "
                             "least one dim (use shape (1,) instead)")
        self.fqn = fqn
        # The user's original param (maybe on meta) is needed only while wrapping; afterwards
        # only its id stays (how an optimizer built on the unwrapped module is remapped), so its
        # storage is not kept alive next to the shards.
        self._orig: nn.Parameter | None = orig
        self.orig_id = id(orig)
        self.locations = locations  # every (module, attr) that holds it (tied weights: several)
        self.shape = tuple(orig.shape)  # global shape (what the sharded DTensor reports)
        self.layout_shape = self.shape  # what the unit shards by rows: the TP-local shape
        self.tp: TPSpec | None = None
        self.dtype = orig.dtype
        self.requires_grad = orig.requires_grad
        self._sharded: nn.Parameter | None = None  # set by the unit at wrap time
        self._unsharded: nn.Parameter | None = None  # set by make_unsharded at wrap time
        self.grad_index: int | None = None  # slot in the unit's grad layout (None: frozen)

    @property
    def orig(self) -> nn.Parameter:
        """The user's original param object; available only until the wrap finishes."""
        if self._orig is None:
            raise RuntimeError(f"parameter {self.fqn!r}: the original (unwrapped) param was released when "
                               "the wrap finished; only its id (orig_id) is kept")
        return self._orig

    def release_orig(self) -> None:
        """Drop the reference to the user's original param (end of the wrap)."""
        self._orig = None

    @property
    def sharded(self) -> nn.Parameter:
        """The DTensor shard (``model.parameters()``); exists once the unit has sharded it."""
        if self._sharded is None:
            raise RuntimeError(f"parameter {self.fqn!r} has no sharded form yet (not sharded by its unit)")
        return self._sharded

    @sharded.setter
    def sharded(self, param: nn.Parameter) -> None:
        self._sharded = param

    @property
    def unsharded(self) -> nn.Parameter:
        """The full-size compute param; exists once ``make_unsharded`` ran."""
        if self._unsharded is None:
            raise RuntimeError(f"parameter {self.fqn!r} has no compute param yet (make_unsharded not run)")
        return self._unsharded

    @property
    def grad_slot(self) -> int:
        """Index of this param in its unit's grad layout (trainable params only)."""
        if self.grad_index is None:
            raise RuntimeError(f"parameter {self.fqn!r} is frozen (requires_grad=False): it has no grad slot")
        return self.grad_index

    def sharded_local(self) -> torch.Tensor:
        """The plain tensor the sharded DTensor wraps (a view into the unit's weight buffer)."""
        return local_tensor(self.sharded)

    def current(self) -> torch.Tensor:
        """The tensor the module holds right now (used to read full values at wrap time)."""
        module, name = self.locations[0]
        value = module._parameters[name]
        if value is None:
            raise RuntimeError(f"parameter {self.fqn!r} was removed from its module ({name!r} is None)")
        return value

    def set_on_module(self, tensor: nn.Parameter) -> None:
        """Register ``tensor`` under every name that refers to this parameter (FSDP2-style swap)."""
        for module, name in self.locations:
            module._parameters[name] = tensor

    def set_tp(self, tp: TPSpec | None) -> None:
        self.tp = tp
        self.layout_shape = tp.local_shape if tp is not None else self.shape

    def local_full(self) -> torch.Tensor:
        """The full tensor this rank lays out: the module's value, TP-local for TP params (a
        meta-init TP param is materialised at its global shape, so it is chunked here)."""
        if is_te_quantized(self.current()):  # a TE FP8 param: main copy from its bf16 init value
            return high_precision_value(self.current(), self.fqn)
        value = self.current().detach()
        if isinstance(value, DTensor):
            return value.to_local()
        return self.tp.local_chunk(value) if self.tp is not None else value

    def make_unsharded(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the compute param (a TP DTensor around a plain local tensor for TP params;
        a TE FP8 param stays its own compute form, filled by the unit's FP8 gathers)."""
        current = self.current()
        if is_te_quantized(current):
            self._unsharded = current if isinstance(current, nn.Parameter) else nn.Parameter(current)
            return
        local = torch.empty(self.layout_shape, dtype=dtype, device=device)
        value = self.tp.to_compute(local) if self.tp is not None else local
        self._unsharded = nn.Parameter(value, requires_grad=self.requires_grad)

    def compute_local(self) -> torch.Tensor:
        """The plain tensor holding the compute values (its storage is what ZeRO-3 frees)."""
        return local_tensor(self.unsharded)

    def take_grad(self) -> torch.Tensor | None:
        """Pop the compute param's fresh grad as a plain TP-local tensor."""
        unsharded = self.unsharded
        grad = unsharded.grad
        unsharded.grad = None
        if grad is not None and self.tp is not None:
            grad = self.tp.local_grad(grad)
        return grad
