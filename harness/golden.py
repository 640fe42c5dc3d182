"""Golden values: short fixed-seed runs compared with reviewed per-platform files.

A test (marked ``golden``) records per-step series (a loss curve, a grad norm, a parameter
checksum) and calls ``golden.check(cell, series, tolerance)``. The file
``<golden dir>/<platform>/<cell>.json`` holds the reviewed series, the tolerance and the versions
they were made with. Without ``--golden-update`` the run is compared with it: every step of
every series must be within ``tolerance`` (relative; 0 = bit for bit), else the test fails naming
the first drifting step; a missing file fails naming the command that makes it. With
``--golden-update`` the file is rewritten (by rank 0 of a distributed test) and the change
against the old file is printed for review. Either way the comparison goes into the JUnit
property ``golden`` (JSON; the sign-off's "Numerics vs golden" section, ``report.golden_view``,
shows it with a plot of each drifting cell).

The ``checkpoint_compat(fixture, check=...)`` marker names a test that loads a checkpoint
committed by an earlier version; it becomes the JUnit property ``checkpoint_compat`` at collection
(so a test that crashes still carries it), which the sign-off's "Checkpoint compatibility"
section lists.

Options reach spawned rank processes through the environment (``ENV_*``): the controller sets
them in ``pytest_configure``, and the ranks, which run their own pytest session without the
controller's command line, read them there.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.gpu_generation import generation_of
from harness.report.junit_format import (
    CHECKPOINT_COMPAT_PROPERTY,
    GOLDEN_DRIFT,
    GOLDEN_MATCH,
    GOLDEN_MISSING,
    GOLDEN_PROPERTY,
    GOLDEN_UPDATED,
)

MARKER = "golden: a golden cell: a fixed-seed run compared with the reviewed per-platform file (harness.golden)"
COMPAT_MARKER = ("checkpoint_compat(fixture, check='loads and continues its curve'): a test of a checkpoint "
                 "committed by an earlier version (JUnit property checkpoint_compat; harness.golden)")
_COMPAT_ADDED = pytest.StashKey[bool]()
ENV_UPDATE = "HARNESS_GOLDEN_UPDATE"
ENV_DIR = "HARNESS_GOLDEN_DIR"
ENV_PLATFORM = "HARNESS_GOLDEN_PLATFORM"
ENV_REVISION = "HARNESS_GIT_REVISION"  # the revision to record when the checkout has no (current) .git
DEFAULT_DIR = "tests/golden"
FORMAT = 1
TINY = 1e-30  # denominators of relative drift (a golden value of exactly 0)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp_harness_golden", "golden values (harness.golden)")
    group.addoption("--golden-update", action="store_true", default=False,
                    help="rewrite the golden files of the selected golden cells and print each change for review")
    group.addoption("--golden-dir", default=None,
                    help=f"directory of the golden files, relative to the rootdir (default {DEFAULT_DIR}; "
                         f"env {ENV_DIR})")
    group.addoption("--golden-platform", default=None,
                    help="platform whose files to use: cpu, a CPU kind (cpu-avx2-amd: harness.golden.cpu_kind), "
                         "or the GPU's generation (h100, h200, b200, gb200); default: detected, a CPU kind's "
                         f"files where the golden dir has them (env {ENV_PLATFORM})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    config.addinivalue_line("markers", COMPAT_MARKER)
    if config.getoption("golden_update", False):
        os.environ[ENV_UPDATE] = "1"
    golden_dir = config.getoption("golden_dir", None)
    if golden_dir:
        os.environ[ENV_DIR] = str((config.rootpath / golden_dir).resolve())
    platform = config.getoption("golden_platform", None)
    if platform:
        os.environ[ENV_PLATFORM] = platform


def compat_property(item: pytest.Item) -> tuple[str, str] | None:
    """The ``checkpoint_compat`` property of ``item`` (from its closest mark), or None."""
    mark = item.get_closest_marker("checkpoint_compat")
    if mark is None:
        return None
    fixture = mark.args[0] if mark.args else mark.kwargs.get("fixture", item.name)
    check = mark.args[1] if len(mark.args) > 1 else mark.kwargs.get("check", "loads and continues its curve")
    return CHECKPOINT_COMPAT_PROPERTY, json.dumps({"fixture": str(fixture), "check": str(check)})


def pytest_itemcollected(item: pytest.Item) -> None:
    """Attach ``checkpoint_compat`` at collection: the controller's report keeps it even when a rank dies."""
    if item.stash.get(_COMPAT_ADDED, False):
        return
    item.stash[_COMPAT_ADDED] = True
    prop = compat_property(item)
    if prop is not None:
        item.user_properties.append(prop)


