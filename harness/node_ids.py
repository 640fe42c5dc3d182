"""Rewriting a collected item's node id, across pytest versions, for xdist's ``loadgroup``.

xdist's ``--dist loadgroup`` scheduler (the harness's default under ``-n``: a bucket's tests stay on
one worker, so they share one set of rank processes) reads each test's group from an ``@group``
suffix of the node ids a worker reports. xdist (3.8) appends it by assigning ``item._nodeid``,
where pytest < 9.2 keeps the id; pytest 9.2 keeps it in a structured ``item._id``
(``_pytest.nodeid.NodeId``) instead, so that assignment changes nothing, every group is lost and
the scheduler spreads a bucket's tests over the workers, each starting rank processes of its own
(measured: a 20-test bucket under ``-n 2`` ran on two sets of ranks with pytest 9.2.0). The
harness therefore writes the suffix of its own buckets itself, the way the running pytest keeps
ids, around the worker's ``pytest_collection_finish`` (``Controller``): not earlier, since hooks
of the collection may select tests by node id (adding it in ``pytest_collection_modifyitems``
made the L0 conftest miss 43 of its 92 cells), and the real ids come back once reported.
"""
from __future__ import annotations

import pytest


def _node_id_class() -> type | None:
    """``_pytest.nodeid.NodeId`` where this pytest has it (9.2 and later), else None."""
    try:
        from _pytest.nodeid import NodeId  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return NodeId  # type: ignore[no-any-return,unused-ignore]


def _structured_class(item: pytest.Item) -> type | None:
    """The ``NodeId`` class when the item keeps its id as one (pytest 9.2 and later), else None."""
    cls = _node_id_class()
    return cls if cls is not None and isinstance(getattr(item, "_id", None), cls) else None


def structured_ids(item: pytest.Item) -> bool:
    """Whether this pytest keeps the item's id as a ``NodeId`` object (9.2 and later)."""
    return _structured_class(item) is not None


def set_node_id(item: pytest.Item, nodeid: str) -> None:
    """Make ``item.nodeid`` read ``nodeid``."""
    cls = _structured_class(item)
    if cls is not None:
        item._id = cls.parse(nodeid)  # type: ignore[attr-defined]
    else:
        item._nodeid = nodeid


def add_group_suffix(item: pytest.Item, group: str) -> None:
    """Append xdist's ``@group`` suffix where xdist's own assignment would not take (pytest >= 9.2;
    before, xdist appends it itself and a second suffix would be redundant)."""
    if structured_ids(item) and not item.nodeid.endswith("@" + group):
        set_node_id(item, f"{item.nodeid}@{group}")
