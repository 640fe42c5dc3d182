"""The seed suite's matrix axes (tests/functional/README.md), declared here so the ported test file
keeps the original's marks and bodies.

Its tests name their configuration with the original's parametrisation arguments; this maps those
names (and only those) to the sign-off's axes. Without the harness plugin (``-p no:fsdp_harness``)
nothing is declared: the ``matrix`` marker and its resolution are the plugin's.
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from tests.functional import matrix_axes as axes

RECIPES = {"fp8_delayed_scaling": "delayed", "fp8_current_scaling": "current",
           "fp8_blockwise_scaling": "blockwise", "mxfp8_blockwise": "mxfp8"}


def _first(params: dict[str, Any], *names: str) -> Any:
    return next((params[n] for n in names if n in params), None)


def _mesh(params: dict[str, Any]) -> str | None:
    shape = _first(params, "mesh_dim_config")  # (dp_outer, dp_shard, cp, tp)
    return axes.mesh_shape(shape) if shape is not None else None


def _zero(params: dict[str, Any]) -> str | None:
    strategy = _first(params, "dp_shard_strategy", "shard_strategy")
    return axes.zero(strategy) if strategy is not None else None


def _outer(params: dict[str, Any]) -> str | None:
    return axes.outer(_first(params, "dp_outer_strategy", "outer_shard_strategy"))


def _recipe(params: dict[str, Any]) -> str | None:
    name = params.get("te_recipe")
    return RECIPES.get(name, name) if name is not None else None


def _graph(test_name: str) -> Any:
    def graph(params: dict[str, Any]) -> str:
        if "cuda_graph" in test_name:
            return "cuda_graph"
        return "compile" if (params.get("common_args") or {}).get("torch_compile") else "eager"
    return graph


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Generator[None, Any, Any]:
    """Put the axes on each test function before the harness resolves them for its items."""
    if (callable(obj) and name.startswith("test") and collector.config.pluginmanager.hasplugin("fsdp_harness_matrix")):
        pytest.mark.matrix(mesh=_mesh, zero=_zero, outer=_outer, model=lambda p: p.get("model_type"),
                           recipe=_recipe, graph=_graph(name))(obj)
    return (yield)
