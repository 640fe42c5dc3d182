"""The sign-off's "what changed since the last release" sections, on small hand-made inputs:
numerics vs golden (the ``golden`` property as ``harness.golden`` writes it), checkpoint
compatibility (``checkpoint_compat``), speed vs a bench baseline, and the golden cells' mutants."""

from __future__ import annotations

import html
import json
import pathlib

import pytest
from report_helpers import run_main, section, table_rows

from harness.golden import GoldenResult, SeriesDrift
from harness.report import signoff
from harness.report.junit_format import CHECKPOINT_COMPAT_PROPERTY, GOLDEN_PROPERTY

GOLDEN_FILE = "tests.functional.test_golden"
COMPAT_FILE = "tests.functional.test_checkpoint_compat"
LOSS = [3.0, 2.5, 2.25, 2.0, 1.9, 1.8]


def golden_json(cell: str, status: str, run: list[float], golden: list[float] | None, tol: float = 0.0) -> str:
    """The property exactly as the plugin writes it (writer and reader share GoldenResult)."""
    drift = SeriesDrift(run, golden, tol)
    drift.compare()
    checksum = SeriesDrift([10.0 + i for i in range(len(run))], None if golden is None else
                           [10.0 + i for i in range(len(golden))], tol)
    checksum.compare()
    result = GoldenResult(cell, "cpu", f"tests/golden/cpu/{cell}.json", status,
                          {"loss": drift, "param_checksum": checksum}, {"git": "abc1234", "torch": "2.13.0+cpu"})
    return result.as_json()


def prop(name: str, value: str) -> str:
    return f'<property name="{name}" value="{html.escape(value, quote=True)}"/>'


def case(name: str, props: list[str], inner: str = "", cls: str = GOLDEN_FILE) -> str:
    return f'<testcase classname="{cls}" name="{name}"><properties>{"".join(props)}</properties>{inner}</testcase>'


FAIL = '<failure message="golden cell drifted">E   Failed: golden cell drifted</failure>'


def junit(path: pathlib.Path, *cases: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'<testsuites><testsuite name="cpu/L0_functional">{"".join(cases)}</testsuite></testsuites>')
    return path


def matching() -> str:
    return case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, golden_json("zero3", "match", LOSS, LOSS))])


