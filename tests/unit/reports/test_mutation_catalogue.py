"""The mutation catalogue (tests/mutants): every mutant applies to today's code, and one whose
target is gone is reported as not applying instead of being run against the real code."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.mutants import catalogue, patching, runner

REPO = pathlib.Path(__file__).resolve().parents[3]
APPLY_ALL = """
from tests.mutants import catalogue, patching
patched = 0
for m in catalogue.MUTANTS:
    getattr(catalogue, m.name)()
    assert patching.APPLIED and not patching.verify(), (m.name, patching.verify())
    patched += len(patching.APPLIED)
    patching.undo()
print("APPLIED", patched)
"""


def test_catalogue_covers_the_known_bug_classes() -> None:
    assert len(catalogue.MUTANTS) >= 10
    assert len(catalogue.BY_NAME) == len(catalogue.MUTANTS)
    for mutant in catalogue.MUTANTS:
        assert callable(getattr(catalogue, mutant.name)), mutant.name
        assert mutant.narrow and mutant.bug_class


def test_every_mutant_applies() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", APPLY_ALL], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"APPLIED {len(catalogue.MUTANTS) + 1}" in out.stdout  # grads_summed patches two functions


def test_a_missing_target_does_not_apply() -> None:
    with pytest.raises(patching.MutantDoesNotApply, match="defines no 'no_such_function'"):
        patching.replace("fsdp_impl.comm:no_such_function", lambda original: None)
    with pytest.raises(patching.MutantDoesNotApply, match="cannot import"):
        patching.replace("fsdp_impl.no_such_module:f", lambda original: None)
    stale = catalogue.Mutant("no_such_mutant", "a mutant whose function was removed", ("tests",))
    assert "AttributeError" in (runner.applies(stale) or "")


def test_undo_down_to_keeps_the_earlier_patches() -> None:
    """A test that applies a mutant for a block undoes only its own patches: a mutant of the
    whole run (applied first) stays in place."""
    import fsdp_impl.comm as comm

    originals = (comm.all_gather, comm.all_reduce_max)
    try:
        patching.replace("fsdp_impl.comm:all_gather", lambda original: lambda *a, **k: "run mutant")
        depth = len(patching.APPLIED)
        patching.replace("fsdp_impl.comm:all_reduce_max", lambda original: lambda *a, **k: "block mutant")
        patching.undo(down_to=depth)
        assert comm.all_reduce_max is originals[1]
        assert comm.all_gather() == "run mutant" and not patching.verify()
    finally:
        patching.undo()
    assert (comm.all_gather, comm.all_reduce_max) == originals


def test_numerics_changing_mutants_say_when() -> None:
    """The golden cells must kill every mutant that changes numerics (``runner --golden``); a
    GPU-only one still says when it changes them."""
    numerics = {m.name for m in catalogue.MUTANTS if m.numerics}
    assert {"grads_summed_not_averaged", "clip_grad_norm_local_only", "fp8_amax_not_reduced",
            "meta_init_rng_not_synchronised", "hsdp_outer_reduce_never"} <= numerics
    assert "root_prefetch_skipped" not in numerics and "harness_rank0_outcome_only" not in numerics
    assert all(m.numerics for m in catalogue.MUTANTS if m.numerics_gpu_only)


def test_golden_gate_counts_survivors_that_change_numerics_here() -> None:
    results = [{"name": "killed", "numerics": "always", "status": "killed"},
               {"name": "missed", "numerics": "always", "status": "survived"},
               {"name": "nccl", "numerics": "NCCL only", "numerics_gpu_only": True, "status": "survived"},
               {"name": "traffic", "numerics": None, "status": "survived"}]
    assert runner.numerics_gate(results, "cpu") == (["missed"], ["nccl"])
    assert runner.numerics_gate(results, "h200") == (["missed", "nccl"], [])
