"""The command-line pieces every bench entry point shares, written once.

Every benchmark is a module run as ``python -m bench.<name>`` from the repository root (or with
the root on ``PYTHONPATH``). They share list flags that name their allowed values, the run flags
(``--device``, ``--fake-world``), the step flags (``--steps``, ``--warmup``, ``--micro-batch``)
and one ``main`` shape: initialise the process group, run, and tear it down whatever happens
(``with_env``), so a failing benchmark never leaves a process group or a hung rank behind.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import runtime
from bench.runtime import Env

DEVICES = ("auto", "cuda", "cpu")


def csv_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type for ``a,b,c`` whose error names the allowed values."""
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; allowed values: {','.join(choices)}")
        return items
    return parse


def positive(text: str) -> int:
    """An argparse type for an integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` prints the module docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_flags(p: argparse.ArgumentParser, fake_world: bool = True) -> None:
    """``--device`` (authoritative: ``cpu`` never touches a GPU, also on a GPU node) and ``--fake-world``."""
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: CUDA when present; cpu: gloo on the host even where GPUs exist")
    if fake_world:
        p.add_argument("--fake-world", type=positive, default=0, metavar="N",
                       help="one process as rank 0 of N >= 2 whose collectives move nothing (torch's fake "
                            "backend; no torchrun): each engine's step without communication at world N")


def add_step_flags(p: argparse.ArgumentParser, steps: int = 8, warmup: int = 3, micro_batch: bool = True) -> None:
    p.add_argument("--steps", type=positive, default=steps, help="timed steps")
    p.add_argument("--warmup", type=positive, default=warmup, help="untimed steps before timing")
    if micro_batch:
        p.add_argument("--micro-batch", type=positive, default=4)


def add_driver_flags(p: argparse.ArgumentParser, out: str, what: str, cell_timeout_s: float, killed_as: str) -> None:
    """The output and time flags of a driver that starts ``what`` (cells, probes) as children:
    ``--out`` JSON lines, ``--md``, ``--time-budget-s`` and ``--cell-timeout-s`` (a child still
    running then is killed and recorded as ``killed_as``)."""
    p.add_argument("--out", type=Path, default=Path(out), help="JSON lines (overwritten)")
    p.add_argument("--md", type=Path, default=None, help="also write the markdown here")
    p.add_argument("--time-budget-s", type=float, default=math.inf,
                   help=f"start no {what} that would end later than this many seconds after start-up")
    p.add_argument("--cell-timeout-s", type=float, default=cell_timeout_s,
                   help=f"a {what} still running after this long is killed and recorded as {killed_as}")


def forward(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """``--flag value`` for each attribute in ``names`` that is set: a driver passes its flags to a child."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name, None)
        if value is None or value is False or (name == "fake_world" and value == 0):
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, ",".join(value) if isinstance(value, list) else str(value)]
    return out


def with_env(device: str, body: Callable[[Env], int | None], fake_world: int = 0) -> int:
    """Initialise the process group, run ``body(env)``, always tear the group down; ``body``'s exit code."""
    env = runtime.init(device, fake_world=fake_world)
    try:
        return body(env) or 0
    finally:
        runtime.shutdown()
