"""Pinned CPU numerics, and the fingerprint of what decides a run's bits.

Why: the same torch build on two CPUs rounds differently. Measured on torch 2.13 (CPU wheel): the
bits of a training step change with the thread count, with the ATen CPU capability torch picks
(AVX2 / AVX-512 kernels sum in other orders and fuse multiply-adds), with MKL's code path for
GEMMs and with oneDNN. *Pinned* numerics removes each of these choices:

- one intra-op thread (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``, ``torch.set_num_threads(1)``);
- ATen's baseline kernels (``ATEN_CPU_CAPABILITY=default``, read when torch first dispatches);
- MKL's conditional numerical reproducibility on its SSE2 path (``MKL_CBWR=COMPATIBLE``);
- oneDNN off (``torch.backends.mkldnn.enabled = False``: bf16 GEMMs and convolutions take ATen's
  own kernels).

The environment part must be in place before torch picks its kernels, so the harness sets it
when it starts a bucket's rank processes (tests marked ``pinned_numerics``); the in-process part
runs at the rank's start. With it, fp32 and bf16 training steps were bit-identical across this
project's AMD AVX2 machine and emulated Intel CPUs (qemu: Nehalem, SandyBridge, Haswell,
Cascadelake), except for one family of operators: MKL's vector math library (VML), which torch
still calls for ``sqrt``, ``acos``, ``asin``, ``atan``, ``tan`` and ``pow(x, 0.5)`` of float32 and
float64 CPU tensors (torch 2.13; ``MKL_CBWR`` does not pin VML, whose ``sqrt`` starts from the
CPU's approximate reciprocal square root). A run that uses them is bitwise only on the same kind
of CPU: :class:`MachineDependentOps` sees them, and the fingerprint then names the CPU kind.

The fingerprint (:func:`fingerprint`) lists what decides the bits of a run on a device: on CPU
the torch build, BLAS and its reproducibility mode, the ATen capability, the thread count and
oneDNN; on GPU the GPU, CUDA, cuBLAS, cuDNN, NCCL and TransformerEngine versions and the
determinism settings. Golden files keep the fingerprint they were made with (``harness.golden``).
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import pytest

from harness import environment

MARKER = ("pinned_numerics: start this distributed test's rank processes with pinned CPU numerics "
          "(harness.numerics: one thread, ATen's default CPU capability, MKL_CBWR=COMPATIBLE, oneDNN off), "
          "so CPU results are bit-identical across x86-64 machines of one torch build")
MARK_NAME = "pinned_numerics"
ENV_MODE = "HARNESS_NUMERICS"  # "pinned" in a pinned rank; "unpinned" in the controller ignores the marker
PINNED = "pinned"
UNPINNED = "unpinned"
DEFAULT = "default"
PINNED_ENV: Mapping[str, str] = {
    ENV_MODE: PINNED,
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# VML-backed operators (torch 2.11-2.14, float32/float64 CPU tensors): their bits follow the CPU.
VML_OPS = frozenset({"sqrt", "acos", "asin", "atan", "tan"})


def wants_pinned(item: pytest.Item) -> bool:
    """Whether ``item``'s rank processes start pinned: it carries the marker and the controller's
    environment does not say ``HARNESS_NUMERICS=unpinned`` (used to measure what an unpinned
    machine would see, e.g. for a golden band)."""
    return item.get_closest_marker(MARK_NAME) is not None and os.environ.get(ENV_MODE) != UNPINNED


def rank_env() -> dict[str, str]:
    """The environment a pinned rank process starts with."""
    return dict(PINNED_ENV)


def apply_from_env() -> None:
    """The in-process part of pinned numerics, where this process's environment asks for it.
    Called at a rank's start, before any test runs."""
    if os.environ.get(ENV_MODE) != PINNED:
        return
    import torch

    torch.backends.mkldnn.set_flags(False)  # oneDNN off: ATen's own bf16 GEMMs and convolutions
    torch.set_num_threads(1)


def mode() -> str:
    """``pinned`` when every pinned setting is in effect in this process, else ``default``."""
    import torch

    pinned = (os.environ.get(ENV_MODE) == PINNED and not torch.backends.mkldnn.enabled
              and torch.get_num_threads() == 1
              and str(torch.backends.cpu.get_cpu_capability()).upper() == "DEFAULT"
              and os.environ.get("MKL_CBWR", "").upper().startswith("COMPATIBLE"))
    return PINNED if pinned else DEFAULT


