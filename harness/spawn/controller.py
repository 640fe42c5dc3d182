"""The controller plugin (spawn mode): bucket distributed tests and run each bucket in rank processes.

Runs in the pytest process (or in each xdist worker). Non-distributed tests are untouched.
"""
from __future__ import annotations

import atexit
import dataclasses
import pathlib
import re
import signal
import threading
from collections.abc import Generator
from typing import Any

import pytest

from harness import backend as backend_mod
from harness import gpu_lease, node_ids, numerics
from harness.combine import ReportBuilder, needs_restart, warn_state_changes
from harness.protocol import SIGNAL_NAME_ATTR
from harness.spawn import procs as procs_mod
from harness.spawn.bucket import Bucket, BucketSetup, TestOutcome
from harness.spec import SPEC_KEY, DistSpec, resolve_startup_timeout, resolve_timeout


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """Identity of a bucket: its name (default: the module's node id), world size and whether its
    ranks start with pinned numerics (``harness.numerics``: an environment fixed at process start)."""

    name: str
    world_size: int
    pinned: bool = False

    @property
    def label(self) -> str:
        """Also the xdist group name; xdist splits node ids at the last '@', so it must contain none."""
        return f"{self.name.replace('@', '_')}::ws{self.world_size}" + ("::pinned" if self.pinned else "")


BUCKET_KEY = pytest.StashKey[BucketKey]()
ORIG_NODEID_KEY = pytest.StashKey[str]()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[-80:]


def bucket_key(item: pytest.Item, spec: DistSpec) -> BucketKey:
    name = spec.bucket if spec.bucket is not None else item.nodeid.split("::", 1)[0]
    return BucketKey(name=name, world_size=spec.world_size, pinned=numerics.wants_pinned(item))


def order_by_bucket(items: list[pytest.Item]) -> None:
    """Make each bucket's items contiguous (at its first item's position), keeping all other order."""
    groups: dict[BucketKey, list[pytest.Item]] = {}
    slots: list[Any] = []
    for item in items:
        key = item.stash.get(BUCKET_KEY, None)
        if key is None:
            slots.append(item)
        elif key not in groups:
            groups[key] = [item]
            slots.append(key)
        else:
            groups[key].append(item)
    items[:] = [x for s in slots for x in (groups[s] if isinstance(s, BucketKey) else [s])]


