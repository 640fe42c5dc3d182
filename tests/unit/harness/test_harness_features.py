"""Fixtures, parametrisation, skip/xfail, requirement markers and pytest-forked inside the harness."""
from __future__ import annotations

import pytest
from harness_selftest import SampleRun, run_samples, run_samples_once


@pytest.fixture(scope="session")
def features_run(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return run_samples_once(tmp_path_factory, "features", "sample_fixtures.py", "sample_mixed_module.py",
                            "sample_mixed_next.py", "sample_requirements.py", "sample_forked.py",
                            "sample_state_leak.py")


def test_fixture_and_param_cases_pass(features_run: SampleRun):
    prefixes = ("test_shared", "test_module", "test_parametrized", "test_env", "test_monkeypatch",
                "test_session_shared", "test_plain", "test_has_json", "test_forked_ok", "test_distributed_after_forked")
    expected_pass = [n for n in features_run.cases if n.startswith(prefixes)]
    assert len(expected_pass) == 21, expected_pass  # 9 parametrised + 12 others
    bad = {n: features_run.cases[n].text[:1500] for n in expected_pass if features_run.cases[n].outcome != "passed"}
    assert bad == {}


def test_local_scope_torn_down_after_a_distributed_item(features_run: SampleRun):
    """A module's local test, then its distributed one, then another module: the first module's
    fixtures are finalised before the next module starts, and that module's test does not error
    with "previous item was not torn down properly" (it did before the controller tore down)."""
    cases = features_run.cases
    outcomes = {n: cases[n].outcome for n in ("test_mixed_local_first", "test_mixed_distributed_last",
                                              "test_mixed_next_module_sees_teardown")}
    assert set(outcomes.values()) == {"passed"}, {n: cases[n].text[:800] for n in outcomes}


def test_skip_xfail_and_disagreement(features_run: SampleRun):
    cases = features_run.cases
    assert cases["test_skip_everywhere"].outcome == "skipped"
    assert "skipped on every rank" in cases["test_skip_everywhere"].message
    assert cases["test_xfail"].outcome == "skipped"  # junit records xfail as skipped
    mixed = cases["test_skip_on_one_rank_only"]
    assert mixed.outcome == "failed" and "rank 1=skipped" in mixed.message


@pytest.mark.parametrize("name, reason", [
    ("test_needs_cuda", "CUDA (no GPU visible)"),
    ("test_needs_hopper", "GPU architecture sm90 (compute capability >= 9.0)"),
    ("test_needs_te", "Python module 'transformer_engine'"),
])
def test_requirement_skips_name_what_is_missing(features_run: SampleRun, name, reason):
    case = features_run.cases[name]
    missing = _missing_here(name, reason)
    if missing is None:  # a GPU node: the requirement holds, so the test must run and pass
        assert case.outcome == "passed", case.text[:1500]
        return
    assert case.outcome == "skipped" and missing in case.message, case.message


def _missing_here(name: str, reason: str) -> str | None:
    """What this machine lacks for the sample (2 ranks, one GPU each), as the skip reason says
    it, or None when nothing is missing. A one-GPU node lacks the second GPU first."""
    import importlib.util

    import torch

    if name == "test_needs_te":
        return None if importlib.util.find_spec("transformer_engine") is not None else reason
    if not torch.cuda.is_available():
        return reason
    if torch.cuda.device_count() < 2:
        return "2 GPUs, one per rank"
    if name == "test_needs_hopper" and min(torch.cuda.get_device_capability(i) for i in range(2)) < (9, 0):
        return reason
    return None


def test_forked_crash_reported_by_pytest_forked(features_run: SampleRun):
    case = features_run.cases["test_forked_crash"]
    assert case.outcome in ("failed", "error") and "SIGSEGV" in (case.message + case.text)
    assert features_run.cases["test_distributed_after_forked"].outcome == "passed"


def test_state_changed_by_a_test_is_restored_and_named(features_run: SampleRun):
    """Destroying the process group restarts the bucket; env, cwd and dtype are put back in place; the
    test that changed them is named (report property and warning), the next test is not blamed."""
    cases = {name.rsplit("::", 1)[-1]: c for name, c in features_run.cases.items()}
    names = ("test_destroys_process_group", "test_after_destroy", "test_changes_env_cwd_dtype", "test_after_changes")
    assert {n: cases[n].outcome for n in names} == dict.fromkeys(names, "passed"), features_run.output[-3000:]
    destroyed = cases["test_destroys_process_group"].prop("state_changed") or ""
    assert "default process group was destroyed" in destroyed and "rank 1:" in destroyed
    assert cases["test_destroys_process_group"].rank_props("pid") != cases["test_after_destroy"].rank_props("pid")
    changed = cases["test_changes_env_cwd_dtype"].prop("state_changed") or ""
    for what in ("CUDA_VISIBLE_DEVICES", "HARNESS_SAMPLE_LEAK", "SAMPLE_LEAK", "working directory", "default dtype"):
        assert what in changed, (what, changed)
    assert cases["test_changes_env_cwd_dtype"].rank_props("pid") == cases["test_after_changes"].rank_props("pid")
    assert cases["test_after_changes"].prop("state_changed") is None
    assert "HarnessStateWarning" in features_run.output and "test_changes_env_cwd_dtype changed" in features_run.output


def test_library_variables_do_not_cry_wolf(features_run: SampleRun):
    """A variable a library set for itself (at its first import inside the test, or inductor's
    internal one) is neither named nor restored; the test's own change in the same test still is."""
    cases = {name.rsplit("::", 1)[-1]: c for name, c in features_run.cases.items()}
    names = ("test_library_sets_env_for_itself", "test_after_library")
    assert {n: cases[n].outcome for n in names} == dict.fromkeys(names, "passed"), features_run.output[-3000:]
    changed = cases["test_library_sets_env_for_itself"].prop("state_changed") or ""
    assert "SAMPLE_LEAK_AFTER_IMPORT" in changed, changed
    assert "SAMPLE_LIB_AT_IMPORT" not in changed and "_TORCHINDUCTOR" not in changed, changed
    assert "SAMPLE_LIB_AT_IMPORT" not in features_run.output and "_TORCHINDUCTOR" not in features_run.output


def test_force_cpu_env_names_the_reason(tmp_path):
    run = run_samples(tmp_path, "sample_requirements.py", env={"HARNESS_FORCE_CPU": "1"}, timeout=300)
    assert "CPU backend forced" in run.cases["test_needs_cuda"].message
    assert run.cases["test_has_json"].outcome == "passed"
