"""``fully_shard(compile_units=)`` input checking: every bad value fails before the wrap (no process
group needed: the check runs before anything is sharded) with a message naming the argument and
what it accepts."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_impl
from fsdp_impl.compile_units import CompileOptions, parse_compile_units


def test_off_and_on_values() -> None:
    assert parse_compile_units(None) is None
    assert parse_compile_units(False) is None
    assert parse_compile_units(True) == CompileOptions()  # torch.compile's defaults: inductor
    opts = parse_compile_units({"backend": "aot_eager", "fullgraph": True, "dynamic": False})
    assert opts == CompileOptions(backend="aot_eager", fullgraph=True, dynamic=False)
    assert parse_compile_units({"options": {"max_autotune": False}}).options == {"max_autotune": False}


@pytest.mark.parametrize(("value", "error", "match"), [
    ("yes", TypeError, r"compile_units must be None/False \(off\), True .* or a dict with keys backend, mode"),
    (1, TypeError, r"compile_units must be"),
    ({"backnd": "inductor"}, ValueError, r"compile_units has unknown key\(s\) \['backnd'\]; allowed: \['backend'"),
    ({"backend": "no_such_backend"}, ValueError, r"compile_units\['backend'\]='no_such_backend' is not a"),
    ({"backend": 3}, TypeError, r"compile_units\['backend'\] must be a backend name \(str\) or a callable"),
    ({"mode": "fast"}, ValueError, r"compile_units\['mode'\] must be one of \[None, 'default', 'reduce-overhead'"),
    ({"fullgraph": 1}, TypeError, r"compile_units\['fullgraph'\] must be True or False, got 1"),
    ({"dynamic": "auto"}, TypeError, r"compile_units\['dynamic'\] must be None, True or False"),
    ({"options": ["x"]}, TypeError, r"compile_units\['options'\] must be None or a dict with str keys"),
    ({"mode": "max-autotune", "options": {"x": 1}}, ValueError, r"pass 'mode' or 'options', not both"),
])
def test_bad_values_fail_before_wrapping(value, error, match) -> None:
    with pytest.raises(error, match=match):
        parse_compile_units(value)
    module = nn.Linear(2, 2)
    before = module.weight.detach().clone()
    with pytest.raises(error, match=match):  # through fully_shard: before any process group is needed
        fsdp_impl.fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.1), compile_units=value)
    assert isinstance(module.weight, nn.Parameter) and torch.equal(module.weight, before)


class _FakeTELinear(nn.Linear):
    """Stands for a TransformerEngine module (CPU CI has no TE): only its class's module path counts."""


_FakeTELinear.__module__ = "transformer_engine.pytorch.module.linear"


@pytest.mark.parametrize(("kwargs", "make", "match"), [
    (dict(compile_units={"fullgraph": True}, enable_fine_grained_param_gather=True), lambda: nn.Linear(2, 2),
     r"fullgraph': True\} cannot be combined with enable_fine_grained_param_gather=True.*fullgraph=False"),
    (dict(compile_units=True), lambda: nn.Sequential(nn.Linear(2, 2), _FakeTELinear(2, 2)),
     r"compile_units with TransformerEngine modules \(1, e.g. '1': transformer_engine\.pytorch\.module\.linear\."
     r"_FakeTELinear\) is not supported"),
])
def test_what_compile_units_cannot_keep_fails_before_wrapping(kwargs, make, match) -> None:
    """fullgraph with the fine-grained gather's per-submodule hooks, and TE modules (never verified
    under compile here), are refused before anything is sharded; the same model wraps without
    compile_units (fine-grained with fullgraph=False runs: test_compile_units.py)."""
    module = make()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=match):
        fsdp_impl.fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.1), **kwargs)
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
