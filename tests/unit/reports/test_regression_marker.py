"""The ``regression`` marker plugin: validation, JUnit properties, and the report built
from a real pytest run (so the parser is checked against pytest's own XML, not only
against hand-written fixtures)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from harness import regression_marker
from harness.report.junit_read import read_junit
from harness.report.regressions import regression_rows

REPO = pathlib.Path(__file__).resolve().parents[3]

GOOD_TESTS = textwrap.dedent('''
    import pytest

    @pytest.mark.regression("decoupled-grad-none-segfault", description="None grads segfault")
    @pytest.mark.parametrize("world_size", [2, 4])
    @pytest.mark.parametrize("dtype", ["bf16", "fp32"])
    def test_clip(dtype, world_size):
        assert not (dtype == "fp32" and world_size == 4), "rank 3 failed: grad norm off"

    @pytest.mark.regression("decoupled-grad-flag-mismatch-silent-no-op", description="mismatch")
    class TestBuffers:
        @pytest.mark.regression("decoupled-grad-flag-mismatch-silent-no-op")
        @pytest.mark.regression("another-bug", description="second bug")
        def test_flags(self):
            pass

    def test_plain():
        pytest.skip("requires CUDA")

    class Transformer:
        pass

    @pytest.mark.parametrize("model", [Transformer, len])
    @pytest.mark.parametrize("lr", [0.5, None])
    def test_values(model, lr):
        pass
''')


def run_pytest(tmp_path: pathlib.Path, files: dict[str, str], *args: str) -> tuple[int, str]:
    """Run pytest in a subprocess with only this plugin (and xdist) loaded."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "harness.regression_marker", "-p", "no:cacheprovider",
         "--strict-markers", "-q", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def properties_by_name(xml: pathlib.Path) -> dict[str, list[tuple[str, str]]]:
    root = ET.parse(xml).getroot()
    return {tc.get("name"): [(p.get("name"), p.get("value")) for p in tc.iter("property")]
            for tc in root.iter("testcase")}


@pytest.mark.parametrize(("mark", "problem"), [
    (pytest.mark.regression("good-id-42"), None),
    (pytest.mark.regression("good", description="text"), None),
    (pytest.mark.regression(), "exactly one positional bug id, got 0"),
    (pytest.mark.regression("a", "b"), "exactly one positional bug id, got 2"),
    (pytest.mark.regression(""), "non-empty kebab-case string"),
    (pytest.mark.regression("Bad_ID"), "got 'Bad_ID'"),
    (pytest.mark.regression("double--dash"), "kebab-case"),
    (pytest.mark.regression("-lead"), "kebab-case"),
    (pytest.mark.regression(3510), "got 3510"),
    (pytest.mark.regression("ok", reason="x"), "unknown keyword argument(s) ['reason']"),
    (pytest.mark.regression("ok", description=3), "description must be a string, got int"),
])
def test_marker_problem(mark, problem) -> None:
    found = regression_marker.marker_problem(mark.mark)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_properties_in_junit_and_report(tmp_path) -> None:
    rc, out = run_pytest(tmp_path, {"tests/functional/test_fsdp_bugs.py": GOOD_TESTS},
                         "--junitxml=run.xml", "tests")
    assert rc == 1, out  # one parametrised case fails on purpose
    props = properties_by_name(tmp_path / "run.xml")
    assert props["test_clip[bf16-2]"] == [
        ("regression", "decoupled-grad-none-segfault"),
        ("regression_description", "None grads segfault"),
        ("param:dtype", "bf16"), ("param:world_size", "2")]
    # closest marker first; the class's duplicate id is counted once
    assert props["test_flags"] == [
        ("regression", "another-bug"), ("regression_description", "second bug"),
        ("regression", "decoupled-grad-flag-mismatch-silent-no-op"),
        ("regression_description", "")]
    assert props["test_plain"] == []
    assert props["test_values[None-Transformer]"] == [("param:lr", "None"), ("param:model", "Transformer")]
    assert props["test_values[0.5-len]"] == [("param:lr", "0.5"), ("param:model", "len")]

    cases = {c.test_id: c for c in read_junit([tmp_path / "run.xml"])}
    assert set(cases) == {
        *(f"tests/functional/test_fsdp_bugs.py::test_clip[{d}-{w}]"
          for d in ("bf16", "fp32") for w in (2, 4)),
        "tests/functional/test_fsdp_bugs.py::TestBuffers::test_flags",
        "tests/functional/test_fsdp_bugs.py::test_plain",
        *(f"tests/functional/test_fsdp_bugs.py::test_values[{lr}-{m}]"
          for lr in ("0.5", "None") for m in ("Transformer", "len"))}
    rows = {r.bug_id: r for r in regression_rows(list(cases.values()), {})}
    assert rows["decoupled-grad-none-segfault"].status == "FAILED"
    assert rows["decoupled-grad-flag-mismatch-silent-no-op"].status == "passed"
    assert rows["another-bug"].description == "second bug"
    failing = cases["tests/functional/test_fsdp_bugs.py::test_clip[fp32-4]"]
    assert failing.params == (("dtype", "fp32"), ("world_size", "4"))
    from harness.report.junit_read import failing_ranks
    assert failing_ranks(failing) == [3]


def test_properties_survive_xdist(tmp_path) -> None:
    pytest.importorskip("xdist")
    rc, out = run_pytest(tmp_path, {"tests/test_x.py": GOOD_TESTS},
                         "-p", "xdist", "-n", "2", "--junitxml=run.xml", "tests")
    assert rc == 1, out
    props = properties_by_name(tmp_path / "run.xml")
    assert ("param:world_size", "4") in props["test_clip[fp32-4]"]
    assert ("regression", "decoupled-grad-none-segfault") in props["test_clip[fp32-4]"]


def test_invalid_marker_is_a_collection_error_of_its_module(tmp_path) -> None:
    files = {
        "tests/test_bad.py": 'import pytest\n\n@pytest.mark.regression("Bad_ID")\n'
                             "def test_x():\n    pass\n",
        "tests/test_ok.py": "def test_ok():\n    pass\n",
    }
    rc, out = run_pytest(tmp_path, files, "tests")
    assert rc == 2, out  # interrupted: errors during collection
    assert "ERROR collecting tests/test_bad.py" in out
    assert ("tests/test_bad.py::test_x: invalid @pytest.mark.regression: bug id must be a "
            "non-empty kebab-case string") in out
    rc, out = run_pytest(tmp_path, {}, "--continue-on-collection-errors", "tests")
    assert rc == 1 and "1 passed, 1 error" in out, out


def test_marker_is_registered_with_help(tmp_path) -> None:
    rc, out = run_pytest(tmp_path, {}, "--markers")
    assert rc == 0
    assert '@pytest.mark.regression(bug_id, description=""): this test guards' in out
