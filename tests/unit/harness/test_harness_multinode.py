"""torchrun across nodes, simulated on one machine: two ``torchrun --nnodes 2`` processes ("nodes",
each with 2 gloo ranks) meet through c10d rendezvous on 127.0.0.1. Node 0 is given the rendezvous
store (``is_host``) and the lower address (``--local-addr``), so it is torchrun's node 0 and holds
global rank 0, as the head node of a Slurm job usually does.

- ``test_two_nodes_*`` (one session, inspected by several tests): a one-rank failure on node 1 is
  reported once, naming host, node and local rank, its spilled output in node 1's directory under
  the shared directory; a rank of node 1 that sleeps longer than the heartbeat timeout is not
  declared lost; the DCP round trip of ``tests/functional/test_multinode.py`` across both nodes.
- ``test_node_lost_*``: node 1's agent and ranks are killed in the middle of a test; node 0 fails
  that test naming the lost node and ranks, keeps the earlier result and ends; nothing is left.
- spawn mode refuses a multi-node request.

The rendezvous that never completes is tested through the Slurm template
(``tests/unit/reports/test_slurm_scripts.py``), where its message is produced.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from harness_selftest import REPO, SAMPLES, Case, parse_junit, pid_alive, run_samples

from harness.nodes import multinode_request

HEARTBEAT_TIMEOUT_S = 8
SLOW_S = 16  # rank 3's sleep in test_slow_rank_on_node1: longer than the heartbeat timeout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Nodes:
    """Two started torchrun "nodes" and where their output goes."""

    procs: list[subprocess.Popen]
    logs: list[pathlib.Path]
    junit: pathlib.Path
    started: float

    def wait(self, timeout: float) -> float:
        """Wait for both to exit; return the seconds since start. Kills them on timeout."""
        deadline = self.started + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return time.monotonic() - self.started

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)

    def cases(self) -> dict[str, Case]:
        return parse_junit(self.junit) if self.junit.exists() else {}


def start_nodes(tmp: pathlib.Path, paths: list[str], args: tuple[str, ...] = (), env: dict | None = None) -> Nodes:
    """``torchrun --nnodes 2 --node-rank n ... -m pytest paths`` for n = 0, 1, each its own process."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    full_env.update(env or {})
    port, junit = free_port(), tmp / "junit.xml"
    procs, logs = [], []
    for node in (0, 1):
        log = tmp / f"node{node}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=selftest-{port}", f"--rdzv-conf=join_timeout=300,is_host={int(node == 0)}",
               f"--local-addr=127.0.0.{node + 1}", "--max-restarts=0",
               "-m", "pytest", *paths, "-p", "no:cacheprovider", "-rA", f"--junitxml={junit}",
               f"--harness-heartbeat-timeout={HEARTBEAT_TIMEOUT_S}", *args]
        with log.open("w") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    return Nodes(procs, logs, junit, time.monotonic())


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Nodes, float, pathlib.Path]:
    tmp = tmp_path_factory.mktemp("two-nodes")
    shared = tmp / "shared"
    nodes = start_nodes(tmp, [str(SAMPLES / "sample_multinode.py"), "tests/functional/test_multinode.py"],
                        args=("-m", "not slow", f"--harness-shared-dir={shared}"),
                        env={"HARNESS_SELFTEST_SLOW_S": str(SLOW_S)})
    elapsed = nodes.wait(timeout=900)
    return nodes, elapsed, shared


def test_two_nodes_one_rank_failure_named_once_with_host_node_and_rank(two_nodes) -> None:
    nodes, _, shared = two_nodes
    out, cases = nodes.output(), nodes.cases()
    assert len(cases) == 6, out[-4000:]
    assert out.count("generated xml file") == 1 and out.count("test session starts") == 1, out[-4000:]
    host = socket.gethostname()
    case = cases["test_fails_on_one_rank_of_node1"]
    assert case.outcome == "failed"
    assert case.message == (f"[rank 3 (node 1, host {host}, local rank 1)] AssertionError: node one, local rank "
                            "one disagrees"), case.message
    assert [case.prop(f"rank{r}") for r in range(4)] == ["passed", "passed", "passed", "failed"]
    node1 = re.search(r"rank 3: node 1, host \S+, local rank 1, pid \d+; log and spilled output in (\S+)", case.text)
    assert node1 is not None, case.text[:3000]
    node1_dir = pathlib.Path(node1.group(1))
    assert node1_dir.parent.parent == shared and node1_dir.name == f"node1-{host}"
    spilled = re.search(r"the full text is in (\S+) on host (\S+);", case.text)
    assert spilled is not None and spilled.group(2) == host, case.text[:3000]
    assert pathlib.Path(spilled.group(1)).parent == node1_dir / "rank3-output"
    assert pathlib.Path(spilled.group(1)).read_text().count("x") >= 300_000
    log = (node1_dir / "rank3.log").read_text()
    assert "rank 3: node 1" in log and "failed on this rank" in log
    assert f"JUnit written by rank 0 on host {host} (node 0): {nodes.junit}" in out


