"""Canonical values of the configuration-matrix axes the functional suites declare.

Each functional test names the matrix cell it covers with ``@pytest.mark.matrix(...)`` (see
``tests/functional/README.md``); these helpers keep the values identical across suites, so the
sign-off's heat map puts the same configuration in the same cell whichever suite tested it:

- ``mesh``: the device-mesh shape, dims larger than 1 plus always ``shard``, e.g. ``shard4``,
  ``outer2-shard2``, ``shard2-cp2-tp2``;
- ``zero``: the ZeRO strategy by name (``no_shard``, ``optim``, ``optim_grads``, ``optim_grads_params``);
- ``outer``: the HSDP outer strategy (``no_shard``/``optim``), left out without one;
- ``model``, ``dtype``, ``recipe`` (FP8), ``graph`` (``eager``, ``compile``, ``cuda_graph``),
  ``recompute`` (activation recompute style, ``common/recompute.py``): as named.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

ZERO = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTER = ("no_shard", "optim")


def zero(strategy: int | str) -> str:
    """``3`` or ``"optim_grads_params"`` -> ``"optim_grads_params"``."""
    if isinstance(strategy, int) and not isinstance(strategy, bool) and 0 <= strategy < len(ZERO):
        return ZERO[strategy]
    if strategy in ZERO:
        return str(strategy)
    raise ValueError(f"not a ZeRO strategy: {strategy!r}; allowed: 0..3 or {ZERO}")


def outer(strategy: int | str | None) -> str | None:
    """The outer (dp_outer) strategy by name; None when the test has none (the axis is left out)."""
    if strategy is None:
        return None
    if isinstance(strategy, int) and not isinstance(strategy, bool) and 0 <= strategy < len(OUTER):
        return OUTER[strategy]
    if strategy in OUTER:
        return str(strategy)
    raise ValueError(f"not an outer strategy: {strategy!r}; allowed: None, 0, 1 or {OUTER}")


DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype(value: Any) -> str:
    """``torch.bfloat16`` (or ``"bfloat16"``, ``"bf16"``) -> ``"bf16"``."""
    name = str(value).removeprefix("torch.")
    if name in DTYPES.values():
        return name
    if name in DTYPES:
        return DTYPES[name]
    raise ValueError(f"not a matrix dtype: {value!r}; allowed: {sorted(DTYPES)} or {sorted(DTYPES.values())}")


def recipe(name: str) -> str:
    """An FP8 recipe by the name the torch-native suites use (TransformerEngine's ``block`` is
    ``blockwise``), so both kinds of suite fill the same cells."""
    return "blockwise" if name == "block" else str(name)


def mesh(shard: int, outer: int = 1, cp: int = 1, tp: int = 1) -> str:
    """``mesh(2, outer=2)`` -> ``"outer2-shard2"``; dims of size 1 other than ``shard`` are omitted."""
    dims = [("outer", outer), ("shard", shard), ("cp", cp), ("tp", tp)]
    return "-".join(f"{name}{size}" for name, size in dims if size > 1 or name == "shard")


def mesh_shape(shape: Sequence[int]) -> str:
    """A ``(dp_outer, dp_shard, cp, tp)`` tuple as :func:`mesh` writes it."""
    outer_size, shard, cp, tp = shape
    return mesh(shard, outer=outer_size, cp=cp, tp=tp)


def item(param: str, index: int | str,
         fmt: Callable[[Any], object] | None = None) -> Callable[[dict[str, Any]], object]:
    """A matrix value taken from one element (index or attribute) of a parametrisation argument."""
    def value(params: dict[str, Any]) -> object:
        arg = params[param]
        got = arg[index] if isinstance(arg, (dict, list, tuple)) else getattr(arg, str(index))
        return fmt(got) if fmt is not None else got
    return value
