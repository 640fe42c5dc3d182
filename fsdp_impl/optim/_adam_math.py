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

__all__ = ["AdamHyper", "AdamTensors", "adam_foreach_", "adam_fused_", "adam_single_", "compute_dtype"]


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

    Mirrors ``torch.optim.adam._multi_tensor_adam``; with ``capturable=True`` its tensor-only
    branch (bias corrections from the device step counters), so a captured step is a few dozen
    multi-tensor kernels instead of ~15 small kernels per parameter.
    """
    if not batch:
        return
    dtypes = [compute_dtype(t.param) for t in batch]
    params = [_upcast(t.param, d) for t, d in zip(batch, dtypes, strict=True)]
    grads = [_upcast(t.grad, d) for t, d in zip(batch, dtypes, strict=True)]
    exp_avgs = [_upcast(t.exp_avg, d) for t, d in zip(batch, dtypes, strict=True)]
    exp_avg_sqs = [_upcast(t.exp_avg_sq, d) for t, d in zip(batch, dtypes, strict=True)]
    if hp.maximize:
        grads = list(torch._foreach_neg(grads))  # a list at run time; the stubs say tuple
    lr = hp.lr if hp.capturable else _as_float(hp.lr)

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

    if hp.capturable:
        _capturable_update(params, exp_avgs, second, steps, hp, lr)
    else:
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


def _capturable_update(params: list[torch.Tensor], exp_avgs: list[torch.Tensor], second: list[torch.Tensor],
                       steps: list[torch.Tensor], hp: AdamHyper, lr: float | torch.Tensor) -> None:
    """``param += exp_avg / denom`` with the bias corrections computed from the step tensors
    (torch's capturable multi-tensor formula, in its order, so no value goes to the host)."""
    bias_correction1 = list(torch._foreach_pow(hp.beta1, steps))
    bias_correction2 = list(torch._foreach_pow(hp.beta2, steps))
    torch._foreach_sub_(bias_correction1, 1)
    torch._foreach_sub_(bias_correction2, 1)
    torch._foreach_neg_(bias_correction2)
    torch._foreach_div_(bias_correction1, lr)
    torch._foreach_reciprocal_(bias_correction1)  # = -lr / (1 - beta1**step): the negative step size
    torch._foreach_sqrt_(bias_correction2)
    denom = list(torch._foreach_sqrt(second))
    torch._foreach_div_(denom, bias_correction2)
    torch._foreach_add_(denom, hp.eps)
    torch._foreach_div_(denom, bias_correction1)
    torch._foreach_addcdiv_(params, exp_avgs, denom)


def _fused_unsupported(t: AdamTensors) -> str | None:
    """Why ``torch._fused_adam(w)_`` cannot update this parameter, or None when it can: the
    kernel reads and writes every tensor in place in one dtype (no upcast or write-back)."""
    dtype = t.param.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return f"the parameter dtype is {dtype}"
    others = {"grad": t.grad, "exp_avg": t.exp_avg, "exp_avg_sq": t.exp_avg_sq, "max_exp_avg_sq": t.max_exp_avg_sq}
    for name, tensor in others.items():
        if tensor is not None and tensor.dtype != dtype:
            return f"{name} is {tensor.dtype} while the parameter is {dtype}"
    if t.step.device != t.param.device:
        return f"the step counter is on {t.step.device}, the parameter on {t.param.device}"
    return None


def adam_fused_(batch: list[AdamTensors], hp: AdamHyper) -> None:
    """The same step as one fused multi-tensor kernel per (device, dtype) group: each element of
    param, grad and moments is read and written once (about 7 passes over fp32 state instead of
    ~18 for the foreach path). No host read, so it is also capturable. Numerics: the fused
    kernel's own fp32 arithmetic, which matches ``torch.optim.AdamW(fused=True)`` bit for bit,
    not the foreach path (fp32-rounding-close)."""
    if not batch:
        return
    for t in batch:
        why = _fused_unsupported(t)
        if why is not None:
            raise ValueError(f"fused=True cannot update this parameter: {why}; the fused kernel needs the "
                             "parameter, its grad and its moments in one dtype on one device (use "
                             "fused=False, or keep moments and grads in the parameter's dtype)")
    groups: dict[tuple[torch.device, torch.dtype], list[AdamTensors]] = {}
    for t in batch:  # insertion-ordered: the same kernel order on every rank
        groups.setdefault((t.param.device, t.param.dtype), []).append(t)
    kernel = torch._fused_adamw_ if hp.decoupled_weight_decay else torch._fused_adam_
    for (device, _), ts in groups.items():
        steps = [t.step for t in ts]
        torch._foreach_add_(steps, 1)
        lr = hp.lr  # like torch: a device lr tensor goes to the params' device, a CPU one as it is
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device:
            lr = lr.to(device)
        kernel([t.param for t in ts], [t.grad for t in ts], [t.exp_avg for t in ts], [t.exp_avg_sq for t in ts],
               [t.max_exp_avg_sq for t in ts] if hp.amsgrad else [],  # type: ignore[misc]
               steps, amsgrad=hp.amsgrad, lr=lr, beta1=hp.beta1, beta2=hp.beta2,  # type: ignore[arg-type]
               weight_decay=hp.weight_decay, eps=hp.eps, maximize=hp.maximize)
