"""Fixtures, parametrisation, skip/xfail, requirement markers and pytest-forked inside the harness."""
from __future__ import annotations

import pytest
from harness_selftest import SampleRun, run_samples, run_samples_once


@pytest.fixture(scope="session")
def features_run(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return run_samples_once(tmp_path_factory, "features", "sample_fixtures.py", "sample_requirements.py",
                            "sample_forked.py")


def test_fixture_and_param_cases_pass(features_run: SampleRun):
    prefixes = ("test_shared", "test_module", "test_parametrized", "test_env", "test_monkeypatch",
                "test_session_shared", "test_plain", "test_has_json", "test_forked_ok", "test_distributed_after_forked")
    expected_pass = [n for n in features_run.cases if n.startswith(prefixes)]
    assert len(expected_pass) == 21, expected_pass  # 9 parametrised + 12 others
    bad = {n: features_run.cases[n].text[:1500] for n in expected_pass if features_run.cases[n].outcome != "passed"}
    assert bad == {}


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
    if _requirement_met_here(name):  # a GPU node: the requirement holds, so the test must run and pass
        assert case.outcome == "passed", case.text[:1500]
        return
    assert case.outcome == "skipped" and reason in case.message, case.message


def _requirement_met_here(name: str) -> bool:
    """Whether this machine satisfies the sample's requirement (2 ranks, one GPU each)."""
    import importlib.util

    import torch

    if name == "test_needs_te":
        return importlib.util.find_spec("transformer_engine") is not None
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    if name == "test_needs_hopper":
        return min(torch.cuda.get_device_capability(i) for i in range(2)) >= (9, 0)
    return True


def test_forked_crash_reported_by_pytest_forked(features_run: SampleRun):
    case = features_run.cases["test_forked_crash"]
    assert case.outcome in ("failed", "error") and "SIGSEGV" in (case.message + case.text)
    assert features_run.cases["test_distributed_after_forked"].outcome == "passed"


def test_force_cpu_env_names_the_reason(tmp_path):
    run = run_samples(tmp_path, "sample_requirements.py", env={"HARNESS_FORCE_CPU": "1"}, timeout=300)
    assert "CPU backend forced" in run.cases["test_needs_cuda"].message
    assert run.cases["test_has_json"].outcome == "passed"
