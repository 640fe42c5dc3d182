"""The sign-off report against hand-written JUnit fixtures whose contents are known.

Every expected number below is counted by hand from ``data/*.xml`` (see the comments
there), so a wrong parser, count, diff or verdict fails these tests. These inputs carry no
sidecar and no matrix axes; ``test_signoff_golden.py`` covers the sidecar-based sections.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
from report_helpers import run_main, table_rows

from harness.report import signoff
from harness.report.diff import baseline_diff
from harness.report.junit_read import (
    ERROR,
    FAILED,
    PASSED,
    SKIPPED,
    XFAILED,
    JunitError,
    failing_ranks,
    one_line_cause,
    read_junit,
)
from harness.report.regressions import parse_required_regressions, regression_rows

DATA = pathlib.Path(__file__).parent / "data"
REPO = pathlib.Path(__file__).resolve().parents[3]
KNOWN_BUGS = DATA / "known_bugs_decoupled.txt"  # the fixtures' bugs (the live list grows)
LIVE_KNOWN_BUGS = REPO / "launch_scripts" / "known_bugs.txt"
CURRENT, BASELINE, ALL_GREEN = DATA / "current.xml", DATA / "baseline.xml", DATA / "all_green.xml"


def by_id(cases):
    return {c.test_id: c for c in cases}


def test_parse_outcomes_and_ids() -> None:
    cases = by_id(read_junit([CURRENT]))
    assert len(cases) == 13
    assert cases["tests/unit/test_sharding.py::TestPadding::test_pad_to_world"].outcome == PASSED
    assert cases["tests/unit/test_policy.py::test_fp8_policy"].outcome == SKIPPED
    assert cases["tests/functional/test_ckpt.py::test_resume"].outcome == ERROR
    assert cases["tests/functional/test_ckpt.py::test_known_broken"].outcome == XFAILED
    failed = cases["tests/functional/test_zero.py::test_train[optim_grads_params-4]"]
    assert failed.outcome == FAILED
    assert failed.suite == "tests/functional"
    assert failed.params == (("strategy", "optim_grads_params"), ("world_size", "4"))
    assert failed.bracket_id == "optim_grads_params-4"


def test_counts_per_suite_and_total(capsys) -> None:
    code, report, _ = run_main(["--junit", CURRENT], capsys)
    assert code == signoff.EXIT_FAIL
    (total,) = table_rows(report, "## Verdict: FAIL", "tests")  # rules, then the totals table
    assert total == {"tests": "13", "passed": "7", "flaky": "0", "failed": "2", "errors": "1",
                     "skipped": "2", "xfailed": "1", "not run": "0"}
    suites = {r["suite"]: r for r in table_rows(report, "### Per suite")}
    assert suites["tests/unit"] == {"suite": "tests/unit", "tests": "4", "passed": "3", "flaky": "0",
                                    "failed": "0", "errors": "0", "skipped": "1", "xfailed": "0",
                                    "not run": "0"}
    assert suites["tests/functional"] == {"suite": "tests/functional", "tests": "9", "flaky": "0",
                                          "passed": "4", "failed": "2", "errors": "1",
                                          "skipped": "1", "xfailed": "1", "not run": "0"}
    files = {r["file"]: r for r in table_rows(report, "### Per test file")}
    assert files["tests/functional/test_zero.py"]["tests"] == "4"
    assert files["tests/functional/test_zero.py"]["failed"] == "1"


def test_unit_test_parameters_never_make_a_matrix(tmp_path, capsys) -> None:
    """Parametrised tests without declared axes (``param:*`` or bare ids) are not matrix cells."""
    xml = tmp_path / "bare.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.unit.test_a" name="test_x[2-cpu]"/>'
                   '<testcase classname="tests.unit.test_a" name="test_x[4-cpu]"><properties>'
                   '<property name="param:bad" value="None"/></properties></testcase>'
                   "</testsuite></testsuites>")
    for source in (CURRENT, xml):
        _, report, _ = run_main(["--junit", source], capsys)
        section = report.split("## Configuration matrix")[1].split("\n## ")[0]
        assert "No test declares matrix axes" in section
        assert "bad" not in section and "world_size" not in section


def test_failures_list_ranks_and_cause(capsys) -> None:
    _, report, _ = run_main(["--junit", CURRENT], capsys)
    rows = {r["test"]: r for r in table_rows(report, "## Failures by rank", "test")}
    assert len(rows) == 3
    train = rows["`tests/functional/test_zero.py::test_train[optim_grads_params-4]`"]
    assert train["failing ranks"] == "1, 3"  # from rankN properties
    assert train["cause"].startswith("ranks [1, 3] failed: loss mismatch")
    crash = rows["`tests/functional/test_decoupled.py::test_flag_mismatch[bf16]`"]
    assert crash["failing ranks"] == "2"  # from the failure text: no rank properties
    assert "signal 11" in crash["cause"]
    setup = rows["`tests/functional/test_ckpt.py::test_resume`"]
    assert (setup["outcome"], setup["failing ranks"]) == ("error", "-")
    assert "store port in use" in setup["cause"]


@pytest.mark.parametrize(("props", "text", "expected"), [
    ((("rank0", "passed"), ("rank1", "failed"), ("rank2", "died")), "", [1, 2]),
    ((("rank3=failed", ""), ("rank1=passed", "")), "", [3]),
    ((("failed_ranks", "0, 5"),), "", [0, 5]),
    ((("rank0", "passed"),), "rank 1 failed", []),  # properties are authoritative
    ((), "rank 0 failed first; rank(s) [1, 3] did not finish", [0, 1, 3]),
    ((), "[rank7]: RuntimeError: NCCL error", [7]),
    ((), "assert 1 == 2", []),  # no rank information at all
    ((), "rank 2 last output lines", []),  # a heading without a failure word
])
def test_failing_ranks_sources(props, text, expected) -> None:
    from harness.report.junit_read import TestCase
    case = TestCase(run="r", classname="tests.t", name="test_x", outcome=FAILED,
                    message=text, properties=props)
    assert failing_ranks(case) == expected


def test_one_line_cause_prefers_message_then_e_lines() -> None:
    from harness.report.junit_read import TestCase
    long = TestCase("r", "t", "x", FAILED, message="x" * 500)
    assert len(one_line_cause(long)) == 160 and one_line_cause(long).endswith("...")
    no_msg = TestCase("r", "t", "x", FAILED, details="def f():\nE   ValueError: bad\nE   more")
    assert one_line_cause(no_msg) == "more"
    empty = TestCase("r", "t", "x", FAILED)
    assert one_line_cause(empty) == "(no message)"


def test_every_skip_listed_with_reason(capsys) -> None:
    _, report, _ = run_main(["--junit", CURRENT], capsys)
    reasons = {r["reason"]: r["count"] for r in table_rows(report, "## Skipped tests")}
    assert reasons == {"skipped: requires CUDA: no GPU visible": "1",
                       "skipped: requires GPU arch sm_89+, found cpu": "1",
                       "xfailed: uneven shards not yet supported": "1"}
    listed = table_rows(report, "<details><summary>All 3 skipped tests</summary>")
    assert {r["test"] for r in listed} == {
        "`tests/unit/test_policy.py::test_fp8_policy`",
        "`tests/functional/test_decoupled.py::test_flag_mismatch[fp8]`",
        "`tests/functional/test_ckpt.py::test_known_broken`"}


def test_regression_table_and_failing_verdict(capsys) -> None:
    code, report, _ = run_main(["--junit", CURRENT, "--require-regressions", KNOWN_BUGS], capsys)
    assert code == signoff.EXIT_FAIL
    rows = {r["bug id"]: r for r in table_rows(report, "## Known bugs and their regression tests")}
    assert set(rows) == {"`decoupled-grad-none-segfault`",
                         "`decoupled-grad-flag-mismatch-silent-no-op`"}
    assert rows["`decoupled-grad-none-segfault`"]["status"] == "passed"
    mismatch = rows["`decoupled-grad-flag-mismatch-silent-no-op`"]
    assert (mismatch["status"], mismatch["required"]) == ("FAILED", "yes")
    assert mismatch["tests"] == "0 passed, 1 failed, 1 skipped"
    assert "- no failures: 2 test(s) failed; 1 test(s) errored" in report
    assert "- required regressions: `decoupled-grad-flag-mismatch-silent-no-op` is FAILED" in report


def test_descriptions_pair_with_their_ids() -> None:
    from harness.report.junit_read import TestCase
    case = TestCase("r", "t", "x", PASSED, properties=(
        ("regression", "bug-a"), ("regression_description", "about a"),
        ("regression", "bug-b"), ("regression_description", "about b")))
    rows = {r.bug_id: r for r in regression_rows([case], {})}
    assert rows["bug-a"].description == "about a" and rows["bug-b"].description == "about b"


def test_all_green_passes_with_required_regressions(tmp_path, capsys) -> None:
    out = tmp_path / "sub" / "signoff.md"
    code, stdout, _ = run_main(["--junit", ALL_GREEN, "--require-regressions", KNOWN_BUGS,
                                "--output", out, "--title", "Release 1.2 sign-off"], capsys)
    assert code == signoff.EXIT_PASS
    assert "PASS (4 tests)" in stdout
    report = out.read_text()
    assert report.startswith("# Release 1.2 sign-off\n")
    assert "## Verdict: PASS" in report
    rows = {r["bug id"]: r["status"]
            for r in table_rows(report, "## Known bugs and their regression tests")}
    # one variant skipped on CPU, one passed: the regression is covered
    assert rows["`decoupled-grad-flag-mismatch-silent-no-op`"] == "passed"


@pytest.mark.parametrize(("listed", "status"), [
    ("never-tested-bug", "missing"),
    ("decoupled-grad-only-skipped", "skipped"),
])
def test_required_regression_missing_or_skipped_fails(tmp_path, capsys, listed, status) -> None:
    xml = tmp_path / "run.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="tests.f.test_d" name="test_s">'
        '<properties><property name="regression" value="decoupled-grad-only-skipped"/>'
        '</properties><skipped type="pytest.skip" message="needs GPU"/></testcase>'
        "</testsuite></testsuites>")
    required = tmp_path / "bugs.txt"
    required.write_text(f"# comment\n\n{listed}  why it matters\n")
    code, report, _ = run_main(["--junit", xml, "--require-regressions", required], capsys)
    assert code == signoff.EXIT_FAIL
    assert f"`{listed}` is {status}" in report.split("### Rules")[0]


def test_unrequired_regression_failure_still_fails_only_through_counts(capsys) -> None:
    code, report, _ = run_main(["--junit", CURRENT], capsys)
    assert code == signoff.EXIT_FAIL
    assert "required regressions:" not in report.split("## Verdict")[1].split("### Rules")[0]


def test_toml_required_list(tmp_path) -> None:
    toml = tmp_path / "bugs.toml"
    toml.write_text('regressions = ["bug-a", {id = "bug-b", description = "about b"}]\n')
    assert parse_required_regressions(toml) == {"bug-a": "", "bug-b": "about b"}
    toml.write_text('regressions = [1]\n')
    with pytest.raises(JunitError, match=r"regressions\[0\] must be a string"):
        parse_required_regressions(toml)


def test_known_bugs_file_lists_the_known_bugs() -> None:
    required = parse_required_regressions(LIVE_KNOWN_BUGS)
    assert set(required) == {"decoupled-grad-none-segfault", "decoupled-grad-flag-mismatch-silent-no-op",
                             "fused-optimizer-stale-compute-weights"}
    assert all(required.values())
    assert set(parse_required_regressions(KNOWN_BUGS)) < set(required)


def test_baseline_diff_by_test_id(capsys) -> None:
    diff = baseline_diff(read_junit([CURRENT]), read_junit([BASELINE]))
    assert [k for k, _, _ in diff.new_failures.shown] == [
        "tests/functional/test_decoupled.py::test_flag_mismatch[bf16]",
        "tests/functional/test_zero.py::test_train[optim_grads_params-4]"]
    assert diff.fixes.shown == [
        ("tests/functional/test_zero.py::test_train[optim_grads_params-2]", FAILED, PASSED)]
    assert diff.other_changes.shown == [("tests/functional/test_ckpt.py::test_resume", FAILED, ERROR)]
    assert diff.newly_skipped.total == 0 and diff.skip_rise == []
    assert diff.added.shown == ["tests/unit/test_sharding.py::test_empty_shard"]
    assert diff.vanished.shown == ["tests/unit/test_sharding.py::test_old_api"]
    _, report, _ = run_main(["--junit", CURRENT, "--baseline", BASELINE], capsys)
    assert "**New failures** (2)" in report and "**Vanished tests** (1)" in report
    assert f"Baseline: `{BASELINE}`" in report
    assert "| `tests/unit/test_sharding.py::test_empty_shard` |" in report


def test_baseline_diff_keeps_runs_apart_when_labels_match(tmp_path) -> None:
    for side, src in (("now", CURRENT), ("before", BASELINE)):
        for gen in ("h100", "b200"):
            (tmp_path / side / gen).mkdir(parents=True)
            shutil.copy(src if gen == "h100" else ALL_GREEN, tmp_path / side / gen / "L0.xml")
    now = read_junit([tmp_path / "now"])
    assert {c.run for c in now} == {"h100/L0", "b200/L0"}
    diff = baseline_diff(now, read_junit([tmp_path / "before"]))
    assert [k for k, _, _ in diff.new_failures.shown] == [
        "h100/L0 :: tests/functional/test_decoupled.py::test_flag_mismatch[bf16]",
        "h100/L0 :: tests/functional/test_zero.py::test_train[optim_grads_params-4]"]
    assert diff.added.shown == ["h100/L0 :: tests/unit/test_sharding.py::test_empty_shard"]


def test_suite_name_labels_the_run(tmp_path) -> None:
    xml = tmp_path / "x.xml"
    xml.write_text('<testsuites><testsuite name="cpu/L0_unit">'
                   '<testcase classname="tests.unit.test_a" name="test_b"/></testsuite></testsuites>')
    assert read_junit([xml])[0].run == "cpu/L0_unit"


def test_bare_testsuite_root_and_collection_error(tmp_path) -> None:
    xml = tmp_path / "x.xml"
    xml.write_text('<testsuite name="pytest"><testcase classname="" name="tests.unit.test_broken">'
                   '<error message="collection failure">E   ImportError: no module x</error>'
                   "</testcase></testsuite>")
    (case,) = read_junit([xml])
    assert (case.test_id, case.suite, case.outcome) == (
        "tests/unit/test_broken.py", "tests/unit", ERROR)
    assert one_line_cause(case) == "ImportError: no module x"


def test_module_skipped_at_collection_is_attributed_to_its_file(tmp_path, capsys) -> None:
    """pytest writes a module skipped as a whole (``pytest.importorskip`` or ``pytest.skip(...,
    allow_module_level=True)``) as classname "" and the reason inside a tuple's repr (as pytest 9 does)."""
    xml = tmp_path / "x.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="" name="tests.functional.test_te_only" time="0.000">'
        '<skipped message="collection skipped">(\'/ci/tests/functional/test_te_only.py\', 2, "Skipped: could not '
        "import 'transformer_engine': No module named 'transformer_engine'\")</skipped></testcase>"
        '<testcase classname="tests.unit.test_a" name="test_b"/></testsuite></testsuites>')
    (case, _) = read_junit([xml])
    assert (case.test_id, case.module_path, case.suite) == (
        "tests/functional/test_te_only.py", "tests/functional/test_te_only.py", "tests/functional")
    assert one_line_cause(case) == "could not import 'transformer_engine': No module named 'transformer_engine'"
    _, report, _ = run_main(["--junit", xml], capsys)
    assert "<unknown>" not in report and "| . |" not in report
    files = {r["file"]: r["skipped"] for r in table_rows(report, "### Per test file")}
    assert files == {"tests/functional/test_te_only.py": "1", "tests/unit/test_a.py": "0"}
    reasons = {r["reason"]: r["count"] for r in table_rows(report, "## Skipped tests")}
    assert reasons == {"skipped: could not import 'transformer_engine': No module named 'transformer_engine'": "1"}


