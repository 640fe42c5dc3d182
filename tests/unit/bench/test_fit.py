"""bench.fit: the doubling-then-bisection search against a stub probe runner with a known limit (the
exact probe sequence), a limit below the start, the maximum reached, an error that is not an OOM
stopping the search, the time budget, how a cell's end becomes a probe status, the markdown; and a
CPU run of the whole driver (tiny model, each probe a process of its own)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import fit, launch, suite
from bench.launch import Finished, World

REPO = Path(__file__).resolve().parents[3]


class Stub:
    """A probe runner without processes: micro-batches up to ``limit`` train, larger ones run out of
    memory; ``errors`` fail with something else; each probe "takes" ``seconds``."""

    def __init__(self, limit: dict[str, int], errors: dict[str, int] | None = None, seconds: float = 10.0):
        self.limit, self.errors, self.seconds = limit, errors or {}, seconds
        self.calls: list[tuple[str, int]] = []

    def __call__(self, size: str, name: str, micro_batch: int) -> dict:
        self.calls.append((name, micro_batch))
        done = Finished(0, False, self.seconds)
        cell: dict
        if micro_batch == self.errors.get(name):
            cell = {"kind": "error", "reason": "RuntimeError: NCCL error: unhandled system error"}
        elif micro_batch <= self.limit[name]:
            cell = {"kind": "cell", "tok_s_per_gpu": 1000.0 * micro_batch, "peak_gib": 0.5 * micro_batch,
                    "step_s": 0.1}
        else:
            cell = {"kind": "error", "reason": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return fit.probe_row(done, cell, size, name, micro_batch)

    def sequence(self, name: str) -> list[int]:
        return [mb for n, mb in self.calls if n == name]


class Clock(suite.Budget):
    """A budget whose clock is the stub's probe seconds (no real waiting)."""

    def __init__(self, limit_s: float, stub: Stub) -> None:
        super().__init__(limit_s, start=0.0)
        self.stub = stub

    def elapsed(self) -> float:
        return self.stub.seconds * len(self.stub.calls)


def _search(tmp_path: Path, stub: Stub, names: list[str], start: int = 4, maximum: int = 256,
            limit_s: float = math.inf, granularity: int = 1) -> tuple[list[fit.Search], list[dict]]:
    out = fit.Writer(tmp_path / "fit.jsonl")
    try:
        searches = fit.search_all(names, "1.3b", start, maximum, stub, Clock(limit_s, stub), out, granularity)
    finally:
        out.close()
    rows = [json.loads(line) for line in (tmp_path / "fit.jsonl").read_text().splitlines()]
    return searches, rows


