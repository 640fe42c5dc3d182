"""Precision-aware Adam / AdamW that can read FSDP's decoupled gradients.

Differences from ``torch.optim.Adam``/``AdamW`` (whose constructor, numerics with fp32 moments
and ``state_dict`` layout they keep):

* ``use_decoupled_grad=True`` reads ``param.decoupled_grad`` instead of ``param.grad`` (the FSDP
  buffer stores low-precision main grads there, uncast);
* ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` store the moments in e.g. bf16 while the update math
  runs in fp32;
* DTensor parameters are updated through their local shards (also empty ones), so no DTensor
  dispatch happens per op; moment state stays DTensor-shaped like the parameter so
  ``torch.distributed.checkpoint`` saves it sharded.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from fsdp_impl.decoupled import clear_grads, grad_attr_name, read_grad
from fsdp_impl.optim._adam_math import AdamHyper, AdamTensors, adam_foreach_, adam_fused_, adam_single_
from fsdp_impl.placement import local_tensor

__all__ = ["Adam", "AdamW"]

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _check_range(name: str, value: Any, low: float, high: float | None = None) -> None:
    """Early, named error for a hyper-parameter outside ``[low, high)``."""
    number = float(value.item()) if isinstance(value, torch.Tensor) else value
    if not isinstance(number, (int, float)) or isinstance(number, bool) or math.isnan(number):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if number < low or (high is not None and number >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Invalid {name}: {value!r}; allowed values are {bound}")


def _check_moment_dtype(name: str, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{name} must be None (same as the parameter) or a floating-point torch.dtype "
            f"such as torch.float32 or torch.bfloat16, got {dtype!r}"
        )


def _check_flags(fused: bool | None, differentiable: bool, lr: Any, foreach: bool | None) -> None:
    if fused not in (None, True, False):
        raise ValueError(f"fused must be None, True or False, got {fused!r}")
    if fused and foreach:
        raise ValueError("fused=True and foreach=True cannot be given together; pick one")
    if differentiable:
        raise ValueError("differentiable=True is not supported by fsdp_impl.optim.Adam/AdamW")
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("lr given as a Tensor must have exactly one element")
    if foreach not in (None, True, False):
        raise ValueError(f"foreach must be None, True or False, got {foreach!r}")


class Adam(Optimizer):
    """Adam with decoupled-gradient support and optional low-precision moments.

    ``torch.optim.Adam`` arguments keep their meaning; ``differentiable`` is rejected.
    ``foreach=None`` picks multi-tensor kernels where torch would (also with ``capturable=True``).
    ``fused=True`` runs torch's fused Adam(W) kernel (one pass over param, grad and moments,
    capturable); it needs each parameter's grad and moments in the parameter's dtype, so it is
    refused with narrower ``exp_avg_dtype``/``exp_avg_sq_dtype``.
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        use_decoupled_grad: bool = False,
        exp_avg_dtype: torch.dtype | None = None,
        exp_avg_sq_dtype: torch.dtype | None = None,
    ) -> None:
        _check_range("lr", lr, 0.0)
        _check_range("eps", eps, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        _check_range("betas[0]", betas[0], 0.0, 1.0)
        _check_range("betas[1]", betas[1], 0.0, 1.0)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_flags(fused, differentiable, lr, foreach)
        if not isinstance(use_decoupled_grad, bool):
            raise ValueError(f"use_decoupled_grad must be True or False, got {use_decoupled_grad!r}")
        _check_moment_dtype("exp_avg_dtype", exp_avg_dtype)
        _check_moment_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype)
        beta1, beta2 = (float(b.item()) if isinstance(b, torch.Tensor) else float(b) for b in betas)
        defaults = {
            "lr": lr,
            "betas": (beta1, beta2),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": bool(amsgrad),
            "maximize": bool(maximize),
            "foreach": foreach,
            "capturable": bool(capturable),
            "differentiable": False,
            "fused": bool(fused) if fused is not None else None,
            "decoupled_weight_decay": bool(decoupled_weight_decay),
        }
        # Instance-level, not per group: param_groups (and so state_dict) keep torch's keys.
        self._use_decoupled_grad = use_decoupled_grad
        self._exp_avg_dtype = exp_avg_dtype
        self._exp_avg_sq_dtype = exp_avg_sq_dtype
        super().__init__(params, defaults)
        if fused:
            self._check_fused_moment_dtypes()

    def _check_fused_moment_dtypes(self) -> None:
        """fused=True: moments must be stored in each parameter's own dtype (early, named error)."""
        for group in self.param_groups:
            for param in group["params"]:
                for key in _MOMENT_KEYS[:2]:
                    if self._moment_dtype(key, param) != param.dtype:
                        raise ValueError(
                            f"fused=True needs the moments in the parameter's dtype, but {key}_dtype="
                            f"{self._moment_dtype(key, param)} and a parameter is {param.dtype}; pass "
                            "fused=False (the foreach path upcasts narrow moments) or drop the moment dtype")

    @property
    def use_decoupled_grad(self) -> bool:
        """True when this optimizer reads ``param.decoupled_grad`` instead of ``param.grad``."""
        return self._use_decoupled_grad

    @property
    def exp_avg_dtype(self) -> torch.dtype | None:
        return self._exp_avg_dtype

    @property
    def exp_avg_sq_dtype(self) -> torch.dtype | None:
        return self._exp_avg_sq_dtype

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("amsgrad", "maximize", "capturable", "decoupled_weight_decay"):
                group.setdefault(key, False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)

    def _moment_dtype(self, key: str, param: torch.Tensor) -> torch.dtype:
        wanted = self._exp_avg_dtype if key == "exp_avg" else self._exp_avg_sq_dtype
        return wanted if wanted is not None else param.dtype

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Lazy state like torch's, with moments in the configured dtypes."""
        state = self.state[param]
        if len(state) == 0:
            # Like torch: the step lives on the host unless capturable or fused (then on the device).
            state["step"] = (
                torch.zeros((), dtype=torch.float32, device=local_tensor(param).device)
                if group["capturable"] or group["fused"]
                else torch.tensor(0.0, dtype=torch.float32)
            )
            keys = _MOMENT_KEYS if group["amsgrad"] else _MOMENT_KEYS[:2]
            for key in keys:
                state[key] = torch.zeros_like(
                    param, dtype=self._moment_dtype(key, param), memory_format=torch.preserve_format
                )
        return state

    def _gather(self, group: dict[str, Any], index_base: int) -> list[AdamTensors]:
        """Local tensors of every param of ``group`` that has a gradient (others are skipped)."""
        batch = []
        for offset, param in enumerate(group["params"]):
            grad = read_grad(param, self._use_decoupled_grad)
            if grad is None:
                continue
            _check_grad_matches(param, grad, index_base + offset, self._use_decoupled_grad)
            if torch.is_complex(param):
                raise ValueError("fsdp_impl.optim.Adam does not support complex parameters")
            state = self._init_state(param, group)
            max_sq = state.get("max_exp_avg_sq") if group["amsgrad"] else None
            batch.append(
                AdamTensors(
                    param=local_tensor(param),
                    grad=local_tensor(grad),
                    exp_avg=local_tensor(state["exp_avg"]),
                    exp_avg_sq=local_tensor(state["exp_avg_sq"]),
                    max_exp_avg_sq=local_tensor(max_sq) if max_sq is not None else None,
                    step=state["step"],
                )
            )
        return batch

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every param with a gradient on the configured attribute."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index_base = 0
        stepped = 0
        for group in self.param_groups:
            batch = self._gather(group, index_base)
            index_base += len(group["params"])
            stepped += len(batch)
            if not batch:
                continue
            step_group(group, batch)
        if stepped == 0:
            self._warn_if_grads_on_other_attr()
        return loss

    def _warn_if_grads_on_other_attr(self) -> None:
        """Flag the silent no-op of a model/optimizer decoupled-grad mismatch at run time."""
        other = not self._use_decoupled_grad
        found = sum(
            1
            for group in self.param_groups
            for param in group["params"]
            if read_grad(param, other) is not None
        )
        if found:
            warnings.warn(
                f"{type(self).__name__}.step() found no gradient on param."
                f"{grad_attr_name(self._use_decoupled_grad)} for any parameter, but {found} "
                f"parameter(s) carry param.{grad_attr_name(other)}: the step did nothing. The "
                "model's and the optimizer's use_decoupled_grad settings probably differ.",
                RuntimeWarning,
                stacklevel=3,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset ``.grad`` like torch and, with decoupled grads, ``decoupled_grad`` too."""
        super().zero_grad(set_to_none=set_to_none)
        params = (param for group in self.param_groups for param in group["params"])
        clear_grads(params, self._use_decoupled_grad, set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, then moments recast to the configured dtypes (torch casts to param's)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                for key in _MOMENT_KEYS:
                    value = state.get(key)
                    wanted = self._moment_dtype(key, param)
                    if isinstance(value, torch.Tensor) and value.dtype != wanted:
                        state[key] = value.to(wanted)


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (default 1e-2), as ``torch.optim.AdamW``."""

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        use_decoupled_grad: bool = False,
        exp_avg_dtype: torch.dtype | None = None,
        exp_avg_sq_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            use_decoupled_grad=use_decoupled_grad,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
        )