def drifting() -> list[float]:
    return [LOSS[0], LOSS[1] * (1 + 3e-7), *(v * (1 + 1e-6) for v in LOSS[2:])]


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One drifting cell, one missing file, one match, a golden test that crashed, and the compat tests."""
    tmp = tmp_path_factory.mktemp("release")
    xml = junit(tmp / "cpu" / "L0_functional.xml",
                case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, golden_json("zero3", "drift", drifting(),
                                                                                       LOSS))], FAIL),
                case("test_golden_world2[zero1]", [prop(GOLDEN_PROPERTY, golden_json("zero1", "missing", LOSS, None))],
                     FAIL),
                case("test_golden_world2[zero2]", [prop(GOLDEN_PROPERTY, golden_json("zero2", "match", LOSS, LOSS))]),
                case("test_golden_world4[hsdp]", [], '<error message="rank 1 died">rank 1 killed by signal</error>'),
                case("test_ckpt[zero3]", [prop(CHECKPOINT_COMPAT_PROPERTY, json.dumps({"fixture": "zero3",
                                                                                        "check": "loads"})),
                                          prop("rank0." + GOLDEN_PROPERTY, golden_json("ckpt_zero3", "match",
                                                                                       LOSS, LOSS))], cls=COMPAT_FILE),
                case("test_refused", [prop(CHECKPOINT_COMPAT_PROPERTY, json.dumps(
                    {"fixture": "zero3, format 99", "check": "refused"}))],
                     '<failure message="DID NOT RAISE">Failed: DID NOT RAISE</failure>', cls=COMPAT_FILE),
                case("test_unit_thing", [], cls="tests.unit.test_u"))
    out = tmp / "report"
    code = signoff.main(["--junit", str(xml), "--out-dir", str(out)])
    return {"code": code, "md": (out / "report.md").read_text(), "html": (out / "report.html").read_text(),
            "json": json.loads((out / "summary.json").read_text()), "dir": out}


def rules(md: str) -> dict[str, tuple[str, str]]:
    return {r["rule"]: (r["result"], r["evidence"]) for r in table_rows(md, "### Rules")}


def test_sections_sit_with_the_changes_since_baseline(failing) -> None:
    headings = [line for line in failing["md"].splitlines() if line.startswith("## ")]
    assert headings[:6] == ["## Verdict: FAIL", "## Changes since baseline", "## Numerics vs golden",
                            "## Checkpoint compatibility", "## Speed vs baseline", "## Configuration matrix"]


def test_golden_and_compat_rules_fail_the_verdict(failing) -> None:
    got = rules(failing["md"])
    result, evidence = got["golden values"]
    assert result == "FAILED"
    assert "1 drifted: `zero3` (cpu, cpu/L0_functional)" in evidence
    assert "1 have no golden file: `zero1`" in evidence and "1 failed before comparing: `hsdp`" in evidence
    assert got["checkpoint compatibility"] == ("FAILED", "`zero3, format 99` (cpu/L0_functional): failed")
    assert failing["code"] == signoff.EXIT_FAIL


def test_numerics_table_missing_command_and_plot(failing) -> None:
    numerics = section(failing["md"], "## Numerics vs golden")
    assert "5 golden cell(s) on cpu: 1 DRIFT, 1 MISSING, 1 NO RESULT, 2 match." in numerics
    problems = {r["cell"]: r for r in table_rows(failing["md"], "## Numerics vs golden")}
    assert problems["`zero3`"]["status"] == "DRIFT"
    assert problems["`zero3`"]["loss: max drift @ first step"] == "1e-06 @ step 1"
    assert problems["`zero3`"]["golden made with"] == "git abc1234, torch 2.13.0+cpu"
    assert problems["`zero1`"]["status"] == "MISSING"
    assert problems["`hsdp`"]["status"] == "NO RESULT" and "rank 1 died" in problems["`hsdp`"]["detail"]
    assert ("`python -m pytest -m golden --golden-update "
            "'tests/functional/test_golden.py::test_golden_world2[zero1]'`") in numerics
    assert "### Drift: zero3 (cpu, run cpu/L0_functional)" in numerics
    link = "![zero3: run over golden, relative drift per step](golden-plots/cpu_L0_functional-zero3.svg)"
    assert link in numerics
    svg = (failing["dir"] / "golden-plots" / "cpu_L0_functional-zero3.svg").read_text()
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg" class="golden-plot" data-cell="zero3"')
    detail = {r["series"]: r for r in table_rows(numerics, "### Drift: zero3 (cpu, run cpu/L0_functional)")}
    assert detail["loss"]["first drifting step"] == "1" and detail["loss"]["golden there"] == "2.5"


def test_html_draws_one_plot_per_drifting_cell_and_stays_self_contained(failing) -> None:
    page = failing["html"]
    assert page.count('class="golden-plot"') == 1 and 'data-cell="zero3"' in page
    assert "<script" not in page and "href=" not in page and "src=" not in page
    plot = page[page.index('class="golden-plot"'):page.index("</svg>", page.index('class="golden-plot"'))]
    assert plot.count("<polyline") == 2 + 2 + 2  # two series' run and golden curves, two drift lines
    assert "step 1: run 2.50000075, golden 2.5, relative drift 3e-07" in plot  # a point's numbers on hover
    order = ["Changes since baseline", "Numerics vs golden", 'class="golden-plot"', "Checkpoint compatibility",
             "Speed vs baseline", "Configuration matrix"]
    assert [page.index(m) for m in order] == sorted(page.index(m) for m in order)


def test_compat_section_and_summary_json(failing) -> None:
    rows = {r["fixture"]: r for r in table_rows(failing["md"], "## Checkpoint compatibility")}
    assert rows["`zero3`"]["outcome"] == "passed" and rows["`zero3`"]["continued curve"] == "match (loss drift 0)"
    refused = rows["`zero3, format 99`"]
    assert refused["outcome"] == "FAILED"
    assert refused["failure"] == "`tests/functional/test_checkpoint_compat.py::test_refused`: DID NOT RAISE"
    data = failing["json"]
    assert {g["cell"]: g["status"] for g in data["golden"]} == {"zero3": "drift", "zero1": "missing",
                                                                "hsdp": "no result", "zero2": "match",
                                                                "ckpt_zero3": "match"}
    drift = next(g for g in data["golden"] if g["cell"] == "zero3")
    assert drift["series"]["loss"]["first_drift_step"] == 1 and len(drift["series"]["loss"]["run"]) == len(LOSS)
    assert [c["ok"] for c in data["checkpoint_compat"]] == [False, True]
    assert data["speed"] is None


def test_matching_cells_pass_and_a_golden_update_run_does_not(tmp_path, capsys) -> None:
    ok = junit(tmp_path / "ok.xml", matching())
    code, md, _ = run_main(["--junit", ok], capsys)
    assert code == signoff.EXIT_PASS, md
    assert rules(md)["golden values"] == ("ok", "1 golden cell(s) match")
    assert "<summary>Every golden cell" not in md
    assert "| `zero3` | cpu | cpu/L0_functional | match | exact | 0 | 0 |" in md
    updated = junit(tmp_path / "upd.xml", case("test_golden_world2[zero3]", [prop(
        GOLDEN_PROPERTY, golden_json("zero3", "updated", LOSS, LOSS))]))
    code, md, _ = run_main(["--junit", updated], capsys)
    assert code == signoff.EXIT_FAIL
    assert rules(md)["golden values"][1] == ("1 were rewritten with --golden-update (nothing compared): "
                                             "`zero3` (cpu, cpu/L0_functional)")


def test_an_unreadable_golden_property_fails(tmp_path, capsys) -> None:
    xml = junit(tmp_path / "bad.xml", case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, "{not json")]))
    code, md, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL and "1 recorded an unreadable comparison: `zero3`" in md


def test_golden_mutants_are_reported_apart_and_noted(tmp_path, capsys) -> None:
    summary = {"tier": "golden", "gen": "cpu", "mutants": [
        {"name": "meta_init_rng", "bug_class": "meta init", "status": "killed", "numerics": "meta-device init",
         "killed_by": ["tests/functional/test_golden.py::test_golden_world2[zero3_meta_init]"], "reason": "1 failed"},
        {"name": "grad_write_lost", "bug_class": "lost .grad write", "status": "survived",
         "numerics": "when .grad is written", "killed_by": [], "reason": "no test failed"},
        {"name": "wrong_chunk", "bug_class": "NCCL chunk", "status": "survived", "numerics": "NCCL only",
         "numerics_gpu_only": True, "killed_by": [], "reason": "no test failed"},
        {"name": "traffic_only", "bug_class": "extra gather", "status": "survived", "numerics": None,
         "killed_by": [], "reason": "no test failed"}]}
    path = tmp_path / "golden-mutants.json"
    path.write_text(json.dumps(summary))
    ok = junit(tmp_path / "ok.xml", matching())
    code, md, _ = run_main(["--junit", ok, "--mutants", path], capsys)
    assert code == signoff.EXIT_PASS  # a note, not a rule: the summary is a separate measurement
    assert "- note: numerics-changing mutant(s) the golden cells do not kill: `grad_write_lost`" in md
    mutation = section(md, "## Mutation testing")
    assert ("on cpu): 1 of 4 killed. Mutants that change numerics on cpu (2): NOT killed: `grad_write_lost`. "
            "Numbers that change only on GPUs (not counted on cpu): `wrong_chunk` (survived).") in mutation
    rows = {r["mutant"]: r for r in table_rows(md, "### Golden cells alone")}
    assert rows["`wrong_chunk`"]["changes numerics"] == "NCCL only (GPU only)"
    assert rows["`traffic_only`"]["changes numerics"] == "no"
    other = tmp_path / "golden2.json"
    other.write_text(json.dumps(summary))
    code, _, err = run_main(["--junit", ok, "--mutants", path, "--mutants", other], capsys)
    assert code == signoff.EXIT_BAD_INPUT and "at most one --mutants summary" in err


def with_status(status: object, **extra: object) -> str:
    """A comparison as the writer makes it, with its status replaced and keys added."""
    data = json.loads(golden_json("zero3", "match", LOSS, LOSS))
    data.update(status=status, **extra)
    return json.dumps(data)


@pytest.mark.parametrize("status", ["MATCH", "Match", "ok", "passed", "", None, 1])
def test_an_unknown_golden_status_fails_and_is_named(tmp_path, capsys, status) -> None:
    """Before: an unknown status was dropped, giving "0 golden cell(s) match" and PASS."""
    xml = junit(tmp_path / "bad.xml", case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, with_status(status))]))
    code, md, _ = run_main(["--junit", xml], capsys)
    assert code == signoff.EXIT_FAIL, md
    result, evidence = rules(md)["golden values"]
    assert result == "FAILED"
    assert evidence == (f"1 recorded an unreadable comparison: `zero3` (cpu, cpu/L0_functional) (first: unknown "
                        f"status {status!r} (the harness writes match, drift, missing, updated))")
    (row,) = table_rows(md, "## Numerics vs golden")
    assert row["status"] == "UNREADABLE" and f"unknown status {status!r}" in row["detail"]


@pytest.mark.parametrize("raw, detail", [
    ("{not json", "not JSON: Expecting property name enclosed in double quotes"),
    ("", "not JSON: Expecting value"),
    ("null", "not a JSON object but NoneType: null"),
    ('["match"]', "not a JSON object but list"),
    ('"match"', "not a JSON object but str"),
    ('{"status": "match"}', "KeyError: 'cell'"),
    ('{"cell": "zero3", "status": "match", "series": {"loss": {"run": ["x"]}}}', "ValueError: could not convert"),
    ('{"cell": "zero3", "status": "match", "series": [1, 2]}', "AttributeError"),
])
def test_an_unreadable_golden_property_fails_with_its_reason(tmp_path, capsys, raw, detail) -> None:
    xml = junit(tmp_path / "bad.xml", case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, raw)]))
    code, md, _ = run_main(["--junit", xml], capsys)
    result, evidence = rules(md)["golden values"]
    assert code == signoff.EXIT_FAIL and result == "FAILED", md
    assert evidence.startswith("1 recorded an unreadable comparison: `zero3`") and detail in evidence, evidence


def test_every_golden_property_of_a_test_counts_and_extra_keys_are_ignored(tmp_path, capsys) -> None:
    """A test that checks two cells records two properties: the second is read too (an unknown
    status there fails); keys a newer writer adds (fingerprints) do not disturb the reader."""
    newer = with_status("match", fingerprint={"sha256": "ab" * 32, "bytes": 1234}, format_note="v2")
    ok = junit(tmp_path / "ok.xml", case("test_golden_world2[zero3]", [prop(GOLDEN_PROPERTY, newer)]))
    code, md, _ = run_main(["--junit", ok], capsys)
    assert code == signoff.EXIT_PASS and rules(md)["golden values"] == ("ok", "1 golden cell(s) match"), md
    second = json.loads(with_status("MATCH"))
    second["cell"] = "zero3_second"
    two = junit(tmp_path / "two.xml", case("test_golden_world2[zero3]", [
        prop(GOLDEN_PROPERTY, newer), prop(GOLDEN_PROPERTY, json.dumps(second))]))
    code, md, _ = run_main(["--junit", two], capsys)
    assert code == signoff.EXIT_FAIL
    assert rules(md)["golden values"][1].startswith("1 recorded an unreadable comparison: `zero3_second`")
    assert "2 golden cell(s) on cpu: 1 UNREADABLE, 1 match." in section(md, "## Numerics vs golden")


DAMAGED = "checkpoint tests/golden/checkpoints/zero3 is damaged ({n} file problem(s)):"
COMPAT_PROP = prop(CHECKPOINT_COMPAT_PROPERTY, json.dumps({"fixture": "zero3", "check": "loads"}))
PROBLEMS = ["data/__0_0.distcp: size 1210, manifest says 1234", "data/.metadata: sha256 differs from the manifest"]


def damaged_distributed(problems: list[str]) -> str:
    """A compat test whose fixture is damaged, as a distributed test's JUnit has it (captured from a
    spawn-mode run): the message is the first line of rank 0's error, the list is in the body."""
    head = DAMAGED.format(n=len(problems))
    error = "\n".join([f"E       fsdp_impl.checkpoint.CheckpointCorruptedError: {head}",
                       *(f"E         {p}" for p in problems)])
    body = "\n".join(["call failed on rank(s) [0, 1]", "==================== rank 0 (cause): call failed ====",
                      "    def test_ckpt(cell, dist_env, golden):", ">       extra = load(path, model, opt)", error,
                      "", "tests/functional/test_checkpoint_compat.py:68: CheckpointCorruptedError",
                      "==================== rank 1: call failed ====", error])
    message = f"[rank 0] fsdp_impl.checkpoint.CheckpointCorruptedError: {head}"
    return case("test_ckpt[zero3]", [COMPAT_PROP, prop("rank0", "failed"), prop("rank1", "failed")],
                f'<failure message="{html.escape(message, quote=True)}">{html.escape(body)}</failure>',
                cls=COMPAT_FILE)