def detect_platform(device_type: str | None = None) -> str:
    """``cpu`` when the run's tensors live on the CPU (``device_type="cpu"``: a gloo cell on a GPU
    host computes with the CPU's kernels, so it compares with CPU files), without a visible GPU, or
    with the CPU backend forced; else the GPU's generation from its name ("NVIDIA H200" -> ``h200``,
    "NVIDIA GB200" -> ``gb200``). ``--golden-platform`` overrides all of it."""
    if os.environ.get(ENV_PLATFORM):
        return os.environ[ENV_PLATFORM]
    import torch

    if (device_type == "cpu" or os.environ.get("HARNESS_FORCE_CPU") == "1"
            or not torch.cuda.is_available()):
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    return generation_of(name) or name.replace("nvidia", "").strip().replace(" ", "_") or "gpu"


def run_device_type() -> str | None:
    """Where a distributed test's tensors live, from its default process group: ``cpu`` when no
    backend of it can drive a GPU (gloo alone), ``cuda`` otherwise; None outside a process group
    (then the machine decides)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend()).lower()
    return "cuda" if any(b in backend for b in ("nccl", "cuda")) else "cpu"


def cpu_kind() -> str:
    """``cpu-<ATen CPU capability>-<vendor>``, e.g. ``cpu-avx2-amd``. The capability and the vendor
    pick the CPU kernels (vectorised reductions, BLAS paths), whose summation order differs: the
    same code and torch measured 1e-7 to 4e-5 relative drift on fp32 cells and 5e-3 on a bf16 cell
    between the AVX-512 machine that made ``cpu/`` and an AVX2 AMD machine."""
    import platform as platform_module

    import torch

    capability = str(torch.backends.cpu.get_cpu_capability()).lower()
    vendor = _cpu_vendor() or platform_module.machine().lower() or "unknown"
    return f"cpu-{capability}-{vendor}"


def _cpu_vendor() -> str | None:
    """``intel`` / ``amd`` (else the raw ``vendor_id``) from /proc/cpuinfo; None where absent."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    raw = line.split(":", 1)[1].strip()
                    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(raw, raw.lower() or None)
    except OSError:
        return None
    return None


def resolve_platform(directory: pathlib.Path, device_type: str | None = None) -> str:
    """The directory of files to compare with: ``detect_platform(device_type)``, except that a
    detected ``cpu`` becomes this machine's CPU kind (``cpu_kind()``) where ``directory`` holds
    files for it; ``cpu`` then stays the files of the kind that made them first. An explicit
    ``--golden-platform`` is used as given (``--golden-platform cpu-avx2-amd --golden-update``
    makes a kind's files)."""
    platform = detect_platform(device_type)
    if platform == "cpu" and not os.environ.get(ENV_PLATFORM):
        kind = cpu_kind()
        if (directory / kind).is_dir():
            return kind
    return platform


