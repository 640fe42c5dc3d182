"""Apply one mutant in every process of a run: ``HARNESS_MUTANT=package.module:function``.

Mutation testing measures the suite: a deliberately broken variant of the code under test (a
*mutant*) must make some test fail. The mutants themselves live with the tests; the harness only
calls the named function at the start of every process that runs tests or combines their results
(the controller, each xdist worker and each rank process inherit the variable), so the mutant is in
effect wherever the code it breaks runs. The function patches its target and raises if the target
does not exist; the harness turns that into a usage error (pytest exit status 4), which a mutation
runner reads as "did not apply", never as "killed".
"""
from __future__ import annotations

import importlib
import os

import pytest

ENV_MUTANT = "HARNESS_MUTANT"


def apply_from_env() -> str | None:
    """Apply the mutant named by ``HARNESS_MUTANT``; return its name (None when unset)."""
    spec = os.environ.get(ENV_MUTANT, "").strip()
    if not spec:
        return None
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise pytest.UsageError(f"{ENV_MUTANT}={spec!r}: expected 'package.module:function'")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        func()
    except Exception as exc:
        raise pytest.UsageError(f"{ENV_MUTANT}={spec!r} did not apply: {type(exc).__name__}: {exc}") from None
    return spec
