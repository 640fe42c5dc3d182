"""GPU checks of the torch-native FP8 path: ``_scaled_mm`` against the emulated GEMM, and
TransformerEngine's quantizers and ``te.Linear`` as an independent oracle (skip on CPU)."""
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
    Fp8Tensor,
    fp8_gemm,
    gemm_calls,
    quantize_with_scale,
)

pytestmark = [pytest.mark.requires_cuda]

# Same FP8 operands on both sides, so only the accumulation differs: Hopper's FP8 tensor cores add
# the products in a partial sum narrower than fp32 (promoted to fp32 only every few k-steps), so
# _scaled_mm is not an fp32-exact dot product. Measured on an H200 (torch 2.11, CUDA 13):
# tensorwise 1.05e-4 (K=128) and 7.2e-5 (K=72), blockwise 1.27e-4 / 1.28e-4 (K=256) relative to
# the fp32 emulation. A wrong scale, layout or operand is off by >= 1e-2.
GEMM_RTOL = 5e-4


def to_cpu(t: Fp8Tensor) -> Fp8Tensor:
    return Fp8Tensor(t.data.cpu(), t.scale_inv.cpu(), t.block)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.requires_gpu_arch("sm89")
@pytest.mark.parametrize("m,k,n", [(64, 128, 32), (37, 72, 50)])  # second: padded to multiples of 16
def test_tensorwise_scaled_mm_matches_emulation(m, k, n):
    """Same FP8 operands, fp32 output: only the accumulation differs (``GEMM_RTOL``)."""
    a = CurrentQuantizer(E4M3).quantize(torch.randn(m, k, device="cuda"))
    b = CurrentQuantizer(E5M2).quantize(torch.randn(n, k, device="cuda"))
    before = gemm_calls["scaled_mm"]
    got = fp8_gemm(a, b, torch.float32)
    assert gemm_calls["scaled_mm"] == before + 1
    assert rel(got.cpu(), fp8_gemm(to_cpu(a), to_cpu(b), torch.float32)) < GEMM_RTOL


@pytest.mark.requires_gpu_arch("sm90")
@pytest.mark.parametrize("b_block", [(1, 128), (128, 128)])
def test_blockwise_scaled_mm_matches_emulation(b_block):
    a = CurrentQuantizer(E4M3, (1, 128), True).quantize(torch.randn(200, 256, device="cuda") * 3)
    b = CurrentQuantizer(E4M3, b_block, True).quantize(torch.randn(384, 256, device="cuda"))
    before = gemm_calls["scaled_mm_blockwise"]
    got = fp8_gemm(a, b, torch.float32)
    assert gemm_calls["scaled_mm_blockwise"] == before + 1, dict(gemm_calls)
    assert rel(got.cpu(), fp8_gemm(to_cpu(a), to_cpu(b), torch.float32)) < GEMM_RTOL


@pytest.mark.requires_gpu_arch("sm90")
@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4), BlockwiseScaling()],
                         ids=["current", "delayed", "blockwise"])
def test_float8_linear_gpu_matches_cpu(recipe):
    """The module on the GPU (fast GEMMs) against the same module on CPU (emulated): same
    quantised operands, so outputs and grads agree to the GEMMs' accumulation noise (``GEMM_RTOL``)."""
    torch.manual_seed(0)
    cpu = Float8Linear(256, 384, recipe=recipe)
    gpu = copy.deepcopy(cpu).cuda()
    x, g = torch.randn(256, 256), torch.randn(256, 384)
    outs = []
    for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
        xi = x.detach().clone().to(dev).requires_grad_()  # a fresh leaf on each device
        y = layer(xi)
        y.backward(g.to(dev))
        outs.append([y.detach().cpu(), xi.grad.cpu(), layer.weight.grad.cpu()])
    for a, b in zip(*outs, strict=True):
        assert rel(b, a) < GEMM_RTOL


