"""Each suite cell in its own process: how a child's end becomes a row (crash, signal, time-out, the
cell's own error), the children's environment and command line, the driver's order with failing
cells, and ``--device cpu`` staying on the CPU when the engine would pick CUDA for its mesh."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import cli, launch, suite
from bench.launch import Finished, World

REPO = Path(__file__).resolve().parents[3]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_crashing_child_is_reported_with_its_signal_and_last_lines() -> None:
    done = launch.run(_py("import os, sys; print('about to abort', flush=True); os.abort()"), None, 60)
    assert done.returncode < 0 and not done.timed_out
    assert done.why().startswith("killed by SIGABRT; last output: about to abort"), done.why()


def test_a_failing_child_is_reported_with_its_exit_code(capsys) -> None:
    done = launch.run(_py("import sys; print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(3)"),
                      None, 60, prefix="[cell] ")
    assert done.why() == "exited with code 3; last output: torch.OutOfMemoryError: CUDA out of memory"
    assert "[cell] torch.OutOfMemoryError" in capsys.readouterr().out  # echoed as it runs


def test_a_hung_child_is_killed_at_its_time_limit() -> None:
    done = launch.run(_py("import time; print('working', flush=True); time.sleep(600)"), None, 2)
    assert done.timed_out and done.seconds < 60
    assert done.why().startswith("timed out after 2s (killed)")


def test_cell_row_prefers_the_cells_own_row(tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    crashed = Finished(-9, False, 3.0, ("Killed",))
    assert suite.cell_row(crashed, result, "1.3b", "megatron-fsdp", 2) == {
        "kind": "error", "size": "1.3b", "impl": "megatron-fsdp", "rep": 2,
        "reason": "cell process killed by SIGKILL; last output: Killed"}
    result.write_text(json.dumps({"kind": "error", "reason": "OutOfMemoryError: CUDA out of memory", "rep": 2}))
    assert suite.cell_row(crashed, result, "1.3b", "megatron-fsdp", 2)["reason"].startswith("OutOfMemoryError")


def _args(**kw: object) -> argparse.Namespace:
    base = dict(sizes=["tiny"], impls=["ours-z3", "fsdp2", "ceiling"], reps=2, steps=1, warmup=1, micro_batch=4,
                time_budget_s=float("inf"))
    return argparse.Namespace(**{**base, **kw})


def test_driver_keeps_order_and_goes_on_after_failed_cells(tmp_path: Path) -> None:
    """Repetitions alternate the implementations; a crashed cell and a timed-out cell become error
    rows with the reason and the next cells still run."""
    calls: list[tuple[str, str, int]] = []

    def start(size: str, name: str, rep: int, result: Path) -> Finished:
        calls.append((size, name, rep))
        if name == "fsdp2" and rep == 1:
            return Finished(-11, False, 1.0, ("Segmentation fault",))
        if name == "ceiling" and rep == 2:
            return Finished(-15, True, 5.0, ())
        result.write_text(json.dumps({"kind": "cell", "size": size, "impl": name, "rep": rep, "tok_s_per_gpu": 1.0,
                                      "step_s": 1.0, "peak_gib": 0.0, "loss_first": 6.0, "loss_last": 6.0,
                                      "cell_s": 0.5}))
        return Finished(0, False, 1.0, ())

    out = suite.Writer(tmp_path / "rows.jsonl")
    suite.run_cells(_args(), World(1, 0, "cpu"), {"total_memory": 0}, out, start)
    out.close()
    assert calls == [("tiny", n, r) for r in (1, 2) for n in ("ours-z3", "fsdp2", "ceiling")]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["impl"], r["rep"]) for r in rows] == [
        ("cell", "ours-z3", 1), ("error", "fsdp2", 1), ("cell", "ceiling", 1),
        ("cell", "ours-z3", 2), ("cell", "fsdp2", 2), ("error", "ceiling", 2)]
    assert rows[1]["reason"] == "cell process killed by SIGSEGV; last output: Segmentation fault"
    assert rows[5]["reason"].startswith("cell process timed out after 5s")


def test_fit_check_uses_the_probed_memory_and_no_gpu_means_no_check() -> None:
    budget = suite.Budget(float("inf"))
    h200 = {"total_memory": 139 * 2**30}
    assert suite.skip_reason("ceiling", "7b", World(2), h200, 4, budget).startswith("would not fit")
    assert suite.skip_reason("ours-z3", "7b", World(2), h200, 4, budget) is None
    assert suite.skip_reason("ceiling", "7b", World(2), {"total_memory": 0}, 4, budget) is None


def test_child_env_and_command(monkeypatch) -> None:
    """No outer torchrun variables in a child, the repository importable, multicast off; ``--device
    cpu`` hides the GPUs; more than one rank is a torchrun of the module."""
    import os

    outer = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"}
    for k, v in outer.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    env = launch.child_env(World(1, 0, "cpu"))
    assert not set(outer) & set(env)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NCCL_NVLS_ENABLE"] == "0"
    assert launch.child_env(World(2, 0, "auto"))["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert launch.command(World(1, 2, "cpu"), "bench.cell", ["--rep", "1"]) == [
        sys.executable, "-m", "bench.cell", "--rep", "1", "--device", "cpu", "--fake-world", "2"]
    assert launch.command(World(4, 0, "cuda"), "bench.cell", [])[1:8] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "bench.cell"]


def test_driver_world_from_flags_and_torchrun(monkeypatch) -> None:
    for k in launch.TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    assert launch.driver_world(None, 0, "auto") == World(1, 0, "auto")
    assert launch.driver_world(2, 0, "cpu") == World(2, 0, "cpu")
    assert launch.driver_world(None, 2, "cpu") == World(1, 2, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch.driver_world(None, 0, "cuda") is None  # rank 0 drives
    monkeypatch.setenv("RANK", "0")
    assert launch.driver_world(None, 0, "cuda") == World(2, 0, "cuda")
    with pytest.raises(SystemExit, match="without torchrun"):
        launch.driver_world(None, 2, "cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="one node"):
        launch.driver_world(None, 0, "cuda")


def test_cli_forward_passes_set_flags_only() -> None:
    args = argparse.Namespace(steps=8, micro_batch=4, fake_world=0, impls=["a", "b"], part=True, md=None)
    assert cli.forward(args, ("steps", "micro_batch", "fake_world", "impls", "part", "md")) == [
        "--steps", "8", "--micro-batch", "4", "--impls", "a,b", "--part"]


def test_device_cpu_stays_on_cpu_where_the_engine_would_build_a_cuda_mesh(tmp_path: Path) -> None:
    """On a GPU node, ``fsdp_impl`` builds its default mesh on CUDA under the fake backend; a
    ``--device cpu --fake-world 2`` cell must still train its CPU model (the bench passes its own
    mesh on the run's device). Emulated here by making the engine's default mesh CUDA."""
    result = tmp_path / "row.json"
    code = f"""
        import fsdp_impl.mesh
        fsdp_impl.mesh.default_device_type = lambda: "cuda"  # what the engine picks on a GPU node
        from bench import cell
        cell.main(["--impl", "ours-z3", "--size", "tiny", "--steps", "1", "--warmup", "1", "--device", "cpu",
                   "--fake-world", "2", "--result", {str(result)!r}])
    """
    env = launch.child_env(World(1, 2, "cpu"))
    proc = subprocess.run(_py(code), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(result.read_text())
    assert row["kind"] == "cell" and row["world"] == 2 and row["device"] == "cpu", row