def versions() -> dict[str, str]:
    """What the numbers depend on: torch, CUDA, NCCL, TransformerEngine (if imported) and the
    checkout's git revision."""
    import sys

    import torch

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    te = sys.modules.get("transformer_engine")
    if te is not None:
        out["transformer_engine"] = str(getattr(te, "__version__", "?"))
    out["git"] = os.environ.get(ENV_REVISION) or _git_revision()
    return out


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return rev.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass
class SeriesDrift:
    """One series of one cell against its golden values."""

    run: list[float]
    golden: list[float] | None
    tolerance: float
    max_rel_drift: float = 0.0
    first_drift_step: int | None = None

    def compare(self) -> None:
        if self.golden is None or len(self.golden) != len(self.run):
            self.max_rel_drift, self.first_drift_step = math.inf, 0
            return
        for step, (got, want) in enumerate(zip(self.run, self.golden, strict=True)):
            drift = 0.0 if got == want else abs(got - want) / max(abs(want), TINY)
            if math.isnan(got) != math.isnan(want) or (not math.isnan(got) and drift > self.tolerance):
                if self.first_drift_step is None:
                    self.first_drift_step = step
            if not math.isnan(drift):
                self.max_rel_drift = max(self.max_rel_drift, drift)

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "golden": self.golden, "tolerance": self.tolerance,
                "max_rel_drift": self.max_rel_drift if math.isfinite(self.max_rel_drift) else None,
                "first_drift_step": self.first_drift_step}


@dataclass
class GoldenResult:
    cell: str
    platform: str
    path: str
    status: str  # one of junit_format.GOLDEN_STATUSES
    series: dict[str, SeriesDrift] = field(default_factory=dict)
    golden_versions: dict[str, str] = field(default_factory=dict)  # what the golden file was made with

    def as_json(self) -> str:
        return json.dumps({"cell": self.cell, "platform": self.platform, "path": self.path, "status": self.status,
                           "golden_versions": self.golden_versions,
                           "series": {k: v.as_dict() for k, v in self.series.items()}})


def _tolerances(series: dict[str, list[float]], tolerance: float | dict[str, float]) -> dict[str, float]:
    if isinstance(tolerance, dict):
        missing = sorted(set(series) - set(tolerance))
        if missing:
            raise ValueError(f"golden.check: no tolerance for series {missing}")
        return {k: float(tolerance[k]) for k in series}
    return dict.fromkeys(series, float(tolerance))


class Golden:
    """The ``golden`` fixture: ``check(cell, series, tolerance=0.0)``."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        # Only an explicit --golden-dir travels through the environment (the default is found
        # from the rootdir, which every rank's session shares): nothing is set behind a test's back.
        self.directory = pathlib.Path(os.environ.get(ENV_DIR) or request.config.rootpath / DEFAULT_DIR)
        self.update = os.environ.get(ENV_UPDATE) == "1"

    def platform(self, device_type: str | None = None) -> str:
        """The platform whose files a run on ``device_type`` compares with (``resolve_platform``);
        without one, the test's process group decides (gloo: cpu), else the machine."""
        return resolve_platform(self.directory, device_type or run_device_type())

    def path(self, cell: str, device: object = None) -> pathlib.Path:
        """The golden file of ``cell`` for a run on ``device`` (as in ``check``)."""
        return self.directory / self.platform(_device_type(device)) / f"{cell}.json"

    def check(self, cell: str, series: dict[str, list[float]], tolerance: float | dict[str, float] = 0.0,
              note: str = "", device: object = None) -> GoldenResult:
        """Compare ``series`` with the golden file of ``cell`` (or rewrite it under
        ``--golden-update``); record the comparison; fail on drift or a missing file.
        ``tolerance`` (relative, per series or one for all) is written into the file on update,
        and its reason into ``note``: a reviewer sees both next to the numbers. ``device`` (a
        device or its type: "cpu", "cuda:0") is where the series were computed: a CPU run on a GPU
        host compares with CPU files (default: the process group's backend, else the machine)."""
        tolerances = _tolerances(series, tolerance)
        path = self.path(cell, device)
        platform = path.parent.name
        stored = json.loads(path.read_text()) if path.exists() else None
        result = GoldenResult(cell, platform, str(path), GOLDEN_MATCH,
                              golden_versions=dict(stored.get("versions", {})) if stored else {})
        for name, values in series.items():
            old = None if stored is None else stored["series"].get(name)
            drift = SeriesDrift([float(v) for v in values], old, tolerances[name])
            drift.compare()
            result.series[name] = drift
        if self.update:
            result.status = GOLDEN_UPDATED
            if _is_writer():
                _write(path, cell, platform, series, tolerances, note)
                print(_change_summary(result, stored is None))
        elif stored is None:
            result.status = GOLDEN_MISSING
        elif any(d.first_drift_step is not None for d in result.series.values()):
            result.status = GOLDEN_DRIFT
        self._request.node.user_properties.append((GOLDEN_PROPERTY, result.as_json()))
        if result.status == GOLDEN_MISSING:
            pytest.fail(f"golden cell {cell!r} has no golden file for platform {platform!r} ({path}); make it "
                        f"with `python -m pytest -m golden --golden-update {self._request.node.nodeid}` (or the "
                        "whole golden tier), review the printed values and commit the file", pytrace=False)
        if result.status == GOLDEN_DRIFT:
            pytest.fail(_drift_message(result), pytrace=False)
        return result


