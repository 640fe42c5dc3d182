"""Starting a benchmark module in fresh processes of a given world, and reading how they ended.

The suite and the profile run every measurement in processes of its own, so no engine sees the
memory, the allocator state, the communicators or the process-global library state (TE's FP8
registry, cuBLAS workspaces) another engine left behind. A world of N > 1 ranks is a
``torchrun --standalone --nproc-per-node N`` of the module (a fresh rendezvous on a free port per
launch); world 1 and ``--fake-world`` are one plain process. The driver that calls this holds no
GPU and no process group itself.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import runtime

REPO = Path(__file__).resolve().parent.parent
# What torchrun sets for its workers: a child must not inherit these from a driver that itself
# runs under torchrun (a plain child would think it is a rank of that outer world).
_LIVE: set[subprocess.Popen] = set()  # children now running, stopped if the driver is signalled
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """Where a child runs: ``nproc`` ranks (torchrun when > 1) or one fake-world process, on ``device``."""

    nproc: int = 1
    fake_world: int = 0
    device: str = "auto"

    @property
    def size(self) -> int:
        return self.fake_world or self.nproc

    def flags(self) -> list[str]:
        """The run flags a child module takes for this world (``bench.cli.add_run_flags``)."""
        return ["--device", self.device] + (["--fake-world", str(self.fake_world)] if self.fake_world else [])

    def describe(self) -> str:
        if self.fake_world:
            return f"fake world {self.fake_world} (one process)"
        return f"world {self.nproc}" + (" (torchrun per cell)" if self.nproc > 1 else "")


def driver_world(nproc: int | None, fake_world: int, device: str) -> World | None:
    """The world a driver launches its children in; None on a torchrun rank other than 0.

    A driver started as ``python -m bench.<driver> --nproc-per-node N`` launches N-rank children.
    Started under ``torchrun`` instead (single node), rank 0 launches children of the same
    world size and the other ranks have nothing to do."""
    outer = int(os.environ.get("WORLD_SIZE", "1"))
    if fake_world:
        if outer != 1:
            raise SystemExit("fake_world is one process pretending to be rank 0: run it without torchrun")
        if nproc not in (None, 1):
            raise SystemExit("--fake-world and --nproc-per-node exclude each other (a fake world is one process)")
        return World(1, fake_world, device)
    if outer > 1:
        if int(os.environ.get("LOCAL_WORLD_SIZE", outer)) != outer:
            raise SystemExit("the bench driver under torchrun supports one node only (it starts each cell "
                             "as a single-node torchrun); run it on one node")
        if nproc not in (None, outer):
            raise SystemExit(f"--nproc-per-node {nproc} under a torchrun of {outer} ranks: give one of the two")
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        return World(outer, 0, device)
    return World(nproc or 1, 0, device)


def child_env(world: World) -> dict[str, str]:
    """The environment of a child: no outer torchrun variables, the repository importable, NVLink
    multicast off, unbuffered output; ``--device cpu`` hides every GPU, so nothing in the child
    (an engine's default mesh, a library's device probe) can pick one."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(runtime.NO_MULTICAST)
    if world.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def command(world: World, module: str, args: Sequence[str]) -> list[str]:
    """``python -m module args`` (plus the world's run flags), under torchrun when nproc > 1."""
    argv = [*args, *world.flags()]
    if world.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(world.nproc), "-m", module, *argv]
    return [sys.executable, "-m", module, *argv]


@dataclass(frozen=True)
class Finished:
    """How a child ended: exit code (negative: the signal), whether it ran out of time, its last lines."""

    returncode: int
    timed_out: bool
    seconds: float
    tail: tuple[str, ...] = ()

    def why(self) -> str:
        """One line for a report row: the exit status and the child's last output lines."""
        if self.timed_out:
            head = f"timed out after {self.seconds:.0f}s (killed)"
        elif self.returncode < 0:
            head = f"killed by {_signal_name(-self.returncode)}"
        else:
            head = f"exited with code {self.returncode}"
        last = " | ".join(line.strip() for line in self.tail[-4:] if line.strip())
        return f"{head}; last output: {last[-600:]}" if last else head


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run(cmd: Sequence[str], env: dict[str, str] | None, timeout_s: float, prefix: str = "",
        tail_lines: int = 40, cwd: Path = REPO) -> Finished:
    """Run ``cmd`` in its own session (in ``cwd``), echo its output (stdout and stderr) line by
    line with ``prefix``, and keep the last ``tail_lines``. Past ``timeout_s`` the whole session
    gets SIGTERM (torchrun passes it to its ranks), then SIGKILL 20 s later."""
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    _LIVE.add(proc)
    reader = threading.Thread(target=_pump, args=(proc, prefix, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    finally:
        _LIVE.discard(proc)
    reader.join(timeout=30)
    return Finished(proc.returncode, timed_out, time.monotonic() - t0, tuple(tail))


def _pump(proc: subprocess.Popen, prefix: str, tail: collections.deque[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line.rstrip("\n"))
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _stop(proc: subprocess.Popen, term_grace_s: float = 20.0) -> None:
    """SIGTERM to the child's session (its process group), SIGKILL if it is still there after the grace."""
    for sig, grace in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_children_on_signal() -> None:
    """In a driver: SIGTERM, SIGINT or SIGHUP first stop the running children (they live in
    sessions of their own, so a terminal's Ctrl-C or ``timeout`` reaches only the driver), then
    end the driver with 128 + the signal number, through its ``finally`` blocks."""
    def handler(signum: int, frame: object) -> None:
        for proc in list(_LIVE):
            _stop(proc, term_grace_s=10.0)
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)


def probe(device: str, timeout_s: float = 300.0) -> dict:
    """``bench.probe`` in a child (a driver never touches CUDA): device, its memory, versions. For
    ``--device cpu`` there is no GPU to ask about: described here, without a child."""
    if device == "cpu":
        from bench import probe as cpu_probe

        return cpu_probe.describe("cpu")
    single = World(1, 0, device)
    done = run(command(single, "bench.probe", []), child_env(single), timeout_s, "[probe] ")
    for line in reversed(done.tail):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"bench.probe failed: {done.why()}")