class Controller:
    """Spawn-mode controller: one active bucket at a time, torn down when the bucket's items end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.active: Bucket | None = None
        self.active_key: BucketKey | None = None
        self.active_lease: gpu_lease.Lease | None = None
        self.bucket_count = 0
        self.test_count = 0
        self._root: pathlib.Path | None = None
        self._item_index: dict[int, int] | None = None  # id(item) -> position in session.items
        atexit.register(self.shutdown)
        self._previous_sigterm = _interrupt_on_sigterm()

    # ----- collection ---------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        for item in items:
            spec = item.stash.get(SPEC_KEY, None)
            missing = backend_mod.missing_requirements(item, config, spec.world_size if spec else None)
            if missing:
                item.add_marker(pytest.mark.skip(reason="missing requirement(s): " + "; ".join(missing)))
            if spec is None:
                continue
            key = bucket_key(item, spec)
            item.stash[BUCKET_KEY] = key
            item.stash[ORIG_NODEID_KEY] = item.nodeid
            item.add_marker(pytest.mark.xdist_group(name=key.label))
        order_by_bucket(items)

    # ----- directories ----------------------------------------------------------------------------
    def root(self) -> pathlib.Path:
        """The controller's working directory for bucket logs and shared test directories."""
        if self._root is None:
            factory = self.config._tmp_path_factory  # type: ignore[attr-defined]
            self._root = factory.mktemp("harness", numbered=True)
        return self._root

    def session_shared_dir(self) -> pathlib.Path:
        """Same for all buckets of the session; under xdist, shared by all workers (basetemp parent)."""
        base = self.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
        if hasattr(self.config, "workerinput"):
            base = base.parent
        path = base / "harness-session-shared"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # ----- running --------------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not self.runs_item(item):
            return None
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self.run_item(item, nextitem)
        for rep in reports:
            item.ihook.pytest_runtest_logreport(report=rep)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    @staticmethod
    def runs_item(item: pytest.Item) -> bool:
        """True for a distributed item that will run in a bucket (not skip-marked)."""
        return item.stash.get(BUCKET_KEY, None) is not None and item.get_closest_marker("skip") is None

    def run_item(self, item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        """Run one distributed item in its bucket; return its reports without logging them."""
        try:
            reports = self._run(item, item.stash[BUCKET_KEY], nextitem)
        except BaseException:
            self.close_active(graceful=False)
            raise
        return teardown_local_scopes(item, nextitem, reports)

    def _run(self, item: pytest.Item, key: BucketKey, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        if self.active is not None and (self.active_key != key or not self.active.alive):
            self.close_active(graceful=True)
        if self.active is None:
            self._start(key)
        bucket = self.active
        assert bucket is not None
        upcoming = self._next_runnable(nextitem)
        same_next = upcoming is not None and upcoming.stash.get(BUCKET_KEY, None) == key
        next_id = upcoming.stash[ORIG_NODEID_KEY] if same_next and upcoming is not None else None
        self.test_count += 1
        shared = self.root() / "shared" / f"{self.test_count:05d}-{_safe(item.name)}"
        shared.mkdir(parents=True)
        timeout = resolve_timeout(self.config, item.stash[SPEC_KEY], bucket.setup.placement.backend)
        outcome: TestOutcome = bucket.run_test(item.stash[ORIG_NODEID_KEY], next_id, shared, timeout)
        if outcome.fault is not None:
            self.close_active(graceful=False)
        elif not same_next or needs_restart(outcome):
            self.close_active(graceful=True)
        warn_state_changes(item, outcome)
        return ReportBuilder(item, key.world_size, outcome).build()

    def _next_runnable(self, nextitem: pytest.Item | None) -> pytest.Item | None:
        """The next test that will really run, looking past skip-marked ones (which never reach
        a bucket): otherwise every skipped test in the middle of a bucket's tests would tear
        the bucket down and the next test would pay for new rank processes. Under xdist a
        worker only knows its own ``nextitem`` (its queue is fed as it goes), so no look-ahead."""
        if nextitem is None or nextitem.get_closest_marker("skip") is None:
            return nextitem
        if hasattr(self.config, "workerinput"):
            return None
        items = nextitem.session.items
        if self._item_index is None or len(self._item_index) != len(items):
            self._item_index = {id(it): i for i, it in enumerate(items)}
        start = self._item_index.get(id(nextitem))
        if start is None:
            return None
        for candidate in items[start:]:
            if candidate.get_closest_marker("skip") is None:
                return candidate
        return None

    def _start(self, key: BucketKey) -> None:
        procs_mod.adopt_orphans()
        placement, lease = self._place(key.world_size)
        self.bucket_count += 1
        setup = BucketSetup(
            label=key.label, world_size=key.world_size, placement=placement,
            workdir=self.root() / f"bucket{self.bucket_count:03d}-{_safe(key.label)}",
            rootdir=self.config.rootpath, pytest_args=tuple(self._rank_args(key)),
            session_shared_dir=self.session_shared_dir(), pinned_numerics=key.pinned,
            startup_s=resolve_startup_timeout(self.config, placement.backend),
            grace_s=float(self.config.getoption("harness_grace")),
            harness_path=pathlib.Path(__file__).resolve().parents[2],  # the directory holding the harness package
        )
        self.active = Bucket(setup)
        self.active_key = key
        self.active_lease = lease

    def _place(self, world_size: int) -> tuple[backend_mod.Placement, gpu_lease.Lease | None]:
        """Backend choice plus the single GPU-lease call site (``harness.gpu_lease``).

        With ``HARNESS_FAKE_GPUS`` on a machine without CUDA the lease (and per-rank
        ``CUDA_VISIBLE_DEVICES``) is real but the ranks still run gloo on CPU, which lets the GPU
        scheduling be tested on CPU.
        """
        if not backend_mod.wants_gpu(self.config, world_size):
            return backend_mod.cpu_placement(), None
        leaser = gpu_lease.GpuLeaser(gpu_lease.default_lock_dir(), backend_mod.visible_gpus())
        lease = leaser.acquire(world_size, timeout_s=None)
        return backend_mod.gpu_placement(tuple(lease.gpu_ids)), lease

    def _rank_args(self, key: BucketKey) -> list[str]:
        items = [i for i in self.config.stash.get(ITEMS_KEY, []) if i.stash.get(BUCKET_KEY, None) == key]
        paths = list(dict.fromkeys(str(i.path) for i in items))
        args = paths + ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:faulthandler", "-o", "addopts=",
                        "--capture=tee-sys",
                        "--continue-on-collection-errors", "-q", "--rootdir", str(self.config.rootpath),
                        f"--import-mode={self.config.option.importmode}"]
        if self.config.inipath is not None:
            args += ["-c", str(self.config.inipath)]
        inv = list(self.config.invocation_params.args)
        for i, a in enumerate(inv):
            if a == "-p" and i + 1 < len(inv) and "xdist" not in inv[i + 1]:
                args += ["-p", inv[i + 1]]
            elif a.startswith("-p") and len(a) > 2 and "xdist" not in a:
                args.append(a)
        return args

    # ----- teardown -------------------------------------------------------------------------------
    def close_active(self, graceful: bool) -> None:
        bucket, lease = self.active, self.active_lease
        self.active, self.active_key, self.active_lease = None, None, None
        if bucket is not None:
            bucket.close(graceful=graceful)
        if lease is not None:
            lease.release()

    def shutdown(self) -> None:
        """Kill whatever is still running; called at unconfigure, on Ctrl-C and at interpreter exit."""
        self.close_active(graceful=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_finish(self, session: pytest.Session) -> Generator[None, None, None]:
        """Remember the items; under xdist loadgroup the buckets' node ids carry their ``@group``
        suffix only while the other plugins' ``pytest_collection_finish`` run.

        xdist appends the group to each node id (pytest < 9.2: its own ``pytest_collection_modifyitems``;
        9.2: ``node_ids.add_group_suffix`` here, after every other hook of the collection, e.g. a
        conftest selecting tests by node id, has seen the real ids) so that its scheduler can group
        them; the worker reports the ids in its own ``pytest_collection_finish``. Afterwards the
        real ids come back, for reports, JUnit names and ``--lf``.
        """
        worker = hasattr(session.config, "workerinput")
        if worker and getattr(session.config.option, "loadgroup", False):
            for item in session.items:
                key = item.stash.get(BUCKET_KEY, None)
                if key is not None:
                    node_ids.add_group_suffix(item, key.label)
        try:
            return (yield)
        finally:
            session.config.stash[ITEMS_KEY] = list(session.items)
            if worker:
                for item in session.items:
                    orig = item.stash.get(ORIG_NODEID_KEY, None)
                    if orig is not None and item.nodeid != orig:
                        node_ids.set_node_id(item, orig)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.shutdown()
        atexit.unregister(self.shutdown)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)


def _raise_interrupt(signum: int, frame: Any) -> None:
    """A plain KeyboardInterrupt (pytest ends the session on it and says so as for Ctrl-C), marked
    with the signal's name for the record of the test it stopped."""
    name = signal.Signals(signum).name
    exc = KeyboardInterrupt(f"{name} received")
    setattr(exc, SIGNAL_NAME_ATTR, name)
    raise exc


def _interrupt_on_sigterm() -> Any:
    """SIGTERM (CI cancellation, ``timeout``) ends the session like Ctrl-C: pytest reports what ran,
    writes JUnit (the test it stopped as an error, ``sidecar.InterruptRecorder``) and the buckets
    are reaped. Only where nobody else handles SIGTERM; returns the handler to restore, or None when
    nothing was changed."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _raise_interrupt)
    return signal.SIG_DFL


ITEMS_KEY = pytest.StashKey[list]()


def teardown_local_scopes(item: pytest.Item, nextitem: pytest.Item | None,
                          reports: list[pytest.TestReport]) -> list[pytest.TestReport]:
    """Tear down, in this process, the scopes ``nextitem`` does not share, as pytest's own
    teardown phase does after every item.

    A distributed item runs in the ranks, so this process never set up or tore down anything for
    it; but a local test before it in the same module (or class) left that module set up here.
    Without this, its module fixtures would be finalised late, and the next module's first test
    would error ("previous item was not torn down properly"). An error of such a finaliser
    becomes this item's teardown report, as it would for a local item."""
    call = pytest.CallInfo.from_call(lambda: item.session._setupstate.teardown_exact(nextitem),
                                     when="teardown")
    if call.excinfo is None:
        return reports
    return [r for r in reports if r.when != "teardown"] + [pytest.TestReport.from_item_and_call(item, call)]
