"""``Float8Linear`` / ``convert_to_fp8``: numerics against torchao's ``Float8Linear`` (an
independent implementation, emulated on CPU), the FP8 weight slot a sharding engine fills, and
the errors for bad input."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fsdp_impl.fp8 import (
    E4M3,
    E5M2,
    BlockwiseScaling,
    CurrentQuantizer,
    CurrentScaling,
    DelayedScaling,
    Float8Linear,
    convert_to_fp8,
    fp8_gemm,
)

RECIPES = [
    pytest.param(CurrentScaling(), id="current"),
    pytest.param(DelayedScaling(amax_history_len=4), id="delayed"),
    pytest.param(BlockwiseScaling(block_size=16), id="blockwise"),
]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def fwd_bwd(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    return (y.detach(), x.grad, *(p.grad for p in model.parameters()))


def assert_all_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(u, v), f"tensor {i} differs: max abs diff {(u - v).abs().max().item()}"


# ------------------------------------------------------------------------------ torchao oracle
@pytest.mark.requires_module("torchao")
class TestTorchaoOracle:
    """torchao's Float8Linear (``emulate=True``): tensorwise and rowwise."""

    @staticmethod
    def _torchao(model: nn.Module, **config) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        return convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig(emulate=True, **config))

    def test_tensorwise_pow2_linear_bit_exact(self):
        """Power-of-2 scales: dividing by the scale (torchao) and multiplying by its reciprocal
        (ours, TE, _scaled_mm) agree exactly, so outputs and every grad match bit for bit."""
        model, x = mlp(), torch.randn(48, 64) * 3
        g = torch.randn(48, 16)
        ours = convert_to_fp8(copy.deepcopy(model), CurrentScaling(power_of_2_scales=True))
        assert_all_equal(fwd_bwd(ours, x, g), fwd_bwd(self._torchao(model, round_scales_to_power_of_2=True), x, g))

    def test_tensorwise_linear(self):
        """Arbitrary scales: q / s and q * (1/s) differ by at most 1 ulp per element, so results
        agree to ~1e-7 relative (bounded at 1e-6 here); a wrong scale, format or missing
        saturation shows up as ~1e-2."""
        model, x = mlp(1), torch.randn(48, 64) * 3
        g = torch.randn(48, 16)
        for a, b in zip(fwd_bwd(convert_to_fp8(copy.deepcopy(model), CurrentScaling()), x, g),
                        fwd_bwd(self._torchao(model), x, g), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())

    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    def test_quantised_bytes_and_scales(self, dtype):
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig
        x = torch.randn(40, 96) * torch.randn(40, 1).exp() * 10
        theirs = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
        ours = CurrentQuantizer(dtype).quantize(x)
        assert torch.equal(theirs._data.view(torch.uint8), ours.data.view(torch.uint8))
        assert torch.equal(torch.reciprocal(theirs._scale).reshape(1, 1), ours.scale_inv)
        for dim, block, view in ((-1, (1, 96), lambda t: t), (0, (1, 40), lambda t: t.t())):
            theirs = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(), axiswise_dim=dim,
                                                 scaling_granularity=ScalingGranularity.AXISWISE,
                                                 round_scales_to_power_of_2=True)
            ours = CurrentQuantizer(dtype, block, power_of_2=True).quantize(view(x))
            assert torch.equal(view(theirs._data).contiguous().view(torch.uint8), ours.data.view(torch.uint8))
            assert torch.equal(torch.reciprocal(view(theirs._scale)), ours.scale_inv)

    def test_rowwise_gemm(self):
        """Rowwise (one scale per row along the contraction dim) = our 1 x K blocks."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, ScaledMMConfig
        x, w = torch.randn(40, 64) * 5, torch.randn(24, 64) * 0.1
        cfg = LinearMMConfig(*(ScaledMMConfig(emulate=True),) * 3)
        common = dict(scaling_granularity=ScalingGranularity.AXISWISE, round_scales_to_power_of_2=True)
        xa = hp_tensor_to_float8_dynamic(x, E4M3, cfg, axiswise_dim=-1, **common)
        wa = hp_tensor_to_float8_dynamic(w.t(), E4M3, cfg, gemm_input_role=GemmInputRole.WEIGHT, axiswise_dim=0,
                                         **common)
        q = CurrentQuantizer(E4M3, (1, 64), power_of_2=True)
        assert torch.equal(fp8_gemm(q.quantize(x), q.quantize(w), torch.float32), torch.mm(xa, wa))


# ----------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("recipe", RECIPES)
def test_close_to_high_precision(recipe):
    """FP8 output and grads stay within 10% (relative Frobenius) of the fp32 layer: E4M3 rounds
    each operand by <= 6.25%, E5M2 grads by <= 12.5%, and errors average out in the dot
    products (measured 3-6%)."""
    model, x, g = mlp(2), torch.randn(64, 64), torch.randn(64, 16)
    fp8_model = convert_to_fp8(copy.deepcopy(model), recipe)
    for _ in range(2):  # delayed scaling: the second pass uses scales from real amaxes
        for p in fp8_model.parameters():
            p.grad = None
        got = fwd_bwd(fp8_model, x, g)
    for a, b in zip(got, fwd_bwd(model, x, g), strict=True):
        assert ((a - b).norm() / b.norm()).item() < 0.10


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_and_3d_input(recipe):
    layer = Float8Linear(32, 16, recipe=recipe).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.shape == (2, 5, 16) and y.dtype == torch.bfloat16
    assert x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    assert layer.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_frozen_weight_and_no_input_grad():
    layer = Float8Linear(16, 16, recipe=CurrentScaling())
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    layer.weight.requires_grad_(True)
    layer(torch.randn(4, 16)).sum().backward()
    assert layer.weight.grad is not None


# -------------------------------------------------------------------------------- weight slot
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("keep_transpose", [False, True])
def test_weight_slot_replaces_weight_reads(recipe, keep_transpose):
    """With the slot filled, forward and backward give exactly the plain path's numbers while
    the weight's storage is freed (as a ZeRO-3 engine leaves it); dW still reaches the param.
    With ``keep_transpose`` the backward reads only the transposed copy built in the forward,
    so the slot's row-wise bytes may be freed in between (no FP8 re-gather for backward)."""
    torch.manual_seed(3)
    plain = Float8Linear(32, 32, recipe=recipe)
    slotted = copy.deepcopy(plain)
    x, g = torch.randn(8, 32), torch.randn(8, 32)
    expected = fwd_bwd(plain, x, g)
    slot = slotted.fp8_weight_slot
    slot.keep_transpose = keep_transpose
    slot.fill(slotted.fp8_quantizers.weight.quantize(slotted.weight.detach()))
    slotted.weight.data.untyped_storage().resize_(0)
    xi = x.clone().requires_grad_()
    y = slotted(xi)
    if keep_transpose:
        slot.weight.data.untyped_storage().resize_(0)
    y.backward(g)
    assert_all_equal((y.detach(), xi.grad, slotted.weight.grad, slotted.bias.grad), expected)
    slot.clear()
    with pytest.raises(RuntimeError, match="FP8 weight slot is empty"):
        slot.transposed()