def step_group(group: dict[str, Any], batch: list[AdamTensors]) -> None:
    """One param group's Adam math on ``batch``, by the group's choice: the fused kernel,
    foreach, or one tensor at a time (also the offloaded streamed step's math)."""
    hp = _hyper(group)
    if group["fused"]:
        adam_fused_(batch, hp)
    elif _use_foreach(group, batch):
        adam_foreach_(batch, hp)
    else:
        for tensors in batch:
            adam_single_(tensors, hp)


def _hyper(group: dict[str, Any]) -> AdamHyper:
    beta1, beta2 = group["betas"]
    return AdamHyper(
        lr=group["lr"],
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
        amsgrad=bool(group["amsgrad"]),
        maximize=bool(group["maximize"]),
        capturable=bool(group["capturable"]),
    )


def _use_foreach(group: dict[str, Any], batch: list[AdamTensors]) -> bool:
    """Explicit ``foreach`` wins; None defers to torch's own default for these local tensors
    (multi-tensor kernels on CUDA, the single-tensor loop on CPU)."""
    if group["foreach"] is not None:
        return bool(group["foreach"])
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - private helper moved
        return False
    tensors = [t.param for t in batch]
    _, foreach = _default_to_fused_or_foreach(tensors, differentiable=False, use_fused=False)
    return bool(foreach)


