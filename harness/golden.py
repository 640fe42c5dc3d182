"""Golden values: short fixed-seed runs compared with reviewed per-platform files.

A test (marked ``golden``) records per-step series (a loss curve, a grad norm, a parameter
checksum) and calls ``golden.check(cell, series, tolerance)``; the file
``<golden dir>/<platform>/<cell>.json`` (``harness.golden_file``) holds the reviewed series and
the *fingerprint* of what decided their bits (``harness.numerics``). How they are compared:

- **exact**: the run's fingerprint equals the file's. Every step of every series must be within
  ``tolerance`` (relative; 0 = bit for bit).
- **band**: the fingerprints differ (another torch, BLAS, thread count, GPU ...). Never compared
  bit for bit: every step must be within the file's per-series ``band``, measured from the
  cross-platform spread (``harness.golden_band``), and the result names the difference. Outside
  the band the test fails naming it too.

A series in the file that the run no longer records is a drift. A missing, empty, damaged or
unknown-format file fails naming the file and the command that makes or repairs it. With
``--golden-update`` the new file is written to a uniquely named pending file by rank 0 and
published (one atomic rename, the last writer wins) only once the test passed on every rank;
its measured band is kept. Either way the comparison goes into the JUnit property ``golden``
(JSON; the sign-off's "Numerics vs golden" section, ``report.golden_view``).

The ``checkpoint_compat(fixture, check=...)`` marker names a test that loads a checkpoint
committed by an earlier version; it becomes the JUnit property ``checkpoint_compat`` at
collection (so a test that crashes still carries it).

Options reach spawned rank processes through the environment (``ENV_*``): the controller sets
them in ``pytest_configure``, and the ranks, which run their own pytest session without the
controller's command line, read them there.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness import golden_file, gpu_lease, numerics, protocol
from harness.golden_file import GoldenFile, GoldenFileError
from harness.gpu_generation import generation_of
from harness.report.junit_format import (
    CHECKPOINT_COMPAT_PROPERTY,
    GOLDEN_BAND,
    GOLDEN_DRIFT,
    GOLDEN_EXACT,
    GOLDEN_MATCH,
    GOLDEN_MISSING,
    GOLDEN_PROPERTY,
    GOLDEN_UPDATED,
    GoldenComparison,
    GoldenStatus,
)

MARKER = "golden: a golden cell: a fixed-seed run compared with the reviewed per-platform file (harness.golden)"
COMPAT_MARKER = ("checkpoint_compat(fixture, check='loads and continues its curve'): a test of a checkpoint "
                 "committed by an earlier version (JUnit property checkpoint_compat; harness.golden)")
_COMPAT_ADDED = pytest.StashKey[bool]()
ENV_UPDATE = "HARNESS_GOLDEN_UPDATE"
ENV_DIR = "HARNESS_GOLDEN_DIR"
ENV_PLATFORM = "HARNESS_GOLDEN_PLATFORM"
ENV_REVISION = "HARNESS_GIT_REVISION"  # the revision to record when the checkout has no (current) .git
PENDING_PROPERTY = "golden_pending"  # rank 0's unpublished update; consumed by the reporting process
DEFAULT_DIR = "tests/golden"
TINY = 1e-30  # denominators of relative drift (a golden value of exactly 0)
_PLATFORM_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp_harness_golden", "golden values (harness.golden)")
    group.addoption("--golden-update", action="store_true", default=False,
                    help="rewrite the golden files of the selected golden cells and print each change for review")
    group.addoption("--golden-dir", default=None,
                    help=f"directory of the golden files, relative to the rootdir (default {DEFAULT_DIR}; "
                         f"env {ENV_DIR})")
    group.addoption("--golden-platform", default=None,
                    help="platform whose files to use: cpu, or the GPU's generation (h100, h200, b200, gb200); "
                         f"a plain name; default: detected (env {ENV_PLATFORM})")


def check_platform_name(name: str, source: str) -> None:
    """Refuse a platform that is not a plain directory name (``../../x`` would write elsewhere)."""
    if not _PLATFORM_RE.fullmatch(name) or ".." in name:
        raise pytest.UsageError(f"{source}={name!r} is not a plain platform name: use letters, digits, '_', '-' "
                                "and '.', no path separators (e.g. cpu, h200)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    config.addinivalue_line("markers", COMPAT_MARKER)
    config.addinivalue_line("markers", numerics.MARKER)
    if config.getoption("golden_update", False):
        os.environ[ENV_UPDATE] = "1"
    golden_dir = config.getoption("golden_dir", None)
    if golden_dir:
        os.environ[ENV_DIR] = str((config.rootpath / golden_dir).resolve())
    platform = config.getoption("golden_platform", None)
    if platform:
        check_platform_name(platform, "--golden-platform")
        os.environ[ENV_PLATFORM] = platform
    elif os.environ.get(ENV_PLATFORM):
        check_platform_name(os.environ[ENV_PLATFORM], ENV_PLATFORM)


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
    with the CPU backend forced; else the GPU's generation from its name ("NVIDIA H200" -> ``h200``).
    ``--golden-platform`` overrides all of it. One ``cpu`` directory serves every CPU: pinned
    numerics (``harness.numerics``) make CPU bits portable, and a run whose fingerprint differs is
    compared within the measured band."""
    if os.environ.get(ENV_PLATFORM):
        return os.environ[ENV_PLATFORM]
    import torch

    if device_type == "cpu" or gpu_lease.cpu_forced() or not torch.cuda.is_available():
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


