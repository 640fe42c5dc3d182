"""The sign-off stays readable, and its files small, however many tests fail or golden cells drift
(issue 52: 3,000 drifting cells x 300 steps made a 91 MB ``summary.json``; 15,000 failures a
1.7 MB "Failures by rank" table). The long lists are capped in the report and ``summary.json``,
with their counts; ``details.json`` next to the report holds every row, once.

The input: 10,000 failing unit tests (a 500-character traceback each, 8 ranks) and 10,000 drifting
golden cells (2 series). The cells the report shows (the first 200; the first 20 plotted, with
their curves in ``summary.json``) have 300 steps, the issue's length; the other 9,800 have 10, which
keeps the input at 23 MB: they reach the capped files only if a cap is broken, and then by
megabytes. Measured on this input (2026-12-05): summary.json 587,294 bytes, report.html 900,379,
report.md 97,144, details.json 15.9 MB.
"""

from __future__ import annotations

import html
import json
import pathlib

import pytest
from report_helpers import section

from harness.report import signoff

FAILURES, DRIFTING, SHOWN, LONG_STEPS, SHORT_STEPS = 10_000, 10_000, 200, 300, 10
# The bounds launch_scripts/README.md states (The sign-off report), with room above the measured sizes.
SUMMARY_BOUND, HTML_BOUND, MD_BOUND = 1_000_000, 1_250_000, 250_000


def golden_property(cell: str, steps: int) -> str:
    run = [3.0 - 0.001 * k for k in range(steps)]
    golden = [v * (1 + 1e-6 * (k > 0)) for k, v in enumerate(run)]
    series = {name: {"run": run, "golden": golden, "tolerance": 0.0, "max_rel_drift": 1e-6, "first_drift_step": 1}
              for name in ("loss", "grad_norm")}
    return json.dumps({"cell": cell, "platform": "cpu", "path": f"tests/golden/cpu/{cell}.json", "status": "drift",
                       "golden_versions": {"git": "abc1234", "torch": "2.13.0+cpu"}, "series": series})


def write_inputs(out: pathlib.Path) -> None:
    out.mkdir(parents=True)
    body = html.escape("def test_x():\n>       assert value == expected\nE       AssertionError: assert 1 == 2\n" * 5)
    with open(out / "unit.xml", "w", encoding="utf-8") as f:
        f.write('<testsuites><testsuite name="cpu/L0_unit">')
        for i in range(FAILURES):
            f.write(f'<testcase classname="tests.unit.test_mod{i % 100:03d}" name="test_case_{i:05d}" time="0.1">'
                    f'<properties><property name="rank{i % 8}" value="failed"/></properties>'
                    f'<failure message="AssertionError: assert 1 == 2 (case {i})">{body}</failure></testcase>')
        f.write("</testsuite></testsuites>")
    with open(out / "golden.xml", "w", encoding="utf-8") as f:
        f.write('<testsuites><testsuite name="cpu/L0_functional">')
        for i in range(DRIFTING):
            cell = f"c{i:05d}"
            value = html.escape(golden_property(cell, LONG_STEPS if i < SHOWN else SHORT_STEPS), quote=True)
            f.write(f'<testcase classname="tests.functional.test_golden" name="test_golden[{cell}]" time="1.0">'
                    f'<properties><property name="golden" value="{value}"/></properties>'
                    f'<failure message="golden cell {cell} drifted">E   Failed: drifted</failure></testcase>')
        f.write("</testsuite></testsuites>")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("bounds")
    write_inputs(tmp / "in")
    assert signoff.main(["--junit", str(tmp / "in"), "--out-dir", str(tmp / "out")]) == signoff.EXIT_FAIL
    return tmp / "out"


def test_summary_and_html_stay_under_the_stated_bound(big) -> None:
    sizes = {name: (big / name).stat().st_size for name in ("summary.json", "report.html", "report.md")}
    assert sizes["summary.json"] < SUMMARY_BOUND, sizes
    assert sizes["report.html"] < HTML_BOUND, sizes
    assert sizes["report.md"] < MD_BOUND, sizes


def test_capped_lists_say_how_many_and_where_the_rest_is(big) -> None:
    md = (big / "report.md").read_text()
    failures = section(md, "## Failures by rank")
    assert failures.count("\n| `tests/") == SHOWN
    assert ("... and 19,800 more failing tests (20,000 in all; the table lists the first 200; every one is in "
            "`details.json`).") in failures
    numerics = section(md, "## Numerics vs golden")
    assert "10000 golden cell(s) on cpu: 10000 DRIFT." in numerics
    assert ("... and 9,800 more problem cells (10,000 in all; the table lists the first 200; every one is in "
            "`details.json`).") in numerics
    assert "<summary>Every golden cell (10000 rows; the first 200 listed)</summary>" in numerics
    assert numerics.count("### Drift: ") == 20 and "... and 9980 more drifting cells" in numerics
    data = json.loads((big / "summary.json").read_text())
    assert (len(data["failures"]), data["failures_total"]) == (SHOWN, FAILURES + DRIFTING)
    assert (len(data["golden"]), data["golden_total"]) == (SHOWN, DRIFTING)
    assert sum("run" in g["series"]["loss"] for g in data["golden"]) == 20  # the plotted cells' curves
    assert data["details"] == "details.json"


def test_details_json_holds_every_failure_and_curve_once(big) -> None:
    data = json.loads((big / "details.json").read_text())
    assert len(data["failures"]) == FAILURES + DRIFTING and len(data["golden"]) == DRIFTING
    assert len({f["id"] for f in data["failures"]}) == FAILURES + DRIFTING
    steps = [len(g["series"]["loss"]["run"]) for g in data["golden"]]
    assert steps.count(LONG_STEPS) == SHOWN and steps.count(SHORT_STEPS) == DRIFTING - SHOWN
    assert [f["cause"] for f in data["failures"][:1]] == ["golden cell c00000 drifted"]  # by run, then test id


def small_run(path: pathlib.Path, failures: int) -> pathlib.Path:
    cases = "".join(f'<testcase classname="tests.unit.test_u" name="test_{i:03d}"><failure message="bad {i}"/>'
                    "</testcase>" for i in range(failures))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'<testsuites><testsuite name="cpu/L0_unit">{cases}</testsuite></testsuites>')
    return path


def test_details_go_next_to_the_report_or_where_asked(tmp_path, capsys) -> None:
    xml = small_run(tmp_path / "in" / "run.xml", SHOWN + 1)
    assert signoff.main(["--junit", str(xml), "--json", str(tmp_path / "j" / "s.json")]) == signoff.EXIT_FAIL
    assert len(json.loads((tmp_path / "j" / "details.json").read_text())["failures"]) == SHOWN + 1
    target = tmp_path / "elsewhere" / "all.json"
    assert signoff.main(["--junit", str(xml), "--out-dir", str(tmp_path / "o"), "--details", str(target)]) == 1
    assert f"every one is in `{target}`" in (tmp_path / "o" / "report.md").read_text()
    assert not (tmp_path / "o" / "details.json").exists() and target.exists()
    capsys.readouterr()
    assert signoff.main(["--junit", str(xml)]) == signoff.EXIT_FAIL  # Markdown to stdout: no files at all
    assert ("... and 1 more failing tests (201 in all; the table lists the first 200; write the report to files "
            "(`--out-dir`) for `details.json`, which lists every one).") in capsys.readouterr().out
