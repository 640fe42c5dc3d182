"""Parse and validate the harness markers on a collected item.

Validation happens at collection time so that bad use (a non-int world size, conflicting markers, a
fixture that cannot live in a rank process) is a collection error instead of a hang at run time.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

DISTRIBUTED = "distributed"
REQUIRES_CUDA = "requires_cuda"
REQUIRES_GPU_ARCH = "requires_gpu_arch"
REQUIRES_MODULE = "requires_module"
PINNED_NUMERICS = "pinned_numerics"  # harness.numerics.MARK_NAME (spec imports nothing of the harness)

# Fixtures that only make sense in the controller process: they drive or describe the controller's own
# pytest session (pytester, xdist worker identity), so a rank process would get a meaningless copy.
CONTROLLER_ONLY_FIXTURES = ("pytester", "testdir", "worker_id", "testrun_uid")

# Per-test timeout and a bucket's start-up allowance (until every rank is ready), per backend, in seconds.
DEFAULT_TIMEOUT_S = {"gloo": 120.0, "nccl": 300.0}
DEFAULT_STARTUP_S = {"gloo": 120.0, "nccl": 300.0}

_ARCH_RE = re.compile(r"^sm_?(\d)(\d+)a?$")


class HarnessUsageError(Exception):
    """Bad use of a harness marker; raised during collection with a message naming the argument."""


@dataclasses.dataclass(frozen=True)
class DistSpec:
    """What one distributed test asks for: a world size, an optional bucket name and timeout."""

    world_size: int
    bucket: str | None
    timeout: float | None


SPEC_KEY = pytest.StashKey[DistSpec]()
"""Where the plugin stores a distributed item's DistSpec (``item.stash``); absent on other items."""


def _parse_distributed_args(mark: pytest.Mark, nodeid: str) -> DistSpec:
    """Turn one ``distributed`` mark into a DistSpec, rejecting unknown or ill-typed arguments."""
    allowed = ("world_size", "bucket", "timeout")
    if len(mark.args) > 1:
        raise HarnessUsageError(f"{nodeid}: distributed() takes at most one positional argument (world_size)")
    kwargs = dict(mark.kwargs)
    if mark.args:
        if "world_size" in kwargs:
            raise HarnessUsageError(f"{nodeid}: distributed() got world_size both positionally and by name")
        kwargs["world_size"] = mark.args[0]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise HarnessUsageError(f"{nodeid}: distributed() got unknown argument(s) {unknown}; allowed: {list(allowed)}")
    if "world_size" not in kwargs:
        raise HarnessUsageError(f"{nodeid}: distributed() requires world_size=N (an int >= 1)")
    ws = kwargs["world_size"]
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise HarnessUsageError(f"{nodeid}: distributed(world_size={ws!r}) is invalid; world_size must be an int >= 1")
    bucket = kwargs.get("bucket")
    if bucket is not None and (not isinstance(bucket, str) or not bucket):
        raise HarnessUsageError(
            f"{nodeid}: distributed(bucket={bucket!r}) is invalid; bucket must be a non-empty str or None")
    timeout = kwargs.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise HarnessUsageError(
            f"{nodeid}: distributed(timeout={timeout!r}) is invalid; timeout must be a number > 0 or None")
    return DistSpec(world_size=ws, bucket=bucket, timeout=None if timeout is None else float(timeout))


def distributed_spec(item: pytest.Item) -> DistSpec | None:
    """The item's DistSpec (closest mark wins), or None for a single-process test.

    Two ``distributed`` marks at the same level (e.g. stacked decorators) that disagree are a conflict.
    """
    marks = list(item.iter_markers(DISTRIBUTED))
    if not marks:
        return None
    specs = [_parse_distributed_args(m, item.nodeid) for m in marks]
    own = [_parse_distributed_args(m, item.nodeid) for m in getattr(item, "own_markers", []) if m.name == DISTRIBUTED]
    if len(set(own)) > 1:
        raise HarnessUsageError(f"{item.nodeid}: conflicting distributed markers on the same test: {own}")
    if item.get_closest_marker("forked") is not None:
        raise HarnessUsageError(
            f"{item.nodeid}: markers 'distributed' and 'forked' conflict; "
            "a distributed test already runs in its own processes"
        )
    return specs[0]


def parse_gpu_arch(arch: object, nodeid: str) -> tuple[int, int]:
    """``"sm90"`` / ``"sm_90"`` / ``"sm100a"`` -> (major, minor) compute capability."""
    m = _ARCH_RE.match(arch) if isinstance(arch, str) else None
    if not m:
        raise HarnessUsageError(
            f"{nodeid}: requires_gpu_arch({arch!r}) is invalid; expected a string like 'sm80', 'sm90', 'sm100'")
    digits = m.group(1) + m.group(2)
    return int(digits[:-1]), int(digits[-1])


def validate_item(item: pytest.Item, forbidden_fixtures: tuple[str, ...]) -> DistSpec | None:
    """Check every harness marker of ``item``; return its DistSpec. Raises HarnessUsageError."""
    spec = distributed_spec(item)
    for mark in item.iter_markers(REQUIRES_GPU_ARCH):
        if len(mark.args) != 1 or mark.kwargs:
            raise HarnessUsageError(f"{item.nodeid}: requires_gpu_arch takes exactly one argument like 'sm90'")
        parse_gpu_arch(mark.args[0], item.nodeid)
    for mark in item.iter_markers(REQUIRES_MODULE):
        if not mark.args or mark.kwargs or not all(isinstance(a, str) and a for a in mark.args):
            raise HarnessUsageError(f"{item.nodeid}: requires_module takes one or more module names (str)")
    if spec is None and item.get_closest_marker(PINNED_NUMERICS) is not None:
        raise HarnessUsageError(
            f"{item.nodeid}: pinned_numerics needs distributed(world_size=N): the harness starts rank processes "
            "with the pinned environment; a test in the pytest process cannot change the CPU kernels torch "
            "already picked")
    if spec is not None:
        names = getattr(item, "fixturenames", ())
        bad = [f for f in names if f in forbidden_fixtures]
        if bad:
            raise HarnessUsageError(
                f"{item.nodeid}: distributed test requests fixture(s) {bad} that cannot cross into rank processes "
                f"(controller-only fixtures: {sorted(forbidden_fixtures)})"
            )
    return spec


def resolve_timeout(config: pytest.Config, spec: DistSpec | None, backend: str) -> float:
    """Seconds one test may run (``spec`` None: an unmarked test under torchrun): the marker's
    ``timeout=``, else ``--harness-timeout``, else ini ``harness_timeout``, else the backend's default."""
    if spec is not None and spec.timeout is not None:
        return spec.timeout
    opt = config.getoption("harness_timeout") or config.getini("harness_timeout")
    return float(opt) if opt else DEFAULT_TIMEOUT_S[backend]


def resolve_startup_timeout(config: pytest.Config, backend: str) -> float:
    """Seconds a bucket's ranks may take to start: ``--harness-startup-timeout``, else the default."""
    return float(config.getoption("harness_startup_timeout") or DEFAULT_STARTUP_S[backend])
