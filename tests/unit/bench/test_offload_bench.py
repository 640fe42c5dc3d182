"""bench/offload_bench.py: the command line refuses what it cannot run, naming the allowed values;
a cell runs as ``python -m bench.offload_bench --one`` in a fresh process whose failure becomes a
row; the table puts each offloaded step against its host<->device bytes over the bandwidth."""
from __future__ import annotations

import argparse

import pytest
import torch

from bench import offload_bench


def test_bad_cells_sizes_and_counts_are_refused_naming_the_allowed_values(capsys: pytest.CaptureFixture) -> None:
    for argv, needle in ((["--cells", "ours,bogus"], "allowed values: ours,ours-gpu"),
                         (["--size", "99b"], "invalid choice: '99b'"), (["--steps", "0"], "must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            offload_bench.parse_args(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    args = offload_bench.parse_args(["--cells", "ours-gpu,fsdp2-offload", "--size", "13b"])
    assert args.cells == ["ours-gpu", "fsdp2-offload"] and offload_bench.SIZES[args.size].hidden == 5120


def test_table_bounds_each_offloaded_step_by_its_bytes_over_the_bandwidth() -> None:
    n = 10**9
    ok = {"status": "ok", "params": n, "tokens_per_s": 1000.0, "step_ms": 900.0, "fwd_bwd_ms": 300.0,
          "opt_ms": 600.0, "peak_gib": 15.2, "rest_gib": 2.4, "host_peak_gib": 104.26, "loss_first": 10.4,
          "loss_last": 10.1}
    rows = [{**ok, "cell": "ours-gpu", "size": "7b"}, {**ok, "cell": "ours", "size": "7b"},
            {"cell": "fsdp2", "size": "7b", "status": "OOM", "detail": "x"},
            {**ok, "cell": "ours-gpu-lean", "size": "9b"}]
    table = offload_bench._table(rows, {"h2d_gbps": 55.0, "d2h_gbps": 55.0, "duplex_each_gbps": 50.0})
    lines = table.splitlines()
    # ours-gpu moves 16 bytes per parameter each way (main params, moments, grads): 16e9 B / 50 GB/s = 320 ms
    assert lines[2].startswith("| ours-gpu | 7b | 1000 | 900 | 300 | 600 | 15.20 | 2.40 | 104.3 |")
    assert lines[2].endswith("| 320 |")
    assert lines[3].endswith("| 10.400/10.100 |  |")  # no offload: no bound
    assert lines[4].startswith("| fsdp2 | 7b | OOM |")
    assert lines[5].endswith("| 200 |")  # the lean cell: 10 bytes per parameter each way


def test_a_cell_runs_in_its_own_process_and_a_failure_is_a_row() -> None:
    args = argparse.Namespace(size="tiny", micro_batch=1, warmup=1, steps=1, timeout=300)
    row = offload_bench._spawn("ours", "tiny", args)
    if torch.cuda.is_available():
        assert row["status"] == "ok" and row["params"] == offload_bench.num_params_of(offload_bench.SIZES["tiny"])
    else:  # the cell needs CUDA: its process fails, and the driver reports it instead of stopping
        assert row["status"] == "error" and row["cell"] == "ours", row
        assert "cuda" in row["detail"].lower(), row


def test_a_size_sweep_steps_each_cell_up_until_it_does_not_train(capsys: pytest.CaptureFixture) -> None:
    fits = {"ours-gpu-hostall": ["1.3b", "7b"], "fsdp2-offload": ["1.3b"]}  # what each cell trains
    calls: list[tuple[str, str]] = []

    def spawn(cell: str, size: str, args: argparse.Namespace) -> dict:
        calls.append((cell, size))
        if size in fits[cell]:
            return {"cell": cell, "size": size, "status": "ok", "tokens_per_s": 100.0 * len(calls), "peak_gib": 9.0}
        return {"cell": cell, "size": size, "status": "OOM", "detail": "CUDA out of memory"}

    sizes = ["1.3b", "7b", "13b"]
    rows = offload_bench.sweep(list(fits), sizes, argparse.Namespace(), spawn=spawn)
    # fsdp2-offload stops at its first failure: 13b is not tried after 7b ran out of memory
    assert calls == [("ours-gpu-hostall", "1.3b"), ("ours-gpu-hostall", "7b"), ("ours-gpu-hostall", "13b"),
                     ("fsdp2-offload", "1.3b"), ("fsdp2-offload", "7b")]
    assert len(capsys.readouterr().out.splitlines()) == len(rows) == 5  # each row printed as it ends
    assert offload_bench.largest(rows, list(fits), sizes).splitlines() == [
        "Largest size trained:", "- ours-gpu-hostall: 7b (200 tokens/s, peak 9.00 GiB)",
        "- fsdp2-offload: 1.3b (400 tokens/s, peak 9.00 GiB)"]
    assert offload_bench.largest([], ["ours"], sizes).endswith("- ours: none of 1.3b,7b,13b")
