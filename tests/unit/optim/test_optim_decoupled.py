"""Which optimizers read decoupled grads, and the wrap-time consistency check's errors."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from fsdp_impl.decoupled import (
    check_decoupled_grad_consistency,
    clear_grad,
    grad_attr_name,
    optimizer_reads_decoupled_grad,
    read_grad,
)
from fsdp_impl.optim import Adam, AdamW


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3))]


class _Wrapper:
    """Stands in for the engine's sharded-optimizer wrapper (exposes `.optimizer`)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer


class _CustomDecoupled(torch.optim.SGD):
    """A user optimizer that declares it reads decoupled grads (defined outside torch.optim)."""

    use_decoupled_grad = True


class _CustomBadFlag(torch.optim.SGD):
    use_decoupled_grad = "yes"  # not a bool: must not be trusted


@pytest.fixture
def fake_te(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in TransformerEngine FusedAdam registered in sys.modules (TE is never installed)."""

    class FusedAdam(torch.optim.Optimizer):
        def __init__(self, params: Any, use_decoupled_grad: bool = False) -> None:
            super().__init__(params, {})
            self.use_decoupled_grad = use_decoupled_grad

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_opt = types.ModuleType("transformer_engine.pytorch.optimizers")
    te_opt.FusedAdam = FusedAdam  # type: ignore[attr-defined]
    te.pytorch = te_pt  # type: ignore[attr-defined]
    te_pt.optimizers = te_opt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", te_opt)
    return FusedAdam


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda: torch.optim.Adam(_params()), False),
        (lambda: torch.optim.AdamW(_params()), False),
        (lambda: torch.optim.SGD(_params(), lr=0.1), False),
        (lambda: Adam(_params()), False),
        (lambda: Adam(_params(), use_decoupled_grad=True), True),
        (lambda: AdamW(_params(), use_decoupled_grad=True), True),
        (lambda: _Wrapper(AdamW(_params(), use_decoupled_grad=True)), True),
        (lambda: _Wrapper(_Wrapper(torch.optim.Adam(_params()))), False),
        (lambda: _CustomDecoupled(_params(), lr=0.1), True),
        (lambda: _CustomBadFlag(_params(), lr=0.1), False),
        (lambda: object(), False),
    ],
    ids=[
        "torch-Adam", "torch-AdamW", "torch-SGD", "ours-off", "ours-Adam-on", "ours-AdamW-on",
        "wrapped-ours-on", "double-wrapped-torch", "custom-bool-attr", "custom-non-bool-attr",
        "unknown-object",
    ],
)
def test_optimizer_reads_decoupled_grad(make: Any, expected: bool) -> None:
    assert optimizer_reads_decoupled_grad(make()) is expected


def test_torch_optimizer_never_reads_decoupled_even_if_attr_set() -> None:
    opt = torch.optim.Adam(_params())
    opt.use_decoupled_grad = True  # torch's step ignores it, so the answer must stay False
    assert optimizer_reads_decoupled_grad(opt) is False


@pytest.mark.parametrize("flag", [False, True])
def test_te_fused_adam_flag(fake_te: type, flag: bool) -> None:
    opt = fake_te(_params(), use_decoupled_grad=flag)
    assert optimizer_reads_decoupled_grad(opt) is flag
    assert optimizer_reads_decoupled_grad(_Wrapper(opt)) is flag


def test_self_referencing_wrapper_terminates() -> None:
    wrapper = _Wrapper(None)
    wrapper.optimizer = wrapper
    assert optimizer_reads_decoupled_grad(wrapper) is False


@pytest.mark.parametrize("flag", [False, True])
def test_consistent_settings_pass(flag: bool) -> None:
    check_decoupled_grad_consistency(flag, AdamW(_params(), use_decoupled_grad=flag))
    check_decoupled_grad_consistency(flag, None)  # model-only wrap: nothing to check


def test_model_decoupled_torch_optimizer_is_rejected() -> None:
    with pytest.raises(ValueError) as info:
        check_decoupled_grad_consistency(True, torch.optim.AdamW(_params()))
    message = str(info.value)
    assert "decoupled gradients" in message
    assert "use_decoupled_grad=True" in message and "use_decoupled_grad=False" in message
    assert "AdamW" in message
    assert "silently do nothing" in message
    assert "Fix:" in message and "fsdp_impl.optim.AdamW(..., use_decoupled_grad=True)" in message


def test_model_plain_ours_decoupled_is_rejected() -> None:
    wrapped = _Wrapper(Adam(_params(), use_decoupled_grad=True))
    with pytest.raises(ValueError, match="decoupled gradients") as info:
        check_decoupled_grad_consistency(False, wrapped)
    message = str(info.value)
    assert "Adam (wrapped in _Wrapper)" in message
    assert "model was wrapped with use_decoupled_grad=False" in message
    assert "has use_decoupled_grad=True" in message


def test_te_mismatch_names_fused_adam(fake_te: type) -> None:
    with pytest.raises(ValueError, match="FusedAdam has use_decoupled_grad=False"):
        check_decoupled_grad_consistency(True, fake_te(_params()))


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_model_flag_must_be_bool(bad: Any) -> None:
    with pytest.raises(TypeError, match="model_uses_decoupled"):
        check_decoupled_grad_consistency(bad, torch.optim.Adam(_params()))


def test_read_grad_never_falls_back_to_other_attribute() -> None:
    param = torch.nn.Parameter(torch.randn(2))
    param.grad = torch.ones(2)
    assert read_grad(param, True) is None
    assert read_grad(param, False) is param.grad
    param.decoupled_grad = torch.zeros(2)
    assert read_grad(param, True) is param.decoupled_grad
    assert grad_attr_name(True) == "decoupled_grad" and grad_attr_name(False) == "grad"


def test_clear_grad_modes() -> None:
    param = torch.nn.Parameter(torch.randn(2))
    param.decoupled_grad = torch.ones(2)
    clear_grad(param, False, True)  # not decoupled: leaves decoupled_grad alone
    assert param.decoupled_grad is not None
    clear_grad(param, True, False)
    assert param.decoupled_grad.sum().item() == 0
    clear_grad(param, True, True)
    assert param.decoupled_grad is None
    clear_grad(param, True, True)  # None stays None without error