def test_two_nodes_slow_rank_is_not_lost_and_results_are_kept(two_nodes) -> None:
    nodes, _, _ = two_nodes
    cases = nodes.cases()
    assert cases["test_slow_rank_on_node1"].outcome == "passed", cases["test_slow_rank_on_node1"].text[:3000]
    assert cases["test_slow_rank_on_node1"].time >= SLOW_S > HEARTBEAT_TIMEOUT_S
    assert cases["test_before"].outcome == cases["test_after"].outcome == "passed"
    sidecar = json.loads(nodes.junit.with_suffix(".harness.json").read_text())
    ranks = sidecar["torchrun"]["ranks"]
    assert [(ranks[str(r)]["node"], ranks[str(r)]["local_rank"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not [r for r, p in ranks.items() if pid_alive(p["pid"])]  # no rank outlives the job
    assert all(p.returncode is not None for p in nodes.procs)


def test_two_nodes_dcp_round_trip_across_nodes(two_nodes) -> None:
    nodes, elapsed, _ = two_nodes
    cases = nodes.cases()
    dcp = {n: c for n, c in cases.items() if n.startswith("test_checkpoint_resume_across_nodes")}
    assert sorted(dcp) == ["test_checkpoint_resume_across_nodes[optim_grads_params-outer_none]",
                           "test_checkpoint_resume_across_nodes[optim_grads_params-outer_optim]"]
    assert {n: c.outcome for n, c in dcp.items()} == dict.fromkeys(dcp, "passed"), \
        {n: c.text[:2000] for n, c in dcp.items()}
    print(f"two simulated nodes x 2 ranks: {elapsed:.0f} s")


def test_node_lost_fails_the_test_naming_the_node_and_ends(tmp_path) -> None:
    piddir = tmp_path / "pids"
    piddir.mkdir()
    nodes = start_nodes(tmp_path, [str(SAMPLES / "sample_multinode_faults.py")],
                        env={"HARNESS_SELFTEST_PIDDIR": str(piddir)})
    try:
        deadline = time.monotonic() + 600
        while len(list(piddir.glob("*.started"))) < 4:
            assert time.monotonic() < deadline and nodes.procs[0].poll() is None, nodes.output()[-4000:]
            time.sleep(0.2)
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in piddir.glob("rank*.json")}
        node1 = sorted(r for r, info in ranks.items() if info["node"] == 1)
        assert node1 == [2, 3]
        killed = time.monotonic()
        nodes.procs[1].send_signal(signal.SIGKILL)  # node 1's torchrun agent ...
        for r in node1:
            os.kill(ranks[r]["pid"], signal.SIGKILL)  # ... and its ranks (torchrun starts each in its own session)
        nodes.procs[0].wait(timeout=240)
        ended = time.monotonic() - killed
    finally:
        nodes.wait(timeout=1)
    out, cases = nodes.output(), nodes.cases()
    assert cases["test_before"].outcome == "passed", out[-4000:]
    case = cases["test_node_lost"]
    host = socket.gethostname()
    assert case.outcome == "failed"
    assert f"node 1 (host {host}) lost: rank(s) [2, 3] sent no heartbeat for" in case.message, case.message
    assert [case.prop(f"rank{r}") for r in (2, 3)] == ["died", "died"]
    assert "test_after" not in cases
    assert ended < 120, ended  # heartbeat timeout, grace and stacks, then the job ends
    pids = [info["pid"] for info in ranks.values()] + [p.pid for p in nodes.procs]
    assert not [p for p in pids if pid_alive(p)]
    print(f"node loss: node 0 ended {ended:.0f} s after node 1 was killed")


def test_spawn_mode_refuses_a_multinode_request(tmp_path) -> None:
    run = run_samples(tmp_path, "sample_torchrun.py", env={"SLURM_NNODES": "2"})
    assert run.returncode == 4, run.output[-3000:]
    assert "SLURM_NNODES=2 asks for more than one node" in run.output
    assert "srun torchrun --nnodes N" in run.output and "HARNESS_SINGLE_NODE=1" in run.output
    alone = run_samples(tmp_path, "sample_torchrun.py", env={"SLURM_NNODES": "2", "HARNESS_SINGLE_NODE": "1"},
                        args=("--co",))
    assert alone.returncode == 0, alone.output[-3000:]


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None),
    ({"SLURM_NNODES": "1", "NNODES": "1"}, None),
    ({"SLURM_STEP_NUM_NODES": "4", "SLURM_NNODES": "4"}, "SLURM_STEP_NUM_NODES=4"),
    ({"SLURM_JOB_NUM_NODES": "2"}, "SLURM_JOB_NUM_NODES=2"),
    ({"PET_NNODES": "1:2"}, "PET_NNODES=1:2"),
    ({"NNODES": "2"}, "NNODES=2"),
    ({"NNODES": "2", "HARNESS_SINGLE_NODE": "1"}, None),
])
def test_what_counts_as_a_multinode_request(environ, expected) -> None:
    assert multinode_request(environ) == expected
