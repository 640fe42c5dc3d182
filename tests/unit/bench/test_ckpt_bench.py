"""bench/ckpt_bench.py: the command line names its allowed values, the table flags a peak above the
issue's 1.1x bound, and a CPU smoke run (one gloo process, tiny GPT) performs every operation,
reports the bytes each wrote and leaves nothing in ``--dir``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ckpt_bench

REPO = Path(__file__).resolve().parents[3]


def test_bad_arguments_are_refused_naming_the_allowed_values(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    for argv, needle in ((["--dir", str(tmp_path), "--ops", "save,bogus"], "allowed values: save,load"),
                         (["--dir", str(tmp_path), "--size", "99b"], "invalid choice: '99b'"),
                         ([], "the following arguments are required: --dir")):
        with pytest.raises(SystemExit) as exc:
            ckpt_bench.parse_args(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


def test_table_flags_a_peak_above_the_bound() -> None:
    rows = [{"op": "export_hf", "seconds": 1.0, "peak_gib": 23.0, "peak_vs_train": 1.15, "within_bound": False,
             "bytes_written": 10},
            {"op": "import_hf", "seconds": 2.0, "peak_gib": 20.0, "peak_vs_train": 1.0, "within_bound": True,
             "bytes_written": 0}]
    lines = ckpt_bench.markdown(rows).splitlines()
    assert lines[2] == "| export_hf | 1.000 | 23.00 | 1.150 | NO | 10 |"
    assert lines[3] == "| import_hf | 2.000 | 20.00 | 1.000 | yes | 0 |"


def test_cpu_smoke_run_performs_every_operation(tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="import_hf reads safetensors files: pip install -e '.[hf]'")
    out = tmp_path / "rows.json"
    # a one-rank run outside torchrun (the bench then uses an in-process store)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-m", "bench.ckpt_bench", "--device", "cpu", "--size", "tiny", "--dir",
                          str(tmp_path / "ck"), "--warmup", "1", "--micro-batch", "1", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r["op"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["train_step", *ckpt_bench.OPS]
    assert all(rows[op]["bytes_written"] > 100_000 for op in ("save", "save_torch_dcp", "export_hf"))
    assert rows["export_hf"]["bytes_written"] >= 4 * rows["export_hf"]["params"]  # fp32, every tensor once
    assert list((tmp_path / "ck").iterdir()) == [], "the bench left checkpoints behind"