# ------------------------------------------------------------------------------- TE oracle
@pytest.mark.requires_module("transformer_engine")
@pytest.mark.requires_gpu_arch("sm90")
class TestTransformerEngineOracle:
    @staticmethod
    def _dtype(dtype: torch.dtype):
        from transformer_engine.pytorch.constants import DType
        return DType.kFloat8E4M3 if dtype == E4M3 else DType.kFloat8E5M2

    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    def test_current_scaling_bits(self, dtype):
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
        x = (torch.randn(256, 512, device="cuda") * 7).to(torch.bfloat16)
        te_q = Float8CurrentScalingQuantizer(self._dtype(dtype), torch.device("cuda"), columnwise=False)(x)
        ours = CurrentQuantizer(dtype).quantize(x)
        assert torch.equal(te_q._data.view(torch.uint8), ours.data.view(torch.uint8))
        assert torch.equal(te_q._scale_inv.reshape(1, 1).float(), ours.scale_inv)

    @pytest.mark.parametrize("dtype", [E4M3, E5M2])
    def test_delayed_scaling_cast_bits(self, dtype):
        """With a given scale (delayed scaling's), the cast itself matches TE bit for bit."""
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
        x = (torch.randn(128, 256, device="cuda") * 30).to(torch.bfloat16)
        scale = torch.tensor([3.7], device="cuda")
        te_q = Float8Quantizer(scale.clone(), torch.zeros(1, device="cuda"), self._dtype(dtype), columnwise=False)(x)
        ours = quantize_with_scale(x, scale.reshape(1, 1), None, dtype)
        assert torch.equal(te_q._data.view(torch.uint8), ours.data.view(torch.uint8))

    @pytest.mark.parametrize("dim", [1, 2])
    def test_blockwise_bits(self, dim):
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
        x = (torch.randn(256, 384, device="cuda") * torch.randn(256, 1, device="cuda").exp()).to(torch.bfloat16)
        te_q = Float8BlockQuantizer(self._dtype(E4M3), rowwise=True, columnwise=False, force_pow_2_scales=True,
                                    block_scaling_dim=dim)(x)
        ours = CurrentQuantizer(E4M3, (1, 128) if dim == 1 else (128, 128), True).quantize(x)
        assert torch.equal(te_q._rowwise_data.view(torch.uint8), ours.data.view(torch.uint8))
        te_scales = te_q._rowwise_scale_inv  # padded: 1x128 stored (K/128, M) transposed
        if dim == 1:
            te_scales = te_scales[: ours.scale_inv.shape[1], : ours.scale_inv.shape[0]].t()
        else:
            te_scales = te_scales[: ours.scale_inv.shape[0], : ours.scale_inv.shape[1]]
        assert torch.equal(te_scales.float(), ours.scale_inv)

    @pytest.mark.parametrize("name", ["current", "delayed", "block"])
    def test_linear_close_to_te_linear(self, name):
        """Our Float8Linear and te.Linear quantise identically; their outputs and grads differ
        far less than either differs from bf16 (GEMM accumulation details only)."""
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
        te_r, ours_r = {"current": (te_recipe.Float8CurrentScaling(), CurrentScaling()),
                        "delayed": (te_recipe.DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4)),
                        "block": (te_recipe.Float8BlockScaling(), BlockwiseScaling())}[name]
        torch.manual_seed(0)
        ref = nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
        te_lin = te.Linear(512, 256, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            te_lin.weight.copy_(ref.weight)
            te_lin.bias.copy_(ref.bias)
        ours = Float8Linear.from_linear(copy.deepcopy(ref), ours_r)
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        results = {}
        for key, layer in (("ref", ref), ("te", te_lin), ("ours", ours)):
            for _ in range(2):  # delayed scaling: compare the second step (scales from real amaxes)
                xi = x.clone().requires_grad_()
                layer.zero_grad()
                with te.autocast(enabled=key == "te", recipe=te_r):
                    y = layer(xi)
                y.backward(g)
            results[key] = (y.detach(), xi.grad, layer.weight.grad)
        for i in range(3):
            gap = rel(results["ours"][i], results["te"][i])
            assert gap < 0.25 * rel(results["te"][i], results["ref"][i]), (i, gap)