def versions() -> dict[str, str]:
    """Informational: torch, CUDA, NCCL, TransformerEngine (if imported) and the git revision
    (what decides the bits is the fingerprint)."""
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
    """One series of one cell against its golden values (``run`` None: the run did not record it)."""

    run: list[float] | None
    golden: list[float] | None
    tolerance: float
    max_rel_drift: float = 0.0
    first_drift_step: int | None = None

    def compare(self) -> None:
        if self.golden is None or self.run is None or len(self.golden) != len(self.run):
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
    status: GoldenStatus
    series: dict[str, SeriesDrift] = field(default_factory=dict)
    golden_versions: dict[str, str] = field(default_factory=dict)  # what the golden file was made with
    comparison: GoldenComparison = GOLDEN_EXACT
    fingerprint: dict[str, str] = field(default_factory=dict)  # this run's
    golden_fingerprint: dict[str, str] | None = None  # the file's (None: a format 1 file or no file)
    problem: str = ""  # why the comparison could not be made (a damaged file, no band)

    @property
    def fingerprint_diff(self) -> list[str]:
        if self.golden_fingerprint is None:
            return []
        return numerics.differences(self.golden_fingerprint, self.fingerprint)

    def as_json(self) -> str:
        return json.dumps({"cell": self.cell, "platform": self.platform, "path": self.path, "status": self.status,
                           "comparison": self.comparison, "fingerprint_diff": self.fingerprint_diff,
                           "fingerprint": self.fingerprint, "golden_fingerprint": self.golden_fingerprint,
                           "golden_versions": self.golden_versions, "problem": self.problem,
                           "series": {k: v.as_dict() for k, v in self.series.items()}})


def _tolerances(series: dict[str, list[float]], tolerance: float | dict[str, float]) -> dict[str, float]:
    if isinstance(tolerance, dict):
        missing = sorted(set(series) - set(tolerance))
        if missing:
            raise ValueError(f"golden.check: no tolerance for series {missing}")
        return {k: float(tolerance[k]) for k in series}
    return dict.fromkeys(series, float(tolerance))


@dataclass
class _Recording:
    """What ``Golden.recording`` saw while the run computed its series."""

    device_type: str
    ops: numerics.MachineDependentOps
    fingerprint: dict[str, str] | None = None


