"""Optimizer state dicts that ``torch.distributed.checkpoint.load`` can load into.

``dcp.load`` only fills the entries the target state dict already has, and torch optimizers
create their state lazily in the first ``step()``, so the usual resume script::

    sd = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.distributed.checkpoint.load(sd, checkpoint_id=path)
    optimizer.load_state_dict(sd["optimizer"])

would load no optimizer state into a never-stepped optimizer, silently. Megatron-FSDP avoids
that by stepping the optimizer once with zero grads at wrap time, which also advances Adam's step
count and applies weight decay once. Here instead ``optimizer.state_dict()`` (with
``fully_shard_optimizer(..., preproc_state_dict_for_dcp_ckpt=True)``, the default) lists, for
every trainable param that has no state yet, placeholder entries shaped like the state the
optimizer's first step would create: zeros laid out like the param (DTensor, same placements)
for param-shaped entries, zeros for the others (Adam's ``step`` is then 0). The optimizer itself
is not changed. Which entries exist is learned once from a throw-away optimizer of the same class
and defaults, stepped on a small dummy param.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from .placement import local_tensor

_DUMMY_SHAPE = (2, 3)


def user_optimizer_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The user's optimizer class: ``fully_shard`` swaps in a one-off subclass ``FSDP<Name>``
    (bases: a mixin and the user's class), which this looks through."""
    cls = type(optimizer)
    while len(cls.__bases__) > 1 and cls.__name__ == f"FSDP{cls.__bases__[-1].__name__}":
        cls = cls.__bases__[-1]
    return cls


def _constructor_kwargs(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` minus what ``cls.__init__`` does not accept (e.g. AdamW records
    ``decoupled_weight_decay`` in its defaults but does not take it)."""
    params = inspect.signature(cls).parameters  # the constructor's, without self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _template(optimizer: torch.optim.Optimizer, like: torch.Tensor) -> dict[str, Any]:
    """The state one step of a fresh optimizer of this class creates for a ``_DUMMY_SHAPE``
    param of ``like``'s dtype and device (``{}`` for stateless optimizers or when the class
    cannot be rebuilt from its defaults)."""
    local = local_tensor(like)
    dummy = torch.zeros(_DUMMY_SHAPE, dtype=local.dtype, device=local.device, requires_grad=True)
    cls = user_optimizer_class(optimizer)
    dummy.grad = torch.zeros_like(dummy)
    dummy.decoupled_grad = dummy.grad  # type: ignore[attr-defined]  # decoupled-grad optimizers read this
    try:
        scratch = cls([dummy], **_constructor_kwargs(cls, optimizer.defaults))
        scratch.step()
    except (TypeError, ValueError, RuntimeError) as err:
        warnings.warn(f"{cls.__name__}.state_dict() lists no state for params that have not been stepped: "
                      f"the state a first step creates could not be learned from a {cls.__name__} rebuilt "
                      f"from its defaults ({err}); torch.distributed.checkpoint.load will load no optimizer "
                      "state into them (fsdp_impl.checkpoint.load does)", stacklevel=3)
        return {}
    return dict(scratch.state.get(dummy, {}))


def _placeholder(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if tuple(value.shape) == _DUMMY_SHAPE:
        return torch.zeros_like(param.detach(), dtype=value.dtype)
    return torch.zeros_like(value)


class PlaceholderStateHook:
    """``optimizer.register_state_dict_post_hook`` target: add placeholder state for trainable
    params without state (param indices as ``Optimizer.state_dict`` numbers them)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[torch.dtype, torch.device], dict[str, Any]] = {}

    def __call__(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        index: dict[int, int] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        missing = [p for group in optimizer.param_groups for p in group["params"]
                   if p.requires_grad and not optimizer.state.get(p)]
        for p in missing:
            local = local_tensor(p)
            key = (local.dtype, local.device)
            if key not in self._cache:
                self._cache[key] = _template(optimizer, p)
            if self._cache[key]:
                state_dict["state"][index[id(p)]] = {k: _placeholder(v, p) for k, v in self._cache[key].items()}
        return state_dict
