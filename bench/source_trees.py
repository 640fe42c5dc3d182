"""Cells from another copy of the sources, alternated with this one's in the same run (an A/B).

    python -m bench.fp8_bench --source-tree base=/tmp/base \\
        --impls ours-fp8-te-current-fused,ours-fp8-te-current-fused@base,te-fp8-ref

Why: a host-bound cell's speed follows the machine's CPU, and two device calls often land on
hosts of different speed (the same 1.3B FP8 cell ran at 50.7k and 64.6k tok/s on two H200
machines), so "before" and "after" a change compare only inside one run. ``NAME@LABEL`` is
implementation ``NAME`` as the tree ``--source-tree LABEL=PATH`` defines it: its cell runs
``bench.cell`` from PATH (working directory and first on ``PYTHONPATH``, so that tree's
``bench`` and ``fsdp_impl`` are imported), alternating with the other implementations in every
repetition like any cell. Its row is labelled ``NAME@LABEL`` and the report adds the ratio of
``NAME`` to each ``NAME@LABEL``. Make PATH with, e.g., ``git archive REV bench fsdp_impl | tar -x
-C PATH``; the tree's ``bench.cell`` must accept the flags this suite passes (``--impl --size
--rep --result --steps --warmup --micro-batch`` and the world's flags).
"""
from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

SEP = "@"
_LABEL = re.compile(r"[A-Za-z0-9_.-]+")
NEEDED = ("bench/cell.py", "fsdp_impl/__init__.py")  # what a tree must hold to run a cell


def split(name: str) -> tuple[str, str | None]:
    """``"NAME@LABEL"`` -> (NAME, LABEL); a plain name -> (name, None)."""
    base, sep, label = name.partition(SEP)
    return base, (label if sep else None)


def impl_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for ``a,b@label,c``: every NAME one of ``choices`` (the error names them),
    every LABEL well formed (whether a tree defines it is checked after parsing: ``check``)."""
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if split(s)[0] not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; allowed values: {','.join(choices)} "
                                             f"(each optionally NAME{SEP}LABEL with --source-tree LABEL=PATH)")
        odd = [s for s in items if (label := split(s)[1]) is not None and not _LABEL.fullmatch(label)]
        if odd:
            raise argparse.ArgumentTypeError(f"bad source-tree label in {odd}: use letters, digits, '_', '.', '-'")
        return items
    return parse


def tree(text: str) -> tuple[str, Path]:
    """An argparse type for ``LABEL=PATH``: a well-formed label and a directory holding ``NEEDED``."""
    label, sep, path = text.partition("=")
    if not sep or not _LABEL.fullmatch(label) or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH (LABEL: letters, digits, '_', '.', '-'), got {text!r}")
    root = Path(path).resolve()
    missing = [n for n in NEEDED if not (root / n).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"source tree {label}={root} lacks {', '.join(missing)}")
    return label, root


def check(names: Sequence[str], trees: dict[str, Path]) -> str | None:
    """The error for implementations naming a label no ``--source-tree`` defines (None: fine)."""
    unknown = sorted({label for n in names if (label := split(n)[1]) is not None and label not in trees})
    if unknown:
        return (f"--impls names source tree(s) {', '.join(unknown)} but --source-tree defines "
                f"{', '.join(sorted(trees)) or 'none'}")
    return None


def cell_env(env: dict[str, str], repo: Path, root: Path) -> dict[str, str]:
    """``env`` with ``root`` in place of ``repo`` on ``PYTHONPATH`` (first), for a cell from ``root``."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != repo.resolve()]
    return dict(env, PYTHONPATH=os.pathsep.join([str(root), *rest]))


def ab_lines(pairs: Sequence[tuple[str, str, float]]) -> list[str]:
    """Report lines for (size, NAME@LABEL, NAME / NAME@LABEL throughput) triples."""
    if not pairs:
        return []
    return ["", "Source trees (same run, alternating cells):"] + [
        f"- {size}: {split(other)[0]} / {other} throughput {r:.3f}x" for size, other, r in pairs]
