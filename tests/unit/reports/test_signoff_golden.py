"""The sign-off's sections from golden JUnit + sidecar inputs (``data/golden``), counted by hand.

``now/cpu``: ``L0_functional`` (7 expected tests with matrix axes: 3 passed, 1 failed on rank 1,
1 flaky, 1 skipped, 1 never ran), ``L0_unit`` (2 passed, 1 skipped, no axes), ``L0_crashed`` (a
journal only: the session died while ``test_b`` ran; ``test_a`` passed, ``test_c`` never ran) and
``flaky/L0_quarantine`` (a failing test of a quarantined script). ``before/cpu`` is the baseline.
Gating totals: 13 tests = 6 passed, 1 flaky, 1 failed, 1 error, 2 skipped, 2 not run.
"""

from __future__ import annotations

import html.parser
import json
import pathlib

import pytest
from report_helpers import run_main, section, table_rows

from harness.report import signoff

GOLDEN = pathlib.Path(__file__).parent / "data" / "golden"
NOW, BEFORE, MUTANTS = GOLDEN / "now", GOLDEN / "before", GOLDEN / "mutants.json"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("signoff")
    bugs = out / "bugs.txt"
    bugs.write_text("decoupled-grad-none-segfault clip over None grads\nckpt-stale-weights stale weights\n")
    code = signoff.main(["--junit", str(NOW), "--baseline", str(BEFORE), "--require-regressions", str(bugs),
                         "--mutants", str(MUTANTS), "--out-dir", str(out / "report")])
    report = out / "report"
    return {"code": code, "md": (report / "report.md").read_text(), "html": (report / "report.html").read_text(),
            "json": json.loads((report / "summary.json").read_text()), "dir": report}


def test_sections_in_order(outputs) -> None:
    md = outputs["md"]
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    # A release manager's order: verdict, what changed (since the baseline run, since the last
    # release), the matrix, the failures, then the rest.
    assert headings == ["## Verdict: FAIL", "## Changes since baseline", "## Numerics vs golden",
                        "## Checkpoint compatibility", "## Speed vs baseline", "## Configuration matrix",
                        "## Failures by rank", "## Known bugs and their regression tests", "## Flaky tests",
                        "## Skipped tests", "## Results per suite and file", "## Slowest tests and buckets",
                        "## Environment", "## Mutation testing"]
    assert outputs["code"] == signoff.EXIT_FAIL


def test_verdict_rules_and_totals(outputs) -> None:
    md = outputs["md"]
    rules = {r["rule"]: (r["result"], r["evidence"]) for r in table_rows(md, "### Rules")}
    assert rules == {
        "tests ran": ("ok", "6 of 13 passed"),
        "every run ran": ("FAILED", "`cpu/L0_crashed` did not finish (no JUnit XML; rebuilt from its journal)"),
        "no failures": ("FAILED", "1 test(s) failed; 1 test(s) errored"),
        "nothing left unrun": ("FAILED", "2 test(s) never ran"),
        "required regressions": ("ok", "2 required, all passed"),
        "no mutant": ("ok", "none"),
        "golden values": ("ok", "no golden cell ran"),
        "checkpoint compatibility": ("ok", "no checkpoint-compatibility test ran"),
    }
    (total,) = table_rows(md, "## Verdict: FAIL", "tests")
    assert total == {"tests": "13", "passed": "6", "flaky": "1", "failed": "1", "errors": "1", "skipped": "2",
                     "xfailed": "0", "not run": "2"}
    runs = {r["run"]: r for r in table_rows(md, "### Per run")}
    assert runs["cpu/flaky/L0_quarantine"]["gating"] == "no (flaky script)"
    assert (runs["cpu/L0_crashed"]["complete"], runs["cpu/L0_crashed"]["errors"]) == ("NO", "1")
    assert "note: 1 test(s) passed only on a rerun" in md


def test_baseline_diff(outputs) -> None:
    diff = section(outputs["md"], "## Changes since baseline")
    assert "**New failures** (2)" in diff and "**Fixed** (1)" in diff
    assert "| `tests/functional/test_hang.py::test_b` | (new test) | error |" in diff
    assert "| `tests/functional/test_parity.py::test_parity[cnn-no_shard]` | passed | failed |" in diff
    assert "| `tests/functional/test_mesh_hsdp.py::test_hsdp[transformer-optim]` | failed | flaky |" in diff
    assert "**Newly skipped or not run** (2)" in diff
    assert "| `tests/functional/test_ckpt.py::test_resume[cnn-optim]` | passed | not run |" in diff
    assert "**Vanished tests** (1)" in diff and "`tests/functional/test_old.py::test_gone`" in diff
    assert "**Added tests** (3)" in diff
    assert table_rows(diff, "**Skip count rose** (1)") == [
        {"run": "all runs", "skipped before": "1", "skipped now": "4"}]


