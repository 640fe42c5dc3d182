"""Which directory of golden files a run compares with (``harness.golden.resolve_platform``): a
CPU kind's own files where the golden directory has them, else ``cpu``; an explicit platform as
given. Kinds exist because CPU kernels differ between kinds (measured: 1e-7..5e-3 relative drift
of the same code between an AVX-512 and an AVX2 AMD machine), so one set of bit-exact CPU files
cannot hold for every CI machine."""
from __future__ import annotations

import pathlib
import re

import pytest

from harness import golden


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    monkeypatch.delenv(golden.ENV_PLATFORM, raising=False)


def test_cpu_kind_names_capability_and_vendor() -> None:
    assert re.fullmatch(r"cpu-[a-z0-9_]+-[a-z0-9_]+", golden.cpu_kind()), golden.cpu_kind()


def test_cpu_without_kind_files_uses_cpu(cpu_only: None, tmp_path: pathlib.Path) -> None:
    (tmp_path / "cpu").mkdir()
    assert golden.resolve_platform(tmp_path) == "cpu"


def test_cpu_with_kind_files_uses_them(cpu_only: None, tmp_path: pathlib.Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / golden.cpu_kind()).mkdir()
    (tmp_path / "cpu-avx512-someone-else").mkdir()
    assert golden.resolve_platform(tmp_path) == golden.cpu_kind()


def test_explicit_platform_is_used_as_given(cpu_only: None, tmp_path: pathlib.Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / golden.cpu_kind()).mkdir()
    monkeypatch.setenv(golden.ENV_PLATFORM, "cpu")
    assert golden.resolve_platform(tmp_path) == "cpu"


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that reports an H200 (the CPU-only test machine pretends)."""
    import torch

    monkeypatch.delenv("HARNESS_FORCE_CPU", raising=False)
    monkeypatch.delenv(golden.ENV_PLATFORM, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")


def test_gpu_host_uses_its_generation(gpu_host: None, tmp_path: pathlib.Path) -> None:
    assert golden.resolve_platform(tmp_path) == "h200"
    assert golden.resolve_platform(tmp_path, "cuda") == "h200"


def test_cpu_run_on_a_gpu_host_uses_cpu_files(gpu_host: None, tmp_path: pathlib.Path) -> None:
    """A gloo cell on a one-GPU host computes on the CPU: it compares with the CPU files (it
    failed with "no golden file for platform 'h200'" before)."""
    (tmp_path / "cpu").mkdir()
    assert golden.resolve_platform(tmp_path, "cpu") == "cpu"
    (tmp_path / golden.cpu_kind()).mkdir()
    assert golden.resolve_platform(tmp_path, "cpu") == golden.cpu_kind()


def test_explicit_platform_wins_over_the_device(gpu_host: None, tmp_path: pathlib.Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(golden.ENV_PLATFORM, "h200")
    assert golden.resolve_platform(tmp_path, "cpu") == "h200"


def test_run_device_type_follows_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert golden.run_device_type() is None
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, want in (("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda")):
        monkeypatch.setattr(dist, "get_backend", lambda *_, b=backend: b)
        assert golden.run_device_type() == want, backend


def test_drift_names_a_different_toolchain() -> None:
    """A drift against a file made with another torch says so (CPU cells on the H200 host, torch
    2.11, drifted by up to 8e-6 from files made with torch 2.13); the same toolchain adds nothing."""
    made = {"torch": "2.13.0+cpu", "cuda": "None", "git": "abc"}
    note = golden._toolchain_note(made, {"torch": "2.11.0+cu130", "cuda": "13.0", "git": "def"})
    assert "torch 2.13.0+cpu (this run 2.11.0+cu130)" in note and "cuda None (this run 13.0)" in note
    assert "git" not in note
    assert golden._toolchain_note(made, {"torch": "2.13.0+cpu", "cuda": "None", "git": "def"}) == ""
