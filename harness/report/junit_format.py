"""The JUnit names the harness writes and the sign-off reads: one definition per name, so a writer
and its reader cannot drift apart. Standard library only: the writers are pytest plugins
(``harness.rerun``, ``harness.matrix``, ``harness.combine``, ``harness.regression_marker``), the reader
(``harness.report``) runs without torch or pytest. The sidecar's names are in ``sidecar_format``.

Properties of a ``<testcase>`` (they may repeat; XML order is kept):

- ``harness_flaky`` = how many attempts failed, on a test that failed and then passed on a rerun
  (JUnit passes it, the sign-off counts it as flaky); ``harness_rerun_failure`` = one failed
  attempt's cause, one per attempt; ``harness_reruns`` = on a test that failed every attempt;
- ``axis:<name>`` = a configuration-matrix axis the suite declared (``@pytest.mark.matrix``);
- ``regression`` = a known bug's id and ``regression_description`` = its description, one pair per
  ``@pytest.mark.regression``; ``param:<name>`` = a parametrisation argument's value;
- ``rank<r>`` = that rank's outcome of a distributed test (``passed``, ``failed``, ``skipped``,
  ``error``, ``died``, ``no-report``); ``rank<r>.<name>`` = a property recorded on some ranks only;
- ``state_changed`` = what the test left changed in its rank (restored by the harness);
- ``golden`` = one golden cell's comparison with its reviewed file, as JSON (``harness.golden``'s
  ``GoldenResult.as_json``: ``cell``, ``platform``, ``path``, ``status`` (one of ``GOLDEN_STATUSES``),
  ``comparison`` (one of ``GOLDEN_COMPARISONS``), ``fingerprint_diff`` (list of text), ``fingerprint``,
  ``golden_fingerprint``, ``golden_versions``, ``problem`` (why no comparison could be made, else empty)
  and per series ``run``, ``golden``, ``tolerance`` (the band when compared within it),
  ``max_rel_drift``, ``first_drift_step``);
- ``checkpoint_compat`` = a checkpoint-compatibility test (``@pytest.mark.checkpoint_compat``), as JSON
  ``{"fixture": ..., "check": ...}``: which committed checkpoint it loads and what it checks.

The sign-off's own merged JUnit adds ``harness_synthesised`` (a case the run never reported: crashed,
never run, missing) and ``<skipped type="harness.not_run">`` for a test that never ran.
"""
from __future__ import annotations

import re
from typing import Final, Literal, get_args

# Outcomes of a test, worst last, as the sidecar records them and the sign-off counts them.
# FLAKY: failed, then passed on a rerun (never "passed"). NOT_RUN: collected for the run but never
# reported (the run crashed, hung, or stopped early).
PASSED = "passed"
FLAKY = "flaky"
XFAILED = "xfailed"
SKIPPED = "skipped"
NOT_RUN = "not run"
ERROR = "error"
FAILED = "failed"
OUTCOMES = (PASSED, FLAKY, XFAILED, SKIPPED, NOT_RUN, ERROR, FAILED)

FLAKY_PROPERTY = "harness_flaky"
RERUN_FAILURE_PROPERTY = "harness_rerun_failure"
RERUNS_PROPERTY = "harness_reruns"
AXIS_PROPERTY_PREFIX = "axis:"
REGRESSION_PROPERTY = "regression"
REGRESSION_DESCRIPTION_PROPERTY = "regression_description"
PARAM_PROPERTY_PREFIX = "param:"
STATE_CHANGED_PROPERTY = "state_changed"
SYNTHESISED_PROPERTY = "harness_synthesised"
NOT_RUN_TYPE = "harness.not_run"
GOLDEN_PROPERTY = "golden"
CHECKPOINT_COMPAT_PROPERTY = "checkpoint_compat"
# A golden cell's status: equal within tolerance; drifted; no golden file for the platform; the file
# was rewritten (``--golden-update``: nothing was compared).
GoldenStatus = Literal["match", "drift", "missing", "updated"]
GOLDEN_MATCH: Final = "match"
GOLDEN_DRIFT: Final = "drift"
GOLDEN_MISSING: Final = "missing"
GOLDEN_UPDATED: Final = "updated"
GOLDEN_STATUSES: tuple[GoldenStatus, ...] = get_args(GoldenStatus)
# How a golden cell was compared: bit for bit / within tolerance (the run's fingerprint equals the
# file's), or within the file's measured band (the fingerprints differ: ``fingerprint_diff`` names how).
GoldenComparison = Literal["exact", "band"]
GOLDEN_EXACT: Final = "exact"
GOLDEN_BAND: Final = "band"
GOLDEN_COMPARISONS: tuple[GoldenComparison, ...] = get_args(GoldenComparison)

# Regression ids as carried in ``regression`` properties and known-bug lists: kebab-case.
BUG_ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
# ``rank2`` (value: the outcome) as the harness writes it; ``rank 2``, ``rank_2``, ``rank2=failed``
# as other tools do.
RANK_PROPERTY_RE = re.compile(r"^rank[ _-]?(\d+)(?:=(\w+))?$")


def rank_property(rank: int, name: str | None = None) -> str:
    """``rank<r>`` (the rank's outcome), or ``rank<r>.<name>`` (a property only some ranks recorded)."""
    return f"rank{rank}" if name is None else f"rank{rank}.{name}"
