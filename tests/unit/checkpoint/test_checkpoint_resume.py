"""Single-process resume exactness: losses, weights, Adam state, hyperparameters, extra."""

from __future__ import annotations

from pathlib import Path

import torch
from _ckpt_unit_models import make_trainer

from fsdp_impl import checkpoint


def _run_and_save(path: Path, k: int, n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Uninterrupted run to ``n`` steps with a checkpoint after ``k``; returns losses and final weights."""
    t = make_trainer(seed=0)
    for i in range(k):
        t.step(i)
    checkpoint.save(path, t.model, t.optimizer, extra={"next_step": k, "rng": torch.get_rng_state()})
    for i in range(k, n):
        t.step(i)
    return t.losses, {n_: p.detach().clone() for n_, p in t.model.named_parameters()}


def test_resume_reproduces_losses_and_weights_bit_for_bit(tmp_path: Path) -> None:
    ref_losses, ref_params = _run_and_save(tmp_path / "ck", k=3, n=7)
    t = make_trainer(seed=123)  # different init: the load must overwrite everything
    extra = checkpoint.load(tmp_path / "ck", t.model, t.optimizer)
    assert extra["next_step"] == 3
    for i in range(extra["next_step"], 7):
        t.step(i)
    assert t.losses == ref_losses[3:]
    for name, p in t.model.named_parameters():
        assert torch.equal(p.detach(), ref_params[name]), name


def test_load_into_never_stepped_optimizer_restores_adam_state_without_a_step(tmp_path: Path) -> None:
    src = make_trainer(seed=0)
    for i in range(2):
        src.step(i)
    checkpoint.save(tmp_path / "ck", src.model, src.optimizer)
    dst = make_trainer(seed=5)
    assert len(dst.optimizer.state) == 0  # Adam creates state lazily
    checkpoint.load(tmp_path / "ck", dst.model, dst.optimizer)
    # Weights right after load equal the saved ones: no dummy step moved them (AdamW decays!).
    for (name, a), b in zip(src.model.named_parameters(), dst.model.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach()), name
    for a, b in zip(src.model.parameters(), dst.model.parameters(), strict=True):
        sa, sb = src.optimizer.state[a], dst.optimizer.state[b]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert float(sb["step"]) == 2.0  # not 3: no dummy step advanced it
        assert sb["step"].dtype == sa["step"].dtype and sb["step"].device == sa["step"].device
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert sb["exp_avg"].shape == b.shape


def test_hyperparameters_and_buffers_are_restored(tmp_path: Path) -> None:
    src = make_trainer(seed=0)
    src.step(0)
    src.optimizer.param_groups[0]["lr"] = 0.0037  # e.g. set by an LR scheduler
    src.model.scale.fill_(2.25)
    checkpoint.save(tmp_path / "ck", src.model, src.optimizer)
    dst = make_trainer(seed=1, lr=0.5, weight_decay=0.0)
    checkpoint.load(tmp_path / "ck", dst.model, dst.optimizer)
    group = dst.optimizer.param_groups[0]
    assert group["lr"] == 0.0037 and group["weight_decay"] == 0.1
    assert group["params"] == list(dst.model.parameters())  # live params, not the saved ids
    assert dst.model.scale.item() == 2.25


def test_load_overwrites_state_of_an_optimizer_that_already_stepped(tmp_path: Path) -> None:
    src = make_trainer(seed=0)
    src.step(0)
    checkpoint.save(tmp_path / "ck", src.model, src.optimizer)
    dst = make_trainer(seed=0)
    for i in range(4):
        dst.step(i)
    checkpoint.load(tmp_path / "ck", dst.model, dst.optimizer)
    assert all(float(s["step"]) == 1.0 for s in dst.optimizer.state.values())
    assert dst.step(1) == src.step(1)


def test_extra_round_trips_and_defaults_to_none(tmp_path: Path) -> None:
    t = make_trainer(seed=0)
    checkpoint.save(tmp_path / "a", t.model, t.optimizer)
    assert checkpoint.load(tmp_path / "a", t.model, t.optimizer) is None
    extra = {"epoch": 4, "loader": {"pos": 17}, "rng": torch.get_rng_state(), "note": "x"}
    checkpoint.save(tmp_path / "b", t.model, t.optimizer, extra=extra)
    got = checkpoint.load(tmp_path / "b", t.model, t.optimizer)
    assert got["epoch"] == 4 and got["loader"] == {"pos": 17} and got["note"] == "x"
    assert torch.equal(got["rng"], extra["rng"])


def test_wrapped_optimizer_is_looked_through(tmp_path: Path) -> None:
    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    src = make_trainer(seed=0)
    src.step(0)
    checkpoint.save(tmp_path / "ck", src.model, Wrapper(src.optimizer))
    dst = make_trainer(seed=1)
    checkpoint.load(tmp_path / "ck", dst.model, Wrapper(dst.optimizer))
    assert dst.step(1) == src.step(1)


def test_tied_weights_round_trip(tmp_path: Path) -> None:
    def tied(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
        m[1].weight = m[0].weight
        return m, torch.optim.Adam(m.parameters(), lr=0.1)

    m, o = tied(0)
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    checkpoint.save(tmp_path / "ck", m, o)
    m2, o2 = tied(1)
    checkpoint.load(tmp_path / "ck", m2, o2)
    assert m2[1].weight is m2[0].weight
    assert torch.equal(m2[0].weight, m[0].weight)
    assert torch.equal(o2.state[m2[0].weight]["exp_avg"], o.state[m[0].weight]["exp_avg"])


def test_state_dict_returning_copies_still_loads_the_weights(tmp_path: Path) -> None:
    """If ``state_dict()`` hands out copies, DCP's in-place load cannot reach the parameters;
    ``load`` must notice and fall back to ``load_state_dict``."""
    src = make_trainer(seed=0)
    src.step(0)
    checkpoint.save(tmp_path / "ck", src.model, src.optimizer)
    dst = make_trainer(seed=7)

    def copies(module: torch.nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for key in state:
            state[key] = state[key].clone()

    dst.model._register_state_dict_hook(copies)
    checkpoint.load(tmp_path / "ck", dst.model, dst.optimizer)
    for a, b in zip(src.model.parameters(), dst.model.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
    assert dst.step(1) == src.step(1)


def test_frozen_parameter_without_optimizer_state(tmp_path: Path) -> None:
    """Params that never got a grad have no Adam state; they round-trip as weights only."""
    src = make_trainer(seed=0)
    src.model.fc1.bias.requires_grad_(False)
    src.step(0)
    assert src.model.fc1.bias not in src.optimizer.state
    checkpoint.save(tmp_path / "ck", src.model, src.optimizer)
    dst = make_trainer(seed=2)
    dst.model.fc1.bias.requires_grad_(False)
    checkpoint.load(tmp_path / "ck", dst.model, dst.optimizer)
    assert dst.model.fc1.bias not in dst.optimizer.state
    assert torch.equal(dst.model.fc1.bias, src.model.fc1.bias)
    assert dst.step(1) == src.step(1)
