"""fsdp_impl.clip_grad_norm against torch.nn.utils.clip_grad_norm_ (single process)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_impl.clip_grad import clip_grad_norm

NORM_TYPES = [2.0, 1.0, 3.5, math.inf]


def _params_with_grads(seed: int = 0, scale: float = 1.0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(5, 3), (7,), (0,), (2, 2, 2)]:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen) * scale
        params.append(p)
    return params


def _torch_clip(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The reference: torch's clip over the params with non-empty grads.

    torch's foreach norm rejects empty tensors for the inf norm; empty grads contribute nothing
    to any norm, so leaving them out gives the same answer.
    """
    kept = [p for p in params if p.grad is not None and p.grad.numel() > 0]
    return torch.nn.utils.clip_grad_norm_(kept, max_norm, norm_type)


def _grads(params: list[torch.Tensor], attr: str = "grad") -> list[torch.Tensor]:
    out = []
    for p in params:
        g = getattr(p, attr)
        out.append(g.full_tensor() if isinstance(g, DTensor) else g.clone())
    return out


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipping", "not-clipping"])
def test_matches_torch(norm_type: float, max_norm: float) -> None:
    ours, ref = _params_with_grads(), _params_with_grads()
    total = clip_grad_norm(ours, max_norm, norm_type)
    ref_total = _torch_clip(ref, max_norm, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for a, b in zip(_grads(ours), _grads(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if max_norm < 1:
        clipped = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads(ours)]), norm_type)
        assert clipped.item() == pytest.approx(max_norm, rel=1e-4)


def test_closed_form_value() -> None:
    """A 3-4-5 triangle: the 2-norm is 5, clipping to 1 scales by 1/5 (within torch's 1e-6 eps)."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 1.0).item() == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)


def test_single_tensor_and_generator_inputs() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm(p, 10.0).item() == pytest.approx(5.0)
    assert clip_grad_norm((q for q in [p]), 10.0).item() == pytest.approx(5.0)


def test_decoupled_grads_with_none_entries_are_skipped() -> None:
    """Seed 1: a None decoupled_grad must be skipped, never handed to a kernel."""
    ours, ref = _params_with_grads(), _params_with_grads()
    for p in ours:
        p.decoupled_grad, p.grad = p.grad, None
    ours[1].decoupled_grad = None
    ref[1].grad = None
    total = clip_grad_norm(ours, 0.5, use_decoupled_grad=True)
    ref_total = _torch_clip(ref, 0.5)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for i in (0, 2, 3):
        torch.testing.assert_close(ours[i].decoupled_grad, ref[i].grad, rtol=1e-6, atol=1e-7)
    assert ours[1].decoupled_grad is None


def test_params_default_to_grad_attribute() -> None:
    params = _params_with_grads()
    for p in params:
        p.decoupled_grad, p.grad = p.grad, None
    assert clip_grad_norm(params, 1.0).item() == 0.0  # .grad is None everywhere: nothing to clip


class _Buffer:
    def __init__(self, flag: bool) -> None:
        self.use_decoupled_grad = flag


class _WrappedModel(torch.nn.Module):
    """Just enough of the FSDP model's surface: parameters and param_and_grad_buffer."""

    def __init__(self, params: list[torch.nn.Parameter], flag: bool) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)
        self.param_and_grad_buffer = _Buffer(flag)