def damaged_local(problems: list[str]) -> str:
    """The same refusal in a test pytest ran itself: the whole message, newlines included."""
    message = "\n  ".join([f"fsdp_impl.checkpoint.CheckpointCorruptedError: {DAMAGED.format(n=len(problems))}",
                           *problems])
    return case("test_ckpt[zero3]", [COMPAT_PROP],
                f'<failure message="{html.escape(message, quote=True).replace(chr(10), "&#10;")}">E   ...</failure>',
                cls=COMPAT_FILE)


@pytest.mark.parametrize("make", [damaged_distributed, damaged_local], ids=["distributed", "local"])
def test_a_damaged_fixture_shows_its_file_problems_in_the_report(tmp_path, capsys, make) -> None:
    """Before: the cause stopped at "is damaged (2 file problem(s)):"; the file names were only in the JUnit."""
    code, md, _ = run_main(["--junit", junit(tmp_path / "ck.xml", make(PROBLEMS))], capsys)
    assert code == signoff.EXIT_FAIL
    (row,) = table_rows(md, "## Checkpoint compatibility")
    assert row["failure"] == ("`tests/functional/test_checkpoint_compat.py::test_ckpt[zero3]`: "
                              + ("[rank 0] " if make is damaged_distributed else "")
                              + "fsdp_impl.checkpoint.CheckpointCorruptedError: " + DAMAGED.format(n=2) + " "
                              + "; ".join(PROBLEMS))
    failure = table_rows(md, "## Failures by rank", first_header="test")[0]
    assert "data/__0_0.distcp" in failure["cause"]  # 160 characters there: the first file name fits


def test_a_long_problem_list_is_bounded(tmp_path, capsys) -> None:
    many = [f"data/__{i}_0.distcp: missing" for i in range(500)]
    code, md, _ = run_main(["--junit", junit(tmp_path / "ck.xml", damaged_distributed(many))], capsys)
    (row,) = table_rows(md, "## Checkpoint compatibility")
    cause = row["failure"].split("`: ", 1)[1]
    assert code == signoff.EXIT_FAIL and len(cause) == 480 and cause.endswith("...")
    assert "data/__0_0.distcp: missing; data/__1_0.distcp: missing" in cause
