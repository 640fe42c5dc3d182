"""``harness.node_ids``: xdist's ``@group`` suffix on the node ids of the harness's buckets, for
pytest 9.2's structured ids (where xdist's own ``item._nodeid`` assignment changes nothing), and
none added where pytest still keeps ``_nodeid`` (xdist appends it itself).

pytest here may predate ``_pytest.nodeid``; a stand-in ``NodeId`` with its ``parse``/``str``
contract (the string round-trips) and an item whose ``nodeid`` reads ``_id`` play pytest 9.2.
The real pytest 9.2 + xdist 3.8 case is ``test_harness_xdist.py`` run under that pytest (it kept a
20-test bucket on one set of rank processes only with this module)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness import node_ids


class _NodeId:
    def __init__(self, text: str) -> None:
        self.text = text

    @classmethod
    def parse(cls, text: str) -> _NodeId:
        return cls(text)

    def __str__(self) -> str:
        return self.text


class _Item:
    """What pytest 9.2's ``Node`` does with ids: ``nodeid`` is ``str(self._id)``."""

    def __init__(self, nodeid: str) -> None:
        self._id = _NodeId(nodeid)

    @property
    def nodeid(self) -> str:
        return str(self._id)


def test_structured_ids_get_the_group_suffix_once_and_lose_it_on_restore(monkeypatch) -> None:
    monkeypatch.setattr(node_ids, "_node_id_class", lambda: _NodeId)
    item = _Item("tests/t.py::test_a[1]")
    assert node_ids.structured_ids(item)  # type: ignore[arg-type]
    node_ids.add_group_suffix(item, "tests/t.py-w2")  # type: ignore[arg-type]
    node_ids.add_group_suffix(item, "tests/t.py-w2")  # type: ignore[arg-type]
    assert item.nodeid == "tests/t.py::test_a[1]@tests/t.py-w2"
    node_ids.set_node_id(item, "tests/t.py::test_a[1]")  # type: ignore[arg-type]
    assert item.nodeid == "tests/t.py::test_a[1]" and isinstance(item._id, _NodeId)


@pytest.mark.parametrize("node_id_class", [None, _NodeId], ids=["no-NodeId", "NodeId-but-plain-item"])
def test_plain_ids_are_left_to_xdist(node_id_class, monkeypatch) -> None:
    """pytest < 9.2 (``_nodeid``): no suffix from the harness, restores write ``_nodeid``."""
    monkeypatch.setattr(node_ids, "_node_id_class", lambda: node_id_class)
    item = SimpleNamespace(_nodeid="tests/t.py::test_a", nodeid="tests/t.py::test_a")
    assert not node_ids.structured_ids(item)  # type: ignore[arg-type]
    node_ids.add_group_suffix(item, "g")  # type: ignore[arg-type]
    assert item._nodeid == "tests/t.py::test_a"
    node_ids.set_node_id(item, "tests/t.py::test_b")  # type: ignore[arg-type]
    assert item._nodeid == "tests/t.py::test_b"
