"""GPU leases on a CPU machine: fake GPU counts, real processes, real flocks.

The properties the harness relies on under ``pytest -n K``: two holders never share a
GPU id, an N-GPU request waits (holding nothing) until N are free, a SIGKILLed holder's
GPUs come back, and a timeout says what it waited for.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from harness import gpu_lease
from harness.gpu_lease import GpuLeaser, LeaseTimeoutError, NotEnoughGpusError

REPO = pathlib.Path(__file__).resolve().parents[3]
WORKER = pathlib.Path(__file__).with_name("lease_worker.py")
WAIT_S = 60.0  # generous: the machine is shared and may be slow


def start_worker(lock_dir: pathlib.Path, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args, "--lock-dir", str(lock_dir)],
        stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)


def read_acquired(proc: subprocess.Popen) -> list[int]:
    line = proc.stdout.readline()
    assert line.startswith("ACQUIRED "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return [int(x) for x in line.split()[1].split(",")]


def stop(proc: subprocess.Popen) -> None:
    """Let a ``hold`` worker release and exit; kill it if it does not."""
    try:
        proc.communicate(input="\n", timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


@pytest.fixture
def workers():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:  # never leave a worker behind, whatever failed
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_visible_gpu_count_from_env() -> None:
    assert gpu_lease.visible_gpu_count({"HARNESS_FAKE_GPUS": "6"}) == 6
    assert gpu_lease.visible_gpu_count({"HARNESS_FAKE_GPUS": "0"}) == 0
    assert gpu_lease.visible_gpu_count({"HARNESS_FORCE_CPU": "1"}) == 0
    assert gpu_lease.visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match=f"HARNESS_FAKE_GPUS must be a non-negative integer, got '{bad}'"):
            gpu_lease.visible_gpu_count({"HARNESS_FAKE_GPUS": bad})


def test_visible_gpu_count_from_nvidia_smi(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "nvidia-smi"
    lines = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})" for i in range(8))
    fake.write_text(f"#!/bin/sh\ncat <<'X'\n{lines}\n  MIG 1g.10gb Device 0: (UUID: MIG-0)\nX\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_lease.visible_gpu_count({}) == 8
    assert gpu_lease.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "2,3,-1,5"}) == 2
    assert gpu_lease.visible_gpu_count({"HARNESS_FORCE_CPU": "1"}) == 0


def test_cuda_visible_devices_maps_lease_ids(tmp_path) -> None:
    with GpuLeaser(tmp_path, 4).acquire(2) as lease:
        lease_ids = lease.gpu_ids
        assert lease.cuda_visible_devices({}) == "0,1"
        assert lease.cuda_visible_devices({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "4,5"
    assert lease_ids == [0, 1] and lease.released


def test_default_lock_dir() -> None:
    # per host: a lock directory on a shared filesystem keeps each node's leases apart
    assert gpu_lease.default_lock_dir({"HARNESS_LOCK_DIR": "/x/y"}) == pathlib.Path("/x/y") / socket.gethostname()
    assert gpu_lease.default_lock_dir({}).name == f"harness-gpu-locks-{os.getuid()}"


def test_bad_requests(tmp_path) -> None:
    leaser = GpuLeaser(tmp_path, 2)
    with pytest.raises(NotEnoughGpusError, match=r"needs 3 GPU\(s\) but only 2 visible on this node"):
        leaser.acquire(3, timeout_s=None)  # at once, not after waiting forever
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n must be a non-negative int"):
            leaser.acquire(bad)
    with pytest.raises(ValueError, match="timeout_s must be None or >= 0"):
        leaser.acquire(1, timeout_s=-1)
    with pytest.raises(ValueError, match="total_gpus must be a non-negative int"):
        GpuLeaser(tmp_path, -2)
    assert leaser.acquire(0).gpu_ids == []


def test_all_or_nothing_and_timeout_message(tmp_path) -> None:
    leaser = GpuLeaser(tmp_path, 4)
    first = leaser.acquire(3, timeout_s=0)
    assert first.gpu_ids == [0, 1, 2]
    with pytest.raises(LeaseTimeoutError) as exc:
        leaser.acquire(2, timeout_s=0.2)
    message = str(exc.value)
    assert "timed out after 0.2s waiting for 2 of 4 GPU(s)" in message
    assert f"GPU 0 by pid {os.getpid()}" in message and str(tmp_path) in message
    # the failed attempt took nothing: the one free GPU is still free
    with leaser.acquire(1, timeout_s=0) as last:
        assert last.gpu_ids == [3]
    first.release()
    first.release()  # idempotent
    with leaser.acquire(4, timeout_s=0) as everything:
        assert everything.gpu_ids == [0, 1, 2, 3]


def test_concurrent_holders_never_share_a_gpu(tmp_path, workers) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    for seed in range(4):
        workers.append(start_worker(tmp_path / "locks", "churn", "--total", "4", "-n", "3",
                                    "--rounds", "12", "--markers", str(markers),
                                    "--seed", str(seed)))
    for proc in workers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip().endswith("DONE"), (out, err)
    assert list(markers.iterdir()) == []


def test_four_gpu_request_waits_until_four_are_free(tmp_path, workers) -> None:
    locks = tmp_path / "locks"
    holder = start_worker(locks, "hold", "--total", "4", "-n", "1")
    workers.append(holder)
    assert read_acquired(holder) == [0]
    with pytest.raises(LeaseTimeoutError):
        GpuLeaser(locks, 4).acquire(4, timeout_s=0.3)
    waiter_out = tmp_path / "waiter.out"
    with waiter_out.open("w") as sink:
        waiter = start_worker(locks, "hold", "--total", "4", "-n", "4", stdout=sink)
    workers.append(waiter)
    time.sleep(1.0)
    assert waiter.poll() is None and waiter_out.read_text() == ""  # still waiting
    # while it waits it holds nothing: three GPUs are free for a small request
    with GpuLeaser(locks, 4).acquire(3, timeout_s=WAIT_S) as small:
        assert small.gpu_ids == [1, 2, 3]
    stop(holder)
    deadline = time.monotonic() + WAIT_S
    while "ACQUIRED" not in waiter_out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiter_out.read_text().startswith("ACQUIRED 0,1,2,3")
    stop(waiter)
    assert waiter.returncode == 0


def test_sigkilled_holder_frees_its_gpus(tmp_path, workers) -> None:
    locks = tmp_path / "locks"
    holder = start_worker(locks, "hold", "--total", "4", "-n", "4")
    workers.append(holder)
    assert read_acquired(holder) == [0, 1, 2, 3]
    leaser = GpuLeaser(locks, 4)
    with pytest.raises(LeaseTimeoutError, match=f"GPU 3 by pid {holder.pid}"):
        leaser.acquire(1, timeout_s=0.1)
    holder.kill()  # SIGKILL: no chance to release
    holder.wait(timeout=WAIT_S)
    with leaser.acquire(4, timeout_s=WAIT_S) as lease:
        assert lease.gpu_ids == [0, 1, 2, 3]


def test_lock_files_name_physical_gpus_across_masks(tmp_path) -> None:
    """Sessions with masks 0,1 and 1,2 share physical GPU 1; masks 0,1 and 2,3 share nothing."""
    first = GpuLeaser(tmp_path, 2, device_names=["0", "1"])
    overlapping = GpuLeaser(tmp_path, 2, device_names=["1", "2"])
    disjoint = GpuLeaser(tmp_path, 2, device_names=["2", "3"])
    with first.acquire(2, timeout_s=0):
        with pytest.raises(LeaseTimeoutError):
            overlapping.acquire(2, timeout_s=0.1)
        with overlapping.acquire(1, timeout_s=0) as one:
            assert one.gpu_ids == [1]  # index 1 of its mask: physical GPU 2
    with disjoint.acquire(2, timeout_s=0) as other, first.acquire(2, timeout_s=0) as mine:
        assert other.gpu_ids == mine.gpu_ids == [0, 1]
    with pytest.raises(ValueError, match="device_names must be 2 distinct names"):
        GpuLeaser(tmp_path, 2, device_names=["0", "0"])


def test_default_device_names_come_from_cuda_visible_devices(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa/1,3")
    a = GpuLeaser(tmp_path, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    b = GpuLeaser(tmp_path, 1)
    with a.acquire(2, timeout_s=0):
        with pytest.raises(LeaseTimeoutError):
            b.acquire(1, timeout_s=0.1)  # physical GPU 3 is held through a's index 1
    assert sorted(p.name for p in tmp_path.glob("gpu-*.lock")) == ["gpu-3.lock", "gpu-GPU-aa_1.lock"]


def test_force_cpu_has_one_reader_with_one_meaning() -> None:
    """``HARNESS_FORCE_CPU``: empty or ``0`` is off, anything else on, for every reader (the backend
    choice, the GPU count and the golden platform all ask ``gpu_lease.cpu_forced``)."""
    assert [gpu_lease.cpu_forced({"HARNESS_FORCE_CPU": v}) for v in ("", "0", "1", "yes")] == [False, False, True, True]
    assert gpu_lease.cpu_forced({}) is False
    assert gpu_lease.visible_gpu_count({"HARNESS_FORCE_CPU": "yes", "CUDA_VISIBLE_DEVICES": "0"}) == 0
