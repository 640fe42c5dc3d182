"""Clear errors: bad arguments, missing/foreign directories, damaged files, different models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _ckpt_unit_models import TinyNet, Trainer, make_trainer

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import (
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A good checkpoint of a stepped TinyNet."""
    t = make_trainer(seed=0)
    t.step(0)
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, extra={"k": 1})
    return tmp_path / "ck"


def _fresh() -> Trainer:
    return make_trainer(seed=9)


def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    t = _fresh()
    with pytest.raises(TypeError, match="path must be"):
        checkpoint.save(None, t.model, t.optimizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="extra must be a dict"):
        checkpoint.save(tmp_path / "x", t.model, t.optimizer, extra=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        checkpoint.save(tmp_path / "x", t.model, object())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        checkpoint.save(tmp_path / "x", object(), t.optimizer)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_optimizer_over_other_parameters_is_rejected(tmp_path: Path) -> None:
    t = _fresh()
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(CheckpointMismatchError,
                       match=r"param group 0, parameter 0 \(shape \(3,\)\) is not a parameter"):
        checkpoint.save(tmp_path / "x", t.model, other)


def test_missing_directory(tmp_path: Path) -> None:
    t = _fresh()
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint directory .*nope does not exist"):
        checkpoint.load(tmp_path / "nope", t.model, t.optimizer)


def test_missing_directory_mentions_leftovers_of_an_interrupted_save(tmp_path: Path) -> None:
    (tmp_path / "ck.tmp-abc123").mkdir()
    t = _fresh()
    with pytest.raises(CheckpointNotFoundError, match=r"leftovers of an interrupted save: ck.tmp-abc123"):
        checkpoint.load(tmp_path / "ck", t.model, t.optimizer)


def test_directory_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    t = _fresh()
    with pytest.raises(CheckpointNotFoundError, match=r"has no manifest.json: it is not a checkpoint"):
        checkpoint.load(tmp_path / "empty", t.model, t.optimizer)


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    t = _fresh()
    with pytest.raises(CheckpointNotFoundError, match="is not a directory"):
        checkpoint.load(tmp_path / "f", t.model, t.optimizer)


def _data_file(path: Path) -> Path:
    return next(p for p in sorted(checkpoint.data_dir(path).iterdir()) if p.suffix == ".distcp")


def test_truncated_data_file_is_named(saved: Path) -> None:
    f = _data_file(saved)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    t = _fresh()
    with pytest.raises(CheckpointCorruptedError, match=rf"{f.name} is truncated: {size // 2} bytes, expected {size}"):
        checkpoint.load(saved, t.model, t.optimizer)


def test_altered_data_file_is_named(saved: Path) -> None:
    f = _data_file(saved)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte inside tensor data
    f.write_bytes(bytes(data))
    t = _fresh()
    with pytest.raises(CheckpointCorruptedError, match=rf"{f.name} is corrupted: SHA-256 differs"):
        checkpoint.load(saved, t.model, t.optimizer)


def test_deleted_file_is_named(saved: Path) -> None:
    (checkpoint.data_dir(saved) / "extra.pt").unlink()
    t = _fresh()
    with pytest.raises(CheckpointCorruptedError, match=r"extra.pt is missing"):
        checkpoint.load(saved, t.model, t.optimizer)


def test_corrupted_manifest_is_named(saved: Path) -> None:
    manifest = saved / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    t = _fresh()
    with pytest.raises(CheckpointCorruptedError, match=r"manifest.json is unreadable or corrupted"):
        checkpoint.load(saved, t.model, t.optimizer)


def test_damaged_load_leaves_model_untouched(saved: Path) -> None:
    """Integrity is checked before any tensor is copied: a failed load must not half-load."""
    f = _data_file(saved)
    with open(f, "r+b") as fh:
        fh.truncate(10)
    t = _fresh()
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(CheckpointCorruptedError):
        checkpoint.load(saved, t.model, t.optimizer)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, t.model.parameters(), strict=True))
    assert len(t.optimizer.state) == 0


