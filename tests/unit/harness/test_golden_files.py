"""Golden files under bad input and their comparison modes (``harness.golden``, ``harness.golden_file``).

Each case runs ``Golden.check`` in this process against files written into a temporary golden
directory, with the run's fingerprint set by the test: exact where it equals the file's, within
the file's band where it differs, and a clear failure naming the file for a file that cannot be
used (issue 52, items 3, 4, 7, 8, 9; issue 46, item 2)."""
from __future__ import annotations

import json
import pathlib
import types
from typing import Any

import pytest

from harness import golden, golden_file
from harness.golden_file import GoldenFile, GoldenFileError
from harness.report.junit_format import GOLDEN_BAND, GOLDEN_DRIFT, GOLDEN_EXACT, GOLDEN_MATCH, GOLDEN_UPDATED

FP = {"numerics": "pinned", "torch": "2.13.0+cpu", "blas": "mkl 2024.2", "mkl_cbwr": "COMPATIBLE",
      "cpu_capability": "DEFAULT", "threads": "1", "onednn": "off"}
SERIES = {"loss": [2.0, 1.5, 1.25], "grad_norm": [3.0, 2.0, 1.0]}


class _Node:
    def __init__(self) -> None:
        self.user_properties: list[tuple[str, Any]] = []
        self.nodeid = "tests/x.py::test_cell"


