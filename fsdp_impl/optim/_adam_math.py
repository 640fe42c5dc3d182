"""The Adam/AdamW update on rank-local tensors, with moments stored in any float dtype.

Kept apart from the optimizer class so the arithmetic can be read (and compared with
``torch.optim.adam``) without the bookkeeping. Every function works on plain local tensors
(DTensor shards are unwrapped by the caller), including empty ones. The math runs in
``compute_dtype(param)`` (at least fp32); tensors stored in a narrower dtype (bf16 moments, bf16
grads) are upcast for the update and written back, so with fp32 everything no copy is made and
the operation sequence is exactly torch's, giving bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AdamHyper", "AdamTensors", "adam_foreach_", "adam_single_", "compute_dtype"]


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyper-parameters, already validated."""

    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    amsgrad: bool
    maximize: bool
    capturable: bool


@dataclass
class AdamTensors:
    """Local tensors of one parameter for one step. ``max_exp_avg_sq`` is None without amsgrad."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    step: torch.Tensor


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower params, the param's own dtype when it is wider (fp64)."""
    return torch.promote_types(param.dtype, torch.float32)


def _as_float(value: float | torch.Tensor) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _upcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _write_back(stored: torch.Tensor, computed: torch.Tensor) -> None:
    if computed is not stored:
        stored.copy_(computed)


def adam_single_(t: AdamTensors, hp: AdamHyper) -> None:
    """One Adam(W) step for one parameter, mirroring ``torch.optim.adam._single_tensor_adam``."""
    dtype = compute_dtype(t.param)
    param = _upcast(t.param, dtype)
    grad = _upcast(t.grad, dtype)
    if hp.maximize:
        grad = -grad
    exp_avg = _upcast(t.exp_avg, dtype)
    exp_avg_sq = _upcast(t.exp_avg_sq, dtype)

    t.step += 1
    if hp.weight_decay != 0:
        if hp.decoupled_weight_decay:
            param.mul_(1 - hp.lr * hp.weight_decay)
        else:
            grad = grad.add(param, alpha=hp.weight_decay)

    exp_avg.lerp_(grad, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)

    second = exp_avg_sq
    max_sq = None
    if hp.amsgrad:
        assert t.max_exp_avg_sq is not None
        max_sq = _upcast(t.max_exp_avg_sq, dtype)
        torch.maximum(max_sq, exp_avg_sq, out=max_sq)
        second = max_sq

    if hp.capturable:
        # Tensor-only math: no host sync, so the step can be captured in a CUDA graph.
        bias_correction1 = 1 - hp.beta1**t.step
        bias_correction2 = 1 - hp.beta2**t.step
        step_size_neg = (hp.lr / bias_correction1).neg()
        bias_correction2_sqrt = bias_correction2.sqrt()
        denom = (second.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(
            hp.eps / step_size_neg
        )
        param.addcdiv_(exp_avg, denom)
    else:
        step = _as_float(t.step)
        lr = _as_float(hp.lr)
        bias_correction1 = 1 - hp.beta1**step
        bias_correction2 = 1 - hp.beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (second.sqrt() / bias_correction2_sqrt).add_(hp.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    _write_back(t.exp_avg, exp_avg)
    _write_back(t.exp_avg_sq, exp_avg_sq)
    if max_sq is not None:
        assert t.max_exp_avg_sq is not None
        _write_back(t.max_exp_avg_sq, max_sq)
    _write_back(t.param, param)


def adam_foreach_(batch: list[AdamTensors], hp: AdamHyper) -> None:
    """The same step for many parameters with ``torch._foreach_*`` kernels (fewer launches).

    Mirrors ``torch.optim.adam._multi_tensor_adam`` for ``capturable=False``; the caller routes
    capturable groups to :func:`adam_single_`, whose tensor-only math is already graph-safe.
    """
    if hp.capturable:
        raise ValueError("adam_foreach_ does not implement capturable=True; use adam_single_")
    if not batch:
        return
    dtypes = [compute_dtype(t.param) for t in batch]
    params = [_upcast(t.param, d) for t, d in zip(batch, dtypes, strict=True)]
    grads = [_upcast(t.grad, d) for t, d in zip(batch, dtypes, strict=True)]
    exp_avgs = [_upcast(t.exp_avg, d) for t, d in zip(batch, dtypes, strict=True)]
    exp_avg_sqs = [_upcast(t.exp_avg_sq, d) for t, d in zip(batch, dtypes, strict=True)]
    if hp.maximize:
        grads = list(torch._foreach_neg(grads))  # a list at run time; the stubs say tuple
    lr = _as_float(hp.lr)

    steps = [t.step for t in batch]
    torch._foreach_add_(steps, 1)
    if hp.weight_decay != 0:
        if hp.decoupled_weight_decay:
            torch._foreach_mul_(params, 1 - lr * hp.weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=hp.weight_decay))

    torch._foreach_lerp_(exp_avgs, grads, 1 - hp.beta1)
    torch._foreach_mul_(exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - hp.beta2)

    second = exp_avg_sqs
    max_sqs: list[torch.Tensor] = []
    if hp.amsgrad:
        max_sqs = [_upcast(t.max_exp_avg_sq, d) for t, d in zip(batch, dtypes, strict=True)]  # type: ignore[arg-type]
        torch._foreach_maximum_(max_sqs, exp_avg_sqs)
        second = max_sqs

    step_values = [_as_float(s) for s in steps]
    step_sizes = [-(lr / (1 - hp.beta1**s)) for s in step_values]
    bias_correction2_sqrt = [(1 - hp.beta2**s) ** 0.5 for s in step_values]
    denom = torch._foreach_sqrt(second)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    for i, t in enumerate(batch):
        _write_back(t.exp_avg, exp_avgs[i])
        _write_back(t.exp_avg_sq, exp_avg_sqs[i])
        if hp.amsgrad:
            _write_back(t.max_exp_avg_sq, max_sqs[i])  # type: ignore[arg-type]
        _write_back(t.param, params[i])
