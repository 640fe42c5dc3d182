"""Other engines' DCP layouts in and out, on one process (no process group; DCP in no-dist mode).

Each writer's layout is produced here with torch's own tools, as the engine produces it:
FSDP2's ``get_state_dict`` (``{"model", "optim"}``), torchtitan's flattened optimizer with the
model keys at the top level and its lr-scheduler / data-loader / train-state entries, and
Megatron-FSDP's ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``
(position-keyed optimizer state). The reference is the writing run itself: right after the
load, parameters, AdamW moments and step counts equal the saved ones bit for bit, and both runs
then train on to the same losses (one process, same arithmetic: exact).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt_unit_models import TinyNet, Trainer, make_trainer
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import CheckpointFormatError, CheckpointMismatchError

STEPS = 3  # before the save: Adam's step count is 3, not a default 1


def _trained(seed: int = 0, steps: int = STEPS) -> Trainer:
    t = make_trainer(seed=seed)
    for i in range(steps):
        t.step(i)
    return t


def _save_fsdp2(t: Trainer, path: Path) -> None:
    model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=True)


def _save_torchtitan(t: Trainer, path: Path, model_key: str | None = None) -> None:
    """torchtitan's layout: model keys at the top level (releases before its flattening of the
    model states: under ``model``), ``optimizer`` flattened, its other states beside them."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd = get_model_state_dict(t.model)
    state: dict[str, Any] = dict(model_sd) if model_key is None else {model_key: model_sd}
    state["optimizer"] = get_optimizer_state_dict(t.model, t.optimizer, options=flat)
    state["lr_scheduler"] = {"last_epoch": STEPS}
    state["train_state"] = {"step": STEPS, "ntokens_seen": 96}
    state["dataloader"] = {"version": 1, "dp_world_size": 1, "dp_rank_0": b"sampler-state"}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _save_megatron_fsdp(t: Trainer, path: Path) -> None:
    dcp.save({"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict()}, checkpoint_id=str(path),
             no_dist=True)


def _state(t: Trainer) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    for n, p in t.model.named_parameters():
        for key, value in t.optimizer.state[p].items():
            out[f"{n}:{key}"] = torch.as_tensor(value).clone()
    return out


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert torch.equal(a[k], b[k]), k


WRITERS: dict[str, Callable[[Trainer, Path], None]] = {
    "fsdp2": _save_fsdp2, "torchtitan": _save_torchtitan, "megatron_fsdp": _save_megatron_fsdp,
    "torchtitan_model_key": lambda t, path: _save_torchtitan(t, path, model_key="model")}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_foreign_checkpoint_loads_exactly_and_trains_on(writer: str, tmp_path: Path) -> None:
    source = _trained()
    WRITERS[writer](source, tmp_path / "ck")
    t = make_trainer(seed=7, lr=0.5)  # other weights, another lr: both must come from the checkpoint
    t.model(torch.zeros(1, 4))
    others = checkpoint.load(tmp_path / "ck", t.model, t.optimizer)
    _assert_equal(_state(t), _state(source))
    assert t.optimizer.param_groups[0]["lr"] == source.optimizer.param_groups[0]["lr"]
    assert float(t.optimizer.state[t.model.fc1.weight]["step"]) == STEPS
    if writer.startswith("torchtitan"):
        assert others == {"lr_scheduler": {"last_epoch": STEPS}, "train_state": {"step": STEPS, "ntokens_seen": 96},
                          "dataloader": {"version": 1, "dp_world_size": 1, "dp_rank_0": b"sampler-state"}}
    else:
        assert others == {}
    for i in range(STEPS, STEPS + 3):
        assert t.step(i) == source.step(i)
    _assert_equal(_state(t), _state(source))


def test_torch_dcp_save_is_loaded_by_fsdp2_set_state_dict(tmp_path: Path) -> None:
    """``format="torch_dcp"``: torch's own ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``
    resume it exactly; our sidecars are ignored; our ``load`` reads it back with ``extra``."""
    source = _trained()
    checkpoint.save(tmp_path / "ck", source.model, source.optimizer, extra={"epoch": 2}, format="torch_dcp")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        ".metadata", "__0_0.distcp", "extra.pt", "manifest.json"]
    theirs = make_trainer(seed=5)
    model_sd, optim_sd = get_state_dict(theirs.model, theirs.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    set_state_dict(theirs.model, theirs.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_equal(_state(theirs), _state(source))
    ours = make_trainer(seed=6)
    assert checkpoint.load(tmp_path / "ck", ours.model, ours.optimizer) == {"epoch": 2}
    _assert_equal(_state(ours), _state(source))
    for i in range(STEPS, STEPS + 2):
        assert theirs.step(i) == source.step(i) == ours.step(i)


def test_torch_dcp_of_a_never_stepped_optimizer_resumes_in_fsdp2(tmp_path: Path) -> None:
    """FSDP2's ``get_state_dict`` creates optimizer state before loading, so ``dcp.load`` wants
    every entry: a save before the first step writes the state a first step would create."""
    source = make_trainer(seed=0)
    checkpoint.save(tmp_path / "ck", source.model, source.optimizer, format="torch_dcp")
    theirs = make_trainer(seed=5)
    model_sd, optim_sd = get_state_dict(theirs.model, theirs.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    set_state_dict(theirs.model, theirs.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert float(theirs.optimizer.state[theirs.model.fc1.weight]["step"]) == 0
    for i in range(2):
        assert theirs.step(i) == source.step(i)


def test_torch_dcp_checkpoint_refuses_another_optimizer_class(tmp_path: Path) -> None:
    source = _trained()
    checkpoint.save(tmp_path / "ck", source.model, source.optimizer, format="torch_dcp")
    t = make_trainer(seed=5)
    sgd = torch.optim.SGD(t.model.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="saved with optimizer AdamW but is being loaded into SGD"):
        checkpoint.load(tmp_path / "ck", t.model, sgd)


def test_torch_dcp_save_is_written_once(tmp_path: Path) -> None:
    t = _trained()
    checkpoint.save(tmp_path / "ck", t.model, t.optimizer, format="torch_dcp")
    with pytest.raises(checkpoint.CheckpointWriteError, match="exists and is not an empty directory"):
        checkpoint.save(tmp_path / "ck", t.model, t.optimizer, format="torch_dcp")
    with pytest.raises(ValueError, match=r"format must be one of \('fsdp_impl', 'torch_dcp'\); got 'dcp'"):
        checkpoint.save(tmp_path / "other", t.model, t.optimizer, format="dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "a refused save left files behind"


class Wider(TinyNet):
    def __init__(self) -> None:
        super().__init__(hidden=7)


class Deeper(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.fc3 = torch.nn.Linear(2, 2)


def _mismatch(build: Callable[[], torch.nn.Module], optimizer: Callable[[Any], torch.optim.Optimizer]) -> Trainer:
    torch.manual_seed(11)
    model = build()
    return Trainer(model, optimizer(model.parameters()))


MISMATCHES = {
    "missing": (lambda: Deeper(), torch.optim.AdamW,
                r"in the model but not in the checkpoint \(2\):\n    model.fc3.weight"),
    "unexpected": (lambda: _without_fc2_bias(), torch.optim.AdamW,
                   r"in the checkpoint but not in the model \(1\):\n    model.fc2.bias"),
    "shape": (lambda: Wider(), torch.optim.AdamW, r"shape differs \(\d\):\n    model.fc1.weight: model \(7, 4\), "
                                                  r"checkpoint \(6, 4\)"),
    "dtype": (lambda: TinyNet().double(), torch.optim.AdamW,
              r"(?s)dtype differs \(5\):.*model.fc1.weight: model torch.float64, checkpoint torch.float32"),
    "sgd": (lambda: TinyNet(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            r"(?s)different optimizer than this SGD:\n.*fc1.weight: checkpoint keeps \['exp_avg', 'exp_avg_sq', "
            r"'step'\], SGD keeps \['momentum_buffer'\]"),
    "adam": (lambda: TinyNet(), torch.optim.Adam, r"different optimizer than this Adam: its param group 0 has "
                                                  r"decoupled_weight_decay=True"),
}


def _without_fc2_bias() -> TinyNet:
    net = TinyNet()
    net.fc2 = torch.nn.Linear(6, 2, bias=False)
    return net


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_is_refused_before_anything_changes(case: str, tmp_path: Path) -> None:
    _save_fsdp2(_trained(), tmp_path / "ck")
    build, optimizer, message = MISMATCHES[case]
    t = _mismatch(build, optimizer)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=message):
        checkpoint.load(tmp_path / "ck", t.model, t.optimizer)
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items()), "a refused load changed the model"
    assert len(t.optimizer.state) == 0, "a refused load created optimizer state"


def test_unreadable_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    torch.save({"w": torch.zeros(1)}, tmp_path / "ck" / "pytorch_model.bin")
    t = make_trainer(seed=0)
    with pytest.raises(CheckpointFormatError, match=r"holds torch.save files, not a sharded checkpoint \(it contains "
                                                    r"pytorch_model.bin\); readable formats: fsdp_impl.checkpoint"):
        checkpoint.load(tmp_path / "ck", t.model, t.optimizer)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match=r"DCP data files without their .metadata"):
        checkpoint.load(tmp_path / "dcp", t.model, t.optimizer)


def test_ambiguous_model_prefix_names_the_candidates(tmp_path: Path) -> None:
    """A checkpoint with the model twice (e.g. its EMA copy) needs ``model_key``."""
    source = _trained()
    model_sd, optim_sd = get_state_dict(source.model, source.optimizer)
    ema = {k: v.clone() + 1 for k, v in model_sd.items()}
    dcp.save({"model": model_sd, "ema": ema, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    t = make_trainer(seed=4)
    with pytest.raises(CheckpointFormatError, match=r"several prefixes \('ema.', 'model.'.*pass model_key="):
        checkpoint.load(tmp_path / "ck", t.model, t.optimizer)
    others = checkpoint.load(tmp_path / "ck", t.model, t.optimizer, model_key="model")
    assert torch.equal(t.model.fc1.weight, source.model.fc1.weight)
    assert torch.equal(others["ema"]["fc1.weight"], ema["fc1.weight"])


def test_position_keyed_checkpoint_needs_the_same_param_groups(tmp_path: Path) -> None:
    """Megatron-FSDP keys optimizer state by position: an optimizer with other groups is refused
    (naming the groups) instead of pairing one parameter's moments with another parameter."""
    _save_megatron_fsdp(_trained(), tmp_path / "ck")
    torch.manual_seed(4)
    model = TinyNet()
    split = torch.optim.AdamW([{"params": [model.fc1.weight, model.fc2.weight]},
                               {"params": [model.fc1.bias, model.fc2.bias]}], lr=0.02, weight_decay=0.1)
    with pytest.raises(CheckpointMismatchError, match=r"no saved group holds exactly this optimizer's group 0 \(2 "
                                                      r"parameters, first fc1.weight\); the checkpoint keys optimizer "
                                                      r"state by position"):
        checkpoint.load(tmp_path / "ck", model, split)
    assert len(split.state) == 0
