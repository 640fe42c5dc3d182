"""Symmetric NCCL registration's pre-check (``nccl_ub.segment_sizes`` / ``segment_mismatch``): the
segment lists every rank of a group would window-register must agree, else a clear error."""
from __future__ import annotations

from fsdp_impl.nccl_ub import segment_mismatch, segment_sizes

MIB = 2**20


def test_segment_sizes_follow_address_order() -> None:
    snap = [{"address": 300, "total_size": 3 * MIB, "segment_type": "large"},
            {"address": 100, "total_size": 1 * MIB, "stream": 0},
            {"address": 200, "total_size": 2 * MIB}]
    assert segment_sizes(snap) == [1 * MIB, 2 * MIB, 3 * MIB]


def test_equal_lists_agree() -> None:
    assert segment_mismatch([[2 * MIB, 4 * MIB]] * 3, [0, 1, 2]) is None
    assert segment_mismatch([[]], [5]) is None


def test_different_sizes_name_ranks_and_first_index() -> None:
    why = segment_mismatch([[2 * MIB, 194 * MIB], [2 * MIB, 98 * MIB]], [0, 1])
    assert why == ("group ranks [0, 1]: rank 0 has [2.0, 194.0] MiB (2 segments), rank 1 has [2.0, 98.0] MiB "
                   "(2 segments); they first differ at segment 1")


def test_different_lengths_differ_where_the_shorter_ends() -> None:
    why = segment_mismatch([[2 * MIB], [2 * MIB, 2 * MIB]], [4, 6])
    assert why is not None and why.endswith("they first differ at segment 1")
    assert "rank 4 has [2.0] MiB (1 segments)" in why and "rank 6 has [2.0, 2.0] MiB (2 segments)" in why


def test_only_the_odd_rank_out_is_named() -> None:
    why = segment_mismatch([[MIB, MIB], [MIB, MIB], [MIB, 2 * MIB]], [0, 2, 4])
    assert why is not None and "rank 4 has [1.0, 2.0]" in why and "rank 2 has" not in why


def test_long_lists_are_truncated() -> None:
    why = segment_mismatch([[MIB] * 20, [MIB] * 19 + [2 * MIB]], [0, 1])
    assert why is not None and ", ...] MiB (20 segments)" in why and why.endswith("segment 19")