def test_baseline_diff_is_capped(capsys) -> None:
    _, md, _ = run_main(["--junit", NOW, "--baseline", BEFORE, "--diff-limit", "1"], capsys)
    diff = section(md, "## Changes since baseline")
    assert "**New failures** (2)" in diff and "**Added tests** (3)" in diff
    assert "`tests/functional/test_hang.py::test_b`" in diff
    assert "test_parity[cnn-no_shard]" not in diff and "test_hang.py::test_c" not in diff
    assert "... and 1 more" in diff and "... and 2 more" in diff


def test_matrix_cells_from_declared_axes_only(outputs) -> None:
    md = outputs["md"]
    matrix = section(md, "## Configuration matrix")
    assert ("Axes: `mesh`, `zero`, `outer`, `model`, `dtype`; columns: `zero`. 7 cells: 1 failed, 1 error, "
            "1 not run, 1 flaky, 2 passed, 1 skipped.") in matrix
    rows = table_rows(md, "## Configuration matrix")
    assert rows == [
        {"mesh": "dp2", "outer": "-", "model": "cnn", "dtype": "fp32", "zero=no_shard": "FAILED 1",
         "zero=optim": "NOT RUN 1", "zero=optim_grads_params": "pass 2"},
        {"mesh": "dp2", "outer": "-", "model": "decoupled_net", "dtype": "bf16", "zero=no_shard": "",
         "zero=optim": "", "zero=optim_grads_params": "pass 1"},
        {"mesh": "dp4", "outer": "-", "model": "-", "dtype": "-", "zero=no_shard": "", "zero=optim": "",
         "zero=optim_grads_params": "ERROR 1"},
        {"mesh": "hsdp2x2", "outer": "no_shard", "model": "transformer", "dtype": "fp32", "zero=no_shard": "skip 1",
         "zero=optim": "FLAKY 1", "zero=optim_grads_params": ""}]
    assert "bad" not in matrix  # a unit test's parameter never becomes an axis
    per_value = {(r["axis"], r["value"]): r for r in table_rows(md, "### Outcomes per axis value")}
    assert (per_value[("zero", "optim_grads_params")]["tests"], per_value[("zero", "optim_grads_params")]["passed"]
            ) == ("4", "3")


def test_regressions_failures_flaky_skips(outputs) -> None:
    md = outputs["md"]
    bugs = {r["bug id"]: r for r in table_rows(md, "## Known bugs and their regression tests")}
    assert bugs["`ckpt-stale-weights`"]["status"] == "passed"
    assert bugs["`ckpt-stale-weights`"]["regression tests"] == (
        "`tests/functional/test_ckpt.py::test_resume[cnn-optim_grads_params]`")
    assert table_rows(md, "## Failures by rank") == [{"rank": "1", "failing tests": "1"}]
    failures = {r["test"]: r for r in table_rows(md, "## Failures by rank", "test")}
    parity = failures["`tests/functional/test_parity.py::test_parity[cnn-no_shard]`"]
    assert (parity["failing ranks"], parity["ranks"]) == ("1", "1 failed, 1 passed")
    assert parity["cause"] == "[rank 1] AssertionError: loss 2.31 != reference 2.30"
    hang = failures["`tests/functional/test_hang.py::test_b`"]
    assert hang["outcome"] == "error" and hang["cause"].startswith("started and never finished")
    flaky = {r["test"]: r for r in table_rows(md, "## Flaky tests")}
    assert flaky["`tests/functional/test_mesh_hsdp.py::test_hsdp[transformer-optim]`"]["source"] == "rerun"
    quarantined = flaky["`tests/functional/test_flaky_thing.py::test_sometimes`"]
    assert (quarantined["source"], quarantined["outcome"]) == ("flaky script", "failed")
    skips = {r["reason"]: r["count"] for r in table_rows(md, "## Skipped tests")}
    assert skips["skipped: requires CUDA: no GPU visible"] == "2"
    assert sum(int(n) for reason, n in skips.items() if reason.startswith("not run:")) == 2