def test_slot_release_keeps_only_the_transpose_when_asked():
    """What an engine's reshard does: the row-wise weight goes; the forward's transposed copy
    stays for the backward only with ``keep_transpose``."""
    layer = Float8Linear(32, 32, recipe=CurrentScaling())
    slot = layer.fp8_weight_slot
    for keep in (False, True):
        slot.keep_transpose = True
        slot.fill(layer.fp8_quantizers.weight.quantize(layer.weight.detach()))
        kept = slot.transposed()
        slot.release(keep_transpose=keep)
        assert slot.weight is None and slot.has_transpose is keep
        if keep:
            assert slot.transposed() is kept


# ------------------------------------------------------------------------------- conversion
class MyLinear(nn.Linear):
    pass


def test_fp8_params_flag():
    """``fp8_params`` marks the weights an engine keeps only in FP8; the module computes the same."""
    model = convert_to_fp8(mlp(), CurrentScaling(), fp8_params=True)
    assert all(m.fp8_params for m in model.modules() if isinstance(m, Float8Linear))
    assert not convert_to_fp8(mlp(), CurrentScaling())[0].fp8_params
    assert "fp8_params=True" in repr(model[0])
    x, g = torch.randn(4, 64), torch.randn(4, 16)
    assert_all_equal(fwd_bwd(model, x, g), fwd_bwd(convert_to_fp8(mlp(), CurrentScaling()), x, g))
    with pytest.raises(TypeError, match="fp8_params must be True or False, got 1"):
        convert_to_fp8(mlp(), CurrentScaling(), fp8_params=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fp8_params must be True or False"):
        Float8Linear(4, 4, recipe=CurrentScaling(), fp8_params="yes")  # type: ignore[arg-type]


def test_convert_swaps_exact_linears_and_shares_params():
    model = nn.Sequential(nn.Linear(16, 16), MyLinear(16, 16), nn.Sequential(nn.Linear(16, 32)))
    params = [id(p) for p in model.parameters()]
    convert_to_fp8(model, CurrentScaling(), module_filter=lambda name, m: name != "2.0")
    assert [type(m) for m in (model[0], model[1], model[2][0])] == [Float8Linear, MyLinear, nn.Linear]
    assert [id(p) for p in model.parameters()] == params
    root = convert_to_fp8(nn.Linear(8, 8), CurrentScaling())
    assert isinstance(root, Float8Linear)


def test_convert_on_meta_then_reset_matches_eager():
    """Converted on the meta device, then materialised with ``reset_parameters`` (what meta
    init does): same weights as the eager model and fresh delayed-scaling state."""
    recipe = DelayedScaling(amax_history_len=2)
    with torch.device("meta"):
        lazy = convert_to_fp8(mlp(4), recipe)
    lazy.to_empty(device="cpu")
    torch.manual_seed(4)
    for m in (lazy[0], lazy[2]):
        m.reset_parameters()
    eager = convert_to_fp8(mlp(4), recipe)
    assert list(lazy.state_dict()) == list(eager.state_dict())
    for key, value in eager.state_dict().items():
        assert torch.equal(lazy.state_dict()[key], value), key
    assert lazy[0].fp8_input_scale.item() == 1.0 and lazy[0].fp8_input_amax_history.abs().sum() == 0


def test_blockwise_dims_must_divide():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 40))
    with pytest.raises(ValueError, match=r"BlockwiseScaling\(block_size=16\) needs linear dims divisible by the "
                                         r"block size; '1' has out_features=40"):
        convert_to_fp8(model, BlockwiseScaling(block_size=16))
    assert type(model[0]) is nn.Linear  # checked before anything was swapped


def test_bad_recipe_and_format():
    with pytest.raises(TypeError, match="recipe must be a fsdp_impl.fp8 recipe"):
        convert_to_fp8(nn.Linear(4, 4), object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp8_format='E2M1' is not supported; allowed: E4M3, HYBRID"):
        CurrentScaling(fp8_format="E2M1")
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockwiseScaling(block_size=0)
    assert CurrentScaling(fp8_format="e4m3").format.backward_dtype == E4M3
