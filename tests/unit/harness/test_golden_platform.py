"""Which directory of golden files a run compares with (``harness.golden.detect_platform``): ``cpu``
for every CPU (pinned numerics make CPU bits portable, and a run whose fingerprint differs is
compared within the file's band), the GPU's generation on a GPU, an explicit platform as given; and
what a fingerprint holds (``harness.numerics``)."""
from __future__ import annotations

import re

import pytest

from harness import golden, numerics


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    monkeypatch.delenv(golden.ENV_PLATFORM, raising=False)


def test_every_cpu_uses_cpu(cpu_only: None) -> None:
    assert golden.detect_platform() == "cpu"
    assert golden.detect_platform("cpu") == "cpu"


def test_explicit_platform_is_used_as_given(cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(golden.ENV_PLATFORM, "h200")
    assert golden.detect_platform() == "h200"


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that reports an H200 (the CPU-only test machine pretends)."""
    import torch

    monkeypatch.delenv("HARNESS_FORCE_CPU", raising=False)
    monkeypatch.delenv(golden.ENV_PLATFORM, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")


def test_gpu_host_uses_its_generation(gpu_host: None) -> None:
    assert golden.detect_platform() == "h200"
    assert golden.detect_platform("cuda") == "h200"


def test_cpu_run_on_a_gpu_host_uses_cpu_files(gpu_host: None) -> None:
    """A gloo cell on a one-GPU host computes on the CPU: it compares with the CPU files (it
    failed with "no golden file for platform 'h200'" before)."""
    assert golden.detect_platform("cpu") == "cpu"


def test_explicit_platform_wins_over_the_device(gpu_host: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(golden.ENV_PLATFORM, "h200")
    assert golden.detect_platform("cpu") == "h200"


def test_run_device_type_follows_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert golden.run_device_type() is None
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, want in (("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda")):
        monkeypatch.setattr(dist, "get_backend", lambda *_, b=backend: b)
        assert golden.run_device_type() == want, backend


def test_a_cpu_fingerprint_names_what_decides_the_bits() -> None:
    import torch

    fp = numerics.cpu_fingerprint()
    assert set(fp) == {"numerics", "torch", "blas", "mkl_cbwr", "cpu_capability", "threads", "onednn"}
    assert fp["torch"] == torch.__version__ and fp["threads"] == str(torch.get_num_threads())
    assert fp["numerics"] == "default"  # this process was not started pinned
    assert re.fullmatch(r"[a-z0-9]+ (avx512|avx2|avx|sse4\.2|baseline)", numerics.cpu_kind()), numerics.cpu_kind()


def test_differences_name_each_changed_or_missing_key() -> None:
    made = {"torch": "2.13.0+cpu", "threads": "1", "onednn": "off"}
    now = {"torch": "2.11.0+cu130", "threads": "1", "cpu_kind": "amd avx2"}
    assert numerics.differences(made, now) == ["torch 2.13.0+cpu (this run 2.11.0+cu130)",
                                               "onednn off (this run absent)", "cpu_kind absent (this run amd avx2)"]
    assert numerics.differences(made, dict(made)) == []


def test_vml_operators_are_counted_and_results_unchanged() -> None:
    """``sqrt`` and ``pow(x, 0.5)`` of float32 CPU tensors reach MKL VML; bf16, ``pow(x, 2)`` and
    ``rsqrt`` do not. The mode changes no value."""
    import torch

    x = torch.rand(64, dtype=torch.float32) + 0.5
    plain = (x.sqrt(), x.pow(0.5), x.pow(2), x.rsqrt(), torch._foreach_sqrt([x])[0])
    with numerics.MachineDependentOps() as seen:
        counted = (x.sqrt(), x.pow(0.5), x.pow(2), x.rsqrt(), torch._foreach_sqrt([x])[0])
        x.bfloat16().sqrt()
    assert seen.counts == {"aten.sqrt": 1, "aten.pow": 1, "aten._foreach_sqrt": 1}, seen.counts
    assert seen.threads == torch.get_num_threads()
    assert all(torch.equal(a, b) for a, b in zip(plain, counted, strict=True))


def test_a_gpu_fingerprint_never_loads_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading cuDNN's version loads torch's cuDNN, and a TransformerEngine imported after it then
    fails to load (``libcudnn_heuristic.so.9: undefined symbol`` on the H200 image): the GPU
    fingerprint names cuDNN from its package instead."""
    import torch

    def loads_cudnn() -> int:
        raise AssertionError("gpu_fingerprint called torch.backends.cudnn.version()")

    monkeypatch.setattr(torch.backends.cudnn, "version", loads_cudnn)
    monkeypatch.setattr(numerics.environment, "cudnn_version", lambda: "9.19.0.56")
    assert numerics.gpu_fingerprint()["cudnn"] == "9.19.0.56"


def test_a_gpu_fingerprint_is_taken_after_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run may import TransformerEngine: its version belongs in the fingerprint, and nothing
    the fingerprint reads may run before the run's own imports."""
    import types

    recorder = golden.Golden.__new__(golden.Golden)
    recorder._recording = None
    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.20.2"  # type: ignore[attr-defined]
    monkeypatch.delitem(__import__("sys").modules, "transformer_engine", raising=False)
    with recorder.recording("cuda"):
        monkeypatch.setitem(__import__("sys").modules, "transformer_engine", te)
    assert recorder._run_fingerprint("cuda")["transformer_engine"] == "2.20.2"
