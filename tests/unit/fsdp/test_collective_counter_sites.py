"""``CollectiveCounter`` records where each call came from, so a count assertion that fails on a
machine the test was not written on names the code that issued the extra calls."""
from __future__ import annotations

from tests.functional.common.collective_counter import CollectiveCounter, call_site


def issuer(counter: CollectiveCounter) -> None:
    counter.record("all_reduce", None, 4, call_site())


def test_call_site_names_the_caller_innermost_first() -> None:
    site = call_site()
    assert site.startswith("test_collective_counter_sites.py:"), site
    assert "test_call_site_names_the_caller_innermost_first" in site.split(" <- ")[0], site


def test_where_counts_calls_per_site_and_op(monkeypatch) -> None:
    monkeypatch.setattr("tests.functional.common.collective_counter.group_ranks", lambda group: (0,))
    counter = CollectiveCounter()
    for _ in range(2):  # one site: the same line twice
        issuer(counter)
    counter.record("all_gather_into_tensor", None, 8, "elsewhere")
    where = counter.where("all_reduce")
    assert list(where.values()) == [2], where
    assert next(iter(where)).split(" <- ")[0].endswith(" issuer"), where
    assert counter.where() == {**where, "elsewhere": 1}
    counter.reset()
    assert counter.where() == {}
