"""bench.suite / bench.report: argument checks, cell order, the time budget, medians and targets, and
CPU smoke runs of the whole suite (tiny model, gloo, each cell a process of its own) that also
exercise the profile path."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import impls, launch, report, suite

REPO = Path(__file__).resolve().parents[3]


def _env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's variables (as a user's shell), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in launch.TORCHRUN_VARS}
    return dict(env, PYTHONPATH=str(REPO), **extra)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_defaults_and_csv_lists() -> None:
    a = suite.parse_args([])
    assert a.sizes == ["1.3b"] and a.impls == list(impls.DEFAULT_IMPLS) and a.reps == 3
    a = suite.parse_args(["--sizes", "0.35b,2.7b", "--impls", "fsdp2,ours-z3", "--reps", "5"])
    assert a.sizes == ["0.35b", "2.7b"] and a.impls == ["fsdp2", "ours-z3"] and a.reps == 5


@pytest.mark.parametrize("argv, needle", [
    (["--sizes", "1.3b,99b"], "allowed values: tiny,0.35b,1.3b,2.7b,7b"),
    (["--impls", "ours-z4"], "allowed values: ours-z3"),
    (["--reps", "0"], "must be >= 1"),
    (["--impls", ","], "empty list"),
    (["--impls", "ours-z3@base"], "--impls names source tree(s) base but --source-tree defines none"),
    (["--impls", "ours-z4@base"], "allowed values: ours-z3"),
    (["--impls", "ours-z3@b/x"], "bad source-tree label"),
    (["--source-tree", "base"], "expected LABEL=PATH"),
    (["--source-tree", "base=/nonexistent/tree"], "lacks bench/cell.py, fsdp_impl/__init__.py"),
])
def test_bad_arguments_name_the_allowed_values(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit):
        suite.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_plan_alternates_impls_inside_each_repetition() -> None:
    assert suite.plan(["a", "b"], ["X", "Y"], 2) == [
        ("a", 1, "X"), ("a", 1, "Y"), ("a", 2, "X"), ("a", 2, "Y"),
        ("b", 1, "X"), ("b", 1, "Y"), ("b", 2, "X"), ("b", 2, "Y")]


def test_budget_estimates_from_measured_cells() -> None:
    b = suite.Budget(limit_s=10.0, start=time.monotonic())
    assert b.estimate("1.3b", "fsdp2") == 0.0 and b.fits("1.3b", "fsdp2")  # nothing measured: run it
    b.record("1.3b", "fsdp2", 4.0)
    b.record("1.3b", "ddp", 6.0)
    assert b.estimate("1.3b", "fsdp2") == 4.0
    assert b.estimate("1.3b", "ours-z3") == 6.0  # slowest of the size
    ratio = impls.num_params_of(impls.SIZES["2.7b"]) / impls.num_params_of(impls.SIZES["1.3b"])
    assert b.estimate("2.7b", "ddp") == pytest.approx(6.0 * ratio)
    assert b.fits("1.3b", "fsdp2") and not b.fits("2.7b", "ddp")


def _row(size: str, impl: str, rep: int, tok: float, peak: float = 20.0, loss: float = 10.4) -> dict:
    return {"kind": "cell", "size": size, "impl": impl, "rep": rep, "tok_s_per_gpu": tok, "step_s": 8192 / tok,
            "peak_gib": peak, "rest_gib": 5.0, "build_gib": 3.0, "loss_first": loss, "finite": True}


def test_report_medians_ratios_and_targets() -> None:
    rows = [_row("1.3b", "fsdp2", r, t, 22.8) for r, t in ((1, 100.0), (2, 90.0), (3, 110.0))]
    rows += [_row("1.3b", "ours-z3", r, t, 22.0) for r, t in ((1, 104.0), (2, 95.0), (3, 113.0))]
    rows += [_row("1.3b", "ceiling", r, 106.0) for r in (1, 2, 3)]
    rows += [{"kind": "skip", "size": "1.3b", "impl": "ours-z2", "rep": 1, "reason": "time budget"}]
    cells = report.summarise(rows)
    z3 = next(c for c in cells if c.impl == "ours-z3")
    assert (z3.tok_s, z3.tok_s_min, z3.tok_s_max, z3.reps) == (104.0, 95.0, 113.0, 3)
    assert report.ratio(cells, "1.3b", "ours-z3", "fsdp2") == pytest.approx(1.04)
    assert report.paired_ratios(cells, "1.3b", "ours-z3", "fsdp2") == pytest.approx([1.04, 95 / 90, 113 / 110])
    verdicts = {t: v for _, t, v in report.targets(cells)}
    assert verdicts["ours-z3 ≥ 1.03× fsdp2"].startswith("met: 1.040, per rep 1.027–1.056")
    assert verdicts["ours-z3 peak ≤ fsdp2 peak"].startswith("met: 22.00 vs 22.80")
    assert verdicts["ours-z3 ≥ 0.97× ceiling"].startswith("met: 0.981")
    assert verdicts["ours-z2 ≥ 1.00× fsdp2-noreshard"] == "n/a (not measured)"
    text = report.markdown(rows)
    assert "| 1.3b | ours-z3 | 3 | 104 | 95–113 |" in text
    assert "- skip: 1.3b ours-z2 rep 1: time budget" in text
    assert "Loss check FAILED" not in text


def test_report_flags_a_different_first_loss() -> None:
    rows = [_row("1.3b", "fsdp2", 1, 100.0), _row("1.3b", "ceiling", 1, 100.0),
            _row("1.3b", "ours-z3", 1, 100.0, loss=11.0)]
    text = report.markdown(rows)
    assert "Loss check FAILED" in text and "1.3b ours-z3: first-step loss 11.0000" in text


def test_param_count_formula_matches_the_model() -> None:
    import torch

    from bench.gpt import GPT, num_params

    for cfg in (impls.SIZES["tiny"], impls.GPTConfig(vocab=100, hidden=32, layers=3, heads=2, seq=16)):
        with torch.device("meta"):
            assert impls.num_params_of(cfg) == num_params(GPT(cfg))


def test_fit_estimate_skips_unsharded_7b_but_not_sharded() -> None:
    h200 = 139 * 2**30
    cfg = impls.SIZES["7b"]
    assert impls.estimated_bytes("ceiling", cfg, 4, 2) > 0.92 * h200
    assert impls.estimated_bytes("ours-z3", cfg, 4, 2) < 0.92 * h200


def test_cpu_smoke_run_of_the_whole_suite(tmp_path) -> None:
    """World 1, gloo: every impl that can run on one CPU rank builds, trains and is freed, each cell
    in a fresh process (one pid per cell, none the driver's); the first losses agree across impls
    (same init and data); the profile path writes its report."""
    out = tmp_path / "s.jsonl"
    cmd = [sys.executable, "-m", "bench.suite", "--device", "cpu", "--sizes", "tiny",
           "--impls", "ours-z3,ours-hsdp,fsdp2,ceiling", "--reps", "2", "--steps", "1", "--warmup", "1",
           "--out", str(out), "--md", str(tmp_path / "s.md"), "--trace-impls", "ours-z3",
           "--trace-size", "tiny", "--trace-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert rows[0]["kind"] == "meta" and rows[0]["world"] == 1 and rows[0]["isolation"] == "one process per cell"
    cells = [(r["rep"], r["impl"]) for r in rows if r["kind"] == "cell"]
    assert cells == [(rep, i) for rep in (1, 2) for i in ("ours-z3", "fsdp2", "ceiling")]
    pids = [r["pid"] for r in rows if r["kind"] == "cell"]
    assert len(set(pids)) == len(pids) == 6, pids
    skips = [r for r in rows if r["kind"] == "skip"]
    assert [s["impl"] for s in skips] == ["ours-hsdp", "ours-hsdp"] and "needs world >= 2" in skips[0]["reason"]
    assert all(r["finite"] and r["tok_s_per_gpu"] > 0 for r in rows if r["kind"] == "cell")
    md = (tmp_path / "s.md").read_text()
    assert "Loss check FAILED" not in md, md
    trace_md = (tmp_path / "trace.md").read_text()
    assert "ours-z3: no GPU events (complete events by category: cpu_op" in trace_md, trace_md
    assert (tmp_path / "trace_ours-z3.json.gz").stat().st_size > 0


def test_cpu_fake_world_run(tmp_path) -> None:
    """``--fake-world 2``: one process acts as rank 0 of 2 (no torchrun); the engines shard for world 2
    and train with collectives that move nothing; DDP is refused with the reason; the report says so."""
    out = tmp_path / "f.jsonl"
    cmd = [sys.executable, "-m", "bench.suite", "--device", "cpu", "--fake-world", "2",
           "--sizes", "tiny", "--impls", "ours-z3,fsdp2,ddp", "--reps", "1", "--steps", "1", "--warmup", "1",
           "--out", str(out), "--md", str(tmp_path / "f.md")]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert rows[0]["kind"] == "meta" and rows[0]["world"] == 2 and rows[0]["fake"] is True
    assert [r["impl"] for r in rows if r["kind"] == "cell"] == ["ours-z3", "fsdp2"], rows
    assert [r["world"] for r in rows if r["kind"] == "cell"] == [2, 2]
    skips = [r for r in rows if r["kind"] == "skip"]
    assert [s["impl"] for s in skips] == ["ddp"] and "fake process group" in skips[0]["reason"]
    md = (tmp_path / "f.md").read_text()
    assert "fake world 2" in md and "Fake world: the verdicts compare" in md
    under_torchrun = subprocess.run(cmd, cwd=REPO, env=_env(WORLD_SIZE="2", RANK="0"), capture_output=True,
                                    text=True, timeout=120)
    assert under_torchrun.returncode != 0 and "without torchrun" in under_torchrun.stderr


def test_world2_cells_under_a_torchrun_driver(tmp_path) -> None:
    """The driver started by torchrun (2 ranks, gloo): rank 0 starts every cell as a fresh 2-rank
    torchrun (the outer ranks' variables do not leak into it), rank 1 has nothing to do; HSDP,
    which needs two ranks, runs."""
    out = tmp_path / "w2.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "bench.suite", "--device", "cpu", "--sizes", "tiny", "--impls", "ours-z3,ours-hsdp",
           "--reps", "1", "--steps", "1", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert rows[0]["world"] == 2 and not rows[0]["fake"]
    cells = [r for r in rows if r["kind"] == "cell"]
    assert [(r["impl"], r["world"]) for r in cells] == [("ours-z3", 2), ("ours-hsdp", 2)], rows
    assert all(r["finite"] for r in cells)


def _tree_copy(root: Path, mark: Path) -> Path:
    """A copy of this checkout's bench/ and fsdp_impl/ whose fsdp_impl records each import in ``mark``."""
    for name in ("bench", "fsdp_impl"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    init = root / "fsdp_impl" / "__init__.py"
    init.write_text(init.read_text() + f"\nwith open({str(mark)!r}, 'a') as _f:\n    _f.write(__file__ + '\\n')\n")
    return root


def test_cells_from_another_source_tree_alternate_in_one_run(tmp_path) -> None:
    """``NAME@LABEL`` runs NAME's cell from the ``--source-tree`` copy (its fsdp_impl is the one
    imported, and only in those cells), alternating with this tree's cells; rows, setups and the
    report name the tree, and the report gives the ratio of the two."""
    mark = tmp_path / "imports.txt"
    tree = _tree_copy(tmp_path / "base", mark)
    out = tmp_path / "ab.jsonl"
    cmd = [sys.executable, "-m", "bench.suite", "--device", "cpu", "--sizes", "tiny",
           "--impls", "ours-z3,ours-z3@base", "--source-tree", f"base={tree}", "--reps", "2", "--steps", "1",
           "--warmup", "1", "--out", str(out), "--md", str(tmp_path / "ab.md")]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert rows[0]["source_trees"] == {"base": str(tree.resolve())}
    assert rows[0]["setups"]["ours-z3@base"].endswith(f"(source tree base: {tree.resolve()})")
    cells = [(r["rep"], r["impl"]) for r in rows if r["kind"] == "cell"]
    assert cells == [(rep, i) for rep in (1, 2) for i in ("ours-z3", "ours-z3@base")], rows
    imports = mark.read_text().splitlines()
    assert len(imports) == 2 and all(line.startswith(str(tree.resolve())) for line in imports), imports
    md = (tmp_path / "ab.md").read_text()
    assert "- tiny: ours-z3 / ours-z3@base throughput" in md, md