def test_slowest_buckets_environment_mutants(outputs) -> None:
    md = outputs["md"]
    slowest = table_rows(md, "## Slowest tests and buckets")
    assert [r["seconds"] for r in slowest[:3]] == ["6.00", "3.00", "2.00"]  # sidecar wall times
    buckets = table_rows(md, "### Buckets")
    hsdp = next(b for b in buckets if "test_mesh_hsdp" in b["bucket"])
    assert (hsdp["ranks"], hsdp["starts"], hsdp["start-up s"]) == ("4", "2", "10.50")
    env = {r[""]: r for r in table_rows(md, "## Environment")}
    assert env["CUDA"]["cpu/L0_functional"] == "13.0" and env["NCCL"]["cpu/L0_functional"] == "2.27.7"
    assert env["GPU names"]["cpu/L0_functional"] == "2 x NVIDIA H200"
    assert env["git commit"]["cpu/L0_unit"] == "0123abcd"
    assert env["backend"]["cpu/L0_crashed"] == "gloo (cpu forced)"
    mutation = section(md, "## Mutation testing")
    assert "Tier `L1`: 2 of 3 mutants killed (67 %)." in mutation
    rows = {r["mutant"]: r for r in table_rows(md, "## Mutation testing")}
    assert rows["`rank0_only`"]["status"] == "survived"


class _Tags(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.cells: list[tuple[str, str]] = []  # (data-outcome, <title> text) of heat-map cells
        self.in_title = False
        self.outcome = ""
        self.counts: dict[str, int] = {}
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        self.counts[tag] = self.counts.get(tag, 0) + 1
        for key in ("src", "href"):
            if a.get(key):
                self.external.append(a[key])
        if tag == "g" and "data-outcome" in a:
            self.outcome = a["data-outcome"]
        self.in_title = tag == "title" and bool(self.outcome)

    def handle_endtag(self, tag) -> None:
        if tag == "g":
            self.outcome = ""
        self.in_title = False

    def handle_data(self, data) -> None:
        if self.in_title:
            self.cells.append((self.outcome, data))


def test_html_is_self_contained_with_heat_map(outputs) -> None:
    page = outputs["html"]
    parser = _Tags()
    parser.feed(page)
    parser.close()
    assert parser.external == [] and "<script" not in page and "http://www.w3.org/2000/svg" in page
    assert parser.counts["svg"] == 2  # the suite bars and the heat map
    outcomes = sorted(o for o, _ in parser.cells)
    assert outcomes == sorted(["failed", "not run", "passed", "passed", "error", "skipped", "flaky"])
    failed_title = next(t for o, t in parser.cells if o == "failed")
    assert "tests/functional/test_parity.py::test_parity[cnn-no_shard]" in failed_title
    assert "mesh=dp2, outer=-, model=cnn, dtype=fp32, zero=no_shard" in failed_title
    order = ["Verdict: FAIL", "Changes since baseline", 'class="heatmap"', "Failures by rank", "Known bugs",
             "Skipped tests", "Results per suite and file", 'class="suite-bars"', "Environment"]
    assert [page.index(marker) for marker in order] == sorted(page.index(marker) for marker in order)


def _folded(page: str, marker: str) -> bool:
    """Whether ``marker`` lies inside a ``<details>`` element of ``page``."""
    before = page[:page.index(marker)]
    return before.count("<details>") > before.count("</details>")


def test_html_folds_the_matrix_table_and_long_tables(outputs) -> None:
    page = outputs["html"]
    matrix = page.split("<h2>Configuration matrix</h2>", 1)[1].split("<h2>", 1)[0]
    heatmap_end = matrix.index("</svg>")
    # the heat map's cells are not repeated as an open table right after it: that table is folded
    assert "<table>" in matrix[heatmap_end:] and _folded(matrix, "<th>zero=no_shard</th>")
    assert _folded(page, "<th>axis</th>")  # outcomes per axis value: the heat map summed up
    assert not _folded(page, 'class="heatmap"') and not _folded(page, "<th>failing ranks</th>")
    assert not _folded(page, "<th>rule</th>")


def test_summary_json_and_merged_junit(outputs) -> None:
    data = outputs["json"]
    assert data["verdict"] == "FAIL" and data["counts"]["not run"] == 2
    assert data["matrix"]["cell_counts"] == {"failed": 1, "error": 1, "not run": 1, "flaky": 1, "passed": 2,
                                             "skipped": 1}
    assert data["baseline"]["new_failures"]["total"] == 2 and data["failures_per_rank"] == {"1": 1}
    assert [r["name"] for r in data["rules"] if not r["ok"]] == ["every run ran", "no failures", "nothing left unrun"]
    from harness.report.runs import load_runs

    (merged,) = load_runs([outputs["dir"] / "merged-junit.xml"])
    by_id = {c.test_id: c.outcome for c in merged.cases}
    assert by_id["tests/functional/test_hang.py::test_b"] == "error"
    assert by_id["tests/functional/test_hang.py::test_c"] == "not run"
    assert by_id["tests/functional/test_ckpt.py::test_resume[cnn-optim]"] == "not run"
    assert len(merged.cases) == 14  # 13 gating + 1 quarantined
