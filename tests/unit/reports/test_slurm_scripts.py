"""The Slurm templates (launch_scripts/<gen>/slurm/run_tier.sbatch, launch_scripts/slurm.sh): syntax,
shellcheck, the exact commands ``--dry-run`` prints, and real runs on this machine with a stand-in
``srun`` that starts one torchrun per simulated node (each its own process, c10d on 127.0.0.1):
a rendezvous that never completes (one node never starts) fails with a clear message within its
join timeout, and two nodes x 2 gloo ranks run the L0 multi-node selection into one JUnit file and
one sign-off."""
from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "launch_scripts"
GPUS_PER_NODE = {"cpu": 2, "h100": 8, "h200": 8, "b200": 8, "gb200": 4}
TEMPLATES = [SCRIPTS / gen / "slurm" / "run_tier.sbatch" for gen in GPUS_PER_NODE]
FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun: --nodes=N CMD... runs N local copies of CMD (one per simulated node), one
# second apart, except the node indices in FAKE_SRUN_SKIP_NODES; exits with the worst status.
nodes=1
while [ $# -gt 0 ]; do
    case "$1" in --nodes=*) nodes=${1#--nodes=} ;; --*) ;; *) break ;; esac
    shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
    case " ${FAKE_SRUN_SKIP_NODES:-} " in *" $i "*) continue ;; esac
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
    pids+=($!)
    sleep 1
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO))


