"""What the compile tests share: the CPU device, the exact backend, the step count, and the check
that compiled code ran (a silent eager fallback must fail a test)."""
from __future__ import annotations

import torch

from fsdp_impl.compile_units import CompileStats

CPU = torch.device("cpu")
AOT = {"backend": "aot_eager"}
STEPS = 3


def assert_compiled(stats: CompileStats, units: int, breaks: int = 0, exact: bool = True) -> None:
    """Every unit ran, and every forward call of it ran ``breaks + 1`` compiled graphs (one per
    piece between graph breaks); ``breaks`` graph breaks were recorded in all (same-class units
    share one trace). compiled_calls == 0 is what a silent eager fallback looks like."""
    assert len(stats.units) == units, stats
    for name, unit in stats.units.items():
        assert unit.calls > 0, f"unit {name!r} never ran: {unit}"
        if exact:
            assert unit.compiled_calls == unit.calls * (breaks + 1), f"unit {name!r}: {unit}"
        else:  # breaks inside nested frames: graphs per call vary with the frame
            assert unit.compiled_calls >= unit.calls, f"unit {name!r}: {unit}"
        assert unit.checked, unit
    assert stats.graph_breaks == breaks, [u.break_reasons for u in stats.units.values()]
    assert stats.graphs_compiled >= breaks + 1, stats
