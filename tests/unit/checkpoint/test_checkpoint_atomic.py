"""Atomic save: a good checkpoint is never replaced by a half-written one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _ckpt_unit_models import make_trainer

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import CheckpointWriteError


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (relative path -> file bytes, ``None`` for a directory)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_save_leaves_only_the_checkpoint(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer)
    assert os.listdir(tmp_path) == ["ck"]
    data = checkpoint.data_dir(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == [data.name, "manifest.json"]
    assert sorted(os.listdir(data)) == [".metadata", "__0_0.distcp", "extra.pt"]


def test_save_into_existing_empty_directory(tmp_path: Path) -> None:
    """The harness hands out an empty per-test directory; saving right into it must work."""
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path, t.model, t.optimizer, extra={"a": 1})
    assert checkpoint.load(tmp_path, t.model, t.optimizer) == {"a": 1}


def test_overwrite_replaces_previous_checkpoint(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 1})
    t.step(0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 2})
    assert os.listdir(tmp_path) == ["ck"]
    assert len(os.listdir(tmp_path / "ck")) == 2  # the superseded data directory was removed
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 2}
    assert all(float(s["step"]) == 1.0 for s in fresh.optimizer.state.values())


def test_failed_save_keeps_previous_checkpoint_and_cleans_up(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 1})
    before = _tree(tmp_path / "ck")
    t.step(0)
    with pytest.raises(CheckpointWriteError, match="writing extra.pt"):
        checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"bad": lambda: 0})  # unpicklable
    assert os.listdir(tmp_path) == ["ck"]
    assert _tree(tmp_path / "ck") == before  # no new data directory left behind
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 1}


def test_crash_between_data_and_publish_keeps_previous_checkpoint(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a failure right before the commit: the old checkpoint must stay loadable."""
    from fsdp_impl.checkpoint import _layout

    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 1})

    def crash(path: Path, data: Path, manifest: dict) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(_layout, "commit", crash)
    t.step(0)
    with pytest.raises(CheckpointWriteError, match="simulated crash before rename"):
        checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 2})
    monkeypatch.undo()
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 1}
    assert len(fresh.optimizer.state) == 0  # the v1 checkpoint was taken before any step


def test_failed_commit_keeps_old_checkpoint_and_removes_new_data(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 1})
    before = _tree(tmp_path / "ck")

    def flaky(src: os.PathLike, dst: os.PathLike) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(CheckpointWriteError, match="disk went away"):
        checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 2})
    monkeypatch.undo()
    assert _tree(tmp_path / "ck") == before  # neither the new data nor a manifest temp file stays
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 1}


def test_checkpoint_is_independent_of_torch_compile_prefix(tmp_path: Path) -> None:
    """``torch.compile`` renames keys with ``_orig_mod.``; checkpoints must not care."""
    from fsdp_impl.checkpoint._state import canonical_name

    assert canonical_name("_orig_mod.fc1.weight") == "fc1.weight"
    assert canonical_name("module._orig_mod.layers.0.w") == "module.layers.0.w"
    t = make_trainer(seed=0)
    t.step(0)

    class Holder(torch.nn.Module):  # mimics OptimizedModule's attribute name
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    checkpoint.save(tmp_path / "ck", Holder(t.model), t.optimizer)
    fresh = make_trainer(seed=4)
    checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer)
    assert fresh.step(1) == t.step(1)
