"""Delayed scaling: the amax history against a literal transcription of TransformerEngine's
update (roll the history, newest amax at slot 0 while casting, scale from max / most recent)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_impl.fp8 import E4M3, E5M2, DelayedQuantizer, DelayedScaling, Float8Linear, fp8_max


def te_scales(amaxes: list[float], length: int, algo: str, margin: int, dtype: torch.dtype) -> list[float]:
    """The scale each cast uses, per TE: cast with the current scale, write the amax to
    history[0], amax = max(history) or history[0], scale = fp8_max / amax / 2**margin unless the
    amax is 0 or not finite, then roll the history left and zero slot 0."""
    history = torch.zeros(length)
    scale = torch.tensor(1.0)
    used = []
    for a in amaxes:
        used.append(scale.item())
        history[0] = a
        amax = history.max() if algo == "max" else history[0].clone()
        candidate = torch.tensor(fp8_max(dtype)) / amax / 2**margin
        if amax > 0 and torch.isfinite(amax):
            scale = torch.where(torch.isinf(candidate), torch.tensor(torch.finfo(torch.float32).max), candidate)
        history = torch.roll(history, -1, 0)
        history[0] = 0.0
    return used


def make(length: int, algo: str, margin: int, dtype: torch.dtype = E4M3) -> DelayedQuantizer:
    return DelayedQuantizer(dtype, torch.nn.Module(), "input", history_len=length, algo=algo, margin=margin)


AMAX = st.one_of(st.floats(min_value=2.0**-20, max_value=2.0**20, width=32), st.just(0.0), st.just(math.inf))


@given(amaxes=st.lists(AMAX, min_size=1, max_size=12), length=st.integers(1, 5),
       algo=st.sampled_from(["max", "most_recent"]), margin=st.integers(0, 3),
       dtype=st.sampled_from([E4M3, E5M2]))
@settings(max_examples=60, deadline=None)
def test_history_matches_te(amaxes, length, algo, margin, dtype):
    q = make(length, algo, margin, dtype)
    used = [q.scale_for(torch.tensor(a).reshape(1, 1)).item() for a in amaxes]
    assert used == pytest.approx(te_scales(amaxes, length, algo, margin, dtype), rel=0, abs=0)


def test_history_window_forgets_old_amax():
    q = make(2, "max", 0)
    for a in [100.0, 1.0, 1.0]:
        q.scale_for(torch.tensor([[a]]))
    assert q.history.tolist() == [1.0, 1.0]
    assert q.scale.item() == 448.0  # the 100 fell out of the 2-long window


def test_deferred_records_max_until_advance():
    q = make(4, "max", 0)
    q.deferred = True
    for a in [3.0, 7.0, 5.0]:  # three microbatches: all cast with the initial scale
        assert q.scale_for(torch.tensor([[a]])).item() == 1.0
    assert q.history.tolist() == [0.0] * 4 and q.pending.item() == 7.0
    q.advance()
    assert q.history.tolist() == [0.0, 0.0, 0.0, 7.0] and q.pending.item() == 0.0
    assert q.scale.item() == pytest.approx(448.0 / 7.0)


def test_recipe_validation():
    with pytest.raises(ValueError, match="amax_compute_algo='mean' is not supported; allowed: max, most_recent"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len must be an int >= 1"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="margin must be an int >= 0"):
        DelayedScaling(margin=-1)
    with pytest.raises(ValueError, match="fp8_format='E5M2' is not supported"):
        DelayedScaling(fp8_format="E5M2")


def test_state_dict_carries_history_and_resume_is_exact():
    """A checkpoint of the module carries every role's history and scale: a copy restored
    from it produces the same outputs, grads and next scales as the original, bit for bit."""
    torch.manual_seed(0)
    recipe = DelayedScaling(amax_history_len=3)
    a = Float8Linear(32, 16, recipe=recipe)
    for _ in range(3):
        a(torch.randn(8, 32) * 4).sum().backward()
    keys = {k for k in a.state_dict() if k.startswith("fp8_")}
    assert keys == {f"fp8_{r}_{n}" for r in ("input", "weight", "grad_output") for n in ("amax_history", "scale")}
    b = Float8Linear(32, 16, recipe=recipe)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    x = torch.randn(8, 32) * 2
    for m in (a, b):
        m.weight.grad = None
        m(x).square().sum().backward()
    assert torch.equal(a(x), b(x)) and torch.equal(a.weight.grad, b.weight.grad)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in keys)


def test_reset_parameters_resets_history():
    m = Float8Linear(16, 16, recipe=DelayedScaling(amax_history_len=2))
    m(torch.randn(4, 16)).sum().backward()
    assert m.fp8_input_amax_history.max() > 0
    m.reset_parameters()
    assert m.fp8_input_amax_history.max() == 0 and m.fp8_input_scale.item() == 1.0
