"""Atomic save: a good checkpoint is never replaced by a half-written one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _ckpt_unit_models import make_trainer

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import CheckpointWriteError


def test_save_leaves_only_the_checkpoint(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer)
    assert os.listdir(tmp_path) == ["ck"]
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names[:2] == [".metadata", "__0_0.distcp"] and names[2:] == ["extra.pt", "manifest.json"]


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
    assert os.listdir(tmp_path) == ["ck"]  # the old one was moved aside and then deleted
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 2}
    assert all(float(s["step"]) == 1.0 for s in fresh.optimizer.state.values())


def test_failed_save_keeps_previous_checkpoint_and_cleans_up(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 1})
    before = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    t.step(0)
    with pytest.raises(CheckpointWriteError, match="writing extra.pt"):
        checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"bad": lambda: 0})  # unpicklable
    assert os.listdir(tmp_path) == ["ck"]  # no temporary directory left behind
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == before
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 1}


def test_crash_between_data_and_publish_keeps_previous_checkpoint(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulate a crash right before the rename: the old checkpoint must stay loadable."""
    from fsdp_impl.checkpoint import _files

    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 1})

    def crash(tmp: Path, path: Path) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(_files, "publish", crash)
    t.step(0)
    with pytest.raises(CheckpointWriteError, match="simulated crash before rename"):
        checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"v": 2})
    monkeypatch.undo()
    fresh = make_trainer(seed=3)
    assert checkpoint.load(tmp_path / "ck", fresh.model, fresh.optimizer) == {"v": 1}
    assert len(fresh.optimizer.state) == 0  # the v1 checkpoint was taken before any step


def test_publish_restores_old_checkpoint_if_rename_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_impl.checkpoint import _files

    old = tmp_path / "ck"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    new = tmp_path / "ck.tmp-x"
    new.mkdir()
    real_rename = os.rename

    def flaky(src: os.PathLike, dst: os.PathLike) -> None:
        if Path(src) == new:
            raise OSError("disk went away")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", flaky)
    with pytest.raises(OSError, match="disk went away"):
        _files.publish(new, old)
    monkeypatch.undo()
    assert (old / "manifest.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.tmp-x"]


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
