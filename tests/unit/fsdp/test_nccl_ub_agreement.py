"""Symmetric NCCL registration's pre-check (``fsdp_impl/nccl_ub.py``), without NCCL: window
registration is collective per pool segment, so every rank of a group must hold segments of the
same sizes in the same order (on 2 H200s at 1.3B they differed, NCCL failed and torch aborted).

``segment_sizes`` reads the order torch registers in, ``segment_mismatch`` names what differs,
and ``agree_on_segments`` (driven here by one thread per rank over an in-process exchange)
brings every rank to the same decision without leaving a peer waiting in a gather."""
from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from fsdp_impl.nccl_ub import agree_on_segments, segment_mismatch, segment_sizes

MIB = 2**20
Group = tuple[int, ...]


def test_segment_sizes_sort_by_address_and_ignore_other_fields() -> None:
    snapshot = [{"address": 0x300, "total_size": 3 * MIB, "segment_type": "large", "blocks": [{"size": 1}]},
                {"address": 0x100, "total_size": 1 * MIB, "stream": 0, "allocated_size": 7},
                {"address": 0x200, "total_size": 2 * MIB}]
    assert segment_sizes(snapshot) == [1 * MIB, 2 * MIB, 3 * MIB]
    assert segment_sizes([]) == []


def test_equal_lists_agree() -> None:
    assert segment_mismatch([[2 * MIB, 4 * MIB]] * 3, [0, 1, 2]) is None
    assert segment_mismatch([[]], [5]) is None


def test_different_sizes_name_the_ranks_and_the_first_differing_segment() -> None:
    # The sizes of the two segments NCCL failed on (rank A 203423744 bytes, rank B 102760448).
    why = segment_mismatch([[2 * MIB, 203423744], [2 * MIB, 102760448]], [0, 1])
    assert why == ("group ranks [0, 1] have segment sizes: rank 0 has [2.0, 194.0] MiB (2 segments) vs rank 1 "
                   "has [2.0, 98.0] MiB (2 segments), first differing at segment 1")


def test_different_lengths_differ_where_the_shorter_list_ends() -> None:
    why = segment_mismatch([[2 * MIB], [2 * MIB, 4 * MIB]], [4, 6])
    assert why == ("group ranks [4, 6] have segment sizes: rank 4 has [2.0] MiB (1 segments) vs rank 6 "
                   "has [2.0, 4.0] MiB (2 segments), first differing at segment 1")


def test_three_ranks_only_the_one_that_differs_is_named() -> None:
    why = segment_mismatch([[MIB, MIB], [MIB, MIB], [MIB, 2 * MIB]], [0, 2, 4])
    assert why == ("group ranks [0, 2, 4] have segment sizes: rank 0 has [1.0, 1.0] MiB (2 segments) vs rank 4 "
                   "has [1.0, 2.0] MiB (2 segments), first differing at segment 1")


def test_long_lists_show_a_window_around_the_difference() -> None:
    why = segment_mismatch([[MIB] * 20, [MIB] * 15 + [2 * MIB] * 5], [0, 1])
    assert why == ("group ranks [0, 1] have segment sizes: rank 0 has [..., 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, ...] MiB "
                   "(20 segments) vs rank 1 has [..., 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, ...] MiB (20 segments), "
                   "first differing at segment 15")
    head = segment_mismatch([[3 * MIB] + [MIB] * 9, [MIB] * 10], [0, 1])
    assert head == ("group ranks [0, 1] have segment sizes: rank 0 has [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, ...] MiB "
                    "(10 segments) vs rank 1 has [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, ...] MiB (10 segments), "
                    "first differing at segment 0")


class Exchange:
    """An in-process ``all_gather_object``: one thread per rank, a barrier per group. A rank
    that skips a gather its peers make breaks their barrier (a hang, under NCCL)."""

    def __init__(self, groups: Sequence[Group]) -> None:
        self.barriers = {g: threading.Barrier(len(g), timeout=10) for g in groups}
        self.posts: dict[tuple[Group, int], dict[int, Any]] = defaultdict(dict)
        self.calls: dict[tuple[Group, int], int] = defaultdict(int)

    def gather(self, rank: int, obj: Any, group: Group) -> list[Any]:
        call = self.calls[group, rank]
        self.calls[group, rank] += 1
        self.posts[group, call][rank] = obj
        self.barriers[group].wait()
        return [self.posts[group, call][r] for r in group]


def _decide(sizes: dict[int, list[int]], groups_of: dict[int, list[Group]]) -> dict[int, str | None]:
    """Run ``agree_on_segments`` on every rank at once; each rank's verdict."""
    everyone = tuple(sorted(sizes))
    exchange = Exchange(sorted({g for groups in groups_of.values() for g in groups} | {everyone}))
    verdicts: dict[int, str | None] = {}
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            verdicts[rank] = agree_on_segments(sizes[rank], groups_of[rank], lambda g: g,
                                               lambda obj, g: exchange.gather(rank, obj, g), everyone)
        except BaseException as err:  # surfaced below: a broken barrier means a rank was left waiting
            errors.append(err)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert sorted(verdicts) == list(everyone), verdicts
    return verdicts


def _grid(rows: int, cols: int) -> dict[int, list[Group]]:
    """A shard (row) x outer (column) mesh, no group spanning it all; each rank's groups in order."""
    return {r: [tuple(range(r - r % cols, r - r % cols + cols)), tuple(range(r % cols, rows * cols, cols))]
            for r in range(rows * cols)}


def test_every_rank_agrees_when_the_segments_match() -> None:
    assert _decide({r: [2 * MIB, 4 * MIB] for r in range(4)}, _grid(2, 2)) == {r: None for r in range(4)}


def test_rank_whose_groups_all_agree_still_gets_the_mismatch() -> None:
    # Only rank 0 differs: rank 3's groups ([2, 3] and [1, 3]) agree, yet its peers 1 and 2 raise,
    # so rank 3 must not register alone. Rank 0's row is compared first everywhere it is seen.
    sizes = {r: [2 * MIB, 4 * MIB] for r in range(4)}
    sizes[0] = [2 * MIB, 6 * MIB]
    want = ("group ranks [0, 1] have segment sizes: rank 0 has [2.0, 6.0] MiB (2 segments) vs rank 1 has "
            "[2.0, 4.0] MiB (2 segments), first differing at segment 1")
    assert _decide(sizes, _grid(2, 2)) == {r: want for r in range(4)}


def test_a_mismatch_in_a_later_group_does_not_stop_the_exchange() -> None:
    # Rows agree, columns differ: every rank gathers in both groups and then over all ranks.
    sizes = {0: [MIB], 1: [MIB], 2: [MIB, MIB], 3: [MIB, MIB]}
    want = ("group ranks [0, 2] have segment sizes: rank 0 has [1.0] MiB (1 segments) vs rank 2 has "
            "[1.0, 1.0] MiB (2 segments), first differing at segment 1")
    assert _decide(sizes, _grid(2, 2)) == {r: want for r in range(4)}