def test_doubling_then_bisection_finds_the_exact_limit(tmp_path, capsys) -> None:
    stub = Stub({"ours-z3+ac": 37})
    searches, rows = _search(tmp_path, stub, ["ours-z3+ac"])
    assert stub.sequence("ours-z3+ac") == [4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    (f,) = [r for r in rows if r["kind"] == "fit"]
    assert (f["largest_micro_batch"], f["tokens_per_s"], f["peak_gib"]) == (37, 37000.0, 18.5)
    assert (f["first_failed_micro_batch"], f["first_failed_status"]) == (38, "oom")
    assert f["finished"] and f["search"] == "exact" and f["probes"] == 10
    probes = [r for r in rows if r["kind"] == "probe"]
    assert [r["status"] for r in probes] == ["ok"] * 4 + ["oom"] * 3 + ["ok", "oom", "ok"]
    err = capsys.readouterr().err.splitlines()  # one progress line per probe, on stderr
    assert len(err) == 10 and "micro-batch 37 (probe 10): ok" in err[-1] and "37 fits, 38 does not" in err[-1]


def test_granularity_stops_the_bisection_early(tmp_path) -> None:
    stub = Stub({"fsdp2": 37})
    searches, _ = _search(tmp_path, stub, ["fsdp2"], granularity=8)
    assert stub.sequence("fsdp2") == [4, 8, 16, 32, 64, 48, 40]
    assert searches[0].ended == "within 8 (--granularity 8)"


def test_a_limit_below_the_start_bisects_down_and_nothing_fitting_is_said(tmp_path) -> None:
    stub = Stub({"fsdp2": 2, "fsdp2+ac": 0})
    searches, rows = _search(tmp_path, stub, ["fsdp2", "fsdp2+ac"])
    assert stub.sequence("fsdp2") == [4, 2, 3]
    assert stub.sequence("fsdp2+ac") == [4, 2, 1]
    fits = {r["impl"]: r for r in rows if r["kind"] == "fit"}
    assert fits["fsdp2"]["largest_micro_batch"] == 2 and fits["fsdp2"]["first_failed_micro_batch"] == 3
    assert fits["fsdp2+ac"]["largest_micro_batch"] is None and fits["fsdp2+ac"]["search"] == "nothing fits"
    # the implementations take turns, one probe each per round
    assert stub.calls[:4] == [("fsdp2", 4), ("fsdp2+ac", 4), ("fsdp2", 2), ("fsdp2+ac", 2)]


def test_the_maximum_reached_without_a_failure(tmp_path) -> None:
    stub = Stub({"ours-z3": 1000})
    searches, rows = _search(tmp_path, stub, ["ours-z3"], start=4, maximum=100)
    assert stub.sequence("ours-z3") == [4, 8, 16, 32, 64, 100]
    (f,) = [r for r in rows if r["kind"] == "fit"]
    assert f["largest_micro_batch"] == 100 and f["first_failed_micro_batch"] is None
    assert f["finished"] and f["search"] == "reached --max 100"


def test_an_error_that_is_not_an_oom_stops_that_search_only(tmp_path) -> None:
    stub = Stub({"ours-z3": 37, "fsdp2": 37}, errors={"ours-z3": 16})
    searches, rows = _search(tmp_path, stub, ["ours-z3", "fsdp2"])
    assert stub.sequence("ours-z3") == [4, 8, 16]
    assert stub.sequence("fsdp2")[-1] == 37  # the other search goes on to its limit
    fits = {r["impl"]: r for r in rows if r["kind"] == "fit"}
    z3 = fits["ours-z3"]
    assert z3["largest_micro_batch"] == 8 and not z3["finished"]
    assert z3["search"] == "stopped: error at micro-batch 16"
    assert (z3["first_failed_micro_batch"], z3["first_failed_status"]) == (16, "error")
    assert z3["first_failed_reason"].startswith("RuntimeError: NCCL error")
    assert fits["fsdp2"]["finished"] and fits["fsdp2"]["largest_micro_batch"] == 37


def test_the_time_budget_stops_every_search_cleanly(tmp_path, capsys) -> None:
    stub = Stub({"ours-z3": 37, "fsdp2": 37}, seconds=10.0)
    searches, rows = _search(tmp_path, stub, ["ours-z3", "fsdp2"], limit_s=55.0)
    # 10 s per probe: the sixth would end at 60 s > 55 s
    assert stub.calls == [("ours-z3", 4), ("fsdp2", 4), ("ours-z3", 8), ("fsdp2", 8), ("ours-z3", 16)]
    fits = {r["impl"]: r for r in rows if r["kind"] == "fit"}
    assert fits["ours-z3"]["largest_micro_batch"] == 16 and fits["fsdp2"]["largest_micro_batch"] == 8
    assert not any(f["finished"] for f in fits.values())
    assert all(f["search"].startswith("unfinished: time budget (50s elapsed + about 10s") for f in fits.values())
    assert "time budget" in capsys.readouterr().err


def test_how_a_cell_end_becomes_a_probe_status() -> None:
    ok, failed, hung = Finished(0, False, 3.0), Finished(0, False, 3.0), Finished(-15, True, 90.0)
    assert fit.status_of(ok, {"kind": "cell"}) == "ok"
    assert fit.status_of(failed, {"kind": "error", "reason": "OutOfMemoryError: CUDA out of memory."}) == "oom"
    assert fit.status_of(failed, {"kind": "error", "reason": "RuntimeError: CUDA error: out of memory"}) == "oom"
    assert fit.status_of(failed, {"kind": "error", "reason": "ValueError: bad shape"}) == "error"
    assert fit.status_of(failed, {"kind": "error", "reason": "cell process killed by SIGKILL"}) == "error"
    assert fit.status_of(hung, {"kind": "error", "reason": "cell process timed out after 90s (killed)"}) == "timeout"


def test_search_order_pure() -> None:
    assert fit.next_micro_batch(0, None, 4, 256) == 4
    assert fit.next_micro_batch(128, None, 4, 256) == 256
    assert fit.next_micro_batch(256, None, 4, 256) is None
    assert fit.next_micro_batch(32, 64, 4, 256) == 48
    assert fit.next_micro_batch(37, 38, 4, 256) is None


def test_arguments(capsys) -> None:
    a = fit.parse_args([])
    assert a.impls == list(fit.DEFAULT_IMPLS) and (a.start, a.max, a.steps, a.warmup) == (4, 256, 2, 1)
    with pytest.raises(SystemExit):
        fit.parse_args(["--start", "8", "--max", "4"])
    assert "--start 8 is above --max 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit.parse_args(["--impls", "ours-z9"])
    assert "allowed values" in capsys.readouterr().err


def test_cpu_run_of_the_driver(tmp_path) -> None:
    """Tiny model on CPU/gloo, each probe a fresh ``bench.cell`` process: nothing runs out of memory
    on the host, so the search doubles to ``--max`` and the markdown says so; an implementation
    that needs two ranks is reported as not run."""
    out, md = tmp_path / "fit.jsonl", tmp_path / "fit.md"
    cmd = [sys.executable, "-m", "bench.fit", "--device", "cpu", "--size", "tiny", "--impls", "ours-z3,ours-hsdp",
           "--start", "1", "--max", "2", "--steps", "1", "--warmup", "1", "--out", str(out), "--md", str(md)]
    env = launch.child_env(World(device="cpu"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["kind"] == "meta" and rows[0]["seq"] == 64 and rows[0]["isolation"] == "one process per probe"
    probes = [r for r in rows if r["kind"] == "probe"]
    assert [(r["impl"], r["micro_batch"], r["status"]) for r in probes] == [("ours-z3", 1, "ok"), ("ours-z3", 2, "ok")]
    assert all(r["tokens_per_s"] > 0 for r in probes)
    fits = {r["impl"]: r for r in rows if r["kind"] == "fit"}
    assert fits["ours-z3"]["largest_micro_batch"] == 2 and fits["ours-z3"]["search"] == "reached --max 2"
    assert fits["ours-hsdp"]["search"].startswith("not run: needs world >= 2") and fits["ours-hsdp"]["probes"] == 0
    text = md.read_text()
    assert "| ours-z3 | 2 |" in text and "reached --max 2" in text and "### ours-z3" in text
    assert "ours-z3 micro-batch 2 (probe 2): ok" in proc.stderr

