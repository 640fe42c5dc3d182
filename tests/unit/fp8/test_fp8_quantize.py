"""Property tests of FP8 quantisation: saturation, scales, block grids, round-trip SQNR.

References are independent of the code under test: every finite FP8 value decoded from its bit
pattern, closed-form scales (``max / amax``, powers of two read with ``math.frexp``), and the
signal-to-quantisation-noise ratio of a round trip.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_impl.fp8 import (
    E4M3,
    E5M2,
    BlockwiseScaling,
    CurrentQuantizer,
    CurrentScaling,
    DelayedScaling,
    Format,
    amax_to_scale,
    fp8_max,
    round_down_to_power_of_2,
    saturating_cast,
)
from fsdp_impl.fp8.scaling import block_amax, grid_shape

FAST = settings(max_examples=40, deadline=None)
DTYPES = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def finite_codes(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype``, decoded from its 256 bit patterns."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[torch.isfinite(values)]


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(20 * torch.log10(x.norm() / (x - y).norm()))


# ------------------------------------------------------------------------------------ casts
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_values(dtype):
    assert fp8_max(dtype) == {E4M3: 448.0, E5M2: 57344.0}[dtype]
    assert finite_codes(dtype).abs().max().item() == fp8_max(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_finite_code_round_trips(dtype):
    codes = finite_codes(dtype)
    back = saturating_cast(codes, dtype).float()
    assert torch.equal(back, codes)


@pytest.mark.parametrize("dtype", DTYPES)
@given(magnitude=st.floats(min_value=1.0, max_value=1e30), sign=st.sampled_from([-1.0, 1.0]))
@FAST
def test_overflow_saturates_to_max(dtype, magnitude, sign):
    limit = fp8_max(dtype)
    x = torch.tensor([sign * limit * magnitude, sign * math.inf])
    assert saturating_cast(x, dtype).float().tolist() == [sign * limit, sign * limit]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_stays_nan(dtype):
    assert torch.isnan(saturating_cast(torch.tensor([math.nan]), dtype).float()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.lists(st.floats(min_value=-2.0**20, max_value=2.0**20, width=32), min_size=1, max_size=64))
@FAST
def test_cast_is_nearest_code(dtype, data):
    """Each in-range value lands on a nearest representable value (ties: either neighbour)."""
    x = torch.tensor(data).clamp(-fp8_max(dtype), fp8_max(dtype))
    got = saturating_cast(x, dtype).float()
    codes = finite_codes(dtype)
    best = (x[:, None] - codes[None, :]).abs().min(dim=1).values
    assert torch.equal((x - got).abs(), best)


# ----------------------------------------------------------------------------------- scales
@pytest.mark.parametrize("dtype", DTYPES)
@given(amax=st.floats(min_value=2.0**-100, max_value=2.0**100, width=32), margin=st.integers(0, 4))
@FAST
def test_scale_closed_form(dtype, amax, margin):
    scale = amax_to_scale(torch.tensor(amax), dtype, margin=margin)
    expected = torch.tensor(fp8_max(dtype), dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
    assert scale.item() == pytest.approx(expected.item() / 2**margin, rel=1e-6)


@given(value=st.floats(min_value=2.0**-126, max_value=2.0**127, width=32))
@FAST
def test_power_of_2_is_largest_not_above(value):
    got = round_down_to_power_of_2(torch.tensor(value)).item()
    mantissa, exponent = math.frexp(value)
    assert got == math.ldexp(1.0, exponent - 1)
    assert got <= value < 2 * got


def test_scale_edge_cases():
    amax = torch.tensor([0.0, math.inf, math.nan, 1e-45])
    scale = amax_to_scale(amax, E4M3, fallback=torch.tensor(3.0))
    assert scale[:3].tolist() == [3.0, 3.0, 3.0]  # no usable amax: keep the previous scale
    assert scale[3].item() == torch.finfo(torch.float32).max  # overflow: clamp to fp32 max
    assert amax_to_scale(torch.tensor(0.0), E4M3).item() == 1.0


@given(amax=st.floats(min_value=2.0**-20, max_value=2.0**20, width=32))
@FAST
def test_quantised_amax_hits_max_without_overflow(amax):
    """The largest element maps to (nearly) the format max: the range is used, never exceeded."""
    x = torch.tensor([amax, -amax / 3, amax / 7])
    q = CurrentQuantizer(E4M3).quantize(x.reshape(1, 3))
    assert q.data.float().abs().max().item() == pytest.approx(448.0, rel=2**-3)


# ------------------------------------------------------------------------------------ blocks
@given(rows=st.integers(0, 300), cols=st.integers(1, 300), br=st.sampled_from([1, 16, 128]),
       bc=st.sampled_from([1, 16, 128]))
@FAST
def test_block_grid_shape_and_values(rows, cols, br, bc):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g)
    amax = block_amax(x, (br, bc))
    assert tuple(amax.shape) == (math.ceil(rows / br), math.ceil(cols / bc)) == grid_shape((rows, cols), (br, bc))
    for i, j in [(0, 0), (amax.shape[0] - 1, amax.shape[1] - 1)] if amax.numel() else []:
        assert amax[i, j].item() == x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max().item()


def test_blockwise_recipe_scale_shapes():
    r = BlockwiseScaling(block_size=16)
    q = r.make_quantizers(torch.nn.Linear(32, 48))
    x = torch.randn(40, 32)
    w = torch.randn(48, 32)
    assert tuple(q.input.quantize(x).scale_inv.shape) == (40, 2)  # 1 x 16 along the contraction dim
    assert tuple(q.weight.quantize(w).scale_inv.shape) == (3, 2)  # 16 x 16
    scales = q.weight.quantize(w).scale_inv
    assert torch.equal(scales, round_down_to_power_of_2(scales))  # power-of-2 scales


# ---------------------------------------------------------------------------- round trip SQNR
RECIPES = [
    pytest.param(CurrentScaling(), id="current"),
    pytest.param(CurrentScaling(fp8_format=Format.E4M3, power_of_2_scales=True), id="current-pow2"),
    pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
    pytest.param(BlockwiseScaling(block_size=32), id="blockwise"),
]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
@given(scale_exp=st.integers(-20, 20), seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_round_trip_sqnr(recipe, role, scale_exp, seed):
    """A round trip keeps >= 25 dB SQNR on Gaussian data of any magnitude (E4M3 gives ~30 dB,
    E5M2 ~25.5 dB: 3 and 2 mantissa bits). Delayed scaling is measured from its second cast,
    once the history holds this tensor's amax (its first cast uses scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g) * 2.0**scale_exp
    quantizer = getattr(recipe.make_quantizers(torch.nn.Linear(64, 64)), role)
    if isinstance(recipe, DelayedScaling):
        quantizer.quantize(x)
    q = quantizer.quantize(x)
    assert sqnr_db(x, q.dequantize()) >= 25.0