def slurm_env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    """A Slurm job's environment (job 4242, nodes gpu-a01 and gpu-a02) with stand-ins for srun and
    scontrol on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "srun").write_text(FAKE_SRUN)
    (bindir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a01\\ngpu-a02\\n"\n')
    for tool in ("srun", "scontrol"):
        (bindir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "SLURM_", "PYTEST_"))}
    env.update(PATH=f"{bindir}{os.pathsep}{env['PATH']}", HARNESS_OUT_DIR=str(tmp_path / "out"),
               PYTHON=sys.executable, SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-a[01-02]")
    env.update(extra)
    return env


def run_template(gen: str, env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPTS / gen / "slurm" / "run_tier.sbatch"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd="/")


def printed(stderr: str, prefix: str) -> list[str]:
    """The command a ``[harness] <prefix>: ...`` line prints, as words."""
    line = next(ln for ln in stderr.splitlines() if ln.startswith(f"[harness] {prefix}: "))
    return shlex.split(line.split(": ", 1)[1])


@pytest.mark.parametrize("template", TEMPLATES, ids=rel)
def test_template_syntax_and_header(template: pathlib.Path) -> None:
    proc = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.access(template, os.X_OK)
    text = template.read_text()
    gen = template.parts[-3]
    assert "#SBATCH --ntasks-per-node=1" in text
    assert f"harness_slurm_run_tier {gen} {GPUS_PER_NODE[gen]} \"$@\"" in text
    if gen != "cpu":
        assert f"#SBATCH --gpus-per-node={GPUS_PER_NODE[gen]}" in text


def test_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", "-x", str(SCRIPTS / "slurm.sh"), *map(str, TEMPLATES)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("gen", list(GPUS_PER_NODE))
def test_dry_run_prints_the_exact_commands(tmp_path, gen: str) -> None:
    proc = run_template(gen, slurm_env(tmp_path), "L1", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    nproc, out = GPUS_PER_NODE[gen], tmp_path / "out"
    assert (f"[harness] slurm: L1 on 2 x {gen} nodes, {nproc} ranks each (world {2 * nproc}); rendezvous "
            "c10d at gpu-a01:24242, join_timeout 600s") in proc.stderr
    torchrun = str(pathlib.Path(sys.executable).parent / "torchrun")
    assert printed(proc.stderr, "running") == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        torchrun, "--nnodes=2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-a01:24242", "--rdzv-id=fsdp-harness-4242", "--rdzv-conf=join_timeout=600",
        "--max-restarts=0", "-m", "pytest", "-rfEs", "-p", "no:cacheprovider", "-o",
        f"junit_suite_name={gen}/L1_multinode", f"--junitxml={out}/{gen}/L1_multinode.xml",
        f"--harness-shared-dir={out}/{gen}/L1_multinode-job4242", "-m", "not slow",
        "tests/functional/test_multinode.py"]
    assert printed(proc.stderr, "then") == [
        sys.executable, "-m", "harness.report.signoff", "--junit", f"{out}/{gen}/L1_multinode.xml",
        "--out-dir", f"{out}/signoff-multinode", "--title", f"Sign-off: L1 on 2 x {gen} nodes ({nproc} ranks each)"]
    assert not out.exists()  # a dry run writes nothing


def test_dry_run_settings(tmp_path) -> None:
    """L2 runs slow cases too; the node count, port, join timeout, ranks per node, tests and extra
    pytest arguments come from the environment."""
    env = slurm_env(tmp_path, SLURM_NNODES="4", HARNESS_RDZV_PORT="29999", HARNESS_RDZV_JOIN_TIMEOUT="90",
                    HARNESS_NPROC_PER_NODE="3", HARNESS_SLURM_TESTS="tests/functional/seed tests/x.py",
                    HARNESS_PYTEST_ARGS="-x --harness-timeout=900", HARNESS_REQUIRED_REGRESSIONS="bugs.txt")
    proc = run_template("gb200", env, "L2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    words = printed(proc.stderr, "running")
    assert words[:2] == ["srun", "--nodes=4"] and "--nnodes=4" in words and "--nproc-per-node=3" in words
    assert "--rdzv-endpoint=gpu-a01:29999" in words and "--rdzv-conf=join_timeout=90" in words
    assert words.count("-m") == 1  # torchrun's "-m pytest" only: L2 deselects nothing
    assert words[-4:] == ["-x", "--harness-timeout=900", "tests/functional/seed", "tests/x.py"]
    assert printed(proc.stderr, "then")[-2:] == ["--require-regressions", "bugs.txt"]


@pytest.mark.parametrize(("args", "env_extra", "message"), [
    (("L3", "--dry-run"), {}, "tier must be one of L0, L1, L2 (got 'L3')"),
    (("L0", "--frobnicate"), {}, "unknown argument '--frobnicate'"),
    (("L0",), {"SLURM_JOB_ID": ""}, "not inside a Slurm job: submit with sbatch (or use --dry-run)"),
])
def test_usage_errors(tmp_path, args, env_extra, message) -> None:
    proc = run_template("h100", slurm_env(tmp_path, **env_extra), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_rendezvous_that_never_completes_fails_clearly_in_bounded_time(tmp_path) -> None:
    """Node 1 never starts: node 0's torchrun gives up after join_timeout, and the job says why and
    still writes a sign-off (FAIL: the run produced nothing)."""
    env = slurm_env(tmp_path, HARNESS_RDZV_HOST="127.0.0.1", HARNESS_RDZV_PORT=str(_free_port()),
                    HARNESS_RDZV_JOIN_TIMEOUT="10", FAKE_SRUN_SKIP_NODES="1")
    start = time.monotonic()
    proc = run_template("cpu", env, "L0", timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("no rank started pytest: the torchrun rendezvous (c10d at 127.0.0.1:" in proc.stderr
            and "2 nodes) did not complete within join_timeout=10s" in proc.stderr), proc.stderr[-3000:]
    assert "RendezvousTimeoutError" in proc.stderr  # torchrun's own account, above ours
    assert elapsed < 120, elapsed
    report = (tmp_path / "out" / "signoff-multinode" / "report.md").read_text()
    assert "## Verdict: FAIL" in report and "cpu/L0_multinode" in report
    print(f"rendezvous never completes: {elapsed:.0f} s")


def test_two_nodes_run_the_tier_into_one_junit_and_one_signoff(tmp_path) -> None:
    """The cpu template for real on 2 simulated nodes x 2 gloo ranks: the L0 multi-node selection
    (the DCP round trip across nodes) passes, rank 0 writes the one JUnit file into the shared
    results directory, and the sign-off says PASS."""
    env = slurm_env(tmp_path, HARNESS_RDZV_HOST="127.0.0.1", HARNESS_RDZV_PORT=str(_free_port()),
                    HARNESS_RDZV_JOIN_TIMEOUT="300")
    start = time.monotonic()
    proc = run_template("cpu", env, "L0", timeout=900)
    elapsed = time.monotonic() - start
    out = tmp_path / "out"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "tier L0 on 2 x cpu nodes: PASS" in proc.stderr
    assert (proc.stdout + proc.stderr).count("generated xml file") == 1
    assert (out / "cpu" / "L0_multinode.xml").exists() and (out / "cpu" / "L0_multinode.harness.json").exists()
    nodes = sorted(p.name for p in (out / "cpu" / "L0_multinode-job4242").glob("torchrun-*/node*"))
    assert [n.split("-")[0] for n in nodes] == ["node0", "node1"]
    report = (out / "signoff-multinode" / "report.md").read_text()
    assert "## Verdict: PASS" in report and "test_checkpoint_resume_across_nodes" in report
    print(f"cpu template, 2 nodes x 2 ranks, L0: {elapsed:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
