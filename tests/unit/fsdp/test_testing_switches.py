"""``fsdp_impl._testing``: every test-only switch is off outside a test, follows the one convention
(a ``Switch`` named as its attribute) and is restored on exit, also when the body raises, so a
switch can never leak from one test into the next and loosen a product check there."""
from __future__ import annotations

import pytest

from fsdp_impl import _testing
from fsdp_impl._testing import GRAPH_MODE_ON_CPU, NCCL_UB_RECORDED, Switch


def test_every_switch_is_off_and_named_as_its_attribute() -> None:
    switches = {name: obj for name, obj in vars(_testing).items() if isinstance(obj, Switch)}
    assert sorted(switches) == sorted(n for n in _testing.__all__ if n != "Switch")
    for name, switch in switches.items():
        assert switch.name == name and name.isupper()
        assert not switch.active and switch.value is None


def test_on_nests_and_restores_even_when_the_body_raises() -> None:
    with GRAPH_MODE_ON_CPU.on() as value:
        assert value is True and GRAPH_MODE_ON_CPU.active
        with GRAPH_MODE_ON_CPU.on():
            assert GRAPH_MODE_ON_CPU.active
        assert GRAPH_MODE_ON_CPU.active  # the inner exit restored the outer "on"
    assert not GRAPH_MODE_ON_CPU.active
    with pytest.raises(RuntimeError, match="body"), NCCL_UB_RECORDED.on() as recorded:
        recorded.append([(0, 1)])
        assert NCCL_UB_RECORDED.value == [[(0, 1)]]
        raise RuntimeError("body")
    assert NCCL_UB_RECORDED.value is None


def test_a_fresh_record_each_time() -> None:
    with NCCL_UB_RECORDED.on() as first:
        first.append([(0,)])
    with NCCL_UB_RECORDED.on() as second:
        assert second == []
