"""What a benchmark runs on: device, its memory, library versions; one JSON line on stdout.

    python -m bench.probe [--device auto|cuda|cpu]

The drivers (``bench.suite``, ``bench.trace``) run it as a child before the cells, so the driver
process itself never creates a CUDA context (every GPU byte stays the cells') and still knows the
device name for the report header and the total memory for the fit check. No process group.
"""
from __future__ import annotations

import importlib.metadata
import json
import platform
import sys

from bench import cli

# Distribution names to try per library (wheels are published under several).
PACKAGES = {"transformer_engine": ("transformer_engine", "transformer-engine-torch", "transformer_engine_cu12"),
            "megatron_fsdp": ("megatron-fsdp", "megatron_fsdp")}


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def describe(device: str) -> dict:
    """Device name, total memory (0 on CPU), torch/CUDA/Python and optional library versions."""
    import torch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch sees no CUDA GPU")
    out = {"device": torch.cuda.get_device_name(0) if use_cuda else "cpu",
           "device_type": "cuda" if use_cuda else "cpu",
           "total_memory": torch.cuda.get_device_properties(0).total_memory if use_cuda else 0,
           "gpus": torch.cuda.device_count() if use_cuda else 0,
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    out.update({name: _version(dists) for name, dists in PACKAGES.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    cli.add_run_flags(p)
    args = p.parse_args(argv)
    print(json.dumps(describe(args.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
