"""The sign-off's Numerics section says how each golden cell was compared (issue 46 item 5): bit for
bit where the run's fingerprint equals the file's, else within the cell's band, with the
fingerprint difference named; a cell within its band passes with a visible note, one outside it
fails; a comparison mode the reader does not know is unreadable, never dropped."""
from __future__ import annotations

import json
import pathlib

import pytest
from report_helpers import section, table_rows
from test_signoff_release import FAIL, LOSS, case, junit, prop

from harness.golden import GoldenResult, SeriesDrift
from harness.report import signoff
from harness.report.junit_format import GOLDEN_BAND, GOLDEN_PROPERTY

DIFF = ["torch 2.13.0+cpu (this run 2.14.1+cu130)", "threads 1 (this run 2)"]


def banded_json(cell: str, status: str, run: list[float], band: float) -> str:
    """The property as the plugin writes it for a run whose fingerprint differs from the file's."""
    drift = SeriesDrift(run, LOSS, band)
    drift.compare()
    result = GoldenResult(cell, "cpu", f"tests/golden/cpu/{cell}.json", status, {"loss": drift},
                          comparison=GOLDEN_BAND, fingerprint={"torch": "2.14.1+cu130", "threads": "2"},
                          golden_fingerprint={"torch": "2.13.0+cpu", "threads": "1"})
    assert result.fingerprint_diff == DIFF
    return result.as_json()


def _report(tmp: pathlib.Path, *cases: str) -> dict[str, object]:
    xml = junit(tmp / "cpu" / "L0_golden.xml", *cases)
    out = tmp / "report"
    code = signoff.main(["--junit", str(xml), "--out-dir", str(out)])
    return {"code": code, "md": (out / "report.md").read_text(), "html": (out / "report.html").read_text(),
            "json": json.loads((out / "summary.json").read_text())}


def test_a_cell_within_its_band_passes_with_a_visible_note(tmp_path: pathlib.Path) -> None:
    near = [v * (1 + 1e-5) for v in LOSS]
    rep = _report(tmp_path, case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY,
                                                                     banded_json("zero3", "match", near, 1e-4))]))
    md = str(rep["md"])
    assert rep["code"] == signoff.EXIT_PASS, md
    (row,) = table_rows(md, "## Numerics vs golden")
    assert row["status"] == "match"
    assert row["compared"] == "within band; fingerprint differs: " + "; ".join(DIFF)
    assert row["loss: max drift @ first step"] == "1e-05 (within 0.0001)"
    numerics = section(md, "## Numerics vs golden")
    assert "**Note: 1 of 1 cell(s) were compared within their band, not bit for bit**" in numerics
    evidence = {r["rule"]: r["evidence"] for r in table_rows(md, "### Rules")}["golden values"]
    assert "1 golden cell(s) match (1 within their band, not bit for bit" in evidence and DIFF[0] in evidence
    assert "within band; fingerprint differs" in str(rep["html"])
    (cell,) = rep["json"]["golden"]
    assert cell["comparison"] == "band" and cell["fingerprint_diff"] == DIFF


def test_a_drift_outside_the_band_fails_naming_the_comparison(tmp_path: pathlib.Path) -> None:
    far = [LOSS[0], *(v * (1 + 1e-3) for v in LOSS[1:])]
    rep = _report(tmp_path, case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY,
                                                                     banded_json("zero3", "drift", far, 1e-4))], FAIL))
    md = str(rep["md"])
    assert rep["code"] == signoff.EXIT_FAIL
    (row,) = table_rows(md, "## Numerics vs golden")
    assert row["status"] == "DRIFT" and row["compared"].startswith("within band; fingerprint differs: torch")
    assert "(within band; fingerprint differs: torch 2.13.0+cpu" in section(md, "## Numerics vs golden")


@pytest.mark.parametrize("comparison", ["BAND", "approx", 3])
def test_an_unknown_comparison_is_unreadable(tmp_path: pathlib.Path, comparison: object) -> None:
    body = json.loads(banded_json("zero3", "match", LOSS, 1e-4))
    body["comparison"] = comparison
    rep = _report(tmp_path, case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, json.dumps(body))]))
    assert rep["code"] == signoff.EXIT_FAIL
    evidence = {r["rule"]: r["evidence"] for r in table_rows(str(rep["md"]), "### Rules")}["golden values"]
    assert "unreadable" in evidence and "unknown comparison" in evidence
