"""The JUnit sidecar: ``<name>.harness.json`` next to ``--junitxml=<name>.xml``.

JUnit XML has no place for what a sign-off needs beyond pass/fail: the environment (torch, CUDA,
NCCL, cuDNN, TE, GPUs, driver, git revision, backend), each test's matrix axes, each rank's outcome
and time, and what each bucket's start-up cost. The sidecar holds them, keyed by node id.

It is also the record of a run that never finished. While the session runs, events are appended to
``<name>.harness.jsonl`` (start, collected ids, each test's start and end); the final JSON replaces
the journal at session end. A run killed by a signal (a CI timeout on a hang) leaves the journal,
from which the sign-off shows the test that was running as an error and the rest as never run.

Three plugins: :class:`ReportAnnotator` runs where tests run (the controller, each xdist worker) and
adds bucket details to the reports; :class:`InterruptRecorder` runs there too (spawn mode) and logs
the test a SIGTERM or Ctrl-C stopped as an error; :class:`SidecarWriter` runs where JUnit is written
(never in an xdist worker, a rank process, or a torchrun rank other than 0) and writes the files.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import tempfile
import time
from collections.abc import Generator
from typing import IO, Any

import pytest

from harness import environment
from harness.matrix import AXES_KEY, allowed_axes
from harness.mutant import ENV_MUTANT
from harness.nodes import PLACEMENT_KEY
from harness.protocol import SIGNAL_NAME_ATTR, RunMode
from harness.report.junit_format import (
    AXIS_PROPERTY_PREFIX,
    ERROR,
    FAILED,
    FLAKY,
    FLAKY_PROPERTY,
    PASSED,
    SKIPPED,
    XFAILED,
)
from harness.report.sidecar_format import SCHEMA, bucket_summary, sidecar_paths, strip_xdist_group

_MESSAGE_CHARS = 300


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def phase_outcome(reports: list[pytest.TestReport]) -> str:
    """One outcome for a test's phase reports, as JUnit would show it (flaky from the rerun property)."""
    if any(r.failed for r in reports if r.when == "call"):
        return FAILED
    if any(r.failed for r in reports):
        return ERROR
    if any(r.skipped for r in reports):
        return XFAILED if any(hasattr(r, "wasxfail") for r in reports if r.skipped) else SKIPPED
    if any(name == FLAKY_PROPERTY for r in reports for name, _ in r.user_properties):
        return FLAKY
    return PASSED


def _one_line(report: pytest.TestReport) -> str:
    """A failed or skipped report's one-line reason (skip reasons live in a (path, line, text) tuple)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = getattr(crash, "message", "") or report.longreprtext
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:_MESSAGE_CHARS]


def record_of(reports: list[pytest.TestReport]) -> dict[str, Any]:
    """The sidecar entry of one test from its phase reports."""
    axes: dict[str, str] = {}
    for rep in reports:
        for name, value in rep.user_properties:
            if str(name).startswith(AXIS_PROPERTY_PREFIX):
                axes.setdefault(str(name)[len(AXIS_PROPERTY_PREFIX):], str(value))
    record: dict[str, Any] = {"outcome": phase_outcome(reports),
                              "duration_s": round(sum(r.duration for r in reports), 6), "axes": axes}
    message = next((_one_line(r) for r in reports if r.failed or r.skipped), None)
    if message:
        record["message"] = message
    for rep in reports:
        ranks = getattr(rep, "harness_ranks", None)
        if ranks and "ranks" not in record:
            record["ranks"], record["wall_s"] = ranks["ranks"], ranks["wall_s"]
        bucket = getattr(rep, "harness_bucket", None)
        if bucket and "bucket" not in record:
            record["bucket"] = bucket
    flaky = [str(v) for rep in reports[-1:] for n, v in rep.user_properties if n == FLAKY_PROPERTY]
    if flaky:
        record["flaky"] = flaky[0]
    return record


class ReportAnnotator:
    """Adds ``harness_bucket`` (label, world size, whether this test started the bucket and the
    estimated start-up time) to the reports of distributed tests, before anything logs them."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.item: pytest.Item | None = None
        self.buckets_before = 0

    def _controller(self) -> Any:
        return self.config.pluginmanager.get_plugin("fsdp_harness_controller")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        controller = self._controller()
        self.item, self.buckets_before = item, getattr(controller, "bucket_count", 0)
        try:
            return (yield)
        finally:
            self.item = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from harness.spawn.controller import BUCKET_KEY

        item = self.item
        if item is None or report.nodeid != item.nodeid or getattr(report, "harness_bucket", None):
            return
        key = item.stash.get(BUCKET_KEY, None)
        if key is None:
            return
        started = getattr(self._controller(), "bucket_count", 0) > self.buckets_before
        info: dict[str, Any] = {"label": key.label, "world_size": key.world_size, "started": started}
        ranks = getattr(report, "harness_ranks", None)
        if started and ranks:
            slowest = max((r["duration_s"] for r in ranks["ranks"].values()), default=0.0)
            info["startup_s"] = round(max(0.0, ranks["wall_s"] - slowest), 3)
        report.harness_bucket = info  # type: ignore[attr-defined]


INTERRUPTED = "interrupted by {what} while this test ran: the session was stopped before it finished (a CI " \
              "cancellation, a timeout or Ctrl-C); its result is unknown"