@pytest.fixture
def env(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A golden directory, this process as a plain (non-distributed) CPU run, and a settable fingerprint."""
    for var in (golden.ENV_UPDATE, golden.ENV_PLATFORM):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(golden.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    state = types.SimpleNamespace(dir=tmp_path, fingerprint=dict(FP), node=_Node())
    monkeypatch.setattr(golden.numerics, "fingerprint", lambda device_type: dict(state.fingerprint))
    return state


def _golden(env: types.SimpleNamespace, update: bool = False, monkeypatch: pytest.MonkeyPatch | None = None) -> Any:
    request = types.SimpleNamespace(node=env.node, config=types.SimpleNamespace(rootpath=env.dir))
    g = golden.Golden(request)  # type: ignore[arg-type]
    g.update = update
    return g


def _store(env: types.SimpleNamespace, cell: str = "c", **changes: Any) -> pathlib.Path:
    content = GoldenFile(cell=cell, platform="cpu", series={k: list(v) for k, v in SERIES.items()},
                         tolerance=dict.fromkeys(SERIES, 0.0), fingerprint=dict(FP), dtype="fp32",
                         band={"loss": 1e-3, "grad_norm": 1e-3})
    for key, value in changes.items():
        setattr(content, key, value)
    path = env.dir / "cpu" / f"{cell}.json"
    golden_file.write(path, content)
    return path


def _failure(call: Any) -> str:
    with pytest.raises(pytest.fail.Exception) as info:
        call()
    return str(info.value)


def test_same_fingerprint_compares_bit_for_bit(env: types.SimpleNamespace) -> None:
    _store(env)
    result = _golden(env).check("c", SERIES)
    assert (result.status, result.comparison) == (GOLDEN_MATCH, GOLDEN_EXACT)
    nudged = {"loss": [2.0, 1.5, 1.25 * (1 + 1e-6)], "grad_norm": SERIES["grad_norm"]}
    message = _failure(lambda: _golden(env).check("c", nudged))
    assert "loss: first drift at step 2" in message and "compared exactly (same fingerprint)" in message


def test_another_fingerprint_is_compared_within_the_band_and_says_so(env: types.SimpleNamespace) -> None:
    _store(env)
    env.fingerprint["torch"] = "2.14.1+cu130"
    within = {"loss": [2.0, 1.5 * (1 + 5e-4), 1.25], "grad_norm": SERIES["grad_norm"]}
    result = _golden(env).check("c", within)
    assert (result.status, result.comparison) == (GOLDEN_MATCH, GOLDEN_BAND)
    assert result.fingerprint_diff == ["torch 2.13.0+cpu (this run 2.14.1+cu130)"]
    prop = json.loads(env.node.user_properties[-1][1])
    assert prop["comparison"] == "band" and prop["fingerprint_diff"] == result.fingerprint_diff
    outside = {"loss": [2.0, 1.5 * (1 + 2e-3), 1.25], "grad_norm": SERIES["grad_norm"]}
    message = _failure(lambda: _golden(env).check("c", outside))
    assert "> band 0.001" in message and "torch 2.13.0+cpu (this run 2.14.1+cu130)" in message


def test_another_fingerprint_without_a_band_fails_naming_the_difference(env: types.SimpleNamespace) -> None:
    _store(env, band={})
    env.fingerprint["threads"] = "2"
    message = _failure(lambda: _golden(env).check("c", SERIES))
    assert "threads 1 (this run 2)" in message and "holds no band" in message and "golden_band" in message


def test_a_format_1_file_is_compared_exactly_without_a_fingerprint(env: types.SimpleNamespace) -> None:
    path = env.dir / "cpu" / "c.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": 1, "cell": "c", "platform": "cpu", "versions": {}, "tolerance": {},
                                "series": SERIES}))
    env.fingerprint["torch"] = "9.9"
    assert _golden(env).check("c", SERIES).comparison == GOLDEN_EXACT


@pytest.mark.parametrize("text, expect", [
    ("", "is empty"),
    ('{"format": 2, "cell": "c", "series": {"loss": [1.0, ', "is damaged (not JSON"),
    ('[1, 2]', "its top level is list"),
    ('{"format": 99, "series": {}}', "has format 99; this harness reads formats 1, 2"),
    ('{"format": 2, "series": {"loss": "x"}, "fingerprint": {"a": "b"}}', "'series' must map"),
    ('{"format": 2, "series": {"loss": [1.0]}, "tolerance": {"loss": -1}, "fingerprint": {"a": "b"}}',
     "'tolerance' must map"),
    ('{"format": 2, "series": {"loss": [1.0]}}', "needs a non-empty 'fingerprint'"),
])
def test_a_file_that_cannot_be_used_fails_naming_it(env: types.SimpleNamespace, text: str, expect: str) -> None:
    path = env.dir / "cpu" / "c.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(GoldenFileError, match="golden file .*c.json"):
        golden_file.read(path)
    message = _failure(lambda: _golden(env).check("c", SERIES))
    assert str(path) in message and expect in message and "--golden-update" in message


def test_golden_update_replaces_a_damaged_file(env: types.SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    path = env.dir / "cpu" / "c.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 2, "series": {"loss": [1.0,')
    result = _golden(env, update=True).check("c", SERIES)
    assert result.status == GOLDEN_UPDATED
    _publish(env.node, passed=True)
    assert golden_file.read(path) is not None and golden_file.read(path).series == SERIES  # type: ignore[union-attr]
    assert "which could not be used" in capsys.readouterr().out


def test_a_series_the_run_no_longer_records_is_a_drift(env: types.SimpleNamespace) -> None:
    _store(env)
    message = _failure(lambda: _golden(env).check("c", {"loss": SERIES["loss"]}))
    assert "grad_norm: in the golden file but not recorded by this run" in message
    assert json.loads(env.node.user_properties[-1][1])["status"] == GOLDEN_DRIFT


def _publish(node: _Node, passed: bool) -> None:
    """What the reporting process does with the test's merged call report."""
    report = types.SimpleNamespace(user_properties=list(node.user_properties), when="call", passed=passed,
                                   nodeid=node.nodeid)
    golden.pytest_runtest_logreport(report)  # type: ignore[arg-type]
    node.user_properties[:] = report.user_properties


def test_an_update_is_published_only_when_the_test_passed(env: types.SimpleNamespace) -> None:
    path = _store(env)
    before = path.read_text()
    changed = {"loss": [9.0, 9.0, 9.0], "grad_norm": SERIES["grad_norm"]}
    _golden(env, update=True).check("c", changed)
    assert path.read_text() == before, "an update was published before the test's outcome was known"
    _publish(env.node, passed=False)
    assert path.read_text() == before and not list(path.parent.glob(".*pending"))
    env.node.user_properties.clear()
    _golden(env, update=True).check("c", changed)
    _publish(env.node, passed=True)
    stored = golden_file.read(path)
    assert stored is not None and stored.series["loss"] == [9.0, 9.0, 9.0]
    assert stored.band == {"loss": 1e-3, "grad_norm": 1e-3}, "an update dropped the measured band"
    assert not any(n.endswith(golden.PENDING_PROPERTY) for n, _ in env.node.user_properties)


def test_a_distributed_tests_pending_write_is_found_under_its_rank_name(env: types.SimpleNamespace) -> None:
    """In a merged distributed report a property only rank 0 recorded is named ``rank0.<name>``."""
    path = _store(env)
    _golden(env, update=True).check("c", {"loss": [7.0, 7.0, 7.0], "grad_norm": SERIES["grad_norm"]})
    env.node.user_properties[:] = [("rank0." + n if n == golden.PENDING_PROPERTY else n, v)
                                   for n, v in env.node.user_properties]
    _publish(env.node, passed=True)
    assert golden_file.read(path).series["loss"] == [7.0, 7.0, 7.0]  # type: ignore[union-attr]


def test_pending_writes_have_unique_names_and_the_last_writer_wins(tmp_path: pathlib.Path) -> None:
    """Two tests updating one cell (``pytest -n 2 --golden-update``): neither clobbers the other's
    temp file, and each publish is one atomic rename."""
    path = tmp_path / "cpu" / "c.json"
    first = golden_file.write_pending(path, GoldenFile(cell="c", platform="cpu", series={"loss": [1.0]},
                                                       fingerprint=dict(FP)))
    second = golden_file.write_pending(path, GoldenFile(cell="c", platform="cpu", series={"loss": [2.0]},
                                                        fingerprint=dict(FP)))
    assert first != second and first.exists() and second.exists()
    golden_file.publish(first, path)
    golden_file.publish(second, path)
    assert golden_file.read(path).series == {"loss": [2.0]}  # type: ignore[union-attr]
    assert not first.exists() and not second.exists()


@pytest.mark.parametrize("name", ["../../x", "cpu/../h200", "..", "a b", "", "/abs"])
def test_a_platform_that_is_not_a_plain_name_is_refused(name: str) -> None:
    with pytest.raises(pytest.UsageError, match="not a plain platform name"):
        golden.check_platform_name(name, "--golden-platform")


@pytest.mark.parametrize("name", ["cpu", "h200", "gb200", "cpu-avx2-amd", "my.lab_1"])
def test_plain_platform_names_are_accepted(name: str) -> None:
    golden.check_platform_name(name, "--golden-platform")
