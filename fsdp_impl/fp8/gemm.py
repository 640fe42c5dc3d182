"""The FP8 GEMM ``a @ b.T`` of two ``Fp8Tensor`` operands (both with the contraction dim last).

Backends, picked per call from the operands' device and scaling:

* ``scaled_mm`` (CUDA sm_89+, tensorwise): ``torch._scaled_mm``; dims are zero-padded to the
  multiples of 16 it needs (zeros add nothing to a dot product; padded rows/cols are cut off);
* ``scaled_mm_blockwise`` (CUDA sm_90, 1x128 / 128x128 blocks): ``torch.nn.functional.scaled_mm``
  with cuBLAS block scaling (needs torch with that API and CUDA >= 12.9);
* ``emulated`` (everything else, e.g. CPU): dequantise both operands to fp32 and multiply.

``gemm_calls`` counts which backend ran, so tests can assert the fast path was taken.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from .tensor import Fp8Tensor

gemm_calls: Counter[str] = Counter()
_BLOCK = 128


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad2d(x: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """Zero-pad a 2-D tensor (FP8 data is padded through its uint8 view: byte 0 is +0.0)."""
    if x.shape[0] == rows and x.shape[1] == cols:
        return x
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return F.pad(x.view(torch.uint8), (0, cols - x.shape[1], 0, rows - x.shape[0])).view(x.dtype)
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]), value=value)


def pick_backend(a: Fp8Tensor, b: Fp8Tensor) -> str:
    if not a.data.is_cuda:
        return "emulated"
    major, minor = torch.cuda.get_device_capability(a.data.device)
    if a.tensorwise and b.tensorwise:
        return "scaled_mm" if (major, minor) >= (8, 9) else "emulated"
    blockwise = a.block == (1, _BLOCK) and b.block in ((1, _BLOCK), (_BLOCK, _BLOCK))
    if blockwise and (major, minor) == (9, 0) and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        return "scaled_mm_blockwise"
    return "emulated"


def _count(backend: str) -> None:
    """Eager calls only: under Dynamo the branch is dropped at trace time, so a compiled unit
    neither graph-breaks here (a ``torch.compiler.disable``d counter broke the graph at every
    GEMM) nor guards on the counter's value (a traced increment recompiled at every call);
    compiled calls are counted by ``compile_units``' ``CompileStats`` instead."""
    if not torch.compiler.is_compiling():
        gemm_calls[backend] += 1


def fp8_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (N, K).T -> (M, N)`` in ``out_dtype`` (fp32 accumulation)."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"FP8 GEMM contraction mismatch: a {a.shape}, b {b.shape}")
    backend = pick_backend(a, b)
    _count(backend)
    if backend == "scaled_mm":
        return _tensorwise_scaled_mm(a, b, out_dtype)
    if backend == "scaled_mm_blockwise":
        return _blockwise_scaled_mm(a, b, out_dtype)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)


def _tensorwise_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    (m, k), n = a.shape, b.shape[0]
    mp, kp, np_ = _round_up(m, 16), _round_up(k, 16), _round_up(n, 16)
    a_data = _pad2d(a.data, mp, kp).contiguous()
    b_data = _pad2d(b.data, np_, kp).contiguous()
    out = torch._scaled_mm(a_data, b_data.t(), scale_a=a.scale_inv.reshape(()).float(),
                           scale_b=b.scale_inv.reshape(()).float(), out_dtype=out_dtype)
    return out[:m, :n]


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """1x128 scales in the "outer-dim-major" layout cuBLAS reads: same shape, stride (1, rows)."""
    return scale.t().contiguous().t()


def _blockwise_scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Block-scaled GEMM: ``a`` 1x128, ``b`` 1x128 or 128x128; rows padded to 128, K must be a
    multiple of 128 (the recipe checks the module dims; tokens are padded here)."""
    (m, k), n = a.shape, b.shape[0]
    mp, kp, np_ = _round_up(m, _BLOCK), _round_up(k, _BLOCK), _round_up(n, _BLOCK)
    kb = kp // _BLOCK
    a_data = _pad2d(a.data, mp, kp).contiguous()
    a_scale = _outer_major(_pad2d(a.scale_inv, mp, kb, value=1.0))
    b_data = _pad2d(b.data, np_, kp).contiguous()
    st = F.ScalingType
    if b.block == (1, _BLOCK):
        b_scale, b_recipe = _outer_major(_pad2d(b.scale_inv, np_, kb, value=1.0)), st.BlockWise1x128
    else:  # 128x128: grid (N/128, K/128), K blocks padded to a multiple of 4, then transposed
        b_scale = _pad2d(b.scale_inv, np_ // _BLOCK, _round_up(kb, 4), value=1.0).t()
        b_recipe = st.BlockWise128x128
    out = F.scaled_mm(a_data, b_data.t(), a_scale, st.BlockWise1x128, b_scale, b_recipe, output_dtype=out_dtype)
    return out[:m, :n]
