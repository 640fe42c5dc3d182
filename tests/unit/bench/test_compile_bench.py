"""bench/compile_bench.py + bench/compile_cells.py (issue 50): the compiled cells really compile (graphs
compiled and compiled forward calls counted, on CPU with ``aot_eager`` at the tiny size) and train
like their eager twins; a compiled cell that ran eagerly is an error, not a number; rounds
alternate the cells; medians, ratios, targets and the table read the rows right."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import compile_bench, compile_cells, launch, runtime
from bench.compile_cells import CELLS
from bench.impls import SIZES

REPO = Path(__file__).resolve().parents[3]
TINY = SIZES["tiny"]
COMPILED = [name for name, c in CELLS.items() if c.compiled and not c.fp8]
DIST = pytest.mark.distributed(world_size=1, timeout=300)


def _train(name: str, steps: int = 3, model: str = "gpt") -> tuple[list[float], compile_cells.CompileCounts]:
    torch._dynamo.reset()  # each cell compiles afresh, as in its own process
    built = compile_cells.build(name, TINY, runtime.Env(0, 1, 0, torch.device("cpu")), 2, backend="aot_eager",
                                model_name=model)
    before = built.counts()
    losses = [float(built.trainee.step()) for _ in range(steps)]
    return losses, built.counts().minus(before)


@DIST
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_cells_compile_and_train_like_their_eager_twin(name: str, dist_env) -> None:
    """Each compiled cell compiles one block graph (same-class blocks share it), no graph break,
    one compiled forward call per block per step (with recompute too: the checkpoint wrapper is
    the unit, so the checkpoint is compiled with the block, as FSDP2's cell does); ``aot_eager``
    changes no arithmetic, so the losses equal the eager cell's bit for bit."""
    losses, counts = _train(name)
    eager_losses, eager_counts = _train(CELLS[name].eager or "")
    assert counts.graphs == 1 and counts.dynamo_graphs >= 1 and counts.breaks == 0, counts
    assert counts.calls == 3 * TINY.layers, counts
    assert eager_counts == compile_cells.CompileCounts(), eager_counts  # the eager twin compiled nothing
    assert losses == eager_losses


@DIST
@pytest.mark.parametrize("name", ["ours+compile", "fsdp2+compile+ac"])
def test_the_llama_model_compiles_per_block_like_the_gpt(name: str, dist_env) -> None:
    """``--model llama`` (torchtitan's block: RMSNorm, rotary, SwiGLU): one block graph, no break,
    one compiled call per block per step (two with ours' recompute), losses equal to the eager
    twin's bit for bit under ``aot_eager``; its closed-form parameter count is the module's; the
    TE reference, built on the GPT only, is refused for it."""
    losses, counts = _train(name, model="llama")
    eager_losses, _ = _train(CELLS[name].eager or "", model="llama")
    assert counts.graphs == 1 and counts.breaks == 0 and counts.calls == 3 * TINY.layers, counts
    assert losses == eager_losses and len(set(losses)) == 3, losses
    module = compile_cells.Llama(TINY)
    assert compile_cells.params_of("llama", TINY) == sum(p.numel() for p in module.parameters())
    assert "bench.gpt only" in (compile_cells.unavailable_reason("te-fp8-ref", "llama") or "")
    with pytest.raises(ValueError, match="model 'nope'; allowed: gpt, llama"):
        compile_cells.build("ours", TINY, runtime.Env(0, 1, 0, torch.device("cpu")), 2, model_name="nope")


@DIST
@pytest.mark.parametrize("name", ["ours+compile", "fsdp2+compile"])
def test_a_compiled_cell_that_runs_eagerly_is_an_error(name: str, dist_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """No throughput row comes out of a compiled cell that ran eagerly: with Dynamo disabled torch
    (fullgraph) or ``compile_units``' check raises; with the compiled calls not happening (what a
    constructor that forgot to compile looks like) the bench's own count raises."""
    env = runtime.Env(0, 1, 0, torch.device("cpu"))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True), pytest.raises(RuntimeError, match="compiled (frames|graph)"):
        compile_bench.measure(env, name, "tiny", 2, 1, 1, "aot_eager")
    torch._dynamo.reset()
    monkeypatch.setattr(compile_cells, "compiled_calls", lambda model, backend: 0)
    with pytest.raises(RuntimeError, match=re.escape(f"{name}: no compiled graph ran in the timed steps")):
        compile_bench.measure(env, name, "tiny", 2, 1, 1, "aot_eager")


@DIST
def test_measure_reports_the_compile_outside_the_timed_steps(dist_env) -> None:
    torch._dynamo.reset()
    row = compile_bench.measure(runtime.Env(0, 1, 0, torch.device("cpu")), "fsdp2+compile", "tiny", 2, 2, 2,
                                "aot_eager")
    assert row["status"] == "ok" and row["graphs"] == 1 and row["graphs_compiled_timed"] == 0, row
    assert row["compiled_calls_per_step"] == TINY.layers and row["finite"], row
    assert row["first_step_s"] > 0 and row["tokens_per_s"] > 0


def _row(cell: str, tok: float, peak: float = 10.0, **extra: object) -> dict:
    return {"cell": cell, "size": "1.3b", "status": "ok", "tokens_per_s": tok, "step_ms": 1.0, "peak_gib": peak,
            "peak_all_gib": peak, "first_step_s": 30.0, "graphs": 1, "dynamo_graphs": 1, "graph_breaks": 0,
            "compiled_calls_per_step": 24, "graphs_compiled_timed": 0, "fx_cache_hits": 0, "fx_cache_misses": 2,
            "loss_first": 10.4, "loss_last": 10.1, **extra}


def test_medians_ratios_and_targets() -> None:
    runs = [_row("ours+compile", t) for t in (120.0, 100.0, 140.0)] + \
           [_row("fsdp2+compile", t, peak=11.0) for t in (110.0, 90.0, 130.0)] + \
           [_row("ours", t) for t in (100.0, 80.0, 120.0)] + \
           [{"cell": "te-fp8-ref", "status": "skip", "detail": "no TE"}]
    rows = compile_bench.medians(runs)
    assert [r["cell"] for r in rows] == ["ours+compile", "fsdp2+compile", "ours", "te-fp8-ref"]
    assert rows[0]["tokens_per_s"] == 120.0 and rows[0]["tokens_per_s_runs"] == [120.0, 100.0, 140.0]
    assert compile_bench.ratio(rows, "ours+compile", "fsdp2+compile") == pytest.approx(120 / 110)
    assert compile_bench.ratio(rows, "ours+compile", "te-fp8-ref") is None
    lines = compile_bench.target_lines(rows)
    assert lines[0] == ("- ours+compile / fsdp2+compile: 1.091x, peak 10.00 vs 11.00 GiB "
                        "(target >= 1.0x at equal or lower peak: met)")
    assert lines[1] == "- ours+compile / ours: 1.200x, peak 10.00 vs 10.00 GiB (target >= 1.1x: met)"
    assert len(lines) == 2  # the recompute and FP8 lines need both sides; absent, they are left out
    heavier = compile_bench.medians([_row("ours+compile", 120.0, peak=12.0), _row("fsdp2+compile", 110.0, peak=11.0),
                                     _row("ours", 115.0)])
    assert [line.endswith("NOT met)") for line in compile_bench.target_lines(heavier)] == [True, True]
    assert compile_bench.target_lines([]) == ["- ours+compile / fsdp2+compile: n/a (not both measured)",
                                              "- ours+compile / ours: n/a (not both measured)"]


def test_a_failed_run_does_not_stand_for_the_cell_and_the_table_says_what_failed() -> None:
    runs = [_row("ours+compile", 100.0), {"cell": "ours+compile", "status": "OOM", "detail": "CUDA out of memory"},
            _row("fsdp2+compile", 100.0, graphs_compiled_timed=3), {"cell": "fsdp2", "status": "error", "detail": "x"}]
    rows = compile_bench.medians(runs)
    assert rows[0]["tokens_per_s"] == 100.0 and rows[0]["runs"] == 1 and rows[0]["failed_runs"] == ["OOM"]
    table = compile_bench.table(rows).splitlines()
    assert table[2].startswith("| ours+compile | 100 | 100-100 (1) | 1.0 | 10.00 | 10.00 | 1.000x fsdp2+compile |")
    assert "1 / 1 / 0 (+3 compiled in the timed steps)" in table[3]
    assert table[4].startswith("| fsdp2 | error | x |")


def test_rounds_alternate_the_cells_and_skip_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def start(cell: str, args: argparse.Namespace) -> dict:
        calls.append(cell)
        return _row(cell, 100.0)

    monkeypatch.setattr(compile_cells, "unavailable_reason", lambda n, m: "no TE" if n == "te-fp8-ref" else None)
    args = argparse.Namespace(reps=2, size="tiny", time_budget_s=float("inf"), model="gpt")
    rows = compile_bench.rounds(["ours+compile", "fsdp2+compile", "te-fp8-ref"], args, start=start)
    assert calls == ["ours+compile", "fsdp2+compile"] * 2
    assert [(r["cell"], r["rep"], r["status"]) for r in rows] == [
        ("ours+compile", 1, "ok"), ("fsdp2+compile", 1, "ok"), ("te-fp8-ref", 1, "skip"),
        ("ours+compile", 2, "ok"), ("fsdp2+compile", 2, "ok"), ("te-fp8-ref", 2, "skip")]


def test_bad_cells_and_backends_are_refused_naming_the_allowed_values(capsys: pytest.CaptureFixture) -> None:
    for argv, needle in ((["--cells", "ours,bogus"], "allowed values: "), (["--backend", "nope"], "not a torch.compile"
                                                                         " backend"), (["--reps", "0"], ">= 1")):
        with pytest.raises(SystemExit):
            compile_bench.parse_args(argv)
        assert needle in capsys.readouterr().err
    assert compile_bench.parse_args([]).cells == list(compile_cells.DEFAULT_CELLS)


@pytest.mark.slow  # ~35 s: two fresh processes that compile (the in-process tests above cover the cells)
def test_cpu_smoke_run_each_cell_in_its_own_process(tmp_path: Path) -> None:
    """The driver on CPU/gloo: two compiled cells, each a fresh process (two pids), the JSON and
    the markdown with the configuration named."""
    env = {k: v for k, v in os.environ.items() if k not in launch.TORCHRUN_VARS}
    out, md = tmp_path / "c.json", tmp_path / "c.md"
    cmd = [sys.executable, "-m", "bench.compile_bench", "--device", "cpu", "--size", "tiny", "--backend", "aot_eager",
           "--cells", "ours+compile,fsdp2+compile", "--reps", "1", "--steps", "1", "--warmup", "1",
           "--micro-batch", "1", "--out", str(out), "--md", str(md)]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["status"] for r in data["runs"]] == ["ok", "ok"], data["runs"]
    assert len({r["pid"] for r in data["runs"]}) == 2 and all(r["pid"] != os.getpid() for r in data["runs"])
    assert all(r["graphs"] == 1 and r["compiled_calls_per_step"] == TINY.layers for r in data["runs"])
    text = md.read_text()
    assert "backend aot_eager" in text and "AdamW(lr 1e-4, fused=True)" in text
    assert "- ours+compile / fsdp2+compile: " in text
