"""The error measures every functional suite compares with, so that one tolerance means the same
thing in every file.

Tensors are compared as ``||actual - expected|| / ||expected||`` in float64 (a norm ratio, not
an element-wise ``allclose``: one rounding flip in a large tensor does not dominate, a wrong
scale or a stale tensor does). Loss lists are compared step by step and must be equally long: a
run that stopped early or skipped a step fails instead of being compared on its prefix.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

_FLOOR = 1e-12  # denominators below this are treated as this (an all-zero expected tensor)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """``||actual - expected|| / ||scale||`` in float64 (``scale`` defaults to ``expected``; a
    sharded comparison passes the full tensor so that every shard is measured against it)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}"
    denominator = (e if scale is None else scale.detach().double().cpu()).norm().clamp_min(_FLOOR)
    return ((a - e).norm() / denominator).item()


def _same_names(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys(), f"tensor names differ: {sorted(actual.keys() ^ expected.keys())}"


def max_relative_error(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
                       ) -> tuple[float, str]:
    """The largest per-tensor ``relative_error`` and the name where it occurs (names must agree)."""
    _same_names(actual, expected)
    worst, where = 0.0, ""
    for name, e in expected.items():
        err = relative_error(actual[name], e)
        if err > worst:
            worst, where = err, name
    return worst, where


def model_relative_error(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                         scale: Mapping[str, torch.Tensor] | None = None) -> float:
    """``||actual - expected|| / ||expected||`` over all tensors together (``scale``: the tensors
    whose norms make the denominator, as in ``relative_error``): not dominated by near-zero
    tensors (e.g. LayerNorm biases) whose per-tensor error is rounding noise."""
    _same_names(actual, expected)
    num = sum(((actual[n].detach().double().cpu() - e.detach().double().cpu()) ** 2).sum().item()
              for n, e in expected.items())
    den = sum((e.detach().double().cpu() ** 2).sum().item() for e in (scale or expected).values())
    return (num / max(den, _FLOOR ** 2)) ** 0.5


def loss_errors(actual: Sequence[float], expected: Sequence[float]) -> list[float]:
    """Each step's ``|a - e| / |e|``; lists of different lengths raise ``ValueError``."""
    return [abs(a - e) / max(abs(e), _FLOOR) for a, e in zip(actual, expected, strict=True)]


def max_loss_error(actual: Sequence[float], expected: Sequence[float]) -> float:
    """The largest per-step ``|a - e| / |e|``; lists of different lengths raise ``ValueError``."""
    return max(loss_errors(actual, expected), default=0.0)


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rtol: float, what: str = "losses"
                        ) -> None:
    """Every step's loss within ``rtol`` of the reference's, and as many steps as it has."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} steps vs {len(expected)} in the reference"
    err = max_loss_error(actual, expected)
    assert err <= rtol, f"{what}: {list(actual)} vs reference {list(expected)} (max relative error {err:.3g} > {rtol})"
