"""The whole sign-off in report order, as neutral blocks: the verdict, what changed (since the
baseline run, then since the last release), the matrix, the failures, then the rest. The blocks
themselves come from ``document`` and ``release_blocks``; both renderers start here."""

from __future__ import annotations

from harness.report import document as doc
from harness.report import release_blocks as rel
from harness.report.sections import Report


def blocks(rep: Report) -> list[doc.Block]:
    """The whole report, in order."""
    return [*doc.verdict_blocks(rep), *doc.diff_blocks(rep.diff, rep.baseline_sources), *rel.golden_blocks(rep),
            *rel.compat_blocks(rep), *rel.speed_blocks(rep), *doc.matrix_blocks(rep), *doc.failure_blocks(rep),
            *doc.regression_blocks(rep), *doc.flaky_blocks(rep), *doc.skip_blocks(rep), *doc.suite_blocks(rep),
            *doc.slow_blocks(rep), *doc.environment_blocks(rep), *doc.mutant_blocks(rep),
            *rel.golden_mutant_blocks(rep)]
