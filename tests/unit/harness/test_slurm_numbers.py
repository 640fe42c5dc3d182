"""The Slurm templates check every number before anything runs (issue 52, item 14): a node count of 0
or -2 printed "world 0", a non-numeric one died in bash's ``unbound variable``, and a port or join
timeout out of range was passed on to torchrun. Each bad value is now an error naming the variable,
its value and the allowed range, shown through the templates' ``--dry-run``."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def dry_run(gen: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "SLURM_", "PYTEST_"))}
    base.update(PYTHON=sys.executable, HARNESS_RDZV_HOST="head", SLURM_JOB_ID="4242", SLURM_NNODES="2")
    base.update(env)
    for key in [k for k, v in base.items() if v == "<unset>"]:
        del base[key]
    return subprocess.run(["bash", str(REPO / "launch_scripts" / gen / "slurm" / "run_tier.sbatch"), "L0",
                           "--dry-run"], env=base, capture_output=True, text=True, timeout=60, cwd="/")


BAD = [
    ("cpu", {"SLURM_NNODES": "0"}, "SLURM_NNODES='0'", "from 1 to 10000"),
    ("cpu", {"SLURM_NNODES": "-2"}, "SLURM_NNODES='-2'", "from 1 to 10000"),
    ("cpu", {"SLURM_NNODES": "two"}, "SLURM_NNODES='two'", "from 1 to 10000"),
    ("cpu", {"SLURM_NNODES": "<unset>", "SLURM_JOB_NUM_NODES": "0"}, "SLURM_JOB_NUM_NODES='0'", "from 1 to 10000"),
    ("cpu", {"HARNESS_NPROC_PER_NODE": "0"}, "HARNESS_NPROC_PER_NODE='0'", "from 1 to 256"),
    ("cpu", {"HARNESS_NPROC_PER_NODE": "2x"}, "HARNESS_NPROC_PER_NODE='2x'", "from 1 to 256"),
    ("h100", {"HARNESS_NPROC_PER_NODE": "16"}, "HARNESS_NPROC_PER_NODE='16'",
     "from 1 to 8 (one rank per GPU, 8 GPUs per h100 node)"),
    ("gb200", {"HARNESS_NPROC_PER_NODE": "8"}, "HARNESS_NPROC_PER_NODE='8'",
     "from 1 to 4 (one rank per GPU, 4 GPUs per gb200 node)"),
    ("cpu", {"HARNESS_RDZV_PORT": "70000"}, "HARNESS_RDZV_PORT='70000'", "from 1 to 65535"),
    ("cpu", {"HARNESS_RDZV_PORT": "0"}, "HARNESS_RDZV_PORT='0'", "from 1 to 65535"),
    ("cpu", {"HARNESS_RDZV_PORT": "http"}, "HARNESS_RDZV_PORT='http'", "from 1 to 65535"),
    ("cpu", {"HARNESS_RDZV_JOIN_TIMEOUT": "10m"}, "HARNESS_RDZV_JOIN_TIMEOUT='10m'", "from 1 to 86400"),
    ("cpu", {"HARNESS_RDZV_JOIN_TIMEOUT": "0"}, "HARNESS_RDZV_JOIN_TIMEOUT='0'", "from 1 to 86400"),
    ("cpu", {"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'", "from 0 to 4294967295"),
]


@pytest.mark.parametrize("gen, env, named, allowed", BAD, ids=[f"{g}-{next(iter(e.items()))}" for g, e, _, _ in BAD])
def test_bad_number_is_refused_naming_variable_value_and_range(gen, env, named, allowed):
    proc = dry_run(gen, **env)
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first == f"[harness] ERROR: {named} is not allowed: it must be a whole number {allowed}", proc.stderr
    assert "unbound variable" not in proc.stderr and "running:" not in proc.stderr


def test_good_numbers_are_read_as_decimal():
    """Leading zeros are decimal (bash arithmetic would read 08 as bad octal), and the plan says so."""
    proc = dry_run("cpu", SLURM_NNODES="03", HARNESS_NPROC_PER_NODE="08", HARNESS_RDZV_PORT="029500",
                   HARNESS_RDZV_JOIN_TIMEOUT="0900")
    assert proc.returncode == 0, proc.stderr
    assert "[harness] slurm: L0 on 3 x cpu nodes, 8 ranks each (world 24); rendezvous c10d at head:29500, " \
           "join_timeout 900s" in proc.stderr
    assert "--nnodes=3 --nproc-per-node=8" in proc.stderr