class Golden:
    """The ``golden`` fixture: ``recording(device)`` around the run, then ``check(cell, series)``."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        # Only an explicit --golden-dir travels through the environment (the default is found
        # from the rootdir, which every rank's session shares): nothing is set behind a test's back.
        self.directory = pathlib.Path(os.environ.get(ENV_DIR) or request.config.rootpath / DEFAULT_DIR)
        self.update = os.environ.get(ENV_UPDATE) == "1"
        self._recording: _Recording | None = None

    def platform(self, device_type: str | None = None) -> str:
        """The platform whose files a run on ``device_type`` compares with (``detect_platform``);
        without one, the test's process group decides (gloo: cpu), else the machine."""
        return detect_platform(device_type or run_device_type())

    def path(self, cell: str, device: object = None) -> pathlib.Path:
        """The golden file of ``cell`` for a run on ``device`` (as in ``check``)."""
        return self.directory / self.platform(_device_type(device)) / f"{cell}.json"

    @contextlib.contextmanager
    def recording(self, device: object = None) -> Iterator[None]:
        """Wrap the run that computes the series: the fingerprint is taken while it runs (its
        thread count, not the one restored after it), and on CPU the VML-backed operators it calls
        are counted (their bits follow the CPU, so they add the CPU kind to the fingerprint).

        A GPU fingerprint is taken after the run: reading the cuDNN version loads torch's cuDNN,
        and a TransformerEngine imported after that loads the system's cuDNN sub-libraries
        against it (seen on the H200 image: ``libcudnn_heuristic.so.9: undefined symbol``); after
        the run the TE version the run imported is known too."""
        device_type = _device_type(device) or run_device_type() or "cpu"
        record = _Recording(device_type, numerics.MachineDependentOps())
        on_cpu = device_type == "cpu"
        with record.ops if on_cpu else contextlib.nullcontext():
            before = numerics.fingerprint(device_type) if on_cpu else None
            yield
            fp = before if before is not None else numerics.fingerprint(device_type)
        if record.ops.threads is not None:  # the thread count the run's first operator saw
            fp["threads"] = str(record.ops.threads)
        record.fingerprint = numerics.with_machine_dependent(fp, record.ops.counts)
        self._recording = record

    def _run_fingerprint(self, device_type: str) -> dict[str, str]:
        rec = self._recording
        if rec is not None and rec.fingerprint is not None and rec.device_type == device_type:
            return rec.fingerprint
        return numerics.fingerprint(device_type)

    def check(self, cell: str, series: dict[str, list[float]], tolerance: float | dict[str, float] = 0.0,
              note: str = "", device: object = None, dtype: str = "") -> GoldenResult:
        """Compare ``series`` with the golden file of ``cell`` (or rewrite it under
        ``--golden-update``); record the comparison; fail on drift or a missing or damaged file.
        ``tolerance`` (relative, per series or one for all) applies where the fingerprints match
        and is written into the file on update with its reason in ``note``; ``dtype`` (``fp32``,
        ``bf16`` ...) is recorded for the band tool. ``device`` (a device or its type: "cpu",
        "cuda:0") is where the series were computed (default: the process group's backend, else
        the machine)."""
        tolerances = _tolerances(series, tolerance)
        path = self.path(cell, device)
        device_type = _device_type(device) or run_device_type() or ("cpu" if path.parent.name == "cpu" else "cuda")
        result = GoldenResult(cell, path.parent.name, str(path), GOLDEN_MATCH,
                              fingerprint=self._run_fingerprint(device_type))
        stored: GoldenFile | None = None
        try:
            stored = golden_file.read(path)
        except GoldenFileError as exc:
            result.problem = str(exc)
        if stored is not None:
            result.golden_versions = dict(stored.versions)
            result.golden_fingerprint = stored.fingerprint
        compare_with = _comparison_tolerances(result, stored, tolerances)
        for name in list(series) + [k for k in (stored.series if stored else {}) if k not in series]:
            run = [float(v) for v in series[name]] if name in series else None
            drift = SeriesDrift(run, stored.series.get(name) if stored else None, compare_with.get(name, 0.0))
            drift.compare()
            result.series[name] = drift
        if self.update:
            self._stage_update(result, stored, series, tolerances, note, dtype)
        elif stored is None and not result.problem:
            result.status = GOLDEN_MISSING
        elif result.problem or any(d.first_drift_step is not None for d in result.series.values()):
            result.status = GOLDEN_DRIFT
        self._request.node.user_properties.append((GOLDEN_PROPERTY, result.as_json()))
        _fail_unless_passed(result, self._request.node.nodeid)
        return result

    def _stage_update(self, result: GoldenResult, stored: GoldenFile | None, series: dict[str, list[float]],
                      tolerances: dict[str, float], note: str, dtype: str) -> None:
        """Rank 0 writes the new file as a pending write; the reporting process publishes it once
        every rank passed the test (``pytest_runtest_logreport``). The measured band is kept."""
        result.status = GOLDEN_UPDATED
        if not _is_writer():
            return
        path = pathlib.Path(result.path)
        content = GoldenFile(cell=result.cell, platform=result.platform, series=series, tolerance=tolerances,
                             versions=versions(), fingerprint=result.fingerprint, note=note,
                             dtype=dtype or (stored.dtype if stored else ""),
                             band=dict(stored.band) if stored else {}, band_note=stored.band_note if stored else "")
        pending = golden_file.write_pending(path, content)
        summary = _change_summary(result, stored is None, result.problem)
        self._request.node.user_properties.append(
            (PENDING_PROPERTY, json.dumps({"pending": str(pending), "path": str(path), "summary": summary})))


def _comparison_tolerances(result: GoldenResult, stored: GoldenFile | None,
                           tolerances: dict[str, float]) -> dict[str, float]:
    """Exact (the test's tolerances) where the fingerprints match or the file has none (format
    1); else the file's band, and ``result.problem`` names a series without one."""
    if stored is None or stored.fingerprint is None or stored.fingerprint == result.fingerprint:
        result.comparison = GOLDEN_EXACT
        return tolerances
    result.comparison = GOLDEN_BAND
    unbanded = sorted(k for k in tolerances if k not in stored.band)
    if unbanded:
        result.problem = (f"the fingerprint differs ({'; '.join(result.fingerprint_diff)}) and {result.path} holds no "
                          f"band for {unbanded}: run where the fingerprint matches, or measure a band "
                          "(python -m harness.golden_band)")
    return dict(stored.band)