@pytest.mark.parametrize("flag", [False, True])
def test_model_buffer_flag_selects_attribute(flag: bool) -> None:
    ours, ref = _params_with_grads(), _params_with_grads()
    if flag:
        for p in ours:
            p.decoupled_grad, p.grad = p.grad, None
    total = clip_grad_norm(_WrappedModel(ours, flag), 0.5)
    ref_total = _torch_clip(ref, 0.5)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    attr = "decoupled_grad" if flag else "grad"
    for a, b in zip(_grads(ours, attr), _grads(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_explicit_flag_contradicting_model_is_rejected() -> None:
    model = _WrappedModel(_params_with_grads(), True)
    with pytest.raises(ValueError, match="decoupled gradients.*use_decoupled_grad=False"):
        clip_grad_norm(model, 1.0, use_decoupled_grad=False)


def test_plain_module_reads_grad() -> None:
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    ref = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
    assert clip_grad_norm(model, 1e9).item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_raises_when_asked(bad: float) -> None:
    params = _params_with_grads()
    params[0].grad[0, 0] = bad
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm(params, 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_non_finite_warns_and_leaves_grads(bad: float, norm_type: float) -> None:
    params = _params_with_grads()
    params[0].grad[0, 0] = bad
    before = _grads(params)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        total = clip_grad_norm(params, 1.0, norm_type)
    assert not torch.isfinite(total)
    for a, b in zip(_grads(params), before, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


def test_empty_and_missing_grads() -> None:
    empty = torch.nn.Parameter(torch.zeros(0, 4))
    empty.grad = torch.zeros(0, 4)
    no_grad = torch.nn.Parameter(torch.ones(3))
    for norm_type in NORM_TYPES:
        assert clip_grad_norm([empty, no_grad], 1.0, norm_type).item() == 0.0
    assert clip_grad_norm([], 1.0).item() == 0.0


def test_zero_grads_are_not_scaled_by_nan() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clip_grad_norm([p], 0.0).item() == 0.0
    assert torch.equal(p.grad, torch.zeros(3))


def test_low_precision_grads_summed_in_fp32() -> None:
    """bf16 squares summed in bf16 would be off by ~1% here; an fp32 sum of 4096 terms is within 1e-5."""
    p = torch.nn.Parameter(torch.zeros(4096))
    p.decoupled_grad = torch.full((4096,), 0.1, dtype=torch.bfloat16)
    total = clip_grad_norm([p], 1e9, use_decoupled_grad=True)
    exact = math.sqrt(4096) * float(torch.tensor(0.1, dtype=torch.bfloat16))
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_norm": -1.0}, "max_norm"),
        ({"max_norm": math.nan}, "max_norm"),
        ({"max_norm": "1"}, "max_norm"),
        ({"max_norm": 1.0, "norm_type": 0.0}, "norm_type"),
        ({"max_norm": 1.0, "norm_type": -2.0}, "norm_type"),
        ({"max_norm": 1.0, "norm_type": math.nan}, "norm_type"),
        ({"max_norm": 1.0, "use_decoupled_grad": 1}, "use_decoupled_grad"),
    ],
)
def test_bad_arguments_fail_early(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        clip_grad_norm(_params_with_grads(), **kwargs)


def test_bad_container_type() -> None:
    with pytest.raises(TypeError, match="model_or_params"):
        clip_grad_norm(3, 1.0)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard0", "replicate"])
def test_dtensor_grads_one_rank(one_rank_mesh: Any, placement: Any, norm_type: float) -> None:
    ref = _params_with_grads()
    ours = []
    for p in _params_with_grads():
        q = torch.nn.Parameter(distribute_tensor(p.detach(), one_rank_mesh, [placement]))
        q.decoupled_grad = distribute_tensor(p.grad, one_rank_mesh, [placement])
        ours.append(q)
    mixed = torch.nn.Parameter(torch.ones(2))  # a plain param next to DTensor ones
    mixed.decoupled_grad = torch.tensor([1.0, -2.0])
    ref_mixed = torch.nn.Parameter(torch.ones(2))
    ref_mixed.grad = torch.tensor([1.0, -2.0])
    total = clip_grad_norm(ours + [mixed], 0.5, norm_type, use_decoupled_grad=True)
    ref_total = _torch_clip(ref + [ref_mixed], 0.5, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for a, b in zip(_grads(ours + [mixed], "decoupled_grad"), _grads(ref + [ref_mixed]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


_shapes = st.lists(
    st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple), min_size=0, max_size=6
)


@settings(max_examples=40, deadline=None)
@given(
    shapes=_shapes,
    norm_type=st.sampled_from(NORM_TYPES),
    max_norm=st.floats(min_value=1e-3, max_value=1e3),
    seed=st.integers(min_value=0, max_value=2**16),
    decoupled=st.booleans(),
)
def test_property_matches_torch(
    shapes: list[tuple[int, ...]], norm_type: float, max_norm: float, seed: int, decoupled: bool
) -> None:
    """Any mix of shapes (scalars, empty tensors), norm types and thresholds agrees with torch."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q, g in zip(ours, ref, grads, strict=True):
        setattr(p, "decoupled_grad" if decoupled else "grad", g.clone())
        q.grad = g.clone()
    total = clip_grad_norm(ours, max_norm, norm_type, use_decoupled_grad=decoupled)
    if any(g.numel() for g in grads):
        ref_total = _torch_clip(ref, max_norm, norm_type)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-7)
    else:
        assert total.item() == 0.0
    for p, q in zip(ours, ref, strict=True):
        got = p.decoupled_grad if decoupled else p.grad
        torch.testing.assert_close(got, q.grad, rtol=1e-5, atol=1e-7)


def test_the_cpu_two_norm_is_the_correctly_rounded_root() -> None:
    """The 2-norm's square root on CPU is the correctly rounded one (float64 root, one rounding),
    not MKL VML's, whose last bit differs from it for about 1 in 7 inputs and depends on the CPU
    (``harness.numerics``): so a clipped step is the same on every machine. Against the exact
    float64 root of many sums of squares, every one must match bit for bit."""
    from fsdp_impl.clip_grad import _root

    gen = torch.Generator().manual_seed(0)
    totals = (torch.rand(2000, generator=gen, dtype=torch.float64) * 1e3).to(torch.float32)
    vml = 0
    for t in totals:
        want = torch.tensor(math.sqrt(float(t)), dtype=torch.float32)
        got = _root(t.clone(), 2.0)
        assert got.dtype == torch.float32 and torch.equal(got, want), (float(t), float(got), float(want))
        vml += int(not torch.equal(t ** 0.5, want))
    # The test can fail: torch's own CPU pow(x, 0.5) is not correctly rounded here (it runs in VML).
    assert vml > 0 or not torch.backends.mkl.is_available(), "VML's root matched everywhere: nothing to guard"
