"""CPU-offload helpers for the functional suites (``test_offload.py``, ``test_offload_gpu.py``).

``OFFLOAD_CASES`` names the ``OffloadPolicy`` settings the suites run; ``policy(case, device)``
builds one for the device (pinned host memory only on CUDA). On a CPU mesh ``step="gpu"`` runs
inside ``fsdp_impl._testing.STREAMED_STEP_ON_CPU.on()`` (``window(device)``): its "device window"
is then host memory, but the chunking, copies and kernels are the ones a GPU runs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_impl
from fsdp_impl._testing import STREAMED_STEP_ON_CPU

from .checkpointing import Case
from .mesh import seed_kwargs, seed_mesh
from .models import build_model, loss_fn, unit_classes
from .reference import global_batch, make_optimizer
from .training import local_slice, train_accumulating

# case -> OffloadPolicy fields (pin_memory is added per device). chunk_bytes is small so that the
# tiny test models are cut into several chunks and parameters are split across chunks.
OFFLOAD_CASES: dict[str, dict[str, Any]] = {
    "gpu": dict(step="gpu", chunk_bytes=4096),  # state + main params on the host, compute shard on the device
    "gpu_host_all": dict(step="gpu", params=True, grads=True, chunk_bytes=4096),  # nothing stays on the device
    "gpu_state_only": dict(step="gpu", main_params=False, chunk_bytes=4096),  # only the optimizer state
    "cpu": dict(step="cpu"),  # FSDP2's CPUOffloadPolicy: the optimizer steps on the host
    # overlap_step=True: each unit steps as its reduced grads land (test_offload_overlap.py)
    "gpu_overlap": dict(step="gpu", chunk_bytes=4096, overlap_step=True),
    "cpu_overlap": dict(step="cpu", overlap_step=True),
}
# Cases whose update runs the non-offloaded optimizer's own math (bit-identical to no offload).
SAME_MATH = ("gpu", "gpu_host_all", "gpu_state_only", "gpu_overlap")
# step="cpu" switches torch's Adam to its fused CPU kernel (the non-offloaded CPU step is the
# single-tensor loop): the same formula in another operation order, so the update differs in the
# last bit of some elements and the runs drift apart by rounding only. Measured on CPU (gloo,
# world 2, 5 steps of the suite's GPT at lr 1e-2, ZeRO-1/2/3, fp32 and bf16 compute): losses
# within 2.3e-7 relative, parameters within 1.8e-7 over the model (``model_relative_error``) and
# 1.6e-6 for the worst single tensor. 1e-5 leaves room for other models and steps and is still
# three orders below what a lost or doubled update (~1e-2 relative) or stale weights give.
CPU_STEP_RTOL = 1e-5


def policy(case: str, device: torch.device) -> fsdp_impl.OffloadPolicy:
    return fsdp_impl.OffloadPolicy(pin_memory=device.type == "cuda", **OFFLOAD_CASES[case])


@contextlib.contextmanager
def window(device: torch.device) -> Iterator[None]:
    """Where ``step="gpu"`` may run: on a CPU mesh only inside the test hook."""
    with STREAMED_STEP_ON_CPU.on() if device.type == "cpu" else contextlib.nullcontext():
        yield


class TinyMLP(nn.Module):
    """Two Linear units whose last layer has one output row: with 2+ shard ranks its weight and
    bias are empty on every rank but the first (the empty-shard case of clipping and the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x)))


def train(model_name: str, device: torch.device, fsdp_kwargs: dict[str, Any], steps: int = 5,
          make_opt: Callable[[nn.Module], torch.optim.Optimizer] | None = None, microbatches: int = 2,
          dtype: torch.dtype = torch.float32, before_step: Callable[[nn.Module, torch.optim.Optimizer, int], None]
          | None = None, seed: int = 0, **model_kwargs: Any
          ) -> tuple[list[float], dict[str, torch.Tensor], nn.Module, Any]:
    """Train ``model_name`` (``"tiny"``: ``TinyMLP``; ``model_kwargs`` go to ``build_model``)
    wrapped with ``fsdp_kwargs`` on this rank's slice of fixed global batches, ``microbatches``
    per step; returns the global losses, the full final params (CPU), the wrapped model and the
    optimizer (default: two-group Adam)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if model_name == "tiny":
        torch.manual_seed(seed)
        module: nn.Module = TinyMLP().to(dtype)
        units: list[type[nn.Module]] = [nn.Linear]
    else:
        module = build_model(model_name, dtype, seed, **model_kwargs)
        units = list(unit_classes(model_name))
    opt = make_opt(module) if make_opt is not None else make_optimizer("adam", module.named_parameters())
    kwargs = dict(fsdp_unit_modules=units)
    kwargs.update(fsdp_kwargs)
    model, opt = fsdp_impl.fully_shard(module, opt, **kwargs)
    local = 2 * microbatches

    def batches(step: int) -> list:
        if model_name == "tiny":
            gen = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(world * local, 6, generator=gen)
            inputs, target = [x], torch.randn(world * local, 1, generator=gen)
        else:
            inputs, target = global_batch(model_name, step, world * local, dtype)
        inputs = [local_slice(x, rank, local).to(device) for x in inputs]
        target = local_slice(target, rank, local).to(device)
        per = local // microbatches
        return [([local_slice(x, m, per) for x in inputs], local_slice(target, m, per)) for m in range(microbatches)]

    loss = loss_fn(model_name) if model_name != "tiny" else nn.functional.mse_loss
    hook = (lambda step: before_step(model, opt, step)) if before_step is not None else None
    losses = train_accumulating(model, opt, steps, batches, loss, device, before_step=hook)
    # overlap_step="forward": the last step's units may still be stepping; params are final only after this
    fsdp_impl.wait_for_step(opt)
    final = {n: full_tensor(p) for n, p in model.module.named_parameters()}
    return losses, final, model, opt


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a DTensor's global value. Offloaded shards live in host memory while the
    mesh may be on CUDA (NCCL cannot gather host tensors): the local shard goes to the mesh's
    device first."""
    if not hasattr(t, "full_tensor"):
        return t.detach().cpu().clone()
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:
        t = type(t).from_local(local.to(t.device_mesh.device_type), t.device_mesh, t.placements,
                               run_check=False, shape=t.shape, stride=t.stride())
    return t.full_tensor().detach().cpu().clone()


def hsdp_kwargs(outer: str, device: torch.device) -> dict[str, Any]:
    """fully_shard mesh arguments of a (dp_outer=2, dp_shard=world/2) mesh with ``outer``."""
    return seed_kwargs(seed_mesh((2, dist.get_world_size() // 2, 1, 1), device.type), outer)


def wrap_case(case: Case, device: torch.device, seed: int, offload: str | None, lr: float = 1e-2) -> tuple:
    """A freshly built ``case`` model with a never-stepped two-group Adam, wrapped with the
    offload ``case`` ``offload`` (None: no offload), as ``common.checkpointing.wrap`` does."""
    module = build_model(case.model, seed=seed)
    optimizer = make_optimizer("adam", module.named_parameters(), lr=lr)
    kwargs: dict[str, Any] = dict(fsdp_unit_modules=list(unit_classes(case.model)), zero_dp_strategy=case.strategy)
    if case.outer is not None:
        kwargs.update(hsdp_kwargs(case.outer, device))
    if offload is not None:
        kwargs["offload_policy"] = policy(offload, device)
    return fsdp_impl.fully_shard(module, optimizer, **kwargs)
