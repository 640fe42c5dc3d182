"""What a test run ran on, for the sign-off's environment section and the JUnit sidecar.

Collected once per session by the process that writes JUnit. Nothing here initialises CUDA: GPU
names and the driver come from ``nvidia-smi``, versions from torch's build information and from
package metadata (TransformerEngine is never imported).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness import backend as backend_mod

_CMD_TIMEOUT_S = 15.0
HARNESS_ENV_PREFIXES = ("HARNESS_GEN", "HARNESS_TIER", "HARNESS_GPU_COUNT", "HARNESS_CAP_", "HARNESS_FULL_MATRIX",
                        "HARNESS_FORCE_CPU", "HARNESS_MUTANT")


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    """stdout of ``cmd`` stripped, or None when it is missing, fails or hangs."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_revision(root: Path) -> dict[str, Any]:
    """Commit, branch and whether the tree had uncommitted changes (None values outside a checkout)."""
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root) if commit else None
    return {"commit": commit, "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=root),
            "dirty": bool(status) if status is not None else None}


def gpus() -> dict[str, Any]:
    """GPU names, count and driver from ``nvidia-smi`` (empty lists without NVIDIA GPUs)."""
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"])
    rows = [[c.strip() for c in line.split(",")] for line in (out or "").splitlines() if line.strip()]
    return {"gpu_names": [r[0] for r in rows], "gpu_count": len(rows),
            "driver": rows[0][1] if rows and len(rows[0]) > 1 else None,
            "compute_capability": sorted({r[2] for r in rows if len(r) > 2})}


def cudnn_version() -> str | None:
    """cuDNN's version from the pip package torch loads it from. Never ``torch.backends.cudnn.version()``:
    that loads libcudnn into the pytest process at session start, and a library that later loads
    another cuDNN build by path (TransformerEngine does) then fails with undefined symbols."""
    for name in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11"):
        version = _dist_version(name)
        if version is not None:
            return version
    return None


def torch_versions() -> dict[str, Any]:
    """torch, CUDA, NCCL and cuDNN versions as built into torch (None where not built in)."""
    try:
        import torch
    except ImportError:
        return {"torch": None}
    nccl: str | None = None
    try:
        if torch.distributed.is_nccl_available():
            ver = torch.cuda.nccl.version()
            nccl = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
    except Exception:  # no NCCL in this build, or no CUDA runtime to ask
        nccl = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "cudnn": cudnn_version() if torch.backends.cudnn.is_available() else None,
            "gloo": bool(torch.distributed.is_available() and torch.distributed.is_gloo_available())}


def backend_choice(config: pytest.Config) -> str:
    """The backend distributed buckets get by default: ``nccl`` with GPUs, else ``gloo (cpu)``."""
    if backend_mod.force_cpu(config):
        return "gloo (cpu forced)"
    return "nccl" if backend_mod.visible_gpus() > 0 else "gloo (no GPU)"


def collect(config: pytest.Config) -> dict[str, Any]:
    """The environment record of one run."""
    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
        "cpu_count": os.cpu_count(), "pytest": pytest.__version__,
        "xdist": _dist_version("pytest-xdist"),
        "transformer_engine": _dist_version("transformer_engine") or _dist_version("transformer-engine"),
        "backend": backend_choice(config),
        "git": git_revision(Path(str(config.rootpath))),
        "argv": [str(a) for a in config.invocation_params.args],
        "harness_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(HARNESS_ENV_PREFIXES)},
    }
    env.update(torch_versions())
    env.update(gpus())
    return env