def _fail_unless_passed(result: GoldenResult, nodeid: str) -> None:
    if result.status == GOLDEN_MISSING:
        pytest.fail(f"golden cell {result.cell!r} has no golden file for platform {result.platform!r} "
                    f"({result.path}); make it with `python -m pytest -m golden --golden-update {nodeid}` (or the "
                    "whole golden tier), review the printed values and commit the file", pytrace=False)
    if result.status == GOLDEN_DRIFT and result.problem:
        pytest.fail(f"golden cell {result.cell!r}: {result.problem}. `--golden-update` rewrites the file; review "
                    "the printed values before committing it", pytrace=False)
    if result.status == GOLDEN_DRIFT:
        pytest.fail(_drift_message(result), pytrace=False)


def _device_type(device: object) -> str | None:
    """``"cpu"`` / ``"cuda"`` of a ``torch.device`` or device string ("cuda:0"); None for None."""
    return None if device is None else str(device).split(":", 1)[0]


def _is_writer() -> bool:
    """Rank 0 of a distributed test, or a plain test."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Publish or discard pending golden writes, in the process that sees the whole test's
    outcome (the spawn-mode controller, or rank 0 under torchrun; never a rank's own report):
    published only if the test's call passed on every rank."""
    if protocol.run_mode() == protocol.RunMode.RANK:
        return
    # rank 0 alone records it, so a distributed test's report names it "rank0.golden_pending"
    pending = [(i, v) for i, (n, v) in enumerate(report.user_properties)
               if str(n) == PENDING_PROPERTY or str(n).endswith("." + PENDING_PROPERTY)]
    if not pending or report.when != "call":
        return
    for _, value in pending:
        entry = json.loads(str(value))
        if report.passed:
            golden_file.publish(pathlib.Path(entry["pending"]), pathlib.Path(entry["path"]))
            print("\n" + entry["summary"])
        else:
            golden_file.discard(pathlib.Path(entry["pending"]))
            print(f"\n[golden] {entry['path']} not updated: {report.nodeid} failed on some rank")
    drop = {i for i, _ in pending}
    report.user_properties = [p for i, p in enumerate(report.user_properties) if i not in drop]


def _change_summary(result: GoldenResult, new: bool, problem: str) -> str:
    if new and problem:
        return (f"[golden] {result.cell} ({result.platform}): replaced {result.path}, which could not be used "
                f"({problem})")
    if new:
        return f"[golden] {result.cell} ({result.platform}): new file {result.path}"
    lines = [f"[golden] {result.cell} ({result.platform}): rewrote {result.path}"]
    diff = result.fingerprint_diff
    if diff:
        lines.append("  fingerprint: " + "; ".join(diff))
    for name, d in result.series.items():
        if d.run is None:
            lines.append(f"  {name}: dropped (the run no longer records it)")
        elif d.first_drift_step is None and d.max_rel_drift == 0.0:
            lines.append(f"  {name}: unchanged")
        else:
            lines.append(f"  {name}: max relative change {d.max_rel_drift:.3g}, first at step {d.first_drift_step}")
    return "\n".join(lines)


def _drift_message(result: GoldenResult) -> str:
    parts = []
    for name, d in result.series.items():
        if d.first_drift_step is None:
            continue
        if d.run is None:
            parts.append(f"{name}: in the golden file but not recorded by this run")
            continue
        step = d.first_drift_step
        got = d.run[step] if step < len(d.run) else None
        want = d.golden[step] if d.golden is not None and step < len(d.golden) else None
        what = "band" if result.comparison == GOLDEN_BAND else "tolerance"
        parts.append(f"{name}: first drift at step {step} (run {got!r}, golden {want!r}), max relative drift "
                     f"{d.max_rel_drift:.3g} > {what} {d.tolerance:g}")
    how = ("compared within the measured band, the fingerprint differing: " + "; ".join(result.fingerprint_diff)
           if result.comparison == GOLDEN_BAND else "compared exactly (same fingerprint)")
    return (f"golden cell {result.cell!r} drifted from {result.path} ({result.platform}; {how}): " + "; ".join(parts)
            + ". If the change is intended, rerun with --golden-update and explain the diff in the commit")


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    """Compare a run's per-step series with the reviewed golden file (``Golden.check``)."""
    return Golden(request)
