"""Where gradients live, and whether model, optimizer and clipping agree on it.

With ``use_decoupled_grad=True`` the FSDP engine stores each synced gradient shard on
``param.decoupled_grad`` (in the main-grads dtype, uncast) and leaves ``param.grad`` as None, so a
precision-aware optimizer can read low-precision gradients without autograd casting them. When
the three parties (model, optimizer, grad clipping) disagree on the attribute:

* grad clipping reads ``decoupled_grad`` while it is None and hands None to a fused kernel
  (segfault);
* the buffer writes ``decoupled_grad`` while the optimizer reads ``.grad`` (None), so every step
  is a silent no-op and training does not converge.

This module is the single place that answers "which attribute holds the gradient" and checks,
at wrap time, that model and optimizer agree.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from .placement import local_tensor

__all__ = [
    "DECOUPLED_GRAD_ATTR",
    "DeclaresDecoupledGrad",
    "check_decoupled_grad_consistency",
    "clear_grad",
    "clear_grads",
    "grad_attr_name",
    "optimizer_reads_decoupled_grad",
    "read_grad",
]

DECOUPLED_GRAD_ATTR = "decoupled_grad"

# Wrappers (e.g. the engine's sharded optimizer) expose the real optimizer as `.optimizer`;
# bound the walk so a self-referencing wrapper cannot loop forever.
_MAX_WRAP_DEPTH = 16


def grad_attr_name(use_decoupled_grad: bool) -> str:
    """Name of the attribute that holds a parameter's gradient under the given setting."""
    return DECOUPLED_GRAD_ATTR if use_decoupled_grad else "grad"


def read_grad(param: torch.Tensor, use_decoupled_grad: bool) -> torch.Tensor | None:
    """The gradient of ``param`` as the given setting defines it (None when absent).

    Only the attribute named by the setting is read: silently falling back to the other one
    would hide exactly the model/optimizer mismatch that this module exists to expose.
    """
    if use_decoupled_grad:
        return getattr(param, DECOUPLED_GRAD_ATTR, None)
    return param.grad


def clear_grad(param: torch.Tensor, use_decoupled_grad: bool, set_to_none: bool) -> None:
    """Reset the decoupled gradient like ``Optimizer.zero_grad`` resets ``.grad``.

    ``.grad`` itself is left to ``torch.optim.Optimizer.zero_grad``; only ``decoupled_grad``
    needs handling here. With ``set_to_none=False`` the tensor is zeroed in place so that
    buffer views (CUDA-graph mode) stay valid.
    """
    if not use_decoupled_grad:
        return
    grad = getattr(param, DECOUPLED_GRAD_ATTR, None)
    if grad is None:
        return
    if set_to_none:
        setattr(param, DECOUPLED_GRAD_ATTR, None)
    else:
        local_tensor(grad).zero_()


def clear_grads(params: Iterable[torch.Tensor], use_decoupled_grad: bool, set_to_none: bool) -> None:
    """``clear_grad`` for each of ``params``."""
    for param in params:
        clear_grad(param, use_decoupled_grad, set_to_none)


@runtime_checkable
class DeclaresDecoupledGrad(Protocol):
    """An optimizer that states which attribute it reads: ``use_decoupled_grad`` True means
    ``param.decoupled_grad``, False ``param.grad`` (``fsdp_impl.optim`` optimizers, TE
    ``FusedAdam``). Declared structurally so this module needs no import of any optimizer."""

    @property
    def use_decoupled_grad(self) -> bool: ...


def _unwrap_optimizer(optimizer: Any) -> Any:
    """Follow ``.optimizer`` attributes to the optimizer that actually reads the gradients."""
    current = optimizer
    for _ in range(_MAX_WRAP_DEPTH):
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            return current
        current = inner
    return current


def _te_fused_adam_type() -> type | None:
    """TransformerEngine's ``FusedAdam`` class, or None when TE is not importable.

    An instance cannot exist unless TE was imported already, so TE is never imported here just
    to answer the question (importing it initialises CUDA).
    """
    if "transformer_engine" not in sys.modules:
        return None
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def optimizer_reads_decoupled_grad(optimizer: Any) -> bool:
    """Whether ``optimizer`` reads ``param.decoupled_grad`` (True) or ``param.grad`` (False).

    * TransformerEngine ``FusedAdam``: its ``use_decoupled_grad`` attribute (truthiness);
    * ``torch.optim`` optimizers: False (they only know ``.grad``);
    * anything else, e.g. ``fsdp_impl.optim`` optimizers: its ``use_decoupled_grad`` attribute
      when that is a bool (``DeclaresDecoupledGrad``), else False.

    Wrapped optimizers are looked through via their ``.optimizer`` attribute.
    """
    if optimizer is None:
        raise TypeError("optimizer must be an optimizer object, got None")
    inner = _unwrap_optimizer(optimizer)
    te_fused_adam = _te_fused_adam_type()
    if te_fused_adam is not None and isinstance(inner, te_fused_adam):
        return bool(getattr(inner, "use_decoupled_grad", False))
    if type(inner).__module__.startswith("torch.optim"):
        return False
    if isinstance(inner, DeclaresDecoupledGrad) and isinstance(inner.use_decoupled_grad, bool):
        return inner.use_decoupled_grad
    return False


def check_decoupled_grad_consistency(model_uses_decoupled: bool, optimizer: Any) -> None:
    """Raise ``ValueError`` at wrap time when model and optimizer disagree on decoupled grads.

    A mismatch either makes every optimizer step a silent no-op (model writes
    ``decoupled_grad``, optimizer reads ``.grad``) or steps on stale/absent values, so it must
    fail loudly before training starts. ``optimizer=None`` (model-only wrap) has nothing to
    check.
    """
    if not isinstance(model_uses_decoupled, bool):
        raise TypeError(
            "model_uses_decoupled must be a bool (True or False), "
            f"got {type(model_uses_decoupled).__name__}: {model_uses_decoupled!r}"
        )
    if optimizer is None:
        return
    optimizer_uses_decoupled = optimizer_reads_decoupled_grad(optimizer)
    if optimizer_uses_decoupled == model_uses_decoupled:
        return
    inner = _unwrap_optimizer(optimizer)
    name = type(inner).__name__
    if inner is not optimizer:
        name = f"{name} (wrapped in {type(optimizer).__name__})"
    model_side = (
        "writes gradients to param.decoupled_grad and leaves param.grad None"
        if model_uses_decoupled
        else "writes gradients to param.grad"
    )
    optim_side = "reads param.decoupled_grad" if optimizer_uses_decoupled else "reads param.grad"
    consequence = (
        "every optimizer step would see no gradients and silently do nothing"
        if model_uses_decoupled
        else "the optimizer would find no decoupled gradients to step on"
    )
    raise ValueError(
        "Inconsistent decoupled gradients setting: the model was wrapped with "
        f"use_decoupled_grad={model_uses_decoupled} (it {model_side}), but the optimizer "
        f"{name} has use_decoupled_grad={optimizer_uses_decoupled} (it {optim_side}); "
        f"{consequence}. Fix: use the same setting for both, e.g. "
        "fully_shard(..., use_decoupled_grad=True) with "
        "fsdp_impl.optim.AdamW(..., use_decoupled_grad=True) (or TransformerEngine "
        "FusedAdam(use_decoupled_grad=True)), or use_decoupled_grad=False for both; "
        "torch.optim optimizers only read param.grad, so they need use_decoupled_grad=False."
    )
