"""torchrun mode: a rendezvous that formed another number of nodes than a rank was started for is a
usage error on every rank, naming both numbers and where the expected one came from (issue 52, item
15: torchrun's c10d rendezvous let agents started with ``--nnodes 3`` and ``--nnodes 2`` run together
on 2 nodes without a word). The expected count comes from ``HARNESS_NNODES`` (the Slurm templates set
it), torchrun's ``PET_NNODES`` or the agent's own ``--nnodes``."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
from harness_selftest import REPO, SAMPLES

from harness.nodes import NodeCount, expected_node_counts, nnodes_argument, parse_node_count
from harness.torchrun.nodecount import problems
from harness.torchrun.placement import Place, Placement


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(tmp: pathlib.Path, node: int, nnodes: int, port: int, env: dict[str, str]) -> subprocess.Popen:
    """One torchrun agent ("node") of one gloo rank running the sample suite."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_", "PET_"))}
    full_env.update(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=nnodes-{port}",
           f"--rdzv-conf=join_timeout=240,is_host={int(node == 0)}", f"--local-addr=127.0.0.{node + 1}",
           "--max-restarts=0", "-m", "pytest", str(SAMPLES / "sample_torchrun.py"), "-p", "no:cacheprovider",
           f"--junitxml={tmp / f'junit{node}.xml'}"]
    out = (tmp / f"node{node}.log").open("w")
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT)


def test_one_node_started_for_another_count_fails_on_every_rank(tmp_path):
    """Two agents agree on ``--nnodes 2`` but node 1 was started with HARNESS_NNODES=3: both fail at
    collection with the same message, naming 2 (what formed) and 3 (what node 1 expected)."""
    port = _free_port()
    procs = [_agent(tmp_path, 0, 2, port, {}), _agent(tmp_path, 1, 2, port, {"HARNESS_NNODES": "3"})]
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"node{n}.log").read_text(errors="replace") for n in (0, 1)]
    assert all(code != 0 for code in codes), (codes, logs[0][-3000:])
    expected = ("the rendezvous formed 2 node(s) (GROUP_WORLD_SIZE=2), but not every node was started for that "
                f"many: node 1 (host {socket.gethostname()}, ranks 1): started for 3 node(s) (HARNESS_NNODES=3)")
    for log in logs:
        assert expected in log, log[-3000:]
    assert not (tmp_path / "junit0.xml").exists() or "<testcase" not in (tmp_path / "junit0.xml").read_text()


def test_agent_of_one_node_started_for_two_fails(tmp_path):
    """One agent (``--nnodes 1``, the default) whose rank was started with HARNESS_NNODES=2."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pytest",
         str(SAMPLES / "sample_torchrun.py"), "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_", "PET_"))},
             "HARNESS_NNODES": "2"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the rendezvous formed 1 node(s) (GROUP_WORLD_SIZE=1)" in out, out[-3000:]
    assert "started for 2 node(s) (HARNESS_NNODES=2)" in out, out[-3000:]


@pytest.mark.parametrize("value, low, high", [("3", 3, 3), (" 2 ", 2, 2), ("1:4", 1, 4), ("02", 2, 2)])
def test_node_counts_parse(value, low, high):
    count = parse_node_count(value, "X", "HARNESS_NNODES")
    assert (count.low, count.high) == (low, high)


@pytest.mark.parametrize("value", ["0", "-2", "abc", "4:1", "0:3", "1:", "3.0", ""])
def test_bad_node_count_names_the_variable_and_value(value):
    with pytest.raises(pytest.UsageError, match=rf"HARNESS_NNODES={value!r} is not a node count: it must be a "
                                                r"whole number from 1 up, or MIN:MAX"):
        parse_node_count(value, "X", "HARNESS_NNODES")


def test_expected_counts_from_every_source(tmp_path):
    counts = expected_node_counts({"HARNESS_NNODES": "3", "PET_NNODES": "1:4"}, agent_pid=None)
    assert [(c.low, c.high, c.source) for c in counts] == [(3, 3, "HARNESS_NNODES=3"), (1, 4, "PET_NNODES=1:4")]
    assert expected_node_counts({}, agent_pid=os.getpid()) == []  # pytest is no torchrun agent
    with pytest.raises(pytest.UsageError, match="PET_NNODES='x'"):
        expected_node_counts({"PET_NNODES": "x"}, agent_pid=None)


@pytest.mark.parametrize("args, value", [
    (["python3", "-m", "torch.distributed.run", "--nnodes=3", "-m", "pytest"], "3"),
    (["/venv/bin/torchrun", "--nnodes", "1:4", "train.py", "--nnodes=9"], "1:4"),
    (["python3", "-m", "torch.distributed.run", "-m", "pytest", "--nnodes=3"], None),  # pytest's, not torchrun's
    (["/venv/bin/torchrun", "--standalone", "train.py"], None),
    (["sleep", "--nnodes=3"], None),
])
def test_nnodes_read_from_a_torchrun_command_line(args, value):
    assert nnodes_argument(args) == value


def test_problems_name_each_node_and_where_its_count_came_from():
    placement = Placement(Place(0, 0, 0, "a", 10))
    for rank, node, host in ((1, 0, "a"), (2, 1, "b"), (3, 1, "b")):
        placement.places[rank] = Place(rank, rank % 2, node, host, 10 + rank)
    agree = {"counts": [[2, 2, "HARNESS_NNODES=2"]], "error": None}
    three = {"counts": [[2, 2, "HARNESS_NNODES=2"], [3, 3, "the torchrun agent's --nnodes=3"]], "error": None}
    posted = {0: agree, 1: agree, 2: three, 3: three}
    assert problems(posted, 2, placement) == [
        "node 1 (host b, ranks 2, 3): started for 3 node(s) (the torchrun agent's --nnodes=3)"]
    assert problems({r: agree for r in range(4)}, 2, placement) == []
    assert NodeCount(1, 4, "x").admits(2) and not NodeCount(3, 3, "x").admits(2)
