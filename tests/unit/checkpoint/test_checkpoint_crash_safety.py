"""Saving again never loses the checkpoint or the user's files, wherever the saving process dies.

Each crash case forks a child that saves over an existing checkpoint and dies (``os._exit``, no
cleanup, like SIGKILL) at one point of the save; the parent then loads: before the commit it must
get the old checkpoint, after it the new one, and the user's files in the directory are always
intact. The next save removes what the dead one left. Checkpoints of the earlier flat format,
and the state its interrupted publish left (nothing at ``path``, only ``path.tmp-*`` and
``path.old-*``), are recovered too.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _ckpt_unit_models import Trainer, make_trainer

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import CheckpointCorruptedError, CheckpointMismatchError

KILLED = 77
CHILD_RAISED = 3
USER_FILES = {"notes.txt": b"lr sweep: keep 3e-4", "eval/result.json": b'{"acc": 0.9}'}


def _add_user_files(path: Path) -> None:
    for name, data in USER_FILES.items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(data)


def _assert_user_files(path: Path) -> None:
    assert {name: (path / name).read_bytes() for name in USER_FILES} == USER_FILES


def _own_entries(path: Path) -> list[str]:
    """What the checkpoint itself keeps in ``path``: the manifest and one data directory."""
    return sorted(p.name for p in path.iterdir() if p.name not in ("notes.txt", "eval"))


def _load_extra(path: Path) -> object:
    fresh = make_trainer(seed=7)
    return checkpoint.load(path, fresh.model, fresh.optimizer)


def test_saving_again_keeps_the_users_files(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    path = tmp_path / "ck"
    checkpoint.save(path, t.model, t.optimizer, extra={"v": 1})
    _add_user_files(path)
    for version in (2, 3):
        t.step(version)
        checkpoint.save(path, t.model, t.optimizer, extra={"v": version})
        _assert_user_files(path)
        assert _own_entries(path) == sorted([checkpoint.data_dir(path).name, "manifest.json"])
    assert _load_extra(path) == {"v": 3}


def _die(*_: object, **__: object) -> None:
    os._exit(KILLED)


def _in_extra_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dies while the new data directory is being filled (extra.pt)."""
    from fsdp_impl.checkpoint import _files
    monkeypatch.setattr(_files, "write_file_durably", _die)


# The commit crash points patch the checkpoint's own publish step, not ``os.replace``: torch's DCP
# writer renames files of its own while writing the data (differently across torch versions).
def _before_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dies with the new data and the new manifest's temp file written, before the replace."""
    from fsdp_impl.checkpoint import _layout
    monkeypatch.setattr(_layout, "publish_manifest", _die)


def _after_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dies right after the atomic replace, before anything superseded is removed."""
    from fsdp_impl.checkpoint import _layout
    real = _layout.publish_manifest

    def replace_then_die(tmp: Path, manifest_path: Path) -> None:
        real(tmp, manifest_path)
        os._exit(KILLED)

    monkeypatch.setattr(_layout, "publish_manifest", replace_then_die)


def _during_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dies half-way through deleting the superseded data directory."""
    def remove_one_then_die(path: str | os.PathLike, ignore_errors: bool = False) -> None:
        next(p for p in sorted(Path(path).iterdir()) if p.is_file()).unlink()
        os._exit(KILLED)

    monkeypatch.setattr(shutil, "rmtree", remove_one_then_die)


CRASHES: list[tuple[Callable[[pytest.MonkeyPatch], None], int]] = [
    (_in_extra_write, 1), (_before_commit, 1), (_after_commit, 2), (_during_cleanup, 2)]


def _save_in_child_that_dies(path: Path, trainer: Trainer, crash: Callable[[pytest.MonkeyPatch], None]) -> int:
    if torch.cuda.is_initialized():
        # DCP's save touches CUDA (``Tensor.is_pinned``), which a forked child of a process that
        # initialised CUDA cannot do; the crash points are device-independent (CPU model), so
        # CPU-only hosts and fresh workers cover them.
        pytest.skip("fork-based crash simulation: CUDA was already initialised in this process "
                    "(another test in this worker used the GPU)")
    pid = os.fork()
    if pid == 0:  # the child: install the crash point, save, and never return into pytest
        code = 0
        try:
            with pytest.MonkeyPatch.context() as mp:
                crash(mp)
                checkpoint.save(path, trainer.model, trainer.optimizer, extra={"v": 2})
        except BaseException:
            traceback.print_exc()
            code = CHILD_RAISED
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code != CHILD_RAISED, "the saving child raised before its crash point (traceback above)"
    return code


