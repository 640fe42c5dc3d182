"""Measure the harness's spawn-mode overhead against torch's MultiProcessTestCase, in one run.

Both run 20 trivial tests on 4 ranks (gloo, CPU): each test all-reduces one scalar. Prints a table of
total wall time, start-up and per-test overhead.

    python bench/harness_overhead.py [--world-size 4] [--tests 20]

Harness: one pytest subprocess; a tiny timing plugin records when each test starts and finishes in
the controller. Start-up = first test's wall time minus the median per-test time; per-test overhead
= median time between consecutive test completions (the test body itself is well under 1 ms).
MultiProcessTestCase spawns fresh processes for every test, so its per-test time includes start-up.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

HARNESS_TEST = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size={ws})
@pytest.mark.parametrize("i", range({n}))
def test_trivial(i, dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {ws}
"""

TIMING_PLUGIN = """
import json, os, time

class _Timing:
    def __init__(self):
        self.data = {"session_start": time.time(), "start": {}, "finish": {}}

    def pytest_runtest_logstart(self, nodeid, location):
        self.data["start"][nodeid] = time.time()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.data["finish"][nodeid] = time.time()

    def pytest_sessionfinish(self, session):
        self.data["session_finish"] = time.time()
        with open(os.environ["BENCH_TIMING_OUT"], "w") as f:
            json.dump(self.data, f)

def pytest_configure(config):
    config.pluginmanager.register(_Timing(), "bench_timing_impl")
"""

MPTC_TEST = """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

class TrivialTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return {ws}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _trivial(self):
        dist.init_process_group("gloo", init_method=f"file://{{self.file_name}}", rank=self.rank,
                                world_size=self.world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == self.world_size
        dist.destroy_process_group()

{methods}

if __name__ == "__main__":
    run_tests()
"""


def _harness_plugin_args() -> list[str]:
    """Load the harness explicitly only when it is not installed (else the entry point loads it)."""
    names = {e.name for e in importlib.metadata.entry_points(group="pytest11")}
    return [] if "fsdp_harness" in names else ["-p", "harness.plugin"]


def bench_harness(tmp: pathlib.Path, ws: int, n: int) -> dict[str, float]:
    (tmp / "test_bench_harness.py").write_text(HARNESS_TEST.format(ws=ws, n=n))
    (tmp / "bench_timing.py").write_text(TIMING_PLUGIN)
    out = tmp / "timing.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(REPO), env.get("PYTHONPATH", "")])
    env["BENCH_TIMING_OUT"] = str(out)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp / "test_bench_harness.py"), "-q",
                           "-p", "no:cacheprovider", "-p", "bench_timing", "--harness-backend=cpu",
                           *_harness_plugin_args()],
                          cwd=tmp, env=env, capture_output=True, text=True)
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"harness run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    ids = sorted(data["start"], key=data["start"].get)
    finishes = [data["finish"][i] for i in ids]
    gaps = [b - a for a, b in zip(finishes, finishes[1:], strict=True)]
    per_test = statistics.median(gaps)
    first = finishes[0] - data["start"][ids[0]]
    return {"total": total, "in_session": data["session_finish"] - data["session_start"],
            "startup": first - per_test, "per_test": per_test, "tests": len(ids)}


def bench_mptc(tmp: pathlib.Path, ws: int, n: int) -> dict[str, float]:
    methods = "\n".join(f"    def test_{i:02d}(self):\n        self._trivial()\n" for i in range(n))
    (tmp / "bench_mptc_case.py").write_text(MPTC_TEST.format(ws=ws, methods=textwrap.indent(methods, "")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(tmp / "bench_mptc_case.py")], cwd=tmp, env=env,
                          capture_output=True, text=True)
    total = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"MultiProcessTestCase run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"total": total, "in_session": float("nan"), "startup": float("nan"), "per_test": total / n, "tests": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--tests", type=int, default=20)
    ap.add_argument("--mptc-tests", type=int, default=None,
                    help="run fewer MultiProcessTestCase tests (each spawns fresh ranks and can take ~10-30 s on a "
                         "loaded 2-core machine); its total is then extrapolated to --tests")
    args = ap.parse_args()
    mptc_n = args.mptc_tests or args.tests
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as d:
        tmp = pathlib.Path(d)
        (tmp / "h").mkdir()
        (tmp / "m").mkdir()
        h = bench_harness(tmp / "h", args.world_size, args.tests)
        m = bench_mptc(tmp / "m", args.world_size, mptc_n)
    print(f"{args.tests} trivial tests x {args.world_size} ranks, gloo/CPU, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'runner':<24}{'total s':>10}{'start-up s':>12}{'per-test s':>12}")
    print(f"{'harness (one bucket)':<24}{h['total']:>10.2f}{h['startup']:>12.2f}{h['per_test']:>12.4f}")
    scaled = m["per_test"] * args.tests
    note = "" if mptc_n == args.tests else f"  (ran {mptc_n}, total scaled to {args.tests})"
    print(f"{'MultiProcessTestCase':<24}{scaled:>10.2f}{'(per test)':>12}{m['per_test']:>12.4f}{note}")
    print(f"harness: {h['tests']} tests; pytest session {h['in_session']:.2f} s of {h['total']:.2f} s total "
          f"(the rest is interpreter + torch import + collection of the controller)")


if __name__ == "__main__":
    main()
