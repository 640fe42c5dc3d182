"""Several nodes: what spawn mode refuses, and where torchrun mode records the ranks' nodes.

Spawn mode (plain ``pytest``) cannot span nodes: a bucket's ranks are child processes of the one
pytest process that runs it, on its node. A run that asks for more than one node without torchrun
is therefore a usage error rather than a silently single-node (or, under ``srun``, N times
duplicated) run. Multi-node runs go through torchrun (``launch_scripts/<gen>/slurm/``).

Standard library and pytest only: the controller imports it before anything else.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest

ENV_SHARED_DIR = "HARNESS_SHARED_DIR"
ENV_SINGLE_NODE = "HARNESS_SINGLE_NODE"
# Variables that ask for several nodes, most specific first: a Slurm step started by srun across
# nodes, a Slurm allocation of several nodes, torchrun's own settings (PET_* is what torchrun
# reads from the environment, e.g. under a Kubeflow PyTorchJob), and a plain NNODES.
NODE_COUNT_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PET_NNODES", "NNODES")
# Where the torchrun session records every rank's node, host and local rank (the sidecar reads it).
PLACEMENT_KEY = pytest.StashKey[dict[str, Any]]()


def _node_count(value: str) -> int:
    """``"4"`` -> 4; torchrun's elastic ``"1:4"`` -> 4 (its maximum); anything else -> 0."""
    numbers = re.findall(r"\d+", value)
    return int(numbers[-1]) if numbers else 0


def multinode_request(environ: Mapping[str, str]) -> str | None:
    """The variable (``NAME=value``) by which this spawn-mode run asks for more than one node, or None.
    ``HARNESS_SINGLE_NODE=1`` says the run is meant for this node only."""
    if environ.get(ENV_SINGLE_NODE) == "1":
        return None
    for var in NODE_COUNT_VARS:
        value = environ.get(var, "")
        if _node_count(value) > 1:
            return f"{var}={value}"
    return None


def refuse_multinode_spawn(environ: Mapping[str, str]) -> None:
    """Raise a usage error naming what to do instead when a spawn-mode run asks for several nodes."""
    why = multinode_request(environ)
    if why is None:
        return
    raise pytest.UsageError(
        f"fsdp_harness: {why} asks for more than one node, but plain pytest (spawn mode) runs every "
        "distributed test's ranks as child processes on this node only. Across nodes, run under torchrun "
        "on every node (srun torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d "
        "--rdzv-endpoint HEAD:PORT -m pytest ...; launch_scripts/<gen>/slurm/run_tier.sbatch does it). "
        f"To run on this node only, set {ENV_SINGLE_NODE}=1.")
