"""FP8 formats and the saturating cast every quantisation goes through.

E4M3 (``float8_e4m3fn``, max 448) carries forward tensors; E5M2 (``float8_e5m2``, max 57344)
has the range gradients need. ``Format`` names which one each role uses, as TransformerEngine's
recipes do: ``E4M3`` everywhere, or ``HYBRID`` (E4M3 forward, E5M2 for gradients).

Eager ``tensor.to(float8)`` does not saturate on torch 2.11 (an overflow becomes NaN for E4M3 or
inf for E5M2) and does on 2.13, so :func:`saturating_cast` clamps to the format's range first:
both versions then give the same bits.
"""
from __future__ import annotations

import enum

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)


class Format(enum.Enum):
    """Which FP8 dtype the forward (input, weight) and backward (grad output) tensors use."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        return E4M3 if self is Format.E4M3 else E5M2

    @classmethod
    def parse(cls, value: Format | str) -> Format:
        """Accept the enum, its name, or a TransformerEngine ``Format`` member (same names)."""
        name = value.name if isinstance(value, enum.Enum) else str(value)
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"fp8_format={value!r} is not supported; allowed: "
                             f"{', '.join(f.name for f in cls)} (pure E5M2 training is not supported)") from None


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    check_fp8_dtype(dtype)
    return float(torch.finfo(dtype).max)


def check_fp8_dtype(dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"FP8 dtype must be one of {[str(d) for d in FP8_DTYPES]}, got {dtype}")


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (already multiplied by its scale) as ``dtype``, overflow clamped to ±max (NaN stays NaN)."""
    limit = fp8_max(dtype)
    return x.clamp(min=-limit, max=limit).to(dtype)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """The FP8 tensor's storage as uint8 (collectives move bytes; gloo has no float8 types)."""
    return x.view(torch.uint8)


def from_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    check_fp8_dtype(dtype)
    return x.view(dtype)