def _check_grad_matches(
    param: torch.Tensor, grad: torch.Tensor, index: int, use_decoupled_grad: bool
) -> None:
    """A gradient must be laid out like its parameter, or updating local shards is wrong."""
    attr = grad_attr_name(use_decoupled_grad)
    if grad.is_sparse:
        raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam")
    if isinstance(param, DTensor) != isinstance(grad, DTensor):
        raise ValueError(
            f"parameter {index}: param is {'a DTensor' if isinstance(param, DTensor) else 'a plain tensor'}"
            f" but param.{attr} is {'a DTensor' if isinstance(grad, DTensor) else 'a plain tensor'};"
            " both must be the same kind"
        )
    if isinstance(param, DTensor) and isinstance(grad, DTensor) and tuple(param.placements) != tuple(grad.placements):
        raise ValueError(
            f"parameter {index}: param.{attr} placements {tuple(grad.placements)} differ from the "
            f"parameter's {tuple(param.placements)}; gradients must be reduced/sharded like the "
            "parameter before the optimizer step"
        )
    if local_tensor(param).shape != local_tensor(grad).shape:
        raise ValueError(
            f"parameter {index}: local param.{attr} shape {tuple(local_tensor(grad).shape)} differs "
            f"from the local parameter shape {tuple(local_tensor(param).shape)}"
        )
