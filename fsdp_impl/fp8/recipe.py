"""FP8 recipes of the torch-native path: which dtype, block shape and scaling each role uses.

* ``CurrentScaling``: tensorwise, scale from each tensor's own amax (TE ``Float8CurrentScaling``).
* ``DelayedScaling``: tensorwise, scale from an amax history (TE ``DelayedScaling``).
* ``BlockwiseScaling``: 1 x ``block_size`` blocks along the contraction dim for activations and
  grads, ``block_size`` x ``block_size`` for weights, power-of-2 scales (TE ``Float8BlockScaling``).

A recipe is a frozen description; ``make_quantizers(module)`` builds the per-module state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .formats import Format
from .quantizer import AMAX_ALGOS, CurrentQuantizer, DelayedQuantizer, Quantizer

ROLES = ("input", "weight", "grad_output")


@dataclass
class LinearQuantizers:
    """The three quantizers of one linear layer (one per GEMM operand role)."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer

    def all(self) -> list[Quantizer]:
        return [self.input, self.weight, self.grad_output]


def _role_dtype(fmt: Format, role: str) -> torch.dtype:
    return fmt.backward_dtype if role == "grad_output" else fmt.forward_dtype


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class Recipe:
    """Base of the torch-native recipes."""

    fp8_format: Format | str  # always a Format after __post_init__
    tensorwise = True  # one scale per tensor: the weight's transpose reuses its scale

    def _normalise_format(self) -> None:
        object.__setattr__(self, "fp8_format", Format.parse(self.fp8_format))

    @property
    def format(self) -> Format:
        return Format.parse(self.fp8_format)

    def make_quantizers(self, module: nn.Module) -> LinearQuantizers:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_linear(self, name: str, in_features: int, out_features: int) -> None:
        """Raise if a linear layer's shape cannot use this recipe."""


@dataclass(frozen=True)
class CurrentScaling(Recipe):
    fp8_format: Format | str = Format.HYBRID
    power_of_2_scales: bool = False

    def __post_init__(self) -> None:
        self._normalise_format()

    def make_quantizers(self, module: nn.Module) -> LinearQuantizers:
        fmt = self.format
        return LinearQuantizers(*(CurrentQuantizer(_role_dtype(fmt, r), None, self.power_of_2_scales)
                                  for r in ROLES))


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format | str = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        self._normalise_format()
        _check_int("margin", self.margin, 0)
        _check_int("amax_history_len", self.amax_history_len, 1)
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"amax_compute_algo={self.amax_compute_algo!r} is not supported; "
                             f"allowed: {', '.join(AMAX_ALGOS)}")

    def make_quantizers(self, module: nn.Module) -> LinearQuantizers:
        """Registers the history/scale buffers on ``module`` (see ``DelayedQuantizer``)."""
        fmt = self.format
        return LinearQuantizers(*(DelayedQuantizer(_role_dtype(fmt, r), module, r, history_len=self.amax_history_len,
                                                   algo=self.amax_compute_algo, margin=self.margin)
                                  for r in ROLES))


@dataclass(frozen=True)
class BlockwiseScaling(Recipe):
    fp8_format: Format | str = Format.E4M3
    block_size: int = 128
    power_of_2_scales: bool = True
    tensorwise: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalise_format()
        _check_int("block_size", self.block_size, 1)

    @property
    def activation_block(self) -> tuple[int, int]:
        return (1, self.block_size)

    @property
    def weight_block(self) -> tuple[int, int]:
        return (self.block_size, self.block_size)

    def make_quantizers(self, module: nn.Module) -> LinearQuantizers:
        fmt = self.format
        blocks = {"input": self.activation_block, "weight": self.weight_block, "grad_output": self.activation_block}
        return LinearQuantizers(*(CurrentQuantizer(_role_dtype(fmt, r), blocks[r], self.power_of_2_scales)
                                  for r in ROLES))

    def check_linear(self, name: str, in_features: int, out_features: int) -> None:
        bad = [f"{d}={v}" for d, v in (("in_features", in_features), ("out_features", out_features))
               if v % self.block_size]
        if bad:
            raise ValueError(f"BlockwiseScaling(block_size={self.block_size}) needs linear dims divisible by "
                             f"the block size; {name!r} has {', '.join(bad)} (leave it out of convert_to_fp8 "
                             "with module_filter, or pick a block_size that divides both)")