class InterruptRecorder:
    """Logs the test that was running when the session was interrupted as an error, so JUnit and
    the sidecar name it. pytest lets a KeyboardInterrupt (the controller turns SIGTERM into one)
    end the session without a report of the running test: JUnit left it out (a nameless
    ``<testcase>`` at best), and a sign-off of that JUnit alone could pass. Spawn mode only: under
    torchrun rank 0's watchdog reports a SIGTERM itself (``harness.torchrun.reporter``)."""

    def __init__(self) -> None:
        self.logged: list[str] = []  # phases logged for the running test

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
        self.logged = []
        try:
            return (yield)
        except KeyboardInterrupt as exc:
            if "teardown" not in self.logged:
                self._record(item, getattr(exc, SIGNAL_NAME_ATTR, None) or "Ctrl-C (KeyboardInterrupt)")
            raise

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.logged.append(report.when or "")

    def _record(self, item: pytest.Item, what: str) -> None:
        """An error in the phase that did not end: setup when none was logged, else teardown."""
        when: Any = "teardown" if "setup" in self.logged else "setup"
        report = pytest.TestReport(item.nodeid, item.location, dict.fromkeys(item.keywords, 1), "failed",
                                   INTERRUPTED.format(what=what), when, user_properties=list(item.user_properties))
        item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


class SidecarWriter:
    """Journal during the session, final JSON at its end; both next to the JUnit file."""

    def __init__(self, config: pytest.Config, xml_path: pathlib.Path) -> None:
        self.config = config
        self.xml_path = xml_path
        self.path, self.journal_path = sidecar_paths(xml_path)
        self.journal: IO[str] | None = None
        self.started = time.time()
        self.header: dict[str, Any] = {}
        self.expected: list[str] = []
        self.expected_axes: dict[str, dict[str, str]] = {}
        self.phases: dict[str, list[pytest.TestReport]] = {}
        self.tests: dict[str, dict[str, Any]] = {}
        self.running: dict[str, float] = {}

    def _event(self, event: str, **data: Any) -> None:
        if self.journal is not None:
            self.journal.write(json.dumps({"event": event, **data}, default=str) + "\n")
            self.journal.flush()

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stale in (self.path, self.journal_path):  # never let a previous run's record pass for this one
            stale.unlink(missing_ok=True)
        self.header = {"schema": SCHEMA, "junit": self.xml_path.name, "started": _now(),
                       "suite_name": self.config.getini("junit_suite_name"),
                       "matrix_axes": allowed_axes(self.config), "mutant": os.environ.get(ENV_MUTANT) or None,
                       "environment": environment.collect(self.config)}
        self.journal = self.journal_path.open("w", encoding="utf-8")
        self._event("start", **self.header)

    def _expect(self, ids: list[str]) -> None:
        if not self.expected:
            self.expected = list(ids)
            self._event("collected", ids=self.expected, axes=self.expected_axes)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.expected_axes = {item.nodeid: item.stash[AXES_KEY] for item in session.items
                              if item.stash.get(AXES_KEY, None)}
        self._expect([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self._expect([strip_xdist_group(i) for i in ids])

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.running[nodeid] = time.time()
        self._event("test_start", nodeid=nodeid, t=self.running[nodeid])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.phases.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self._finish(nodeid)

    def _finish(self, nodeid: str) -> None:
        self.running.pop(nodeid, None)
        reports = self.phases.pop(nodeid, None)
        if reports:
            self.tests[nodeid] = record_of(reports)
            self._event("test_end", nodeid=nodeid, record=self.tests[nodeid])

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        for nodeid, reports in list(self.phases.items()):
            if any(r.failed for r in reports):  # a crashed xdist worker's test: reported failed, never finished
                self._finish(nodeid)
            else:  # interrupted mid-test: only its setup reported; it stays "unfinished"
                self.running.setdefault(nodeid, time.time())
        data = dict(self.header, finished=_now(), wall_s=round(time.time() - self.started, 3),
                    exitstatus=int(exitstatus), complete=True, expected=self.expected,
                    expected_axes=self.expected_axes, tests=self.tests,
                    unfinished=sorted(self.running), buckets=bucket_summary(self.tests))
        placement = self.config.stash.get(PLACEMENT_KEY, None)
        if placement is not None:  # torchrun mode: every rank's node, host, local rank and node directory
            data["torchrun"] = placement
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        self.journal_path.unlink(missing_ok=True)


def check_writable(option: str, path: pathlib.Path) -> None:
    """Refuse a ``--junitxml`` path that cannot be written, before any test runs, in one line naming
    it: otherwise the journal fails at session start with an INTERNALERROR traceback (and pytest's
    own JUnit would fail only at the end, after every test ran). Probes with a real file, so a
    read-only mount or directory counts even for root."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
        if path.exists():
            with path.open("a"):  # append mode: an old result is not touched
                pass
    except OSError as exc:
        raise pytest.UsageError(f"--junitxml={option}: cannot write {path} ({exc.strerror or exc}); "
                                "give a path in a writable directory") from None


def register(config: pytest.Config, mode: RunMode) -> None:
    """Register the annotator where tests run and the writer where JUnit is written."""
    if mode == RunMode.RANK:
        return
    config.pluginmanager.register(ReportAnnotator(config), "fsdp_harness_annotator")
    if mode == RunMode.CONTROLLER:
        config.pluginmanager.register(InterruptRecorder(), "fsdp_harness_interrupts")
    xml = getattr(config.option, "xmlpath", None)
    if xml and not hasattr(config, "workerinput"):
        path = pathlib.Path(os.path.abspath(os.path.expanduser(os.path.expandvars(xml))))
        check_writable(xml, path)
        config.pluginmanager.register(SidecarWriter(config, path), "fsdp_harness_sidecar")