def _blas() -> str:
    """``mkl 2024.2`` (from torch's build configuration), or the BLAS name, or ``unknown``."""
    import torch

    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([0-9][0-9.]*)", config)
    if mkl:
        return f"mkl {mkl.group(1)}"
    info = re.search(r"BLAS_INFO=([^,\s]+)", config)
    return info.group(1) if info else "unknown"


def cpu_kind() -> str:
    """The CPU's vendor and widest vector extension torch and MKL can use, e.g. ``amd avx2``:
    what a VML-backed operator's bits follow."""
    flags: set[str] = set()
    vendor = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(value.strip(), value.strip().lower())
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        import platform

        return platform.machine().lower() or "unknown"
    isa = next((name for name, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"), ("sse4.2", "sse4_2"))
                if flag in flags), "baseline")
    return f"{vendor} {isa}"


def cpu_fingerprint() -> dict[str, str]:
    """What decides the bits of a CPU run in this process now."""
    import torch

    return {
        "numerics": mode(),
        "torch": torch.__version__,
        "blas": _blas(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "AUTO") or "AUTO",
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": str(torch.get_num_threads()),
        "onednn": "on" if torch.backends.mkldnn.enabled else "off",
    }


def _package(name_prefix: str) -> str:
    """The version of the first installed distribution whose name starts with ``name_prefix``
    (the CUDA libraries torch loads come as ``nvidia-cublas-cu12`` etc.), else ``unknown``."""
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(name_prefix):
            return str(dist.version)
    return "unknown"


def gpu_fingerprint() -> dict[str, str]:
    """What decides the bits of a GPU run on the current device in this process now."""
    import torch

    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    te = sys.modules.get("transformer_engine")
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    return {
        "gpu": torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "cublas": _package("nvidia-cublas"),
        "cudnn": environment.cudnn_version() or "none",  # never torch.backends.cudnn.version(): see there
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "transformer_engine": str(getattr(te, "__version__", "none")) if te is not None else "none",
        "deterministic": str(torch.are_deterministic_algorithms_enabled()).lower(),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"),
        "tf32": "on" if matmul_tf32 or torch.backends.cudnn.allow_tf32 else "off",
    }


def fingerprint(device_type: str) -> dict[str, str]:
    """The fingerprint of a run on ``device_type`` (``cpu`` or ``cuda``) in this process now."""
    return cpu_fingerprint() if device_type == "cpu" else gpu_fingerprint()


def with_machine_dependent(fp: Mapping[str, str], counts: Mapping[str, int]) -> dict[str, str]:
    """``fp`` plus, when a CPU run used VML-backed operators (``counts``, from
    :class:`MachineDependentOps`), the CPU kind and those operators: their bits follow the CPU."""
    out = dict(fp)
    if counts:
        out["cpu_kind"] = cpu_kind()
        out["vml_ops"] = ",".join(sorted(counts))
    return out


def differences(made_with: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``["torch 2.13.0+cpu (this run 2.14.1+cu130)", ...]``: every key whose value differs or is
    missing on one side, in a stable order."""
    keys = list(made_with) + [k for k in now if k not in made_with]
    return [f"{k} {made_with.get(k, 'absent')} (this run {now.get(k, 'absent')})"
            for k in keys if made_with.get(k) != now.get(k)]


def _is_vml_call(name: str, args: tuple[Any, ...]) -> bool:
    """Whether an aten call reaches MKL VML: a VML operator, or ``pow(x, 0.5)``, on a float32 or
    float64 CPU tensor."""
    import torch

    base = name.split(".", 1)[0].removeprefix("_foreach_").rstrip("_")
    if base == "pow":
        exponent = args[1] if len(args) > 1 else None
        if not (isinstance(exponent, float) and exponent == 0.5):
            return False
    elif base not in VML_OPS:
        return False
    first = args[0] if args else None
    tensors = first if isinstance(first, (list, tuple)) else [first]
    return any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
               for t in tensors)


def _dispatch_mode_base() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class MachineDependentOps(_dispatch_mode_base()):  # type: ignore[misc]
    """A dispatch mode that counts the aten calls whose bits follow the CPU (:data:`VML_OPS`):
    ``with MachineDependentOps() as seen: ...``; then ``seen.counts`` maps ``aten.sqrt`` -> calls
    and ``seen.threads`` is the thread count the first operator ran with. It changes no result:
    every call runs as it would without it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.threads: int | None = None  # torch's intra-op thread count when the first operator ran

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.threads is None:
            import torch

            self.threads = torch.get_num_threads()
        name = str(func.overloadpacket.__name__)
        if _is_vml_call(name, args):
            key = f"aten.{name}"
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))
