"""Torch-native FP8 training: formats, recipes, quantisation, ``Float8Linear`` and the sharded
quantisation a ZeRO-3 engine uses to gather FP8 weights as bytes (see ``fsdp_impl/README.md``)."""
from .formats import E4M3, E5M2, Format, fp8_max, saturating_cast
from .gemm import fp8_gemm, gemm_calls
from .linear import Float8Linear, Float8WeightSlot, convert_to_fp8
from .quantizer import CurrentQuantizer, DelayedQuantizer, Quantizer
from .recipe import BlockwiseScaling, CurrentScaling, DelayedScaling, LinearQuantizers, Recipe
from .scaling import amax_to_scale, round_down_to_power_of_2
from .tensor import Fp8Tensor, amax_of, quantize_with_scale

__all__ = [
    "E4M3", "E5M2", "BlockwiseScaling", "CurrentQuantizer", "CurrentScaling", "DelayedQuantizer",
    "DelayedScaling", "Float8Linear", "Float8WeightSlot", "Format", "Fp8Tensor", "LinearQuantizers",
    "Quantizer", "Recipe", "amax_of", "amax_to_scale", "convert_to_fp8", "fp8_gemm", "fp8_max", "gemm_calls",
    "quantize_with_scale", "round_down_to_power_of_2", "saturating_cast",
]
