"""What changed since the baseline run: new failures, fixes, newly skipped, vanished and added tests,
and skip counts that rose. Every list is capped (``limit`` entries, totals kept) so that a renamed
suite or a broken baseline cannot bury the report under thousands of lines."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

from harness.report.junit_read import (
    FAILING,
    FLAKY,
    NOT_RUN,
    OUTCOME_RANK,
    PASSED,
    SKIPPED,
    XFAILED,
    TestCase,
)

DEFAULT_LIMIT = 20
_GOOD = frozenset({PASSED, FLAKY})
_NOT_EXECUTED = frozenset({SKIPPED, XFAILED, NOT_RUN})


@dataclasses.dataclass
class Capped:
    """The first ``limit`` entries of a longer list, and how long it was."""

    total: int
    shown: list[Any]

    @classmethod
    def of(cls, entries: Sequence[Any], limit: int) -> Capped:
        return cls(len(entries), list(entries[:limit]))

    @property
    def hidden(self) -> int:
        return self.total - len(self.shown)


@dataclasses.dataclass
class BaselineDiff:
    """Test-level changes; entries are ``(test key, baseline outcome, outcome now)``."""

    new_failures: Capped
    fixes: Capped
    newly_skipped: Capped
    other_changes: Capped
    vanished: Capped  # test keys in the baseline that are gone now
    added: Capped  # test keys that are new
    skip_rise: list[tuple[str, int, int]]  # (run or "all runs", skips before, skips now) where now > before
    limit: int

    @property
    def empty(self) -> bool:
        groups = (self.new_failures, self.fixes, self.newly_skipped, self.other_changes, self.vanished, self.added)
        return not self.skip_rise and all(g.total == 0 for g in groups)


def _keyed(cases: Sequence[TestCase], with_run: bool) -> dict[str, str]:
    """Map test key to its worst outcome (duplicates keep the worst)."""
    keyed: dict[str, str] = {}
    for case in cases:
        key = f"{case.run} :: {case.test_id}" if with_run else case.test_id
        old = keyed.get(key)
        if old is None or OUTCOME_RANK[case.outcome] > OUTCOME_RANK[old]:
            keyed[key] = case.outcome
    return keyed


def _skips(cases: Sequence[TestCase]) -> Counter[str]:
    return Counter(c.run for c in cases if c.outcome in _NOT_EXECUTED)


def baseline_diff(current: Sequence[TestCase], baseline: Sequence[TestCase],
                  limit: int = DEFAULT_LIMIT) -> BaselineDiff:
    """Compare outcomes per test.

    Tests are matched by run label and test id when both sides hold the same set of run labels
    (e.g. ``h100/L0_unit``), else by test id alone, so ``--junit new.xml --baseline old.xml``
    compares the same tests although the file names differ. A new test that fails is a new failure.
    """
    with_run = {c.run for c in current} == {c.run for c in baseline}
    now, before = _keyed(current, with_run), _keyed(baseline, with_run)
    failures, fixes, skipped, other = [], [], [], []
    for key in sorted(now):
        new, old = now[key], before.get(key)
        if old == new:
            continue
        entry = (key, old or "(new test)", new)
        if new in FAILING and old not in FAILING:
            failures.append(entry)
        elif old is None:
            continue
        elif new in _GOOD and old in FAILING:
            fixes.append(entry)
        elif new in _NOT_EXECUTED and old in _GOOD:
            skipped.append(entry)
        else:
            other.append(entry)
    skips_now, skips_before = _skips(current), _skips(baseline)
    rise = [(run, skips_before[run], skips_now[run]) for run in sorted(skips_now)
            if with_run and skips_now[run] > skips_before[run]]
    if sum(skips_now.values()) > sum(skips_before.values()):
        rise.append(("all runs", sum(skips_before.values()), sum(skips_now.values())))
    return BaselineDiff(
        new_failures=Capped.of(failures, limit), fixes=Capped.of(fixes, limit),
        newly_skipped=Capped.of(skipped, limit), other_changes=Capped.of(other, limit),
        vanished=Capped.of(sorted(set(before) - set(now)), limit),
        added=Capped.of(sorted(set(now) - set(before)), limit),
        skip_rise=rise, limit=limit)
