"""Checkpoint failures under several ranks: every rank raises the same clear error, none hangs.

Damage found by one rank (file hashing is split round-robin across ranks) must surface on all
ranks; a failure on one rank during save must abort the save everywhere and leave the previous
checkpoint in place.  Messages are checked, not just the exception types.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import (
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.checkpointing import Case, assert_same_state, full_state, train_step, wrap

pytestmark = [
    pytest.mark.distributed(world_size=2),
    pytest.mark.matrix(mesh=axes.mesh(2), model="cnn", dtype="fp32"),
]
CNN = Case("cnn", "optim_grads_params")


def _trained(dist_env: Any, case: Case = CNN, steps: int = 1) -> tuple:
    model, optimizer = wrap(case, dist_env.device, seed=0)
    for step in range(steps):
        train_step(model, optimizer, case.model, step, dist_env.device)
    return model, optimizer


def _on_rank0(dist_env: Any, action: Any) -> None:
    """Damage the shared checkpoint once, after every rank looked at it and before any reads on."""
    dist.barrier()
    if dist_env.rank == 0:
        action()
    dist.barrier()


def test_truncated_shard_found_by_another_rank_fails_everywhere(dist_env: Any, shared_tmp_path: Path) -> None:
    model, optimizer = _trained(dist_env)
    path = shared_tmp_path / "ck"
    checkpoint.save(path, model, optimizer)
    # hashed by rank 1 in the round-robin split (sorted: .metadata, __0_0, ...)
    victim = checkpoint.data_dir(path) / "__0_0.distcp"
    size = victim.stat().st_size
    _on_rank0(dist_env, lambda: os.truncate(victim, size - 7))
    fresh, fresh_opt = wrap(CNN, dist_env.device, seed=5)
    before = full_state(fresh, fresh_opt)
    truncated = rf"__0_0.distcp is truncated: {size - 7} bytes, expected {size}"
    with pytest.raises(CheckpointCorruptedError, match=truncated):
        checkpoint.load(path, fresh, fresh_opt)
    assert_same_state(full_state(fresh, fresh_opt), before, None, "after a refused load")


def test_flipped_byte_is_reported_with_the_file_name(dist_env: Any, shared_tmp_path: Path) -> None:
    model, optimizer = _trained(dist_env)
    path = shared_tmp_path / "ck"
    checkpoint.save(path, model, optimizer)
    victim = checkpoint.data_dir(path) / "__1_0.distcp"

    def flip() -> None:
        data = bytearray(victim.read_bytes())
        data[-40] ^= 0x01
        victim.write_bytes(bytes(data))

    _on_rank0(dist_env, flip)
    fresh, fresh_opt = wrap(CNN, dist_env.device, seed=5)
    with pytest.raises(CheckpointCorruptedError, match=r"__1_0.distcp is corrupted: SHA-256 differs"):
        checkpoint.load(path, fresh, fresh_opt)


def test_checkpoint_of_another_model_lists_mismatches(dist_env: Any, shared_tmp_path: Path) -> None:
    model, optimizer = _trained(dist_env)
    checkpoint.save(shared_tmp_path / "ck", model, optimizer)
    other, other_opt = wrap(Case("transformer", "optim_grads_params"), dist_env.device, seed=0)
    with pytest.raises(CheckpointMismatchError) as info:
        checkpoint.load(shared_tmp_path / "ck", other, other_opt)
    message = str(info.value)
    assert "saved from a different model" in message
    assert "in the model but not in the checkpoint" in message and "module.src_in.weight" in message
    assert "in the checkpoint but not in the model" in message and "module.conv1.weight" in message


def test_checkpoint_with_other_shapes_lists_them(dist_env: Any, shared_tmp_path: Path) -> None:
    from tests.functional.common.models import SmallCNN

    model, optimizer = _trained(dist_env)
    checkpoint.save(shared_tmp_path / "ck", model, optimizer)
    import fsdp_impl
    from tests.functional.common.models import unit_classes

    torch.manual_seed(0)
    wide = SmallCNN(hidden=6)
    wide_model, wide_opt = fsdp_impl.fully_shard(wide, torch.optim.Adam(wide.parameters()),
                                                 fsdp_unit_modules=list(unit_classes("cnn")))
    with pytest.raises(CheckpointMismatchError, match=r"shape differs \(5\):\n    module.conv1.weight: "
                                                      r"model \(6, 3, 3, 3\), checkpoint \(5, 3, 3, 3\)"):
        checkpoint.load(shared_tmp_path / "ck", wide_model, wide_opt)


def test_missing_directory_fails_everywhere(dist_env: Any, shared_tmp_path: Path) -> None:
    model, optimizer = wrap(CNN, dist_env.device, seed=0)
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint directory .*never-saved does not exist"):
        checkpoint.load(shared_tmp_path / "never-saved", model, optimizer)


def test_overwrite_keeps_one_directory_and_newest_state(dist_env: Any, shared_tmp_path: Path) -> None:
    model, optimizer = _trained(dist_env)
    path = shared_tmp_path / "ck"
    checkpoint.save(path, model, optimizer, extra={"version": 1})
    train_step(model, optimizer, CNN.model, 1, dist_env.device)
    checkpoint.save(path, model, optimizer, extra={"version": 2})
    expected = full_state(model, optimizer)
    assert sorted(os.listdir(shared_tmp_path)) == ["ck"]
    fresh, fresh_opt = wrap(CNN, dist_env.device, seed=5)
    assert checkpoint.load(path, fresh, fresh_opt) == {"version": 2}
    assert_same_state(full_state(fresh, fresh_opt), expected, None, "after loading the overwritten checkpoint")


def test_failure_on_one_rank_aborts_save_everywhere(dist_env: Any, shared_tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_impl.checkpoint import _files

    model, optimizer = _trained(dist_env)
    path = shared_tmp_path / "ck"
    checkpoint.save(path, model, optimizer, extra={"version": 1})
    good = full_state(model, optimizer)
    if dist_env.rank == 1:
        def broken(file: Path) -> dict:
            raise OSError(f"simulated read error on {file.name}")

        monkeypatch.setattr(_files, "file_digest", broken)
    train_step(model, optimizer, CNN.model, 1, dist_env.device)
    with pytest.raises(CheckpointWriteError, match=r"hashing checkpoint files failed on 1 rank\(s\): rank 1: "
                                                   r"OSError: simulated read error"):
        checkpoint.save(path, model, optimizer, extra={"version": 2})
    monkeypatch.undo()
    dist.barrier()
    assert sorted(os.listdir(shared_tmp_path)) == ["ck"], "the temporary directory must be removed"
    fresh, fresh_opt = wrap(CNN, dist_env.device, seed=5)
    assert checkpoint.load(path, fresh, fresh_opt) == {"version": 1}
    assert_same_state(full_state(fresh, fresh_opt), good, None, "previous checkpoint after a failed save")


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
def test_state_dicts_are_dtensors_with_global_shapes(strategy: str, dist_env: Any, shared_tmp_path: Path) -> None:
    """What DCP sees: DTensor params/moments with the module's global shapes (uneven/empty shards
    included), and a checkpoint whose metadata records those global shapes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tests.functional.common.models import build_model

    model, optimizer = _trained(dist_env, Case("cnn", strategy))
    shapes = {f"module.{n}": tuple(p.shape) for n, p in build_model("cnn").named_parameters()}
    expected_placement = Replicate() if strategy == "no_shard" else Shard(0)
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor), f"{name} is {type(value).__name__}, not a DTensor"
        assert tuple(value.shape) == shapes[name] and value.placements == (expected_placement,), name
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(optimizer.state[p][key], DTensor)
    checkpoint.save(shared_tmp_path / "ck", model, optimizer)
    metadata = FileSystemReader(checkpoint.data_dir(shared_tmp_path / "ck")).read_metadata()
    for name, shape in shapes.items():
        assert tuple(metadata.state_dict_metadata[f"model.{name}"].size) == shape
        assert tuple(metadata.state_dict_metadata[f"optim.{name}.exp_avg"].size) == shape