def test_empty_run_fails(tmp_path, capsys) -> None:
    xml = tmp_path / "empty.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    code, report, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL
    assert "- tests ran: no test results" in report


@pytest.mark.parametrize(("content", "message"), [
    (None, "JUnit path not found"),
    ("<testsuites><testsuite>", "is not well-formed XML"),
    ("<html><body/></html>", "root element is <html>, expected <testsuites> or <testsuite>"),
])
def test_bad_junit_input_exits_2(tmp_path, capsys, content, message) -> None:
    xml = tmp_path / "in.xml"
    if content is not None:
        xml.write_text(content)
    code, out, err = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_BAD_INPUT
    assert out == ""
    assert err.startswith("harness-signoff: error: ") and message in err and str(xml) in err


def test_bad_directory_and_required_list_exit_2(tmp_path, capsys) -> None:
    code, _, err = run_main(["--junit", tmp_path], capsys)
    assert code == signoff.EXIT_BAD_INPUT and "no *.xml files under directory" in err
    bugs = tmp_path / "bugs.txt"
    bugs.write_text("good-id\nBad_Id some text\n")
    code, _, err = run_main(["--junit", ALL_GREEN, "--require-regressions", bugs], capsys)
    assert code == signoff.EXIT_BAD_INPUT
    assert f"{bugs}:2: bug id 'Bad_Id' is not kebab-case" in err
    code, _, err = run_main(["--junit", ALL_GREEN, "--require-regressions", tmp_path / "no"],
                            capsys)
    assert code == signoff.EXIT_BAD_INPUT and "cannot read --require-regressions" in err
    code, _, err = run_main(["--junit", ALL_GREEN, "--baseline", tmp_path / "nope.xml"], capsys)
    assert code == signoff.EXIT_BAD_INPUT and "nope.xml" in err