@pytest.mark.parametrize("crash,survivor", CRASHES, ids=[c.__name__.strip("_") for c, _ in CRASHES])
def test_killed_save_leaves_a_complete_checkpoint(crash: Callable[[pytest.MonkeyPatch], None], survivor: int,
                                                   tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    path = tmp_path / "ck"
    checkpoint.save(path, t.model, t.optimizer, extra={"v": 1})
    _add_user_files(path)
    t.step(0)
    assert _save_in_child_that_dies(path, t, crash) == KILLED, "the crash point was not reached"
    assert _load_extra(path) == {"v": survivor}
    _assert_user_files(path)
    checkpoint.save(path, t.model, t.optimizer, extra={"v": 3})  # removes what the dead save left
    assert _own_entries(path) == sorted([checkpoint.data_dir(path).name, "manifest.json"])
    assert os.listdir(tmp_path) == ["ck"]
    _assert_user_files(path)
    assert _load_extra(path) == {"v": 3}


def _die_at_rename(k: int) -> Callable[[pytest.MonkeyPatch], None]:
    """Dies at the ``k``-th rename or replace of the save, whichever the publish uses."""
    def crash(monkeypatch: pytest.MonkeyPatch) -> None:
        calls = [0]
        for name in ("rename", "replace"):
            real = getattr(os, name)

            def counted(src: str, dst: str, _real: Callable[[str, str], None] = real) -> None:
                calls[0] += 1
                if calls[0] == k:
                    os._exit(KILLED)
                _real(src, dst)

            monkeypatch.setattr(os, name, counted)
    return crash


def test_killed_at_any_rename_leaves_old_or_new_checkpoint(tmp_path: Path) -> None:
    """Whatever renames a publish does, dying before any of them leaves a loadable checkpoint
    (the old one until the commit, then the new one) and the user's files."""
    t = make_trainer(seed=0)
    for k in range(1, 8):
        path = tmp_path / f"ck{k}"
        checkpoint.save(path, t.model, t.optimizer, extra={"v": 1})
        _add_user_files(path)
        code = _save_in_child_that_dies(path, t, _die_at_rename(k))
        assert _load_extra(path) == ({"v": 1} if code == KILLED else {"v": 2}), f"killed at rename {k}"
        _assert_user_files(path)
        if code != KILLED:
            break


def test_an_unreleased_version_1_checkpoint_is_refused_naming_the_versions(tmp_path: Path) -> None:
    """Format 1 (data next to the manifest) was never released: such a manifest is refused before
    anything is read, naming the version found and the one this code reads."""
    t = make_trainer(seed=0)
    path = tmp_path / "ck"
    checkpoint.save(path, t.model, t.optimizer, extra={"v": 1})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["version"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    fresh = make_trainer(seed=1)
    with pytest.raises(CheckpointCorruptedError, match=r"has format version 1; this code reads versions 2"):
        checkpoint.load(path, fresh.model, fresh.optimizer)


def _stepped(kind: str) -> Trainer:
    t = make_trainer(seed=0)
    params = t.model.parameters()
    t.optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9) if kind == "SGD" else torch.optim.Adam(params)
    t.step(0)
    return t


@pytest.mark.parametrize("saved_with,loaded_into", [("Adam", "SGD"), ("SGD", "Adam")])
def test_checkpoint_of_another_optimizer_is_refused_at_load(saved_with: str, loaded_into: str,
                                                            tmp_path: Path) -> None:
    t = _stepped(saved_with)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer)
    other = _stepped(loaded_into)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=rf"saved with optimizer {saved_with} but is being loaded "
                                                      rf"into {loaded_into}"):
        checkpoint.load(tmp_path / "ck", other.model, other.optimizer)
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())  # nothing loaded
    other.step(1)  # and the optimizer still works
