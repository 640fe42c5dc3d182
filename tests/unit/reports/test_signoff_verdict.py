"""Each verdict rule on the smallest input that breaks it, and what must not break the verdict.

An all-skipped run used to be a PASS (exit 0); a sign-off needs tests that ran and passed.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from report_helpers import run_main, table_rows

from harness.report import signoff


def junit(path: pathlib.Path, *cases: str, suite: str = "pytest") -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'<testsuites><testsuite name="{suite}">{"".join(cases)}</testsuite></testsuites>')
    return path


def case(name: str, inner: str = "", cls: str = "tests.functional.test_f") -> str:
    return f'<testcase classname="{cls}" name="{name}">{inner}</testcase>'


SKIP = '<skipped type="pytest.skip" message="requires CUDA: no GPU visible"/>'
FAIL = '<failure message="AssertionError: boom">E   AssertionError: boom</failure>'


def sidecar(xml: pathlib.Path, **fields: object) -> None:
    data = {"schema": "fsdp-harness-sidecar/1", "complete": True, "tests": {}, "expected": [], "unfinished": []}
    data.update(fields)
    xml.with_name(xml.stem + ".harness.json").write_text(json.dumps(data))


def rule_results(report: str) -> dict[str, str]:
    return {r["rule"]: r["result"] for r in table_rows(report, "### Rules")}


def test_all_skipped_is_not_a_pass(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case("test_a", SKIP), case("test_b", SKIP))
    code, report, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL
    assert "## Verdict: FAIL" in report
    assert "- tests ran: all 2 test(s) were skipped or never ran" in report


def test_all_skipped_is_not_a_pass_through_the_console_entry(tmp_path) -> None:
    xml = junit(tmp_path / "run.xml", case("test_a", SKIP))
    assert signoff.main(["--junit", str(xml), "--output", str(tmp_path / "r.md")]) == signoff.EXIT_FAIL


def test_empty_input_is_not_a_pass(tmp_path, capsys) -> None:
    code, report, _ = run_main(["--junit", junit(tmp_path / "run.xml")], capsys)
    assert code == signoff.EXIT_FAIL and "- tests ran: no test results" in report


def test_a_run_that_ran_nothing_fails_although_another_passed(tmp_path, capsys) -> None:
    junit(tmp_path / "cpu" / "L0_unit.xml", case("test_ok", cls="tests.unit.test_u"))
    junit(tmp_path / "cpu" / "L0_functional.xml", case("test_gpu", SKIP))
    code, report, _ = run_main(["--junit", tmp_path], capsys)
    assert code == signoff.EXIT_FAIL
    assert rule_results(report)["every run ran"] == "FAILED"
    assert "`cpu/L0_functional` all 1 test(s) were skipped or never ran" in report


def test_a_missing_run_is_an_error_case(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case("test_ok"))
    code, report, _ = run_main(["--junit", xml, "--missing-run", "cpu/L0_functional"], capsys)
    assert code == signoff.EXIT_FAIL
    results = rule_results(report)
    assert (results["every run ran"], results["no failures"]) == ("FAILED", "FAILED")
    rows = {r["test"]: r for r in table_rows(report, "## Failures by rank", "test")}
    assert rows["`cpu/L0_functional::<no results>`"]["outcome"] == "error"


def test_collected_but_never_reported_tests_are_not_run(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case("test_a"))
    sidecar(xml, expected=["tests/functional/test_f.py::test_a", "tests/functional/test_f.py::test_b"],
            tests={"tests/functional/test_f.py::test_a": {"outcome": "passed", "duration_s": 0.1, "axes": {}}})
    code, report, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL
    assert rule_results(report) == {"tests ran": "ok", "every run ran": "ok", "no failures": "ok",
                                    "nothing left unrun": "FAILED", "required regressions": "ok", "no mutant": "ok",
                                    "golden values": "ok", "checkpoint compatibility": "ok"}


def test_a_test_interrupted_mid_run_is_an_error(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case("test_a"))
    sidecar(xml, expected=["tests/functional/test_f.py::test_a", "tests/functional/test_f.py::test_b"],
            unfinished=["tests/functional/test_f.py::test_b"])
    code, report, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL
    assert "- no failures: 1 test(s) errored" in report
    assert rule_results(report)["nothing left unrun"] == "ok"  # it started: an error, not "never ran"


def test_a_mutant_run_is_never_a_signoff(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case("test_a"))
    sidecar(xml, mutant="tests.mutants.catalogue:grads_summed")
    code, report, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL
    assert "HARNESS_MUTANT=tests.mutants.catalogue:grads_summed" in report


@pytest.mark.parametrize("source", ["flaky directory", "--flaky-junit", "rerun"])
def test_flaky_tests_are_reported_and_do_not_gate(tmp_path, capsys, source) -> None:
    junit(tmp_path / "cpu" / "L0_unit.xml", case("test_ok"))
    args: list[object] = ["--junit", tmp_path]
    if source == "flaky directory":
        junit(tmp_path / "flaky" / "cpu" / "L0_racy.xml", case("test_racy", FAIL))
    elif source == "--flaky-junit":
        args += ["--flaky-junit", junit(tmp_path.parent / "quarantine" / "L0_racy.xml", case("test_racy", FAIL))]
    else:
        junit(tmp_path / "cpu" / "L0_more.xml", case("test_other"), case(
            "test_racy", '<properties><property name="harness_flaky" value="failed 1 of 2 attempts, then passed"/>'
                         "</properties>"))
    code, report, _ = run_main(args, capsys)
    assert code == signoff.EXIT_PASS, report
    flaky = table_rows(report, "## Flaky tests")
    assert [r["test"] for r in flaky] == ["`tests/functional/test_f.py::test_racy`"]
    assert flaky[0]["source"] == ("rerun" if source == "rerun" else "flaky script")


def test_a_flaky_test_never_counts_as_passed(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case(
        "test_racy", '<properties><property name="harness_flaky" value="failed 1 of 2 attempts, then passed"/>'
                     '<property name="regression" value="bug-x"/></properties>'))
    bugs = tmp_path / "bugs.txt"
    bugs.write_text("bug-x needs a real pass\n")
    code, report, _ = run_main(["--junit", xml, "--require-regressions", bugs], capsys)
    assert code == signoff.EXIT_FAIL
    results = rule_results(report)
    assert (results["tests ran"], results["required regressions"]) == ("FAILED", "FAILED")
    assert "`bug-x` is flaky" in report


NAMELESS = '<testcase time="0.000" />'  # what pytest's junitxml leaves for a test a KeyboardInterrupt stopped


def test_a_nameless_testcase_is_not_a_pass(tmp_path, capsys) -> None:
    """Before: counted as passed, so an interrupted run's JUnit alone gave PASS (issue 52, item 13)."""
    xml = junit(tmp_path / "run.xml", case("test_ok"), NAMELESS)
    code, md, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL and rule_results(md)["no failures"] == "FAILED"
    (totals,) = table_rows(md, "## Verdict: FAIL")
    assert (totals["tests"], totals["passed"], totals["errors"]) == ("2", "1", "1")
    assert "without a name or a result: pytest writes one for the test that was running" in md


def test_a_nameless_testcase_gives_way_to_the_sidecar_naming_the_test(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "run.xml", case("test_ok"), NAMELESS)
    sidecar(xml, expected=["tests/functional/test_f.py::test_ok", "tests/functional/test_f.py::test_hang"],
            unfinished=["tests/functional/test_f.py::test_hang"])
    code, md, _ = run_main(["--junit", xml], capsys)
    (totals,) = table_rows(md, "## Verdict: FAIL")
    assert (totals["tests"], totals["passed"], totals["errors"]) == ("2", "1", "1")  # the hang, counted once
    assert "`tests/functional/test_f.py::test_hang`" in md and "without a name" not in md
