"""The test-only switches of the engine, all in one place, all alike.

Why they exist: a few product paths are refused off a GPU (``cuda_graph_mode=True``,
``OffloadPolicy(step="gpu")``, ``nccl_ub=True``), yet their bookkeeping is plain Python that CPU
tests on gloo should run. A switch lets a test take such a path on CPU; nothing in the product
turns one on, so outside a test every check stays as strict as documented.

The convention (every switch follows it):

* a switch is a module-level ``Switch`` named for what it allows, in capitals
  (``GRAPH_MODE_ON_CPU``); it is off unless a test is inside ``with SWITCH.on():``;
* ``on()`` yields the switch's value while on (``True``, or a record the product appends to) and
  restores the previous value on exit, so switches nest and never leak out of a test;
* product code only reads it: ``SWITCH.active`` (is it on?) or ``SWITCH.value`` (the record,
  ``None`` when off). Product modules import this module; this module imports nothing from the
  engine.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Switch(Generic[T]):
    """One test-only switch: ``None`` when off, ``make()``'s value inside ``with self.on()``."""

    def __init__(self, name: str, make: Callable[[], T]) -> None:
        self.name = name
        self._make = make
        self.value: T | None = None

    @property
    def active(self) -> bool:
        return self.value is not None

    @contextlib.contextmanager
    def on(self) -> Iterator[T]:
        previous, self.value = self.value, self._make()
        try:
            yield self.value
        finally:
            self.value = previous

    def __repr__(self) -> str:
        return f"Switch({self.name}, {'on' if self.active else 'off'})"


# ``cuda_graph_mode=True`` wraps a CPU model: the graph-mode bookkeeping (persistent buffers,
# refresh every forward, grad views) runs eagerly on gloo. Nothing can be captured there.
GRAPH_MODE_ON_CPU: Switch[bool] = Switch("GRAPH_MODE_ON_CPU", lambda: True)

# ``OffloadPolicy(step="gpu")`` on a CPU mesh: the streamed step's "device window" is host memory
# too and its streams are no-ops, so the chunking and the copies run (and can be recorded) on gloo.
STREAMED_STEP_ON_CPU: Switch[bool] = Switch("STREAMED_STEP_ON_CPU", lambda: True)

# ``nccl_ub=True`` wraps on any backend: no pool is made, and each model's registrations (the
# global ranks of each group, in order) are appended to the yielded list instead of reaching NCCL.
NCCL_UB_RECORDED: Switch[list[list[tuple[int, ...]]]] = Switch("NCCL_UB_RECORDED", list)

__all__ = ["GRAPH_MODE_ON_CPU", "NCCL_UB_RECORDED", "STREAMED_STEP_ON_CPU", "Switch"]
