"""Capture one FSDP training iteration in a CUDA graph and replay it.

``capture_train_step`` does what a user would otherwise write by hand around
``torch.cuda.graph``: warm-up steps on a side stream (they create the optimizer state, the grad
views, the engine's persistent buffers and the NCCL communicators before capture), a join and a
barrier so no rank captures while another still runs collectives, then the capture on a fresh
stream in ``thread_local`` error mode (autograd runs the backward on its own thread, and the NCCL
watchdog queries events from another thread while a rank captures).

The captured iteration is ``optimizer.zero_grad(set_to_none=False)``, ``step_fn(*static_inputs)``
(forward, loss and ``loss.backward()``; returns the loss) and, with
``include_optimizer_step=True``, ``optimizer.step()``. New data goes into the static input
tensors (``copy_inputs``) before each ``replay()``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .module import FullyShardedModule
from .optimizer_binding import bound_engines

StepFn = Callable[..., torch.Tensor]


class CapturedTrainStep:
    """A captured training iteration. ``replay()`` re-runs it on the current contents of
    ``static_inputs`` and returns ``static_loss`` (overwritten by every replay: clone it to keep)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_inputs: tuple[torch.Tensor, ...],
                 static_loss: torch.Tensor, warmup: int, include_optimizer_step: bool) -> None:
        self.graph = graph
        self.static_inputs = static_inputs
        self.static_loss = static_loss
        self.warmup = warmup  # eager iterations (with optimizer steps) run before the capture
        self.include_optimizer_step = include_optimizer_step

    def copy_inputs(self, *values: torch.Tensor) -> None:
        """Copy ``values`` into the static inputs (same order, shapes and devices)."""
        if len(values) != len(self.static_inputs):
            raise ValueError(f"copy_inputs got {len(values)} tensors for {len(self.static_inputs)} static inputs")
        for i, (dst, src) in enumerate(zip(self.static_inputs, values, strict=True)):
            if src.shape != dst.shape:
                raise ValueError(f"copy_inputs: input {i} has shape {tuple(src.shape)}, the static input "
                                 f"{tuple(dst.shape)}")
            dst.copy_(src)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.static_loss


def _check_args(model: Any, optimizer: Any, step_fn: Any, static_inputs: Any, warmup: Any) -> torch.device:
    if not isinstance(model, FullyShardedModule):
        raise TypeError(f"model must be a model returned by fully_shard/fully_shard_model, got {type(model).__name__}")
    engine = model._fsdp_engine
    if not engine.config.cuda_graph_mode:
        raise ValueError("capture_train_step needs a model wrapped with cuda_graph_mode=True (persistent buffers, "
                         "the same host-side path every step); rewrap it with cuda_graph_mode=True")
    device = engine.ctx.device
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"capture_train_step needs CUDA: the model runs on {device}")
    if all(e is not engine for e in bound_engines(optimizer)):
        raise ValueError("optimizer must be bound to this model by fully_shard or fully_shard_optimizer (its "
                         "zero_grad must reset the model's gradient buffers)")
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable (forward, loss, backward; returns the loss), got {step_fn!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (the warm-up steps create the optimizer state and "
                         f"grads before capture), got {warmup!r}")
    for i, t in enumerate(static_inputs):
        if not isinstance(t, torch.Tensor) or t.device != device:
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"static_inputs[{i}] must be a tensor on {device}, got {where}")
    return device


def _barrier(device: torch.device) -> None:
    if dist.is_available() and dist.is_initialized():
        if "nccl" in str(dist.get_backend()).lower():
            dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
        else:
            dist.barrier()


def _loss_of(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"step_fn must return the loss tensor, got {type(value).__name__}")
    return value


def capture_train_step(model: FullyShardedModule, optimizer: torch.optim.Optimizer, step_fn: StepFn,
                       static_inputs: Sequence[torch.Tensor], warmup: int = 3,
                       include_optimizer_step: bool = True, pool: Any = None) -> CapturedTrainStep:
    """Warm up, then capture ``zero_grad(set_to_none=False); step_fn(*static_inputs)[; step()]``.

    ``model``/``optimizer`` come from ``fully_shard(..., cuda_graph_mode=True)`` (the optimizer
    capturable); every rank must call this together. The ``warmup`` eager iterations are real
    training steps (optimizer step included, also with ``include_optimizer_step=False``, whose
    replays then leave ``optimizer.step()`` to the caller). ``pool`` is passed to
    ``torch.cuda.graph`` (share a memory pool between graphs).
    """
    inputs = tuple(static_inputs)
    device = _check_args(model, optimizer, step_fn, inputs, warmup)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            optimizer.zero_grad(set_to_none=False)
            _loss_of(step_fn(*inputs))
            optimizer.step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    _barrier(device)
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream(device)
    ctx = model._fsdp_engine.ctx
    ctx.capture_token = graph  # the zero_grad below is in this graph: its backward may overwrite
    try:
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream, capture_error_mode="thread_local"):
            optimizer.zero_grad(set_to_none=False)
            static_loss = _loss_of(step_fn(*inputs))
            if include_optimizer_step:
                optimizer.step()
    finally:
        ctx.capture_token = None
    torch.cuda.synchronize(device)
    _barrier(device)
    return CapturedTrainStep(graph, inputs, static_loss, warmup, include_optimizer_step)