def _device_type(device: object) -> str | None:
    """``"cpu"`` / ``"cuda"`` of a ``torch.device`` or device string ("cuda:0"); None for None."""
    return None if device is None else str(device).split(":", 1)[0]


def _is_writer() -> bool:
    """Rank 0 of a distributed test, or a plain test."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _write(path: pathlib.Path, cell: str, platform: str, series: dict[str, list[float]],
           tolerances: dict[str, float], note: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "cell": cell, "platform": platform, "versions": versions(), "note": note,
            "tolerance": tolerances, "series": {k: [float(v) for v in vs] for k, vs in series.items()}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)


def _change_summary(result: GoldenResult, new: bool) -> str:
    if new:
        return f"[golden] {result.cell} ({result.platform}): new file {result.path}"
    lines = [f"[golden] {result.cell} ({result.platform}): rewrote {result.path}"]
    for name, d in result.series.items():
        if d.first_drift_step is None and d.max_rel_drift == 0.0:
            lines.append(f"  {name}: unchanged")
        else:
            lines.append(f"  {name}: max relative change {d.max_rel_drift:.3g}, first at step {d.first_drift_step}")
    return "\n".join(lines)


def _drift_message(result: GoldenResult) -> str:
    parts = []
    for name, d in result.series.items():
        if d.first_drift_step is None:
            continue
        step = d.first_drift_step
        got = d.run[step] if step < len(d.run) else None
        want = d.golden[step] if d.golden is not None and step < len(d.golden) else None
        parts.append(f"{name}: first drift at step {step} (run {got!r}, golden {want!r}), max relative drift "
                     f"{d.max_rel_drift:.3g} > tolerance {d.tolerance:g}")
    return (f"golden cell {result.cell!r} drifted from {result.path} ({result.platform}): " + "; ".join(parts)
            + ". If the change is intended, rerun with --golden-update and explain the diff in the commit"
            + _toolchain_note(result.golden_versions, versions()))


# What the numbers depend on besides our code: a drift under another of these is expected.
TOOLCHAIN_KEYS = ("torch", "cuda", "nccl", "transformer_engine")


def _toolchain_note(made_with: dict[str, str], now: dict[str, str]) -> str:
    """Names the toolchain differences between the golden file and this run (seen: CPU cells on
    a GPU host with torch 2.11 drift by up to 8e-6 from files made with torch 2.13), so a drift
    from another toolchain is not read as a regression of the code."""
    diffs = [f"{k} {made_with[k]} (this run {now.get(k, 'absent')})" for k in TOOLCHAIN_KEYS
             if k in made_with and made_with[k] != now.get(k, "absent")]
    if not diffs:
        return ""
    return (". The file was made with " + ", ".join(diffs) + ": another toolchain changes the kernels, "
            "so compare on the toolchain that made the file, or make and review files of a platform of "
            "this machine's own (--golden-platform NAME --golden-update)")


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    """Compare a run's per-step series with the reviewed golden file (``Golden.check``)."""
    return Golden(request)
