"""The state check between tests (``harness.rank_guard``), in process: what a test changed is named
and restored; what a library set for itself (on its first import inside the test, or through a
known internal variable) is neither, so the warning does not cry wolf."""
from __future__ import annotations

import importlib.util
import os
import pathlib
from collections.abc import Callable

import pytest
import torch

from harness.rank_guard import LIBRARY_INTERNAL_VARS, RankGuard

INDUCTOR_VAR = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def _run_test(guard: RankGuard, body: Callable[[], None]) -> list[str]:
    """One test through the guard as a rank runs it: snapshot, the call-phase wrapper, restore."""
    guard.before_test()
    wrapper = guard.pytest_runtest_call(item=None)  # type: ignore[arg-type]
    next(wrapper)
    body()
    with pytest.raises(StopIteration):
        wrapper.send(None)
    changes, restart = guard.after_test()
    assert not restart
    return changes


def _import_file(path: pathlib.Path, source: str) -> None:
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("GUARD_LIB_AT_IMPORT", "GUARD_TEST_LEAK", "GUARD_LIB_THEN_TEST", INDUCTOR_VAR):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_library_variables_set_at_import_or_internal_are_left_alone(clean_env, tmp_path):
    guard = RankGuard()

    def body() -> None:
        # a library configuring itself on its first import (as TransformerEngine sets NVTE_CUDA_INCLUDE_DIR)
        _import_file(tmp_path / "guard_lib.py", 'import os\nos.environ["GUARD_LIB_AT_IMPORT"] = "/usr/include"\n')
        os.environ[INDUCTOR_VAR] = "140000"  # as inductor does before loading a compiled module

    assert _run_test(guard, body) == []
    assert os.environ["GUARD_LIB_AT_IMPORT"] == "/usr/include" and os.environ[INDUCTOR_VAR] == "140000"
    assert INDUCTOR_VAR in LIBRARY_INTERNAL_VARS


def test_what_the_test_itself_changed_is_still_named_and_restored(clean_env, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    guard = RankGuard()  # the rank's start: CUDA_VISIBLE_DEVICES=0
    cwd, dtype = os.getcwd(), torch.get_default_dtype()

    def body() -> None:
        _import_file(tmp_path / "guard_lib2.py", 'import os\nos.environ["GUARD_LIB_THEN_TEST"] = "library"\n'
                                                 'os.environ["CUDA_VISIBLE_DEVICES"] = "3"\n')
        os.environ["GUARD_LIB_THEN_TEST"] = "test"  # the test wrote last: its change, not the library's
        os.environ["GUARD_TEST_LEAK"] = "leaked"
        os.environ["CUDA_VISIBLE_DEVICES"] = "7"
        os.chdir(tmp_path)
        torch.set_default_dtype(torch.float64)

    changes = "\n".join(_run_test(guard, body))
    for what in ("GUARD_LIB_THEN_TEST", "GUARD_TEST_LEAK", "CUDA_VISIBLE_DEVICES", "working directory",
                 "default dtype"):
        assert what in changes, (what, changes)
    assert "GUARD_LIB_THEN_TEST" not in os.environ and "GUARD_TEST_LEAK" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and os.getcwd() == cwd and torch.get_default_dtype() == dtype


def test_a_rank_defining_variable_set_during_an_import_is_still_restored(clean_env, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    guard = RankGuard()
    changes = _run_test(guard, lambda: _import_file(
        tmp_path / "guard_lib3.py", 'import os\nos.environ["CUDA_VISIBLE_DEVICES"] = "5"\n'))
    assert changes == ["environment variable CUDA_VISIBLE_DEVICES changed ('1' -> '5'); restored"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_write_hook_is_removed_after_the_call(clean_env):
    setitem = type(os.environ).__setitem__
    _run_test(RankGuard(), lambda: None)
    assert type(os.environ).__setitem__ is setitem
