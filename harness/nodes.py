"""Several nodes: what spawn mode refuses, and where torchrun mode records the ranks' nodes.

Spawn mode (plain ``pytest``) cannot span nodes: a bucket's ranks are child processes of the one
pytest process that runs it, on its node. A run that asks for more than one node without torchrun
is therefore a usage error rather than a silently single-node (or, under ``srun``, N times
duplicated) run. Multi-node runs go through torchrun (``launch_scripts/<gen>/slurm/``).

torchrun mode knows how many nodes a rank was started for from ``HARNESS_NNODES`` (the Slurm
templates set it), torchrun's ``PET_NNODES`` or its agent's ``--nnodes``; ``harness.torchrun.nodecount``
compares that with the nodes the rendezvous formed (torchrun itself accepts agents that disagree).

Standard library and pytest only: the controller imports it before anything else.
"""
from __future__ import annotations

import dataclasses
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


# ----- torchrun mode: how many nodes the run was started for ----------------------------------------
ENV_NNODES = "HARNESS_NNODES"  # the Slurm templates set it from the allocation


@dataclasses.dataclass(frozen=True)
class NodeCount:
    """A node count one rank was started for: ``low``..``high`` (torchrun's elastic ``MIN:MAX``, or one
    number) and where it was read (``HARNESS_NNODES=3``, ``the torchrun agent's --nnodes=3``)."""

    low: int
    high: int
    source: str

    def admits(self, nodes: int) -> bool:
        return self.low <= nodes <= self.high

    def text(self) -> str:
        return f"{self.low} node(s)" if self.low == self.high else f"{self.low} to {self.high} nodes"


def parse_node_count(value: str, source: str, what: str) -> NodeCount:
    """``"3"`` or ``"1:4"`` (whole numbers, 1 <= low <= high); anything else is a usage error naming
    ``what`` (the variable or argument) and its value."""
    match = re.fullmatch(r"\s*(\d{1,6})\s*(?::\s*(\d{1,6})\s*)?", value)
    low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not match or not 1 <= low <= high:
        raise pytest.UsageError(f"fsdp_harness: {what}={value!r} is not a node count: it must be a whole number "
                                "from 1 up, or MIN:MAX with 1 <= MIN <= MAX")
    return NodeCount(low, high, source)


def agent_nnodes(pid: int) -> str | None:
    """The ``--nnodes`` value on the command line of process ``pid`` when it is a torchrun agent (the
    parent of a torchrun worker), else None. Linux only (``/proc``); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    return nnodes_argument(args)


def nnodes_argument(args: list[str]) -> str | None:
    """The ``--nnodes`` value of a torchrun command line (``torchrun ...`` or ``python -m
    torch.distributed.run ...``), up to the workers' own command; None when there is none."""
    launcher = next((i for i, a in enumerate(args[:3]) if a.endswith("torchrun") or a == "torch.distributed.run"),
                    None)
    if launcher is None:
        return None
    options = args[launcher + 1:]
    for i, arg in enumerate(options):
        if arg in ("-m", "--module") or arg.endswith(".py"):  # the workers' own command line follows
            return None
        if arg.startswith("--nnodes="):
            return arg.split("=", 1)[1]
        if arg == "--nnodes":
            return options[i + 1] if i + 1 < len(options) else None
    return None


def expected_node_counts(environ: Mapping[str, str], agent_pid: int | None) -> list[NodeCount]:
    """Every node count this rank knows it was started for: ``HARNESS_NNODES``, torchrun's ``PET_NNODES``
    (which it reads for ``--nnodes``, and its workers inherit) and the agent's own ``--nnodes``."""
    counts = []
    for var in (ENV_NNODES, "PET_NNODES"):
        value = environ.get(var, "").strip()
        if value:
            counts.append(parse_node_count(value, f"{var}={value}", var))
    arg = agent_nnodes(agent_pid) if agent_pid else None
    if arg is not None:
        counts.append(parse_node_count(arg, f"the torchrun agent's --nnodes={arg}", "torchrun's --nnodes"))
    return counts
