"""``--harness-reruns N``: rerun a failed test up to N times; a test that failed and then passed is FLAKY.

Opt-in, for triage runs: a release verdict should not depend on luck, so a test that needed a rerun
is never reported as plainly passed. Its JUnit testcase passes (CI dashboards stay readable) but
carries the property ``harness_flaky`` (how many attempts failed) and ``harness_rerun_failure``
(each failed attempt's one-line cause); the terminal shows it as ``FLAKY`` and the sign-off counts
it as flaky, not passed. A test that fails every attempt is reported with its last failure and
``harness_reruns`` saying how many attempts were made.

Only the last attempt's reports are logged, so JUnit, the terminal and ``--lf`` see one result.

Distributed tests (spawn mode) rerun in a fresh bucket: the failed attempt may have left its rank
processes in any state (a desynchronised process group, a half-finished collective, a changed
global), and a rerun in the same processes would test that state rather than the test. A fresh
bucket costs one start-up per rerun, which an opt-in triage run can afford. torchrun mode cannot
restart its ranks, so reruns are refused there.
"""
from __future__ import annotations

from typing import Any

import pytest
from _pytest.runner import runtestprotocol

from harness.protocol import RunMode
from harness.report.junit_format import FLAKY_PROPERTY, RERUN_FAILURE_PROPERTY, RERUNS_PROPERTY

_MAX_SECTION_CHARS = 20_000


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp_harness")
    group.addoption("--harness-reruns", dest="harness_reruns", type=int, default=0, metavar="N",
                    help="rerun a failed test up to N times (distributed tests in a fresh bucket); a test that "
                         "failed and then passed is reported FLAKY, never passed (default 0: no reruns)")


def one_line(report: pytest.TestReport) -> str:
    """The failure's one-line cause."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", "") or ""
    lines = [ln for ln in (message or report.longreprtext).splitlines() if ln.strip()]
    line = (lines[0] if message else lines[-1]) if lines else f"{report.when} failed"
    return line[:300]


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    """Show a flaky pass as FLAKY (category ``flaky`` in the summary line), not as passed."""
    if report.when == "call" and report.passed and any(n == FLAKY_PROPERTY for n, _ in report.user_properties):
        return "flaky", "K", ("FLAKY", {"yellow": True})
    return None


class Rerunner:
    """Runs each test up to 1 + N times until it passes; logs only the last attempt."""

    def __init__(self, config: pytest.Config, reruns: int) -> None:
        self.config = config
        self.reruns = reruns

    def _attempt(self, item: pytest.Item, nextitem: pytest.Item | None, attempt: int) -> list[pytest.TestReport]:
        controller: Any = self.config.pluginmanager.get_plugin("fsdp_harness_controller")
        if controller is not None and controller.runs_item(item):
            if attempt:
                controller.close_active(graceful=False)  # a rerun starts from fresh rank processes
            return list(controller.run_item(item, nextitem))
        return runtestprotocol(item, nextitem=nextitem, log=False)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        failures: list[pytest.TestReport] = []
        for attempt in range(self.reruns + 1):
            reports = self._attempt(item, nextitem, attempt)
            failed = [r for r in reports if r.failed]
            if not failed:
                break
            failures.append(failed[0])
        props: list[tuple[str, object]] = []
        if failures and not any(r.failed for r in reports):
            props.append((FLAKY_PROPERTY, f"failed {len(failures)} of {len(failures) + 1} attempts, then passed"))
        elif len(failures) > 1:
            props.append((RERUNS_PROPERTY, f"failed all {len(failures)} attempts"))
        if props:
            props.extend((RERUN_FAILURE_PROPERTY, f"attempt {i + 1}: {one_line(r)}") for i, r in enumerate(failures))
        for rep in reports:
            rep.user_properties = [*rep.user_properties, *props]
            if props and rep.when == "call":
                text = "\n\n".join(f"attempt {i + 1} ({r.when}):\n{r.longreprtext}" for i, r in enumerate(failures))
                rep.sections.append(("harness reruns", text[-_MAX_SECTION_CHARS:]))
            item.ihook.pytest_runtest_logreport(report=rep)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True


def register(config: pytest.Config, mode: RunMode) -> None:
    """Install the rerunner when ``--harness-reruns`` asks for it (not in rank processes)."""
    reruns = int(config.getoption("harness_reruns", 0) or 0)
    if reruns < 0:
        raise pytest.UsageError(f"--harness-reruns must be >= 0, got {reruns}")
    if reruns == 0 or mode == RunMode.RANK:
        return
    if mode == RunMode.TORCHRUN:
        raise pytest.UsageError("--harness-reruns is not supported under torchrun: the ranks cannot be restarted "
                                "for a rerun; run the suite in spawn mode (plain pytest) to rerun failures")
    config.pluginmanager.register(Rerunner(config, reruns), "fsdp_harness_rerunner")
