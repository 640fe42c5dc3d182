"""Choose backend and device for a bucket, and evaluate the GPU/module requirement markers.

This is the one place in the harness that decides between CUDA/NCCL and CPU/gloo.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys

import pytest

from harness import gpu_lease
from harness import spec as spec_mod

BACKEND_CHOICES = ("auto", "cpu")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a bucket's ranks run: backend name, device type and the GPU id per rank (None on CPU)."""

    backend: str
    device_type: str
    gpu_ids: tuple[int, ...] | None


def force_cpu(config: pytest.Config) -> bool:
    """True when the CPU backend is forced by option or by ``HARNESS_FORCE_CPU=1``."""
    return config.getoption("harness_backend") == "cpu" or gpu_lease.cpu_forced()


def visible_gpus() -> int:
    """Number of GPUs the harness may use (``HARNESS_FAKE_GPUS`` when set, see ``harness.gpu_lease``)."""
    return gpu_lease.visible_gpu_count()


def cpu_placement() -> Placement:
    return Placement(backend="gloo", device_type="cpu", gpu_ids=None)


def gpu_placement(gpu_ids: tuple[int, ...]) -> Placement:
    """NCCL on the leased GPUs; gloo on CPU when the GPUs are fake (``HARNESS_FAKE_GPUS``) or absent.

    Fake GPU ids exist only to test the lease scheduling; on a real GPU node they may name devices
    that do not exist, so they never select NCCL.
    """
    import torch

    if torch.cuda.is_available() and os.environ.get(gpu_lease.ENV_FAKE_GPUS, "") == "":
        return Placement(backend="nccl", device_type="cuda", gpu_ids=gpu_ids)
    return Placement(backend="gloo", device_type="cpu", gpu_ids=gpu_ids)


def wants_gpu(config: pytest.Config, world_size: int) -> bool:
    """NCCL with one GPU per rank when enough GPUs are visible and CPU is not forced."""
    return not force_cpu(config) and visible_gpus() >= world_size


def _cuda_usable() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@functools.cache
def _cuda_capability() -> tuple[int, int] | None:
    """The lowest compute capability of the visible GPUs, asked of a child process: torch's
    ``get_device_capability`` initialises CUDA in the caller, after which no forked test
    (``@pytest.mark.forked``) of this process can use CUDA."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    if torch.cuda.is_initialized():
        return min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    code = ("import torch; print(min(torch.cuda.get_device_capability(i) "
            "for i in range(torch.cuda.device_count())))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        major, minor = out.stdout.strip().strip("()").split(",")
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_requirements(item: pytest.Item, config: pytest.Config, world_size: int | None = None) -> list[str]:
    """Human-readable list of what the machine lacks for ``item``'s requirement markers.

    ``world_size`` (for distributed items) also checks that the node has one GPU per rank.
    """
    missing: list[str] = []
    forced = force_cpu(config)
    needs_cuda = item.get_closest_marker(spec_mod.REQUIRES_CUDA) is not None
    arch_marks = list(item.iter_markers(spec_mod.REQUIRES_GPU_ARCH))
    no_gpu = ""
    if needs_cuda or arch_marks:
        if forced:
            no_gpu = "CPU backend forced by --harness-backend=cpu / HARNESS_FORCE_CPU=1"
        elif visible_gpus() == 0 or not _cuda_usable():
            no_gpu = "no GPU visible"
    if needs_cuda and no_gpu:
        missing.append(f"CUDA ({no_gpu})")
    elif (needs_cuda or arch_marks) and world_size is not None and visible_gpus() < world_size:
        missing.append(f"{world_size} GPUs, one per rank (the node has {visible_gpus()})")
    for mark in arch_marks:
        need = spec_mod.parse_gpu_arch(mark.args[0], item.nodeid)
        want = f"GPU architecture {mark.args[0]} (compute capability >= {need[0]}.{need[1]})"
        if no_gpu:
            missing.append(f"{want}: {no_gpu}")
            continue
        cap = _cuda_capability()
        if cap is None or cap < need:
            have = "none" if cap is None else f"sm{cap[0]}{cap[1]}"
            missing.append(f"{want}; have {have}")
    for mark in item.iter_markers(spec_mod.REQUIRES_MODULE):
        for name in mark.args:
            if not _module_available(name):
                missing.append(f"Python module {name!r}")
    return missing