def test_missing_junit_option_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        signoff.main([])
    assert exc.value.code == 2
    assert "--junit" in capsys.readouterr().err


def test_module_entry_point_exit_codes(tmp_path) -> None:
    """``python -m harness.report.signoff`` propagates PASS/FAIL as 0/1 to the shell."""
    for xml, expected in ((ALL_GREEN, 0), (CURRENT, 1)):
        proc = subprocess.run([sys.executable, "-m", "harness.report.signoff", "--junit", str(xml),
                               "--output", str(tmp_path / "r.md")],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == expected, proc.stderr


def test_several_runs_get_a_per_run_table_and_prefixed_cells(tmp_path, capsys) -> None:
    for gen, src in (("cpu", ALL_GREEN), ("h100", CURRENT)):
        (tmp_path / gen).mkdir()
        shutil.copy(src, tmp_path / gen / "L0_unit.xml")
    code, report, _ = run_main(["--junit", tmp_path, "--require-regressions", KNOWN_BUGS], capsys)
    assert code == signoff.EXIT_FAIL
    runs = {r["run"]: r for r in table_rows(report, "### Per run")}
    assert (runs["cpu/L0_unit"]["tests"], runs["cpu/L0_unit"]["failed"]) == ("4", "0")
    assert (runs["h100/L0_unit"]["tests"], runs["h100/L0_unit"]["failed"]) == ("13", "2")
    rows = {r["bug id"]: r for r in table_rows(report, "## Known bugs and their regression tests")}
    # one run's failure fails the bug, whatever the other run did
    assert rows["`decoupled-grad-flag-mismatch-silent-no-op`"]["status"] == "FAILED"
    assert rows["`decoupled-grad-flag-mismatch-silent-no-op`"]["tests"] == "1 passed, 1 failed, 2 skipped"


def test_console_script_when_installed(tmp_path) -> None:
    exe = shutil.which("harness-signoff") or shutil.which(
        "harness-signoff", path=str(pathlib.Path(sys.executable).parent))
    if exe is None:
        pytest.skip("harness-signoff console script not installed (pip install -e .)")
    proc = subprocess.run([exe, "--junit", str(ALL_GREEN), "--output", str(tmp_path / "r.md")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "## Verdict: PASS" in (tmp_path / "r.md").read_text()


def test_xunit1_file_attribute_disambiguates_module_and_class(tmp_path) -> None:
    xml = tmp_path / "x1.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.unit.Test_upper.TestA" name="test_b" '
                   'file="tests/unit/Test_upper.py" line="3"/>'
                   '<testcase classname="tests.unit.Test_upper.TestA" name="test_c"/>'
                   "</testsuite></testsuites>")
    with_file, without = read_junit([xml])
    assert with_file.test_id == "tests/unit/Test_upper.py::TestA::test_b"
    # without the attribute an upper-case module name reads as a class (documented limit)
    assert without.test_id == "tests/unit.py::Test_upper::TestA::test_c"


def test_axis_values_sort_naturally(tmp_path, capsys) -> None:
    xml = tmp_path / "n.xml"
    cases = "".join(
        f'<testcase classname="tests.f.test_w" name="test_w[{w}]"><properties>'
        f'<property name="axis:mesh" value="dp{w}"/><property name="axis:zero" value="3"/></properties></testcase>'
        for w in (16, 2, 8, 1))
    xml.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    _, report, _ = run_main(["--junit", xml], capsys)
    rows = table_rows(report, "## Configuration matrix")
    assert [r["mesh"] for r in rows] == ["dp1", "dp2", "dp8", "dp16"]
    assert all(r["zero=3"] == "pass 1" for r in rows)


def test_a_file_named_twice_is_read_once(tmp_path) -> None:
    (tmp_path / "cpu").mkdir()
    shutil.copy(CURRENT, tmp_path / "cpu" / "L0.xml")
    cases = read_junit([tmp_path, tmp_path / "cpu" / "L0.xml"])
    assert len(cases) == 13