def test_different_model_lists_first_mismatches(saved: Path) -> None:
    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Linear(4, 6)
            self.fc2 = torch.nn.Linear(6, 2)
            self.register_buffer("scale", torch.tensor([1.0]))

    m = Renamed()
    with pytest.raises(CheckpointMismatchError) as info:
        checkpoint.load(saved, m, torch.optim.Adam(m.parameters()))
    msg = str(info.value)
    assert "saved from a different model" in msg
    assert "in the model but not in the checkpoint (2):\n    encoder.weight\n    encoder.bias" in msg
    assert "in the checkpoint but not in the model (2):\n    fc1.bias\n    fc1.weight" in msg


def test_different_shapes_are_listed(saved: Path) -> None:
    t = make_trainer(seed=0, hidden=7)
    with pytest.raises(CheckpointMismatchError) as info:
        checkpoint.load(saved, t.model, t.optimizer)
    msg = str(info.value)
    assert "shape differs (3):" in msg
    assert "fc1.weight: model (7, 4), checkpoint (6, 4)" in msg
    assert "fc2.weight: model (2, 7), checkpoint (2, 6)" in msg
    assert "fc2.bias" not in msg  # same shape: not a mismatch


def test_mismatch_list_is_capped(tmp_path: Path) -> None:
    def deep(n: int) -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(n)])

    m = deep(1)
    checkpoint.save(tmp_path / "ck", m, torch.optim.SGD(m.parameters(), lr=0.1))
    m = deep(8)
    with pytest.raises(CheckpointMismatchError,
                       match=r"not in the checkpoint \(14\):(\n    .*){5}\n    \.\.\. and 9 more"):
        checkpoint.load(tmp_path / "ck", m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_different_param_groups_are_reported(saved: Path) -> None:
    m = TinyNet()
    groups = [{"params": [m.fc1.weight, m.fc1.bias]}, {"params": [m.fc2.weight, m.fc2.bias], "lr": 0.1}]
    with pytest.raises(CheckpointMismatchError, match=r"optimizer has 2 param group\(s\) but the checkpoint has 1"):
        checkpoint.load(saved, m, torch.optim.AdamW(groups))


def test_group_membership_difference_is_reported(tmp_path: Path) -> None:
    m = TinyNet()
    two = [{"params": [m.fc1.weight, m.fc1.bias]}, {"params": [m.fc2.weight, m.fc2.bias]}]
    checkpoint.save(tmp_path / "ck", m, torch.optim.Adam(two))
    swapped = [{"params": [m.fc1.weight, m.fc2.bias]}, {"params": [m.fc2.weight, m.fc1.bias]}]
    with pytest.raises(CheckpointMismatchError,
                       match=r"group 0: parameter 'fc2.bias' is not in the checkpoint's group"):
        checkpoint.load(tmp_path / "ck", m, torch.optim.Adam(swapped))


def test_bare_model_only_dcp_checkpoint_loads_the_model_only(tmp_path: Path) -> None:
    """A bare DCP directory without optimizer state: refused with an optimizer (naming why),
    loaded with ``optimizer=None``."""
    import torch.distributed.checkpoint as dcp

    source = make_trainer(seed=3)
    dcp.save({"model": source.model.state_dict()}, checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    t = _fresh()
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state; pass optimizer=None"):
        checkpoint.load(tmp_path / "bare", t.model, t.optimizer)
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters()), "a refused load changed the model"
    assert checkpoint.load(tmp_path / "bare", t.model, None) == {}
    for name, p in source.model.state_dict().items():
        assert torch.equal(t.model.state_dict()[name], p), name


def test_newer_format_version_is_refused(saved: Path) -> None:
    manifest = saved / "manifest.json"
    data = json.loads(manifest.read_text())
    data["version"] = 99
    manifest.write_text(json.dumps(data))
    t = _fresh()
    with pytest.raises(CheckpointCorruptedError, match="format version 99; this code reads versions 2"):
        checkpoint.load(saved, t.model, t.optimizer)


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "mydata"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    t = _fresh()
    with pytest.raises(CheckpointWriteError, match="non-empty directory that is not a checkpoint"):
        checkpoint.save(target, t.model, t.optimizer)
    assert (target / "precious.txt").read_text() == "keep me"
    assert os.listdir(tmp_path) == ["mydata"]
