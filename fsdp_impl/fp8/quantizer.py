"""Per-role quantizers: turn a high-precision tensor into an ``Fp8Tensor`` under one recipe.

A quantizer owns the scaling state of one role (input, weight or grad output) of one module.
``scale_for(amax)`` maps an amax grid to the scales to cast with (and advances any state), so
the plain path (``quantize``: amax of the whole tensor) and the sharded path (amax of every
shard, MAX-reduced, then each shard cast locally) go through the same arithmetic and give the
same bits.

* ``CurrentQuantizer``: scale from this tensor's own amax (tensorwise or per block).
* ``DelayedQuantizer``: scale from a history of past amaxes (TransformerEngine's delayed
  scaling): the tensor is cast with the scale computed *before* it was seen, its amax is
  recorded, and ``advance()`` pushes the recorded amax into the history and recomputes the
  scale. Alone, every cast advances at once; under a sharding engine (``deferred``) the engine
  MAX-reduces the recorded amaxes of all quantizers over the data-parallel group once per step
  and then advances, so every rank holds the same history (and a checkpoint of it is exact).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .scaling import Block, amax_to_scale
from .tensor import Fp8Tensor, amax_of, quantize_with_scale

AMAX_ALGOS = ("max", "most_recent")


class Quantizer:
    """Common part: target dtype and block shape (``None`` = tensorwise)."""

    def __init__(self, dtype: torch.dtype, block: Block | None) -> None:
        self.dtype = dtype
        self.block = block

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        """Quantise the 2-D ``x`` (contraction dim last)."""
        return quantize_with_scale(x, self.scale_for(amax_of(x, self.block)), self.block, self.dtype)


class CurrentQuantizer(Quantizer):
    """Scales from the current tensor: ``fp8_max / amax``, optionally rounded down to 2**k."""

    def __init__(self, dtype: torch.dtype, block: Block | None = None, power_of_2: bool = False) -> None:
        super().__init__(dtype, block)
        self.power_of_2 = power_of_2

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        return amax_to_scale(amax, self.dtype, power_of_2=self.power_of_2)


class DelayedQuantizer(Quantizer):
    """Tensorwise scale from an amax history (``history[-1]`` is the newest entry).

    The state lives in buffers of ``owner`` (``fp8_<role>_amax_history`` and ``fp8_<role>_scale``
    persistent, so ``state_dict`` and checkpoints carry them; ``fp8_<role>_amax_pending`` not);
    they are looked up at use time, so ``.to()``, meta-device materialisation and
    ``load_state_dict`` are seen.
    """

    def __init__(self, dtype: torch.dtype, owner: nn.Module, role: str, *, history_len: int = 1024,
                 algo: str = "max", margin: int = 0) -> None:
        super().__init__(dtype, None)
        if algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo={algo!r} is not supported; allowed: {', '.join(AMAX_ALGOS)}")
        self.owner, self.prefix = owner, f"fp8_{role}_"
        self.algo, self.margin = algo, margin
        self.deferred = False
        device = next((p.device for p in owner.parameters(recurse=False)), None)
        owner.register_buffer(self.prefix + "amax_history", torch.zeros(history_len, device=device))
        owner.register_buffer(self.prefix + "scale", torch.ones((), device=device))
        owner.register_buffer(self.prefix + "amax_pending", torch.zeros((), device=device), persistent=False)

    def _buffer(self, key: str) -> torch.Tensor:
        buf = self.owner._buffers[self.prefix + key]
        if buf is None:
            raise RuntimeError(f"FP8 delayed-scaling buffer {self.prefix + key!r} was set to None")
        return buf

    @property
    def history(self) -> torch.Tensor:
        return self._buffer("amax_history")

    @property
    def scale(self) -> torch.Tensor:
        return self._buffer("scale")

    @property
    def pending(self) -> torch.Tensor:
        return self._buffer("amax_pending")

    @torch.no_grad()
    def reset(self) -> None:
        """Empty history, scale 1 (what ``reset_parameters`` and meta init call)."""
        self.history.zero_()
        self.scale.fill_(1.0)
        self.pending.zero_()

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The current (delayed) scale; ``amax`` is recorded for the next ``advance()``."""
        scale = self.scale.detach().clone().reshape(1, 1)
        self.record(amax)
        if not self.deferred:
            self.advance()
        return scale

    @torch.no_grad()
    def record(self, amax: torch.Tensor) -> None:
        """Fold ``amax`` into the pending amax (max over the casts since the last advance)."""
        self.pending.copy_(torch.maximum(self.pending, amax.detach().float().reshape(())))

    @torch.no_grad()
    def advance(self) -> None:
        """Push the pending amax into the history, recompute the scale, clear pending."""
        history = self.history
        history.copy_(torch.cat([history[1:], self.pending.reshape(1)]))
        amax = history.max() if self.algo == "max" else history[-1]
        self.scale.copy_(amax_to_scale(amax, self.dtype, margin=self.margin, fallback=self.scale))
        self.pending.zero_()
