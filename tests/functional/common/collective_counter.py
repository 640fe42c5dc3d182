"""Count the collectives a block of code issues, per op and per process group.

HSDP/HFSDP tests assert *where* traffic goes (e.g. the dp_outer all-reduce happens once per
optimisation cycle, never on accumulation microbatches), which final numbers alone cannot show.
``CollectiveCounter`` temporarily wraps the ``torch.distributed`` functions the engine calls
(looked up through the module at call time, so wrapping the module attributes sees every call)
and restores them on exit, even if the block raises. It also records the bytes of each call's
first tensor argument (the output of ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the
tensor of ``all_reduce``), so FP8 tests can compare how much a gather moved, and where each call
came from (``where``), so a count that differs on a machine the test was not written on says
which code issued the extra calls.
"""
from __future__ import annotations

import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast")

Key = tuple[str, tuple[int, ...]]  # (op name, sorted global ranks of the group)
SITE_FRAMES = 3  # callers kept per call: enough to see past comm.py's thin wrappers


def call_site() -> str:
    """``file:line func`` of the innermost callers outside this file, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-1] if f.filename != __file__][-SITE_FRAMES:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Sorted global ranks of ``group`` (``None`` = the default group)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


class _Recorder:
    """The replacement for one ``torch.distributed`` function: record, then call through."""

    def __init__(self, counter: CollectiveCounter, op: str, original: Callable[..., Any]) -> None:
        self.counter, self.op, self.original = counter, op, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        self.counter.record(self.op, kwargs.get("group"), nbytes, call_site())
        return self.original(*args, **kwargs)


class CollectiveCounter:
    """``with CollectiveCounter() as c: ...`` then ``c.count(op, group)`` / ``c.calls``."""

    def __init__(self, ops: Iterable[str] = OPS) -> None:
        self.ops = tuple(ops)
        self.calls: list[Key] = []
        self.sizes: list[int] = []  # bytes of each call's first tensor, parallel to ``calls``
        self.sites: list[str] = []  # where each call came from (``call_site``), parallel to ``calls``
        self._saved: dict[str, Callable[..., Any]] = {}

    def record(self, op: str, group: dist.ProcessGroup | None, nbytes: int = 0, site: str = "") -> None:
        self.calls.append((op, group_ranks(group)))
        self.sizes.append(nbytes)
        self.sites.append(site)

    def __enter__(self) -> CollectiveCounter:
        for op in self.ops:
            self._saved[op] = getattr(dist, op)
            setattr(dist, op, _Recorder(self, op, self._saved[op]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved.clear()

    def reset(self) -> None:
        self.calls.clear()
        self.sizes.clear()
        self.sites.clear()

    def _selected(self, op: str | None, group: dist.ProcessGroup | None,
                  ranks: tuple[int, ...] | None) -> list[int]:
        want = group_ranks(group) if group is not None else ranks
        return [i for i, (o, r) in enumerate(self.calls) if (op is None or o == op) and (want is None or r == want)]

    def count(self, op: str | None = None, group: dist.ProcessGroup | None = None,
              ranks: tuple[int, ...] | None = None) -> int:
        """Calls of ``op`` (any op if None) on ``group`` / ``ranks`` (any group if both None)."""
        return len(self._selected(op, group, ranks))

    def nbytes(self, op: str | None = None, group: dist.ProcessGroup | None = None,
               ranks: tuple[int, ...] | None = None) -> int:
        """Total bytes of the calls ``count`` would count."""
        return sum(self.sizes[i] for i in self._selected(op, group, ranks))

    def summary(self) -> dict[Key, int]:
        """{(op, ranks): count}, for assertion messages."""
        return dict(Counter(self.calls))

    def where(self, op: str | None = None) -> dict[str, int]:
        """{call site: count} of the calls of ``op`` (any op if None), for assertion messages."""
        return dict(Counter(self.sites[i] for i in self._selected(op, None, None)))
