"""One managed parameter: where the user's module refers to it and its two FSDP forms.

``sharded`` is the DTensor ``nn.Parameter`` the optimizer and ``model.parameters()`` see (a view
into the unit's weight buffer); ``unsharded`` is the plain full-size compute parameter that is
registered on the module only while a forward runs.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn


class ManagedParam:
    """Static facts about one parameter plus its sharded / unsharded tensors."""

    def __init__(self, fqn: str, orig: nn.Parameter, locations: List[Tuple[nn.Module, str]]) -> None:
        if orig.dim() == 0:
            raise ValueError(f"parameter {fqn!r} is 0-dimensional; fully_shard needs params with at "
                             "least one dim (use shape (1,) instead)")
        self.fqn = fqn
        self.orig = orig  # the object the user's optimizer knows (maybe on meta)
        self.locations = locations  # every (module, attr) that holds it (tied weights: several)
        self.shape = tuple(orig.shape)
        self.dtype = orig.dtype
        self.requires_grad = orig.requires_grad
        self.sharded: Optional[nn.Parameter] = None
        self.unsharded: Optional[nn.Parameter] = None
        self.grad_index: Optional[int] = None  # slot in the unit's grad layout (None: frozen)

    def current(self) -> torch.Tensor:
        """The tensor the module holds right now (used to read full values at wrap time)."""
        module, name = self.locations[0]
        return module._parameters[name]

    def set_on_module(self, tensor: nn.Parameter) -> None:
        """Register ``tensor`` under every name that refers to this parameter (FSDP2-style swap)."""
        for module, name in self.locations:
            module._parameters[name] = tensor
