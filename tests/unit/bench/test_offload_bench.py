"""bench/offload_bench.py: the command line refuses what it cannot run, naming the allowed values;
a cell runs as ``python -m bench.offload_bench --one`` in a fresh process whose failure becomes a
row; the table puts each offloaded step against its host<->device bytes over the bandwidth."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import offload_bench, offload_cells


def test_bad_cells_sizes_and_counts_are_refused_naming_the_allowed_values(capsys: pytest.CaptureFixture) -> None:
    for argv, needle in ((["--cells", "ours,bogus"], "allowed values: ours,ours-gpu"),
                         (["--size", "99b"], "invalid choice: '99b'"), (["--steps", "0"], "must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            offload_bench.parse_args(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    args = offload_bench.parse_args(["--cells", "ours-gpu,fsdp2-offload", "--size", "13b"])
    assert args.cells == ["ours-gpu", "fsdp2-offload"] and offload_bench.SIZES[args.size].hidden == 5120


def _ok_row(n: int) -> dict[str, object]:
    """A measured row of a model of ``n`` params (the cell and size left to the caller)."""
    return {"status": "ok", "params": n, "tokens_per_s": 1000.0, "step_ms": 900.0, "fwd_bwd_ms": 300.0,
            "opt_ms": 600.0, "peak_gib": 15.2, "rest_gib": 2.4, "host_peak_gib": 104.26, "loss_first": 10.4,
            "loss_last": 10.1}


def test_table_bounds_each_offloaded_step_by_its_bytes_over_the_bandwidth() -> None:
    n = 10**9
    ok = _ok_row(n)
    rows = [{**ok, "cell": "ours-gpu", "size": "7b"}, {**ok, "cell": "ours", "size": "7b"},
            {"cell": "fsdp2", "size": "7b", "status": "OOM", "detail": "x"},
            {**ok, "cell": "ours-gpu-lean", "size": "9b"}]
    table = offload_bench._table(rows, {"h2d_gbps": 55.0, "d2h_gbps": 55.0, "duplex_each_gbps": 50.0})
    lines = table.splitlines()
    # ours-gpu moves 16 bytes per parameter each way (main params, moments, grads): 16e9 B / 50 GB/s = 320 ms
    assert lines[2].startswith("| ours-gpu | 7b | 1000 |  | 900 | 300 | 600 | 15.20 | 2.40 | 104.3 |")  # no anchor row
    # the host-memory floor: the host steps nothing here (and no host AdamW rate was measured)
    assert lines[2].endswith("| 320 |  |  |")  # the last column: not an overlapped cell
    assert lines[3].endswith("| 10.400/10.100 |  |  |  |")  # no offload: no bound
    assert lines[4].startswith("| fsdp2 | 7b | OOM |")
    assert lines[5].endswith("| 200 |  |  |")  # the lean cell: 10 bytes per parameter each way


def test_the_host_memory_floor_counts_the_host_adam_and_a_host_cast() -> None:
    """A host-stepped cell's floor: (28 bytes a param of fused AdamW + the host cast's 6) over the
    host's faster AdamW rate; not the DMA (the copy engines' traffic is not the cores'); none where
    the host steps nothing or part of the step runs on the device."""
    n = 10**9
    for cell in ("fsdp2-offload-fused", "ours-cpu-hostall-forward", "ours-cpu-hostall-narrow-overlap",
                 "ours-cpu-hostall-huge-forward", "ours-cpu-overlap",
                 "ours-cpu-hostall-devcopy-overlap"):  # the devcopy's cast runs on the device
        assert offload_cells.host_bytes(cell, n) == 28 * n, cell
    assert offload_cells.host_bytes("ours-cpu-hostall-hostcopy-overlap", n) == (28 + 6) * n
    for cell in ("ours-gpu", "ours", "fsdp2", "ours-cpu-hostall-dev4-overlap"):
        assert offload_cells.host_bytes(cell, n) == 0, cell
    ok = _ok_row(n)
    rows = [{**ok, "cell": "fsdp2-offload-fused", "size": "7b"}, {**ok, "cell": "ours-gpu", "size": "7b"}]
    bw = {"h2d_gbps": 55.0, "d2h_gbps": 55.0, "duplex_each_gbps": 50.0, "host_adam_gbps": 140.0,
          "host_adam_spare_gbps": 160.0}  # one thread fewer ran faster: the floor takes the faster rate
    lines = offload_bench._table(rows, bw).splitlines()
    assert lines[2].endswith("| 160 | 175 |  |")  # link: 8e9 B / 50 GB/s; host: 28e9 B / 160 GB/s
    assert lines[3].endswith("| 320 |  |  |")


def test_a_cell_runs_in_its_own_process_and_a_failure_is_a_row() -> None:
    """``--size tiny`` runs on the CPU too (gloo); a cell the machine cannot run (the streamed
    step without CUDA) is a row with its error, and the driver goes on."""
    args = argparse.Namespace(size="tiny", micro_batch=1, warmup=1, steps=1, timeout=300)
    row = offload_bench._spawn("ours-cpu-overlap", "tiny", args)
    assert row["status"] == "ok" and row["params"] == offload_bench.num_params_of(offload_bench.SIZES["tiny"]), row
    assert 0.0 <= row["overlap_share"] <= 1.0 and row["overlap_total_ms"] > 0, row
    hostall = offload_bench._spawn("ours-cpu-hostall-overlap", "tiny", args)  # gathers from the host shard
    assert hostall["status"] == "ok" and hostall["losses"] == row["losses"], (hostall, row)
    late = offload_bench._spawn("ours-cpu-hostall-lateup-overlap", "tiny", args)  # no copy uploaded ahead
    assert late["status"] == "ok" and late["losses"] == row["losses"], (late, row)
    half = offload_bench._spawn("ours-cpu-hostall-hostcopy-overlap", "tiny", args)  # uploads the host bf16 copy
    assert half["status"] == "ok" and half["losses"] == row["losses"], (half, row)
    down = offload_bench._spawn("ours-cpu-hostall-devcopy-overlap", "tiny", args)  # the device's cast brought down
    assert down["status"] == "ok" and down["losses"] == row["losses"], (down, row)
    # where the worker's time went: each phase of its unit tasks, their sum within its busy time
    phases = {k: v for k, v in half.items() if k.startswith("worker_")}
    rates = [half.get(k) for k in ("adam_gbs_during_bwd", "adam_gbs_after_bwd")]  # its host Adam's rate
    assert any(r is not None for r in rates) and all(r is None or r > 0 for r in rates), half
    assert set(phases) == {f"worker_{p}_ms" for p in ("grads", "step", "host_copy", "upload")}, half
    assert phases["worker_step_ms"] > 0 and sum(phases.values()) <= half["overlap_total_ms"] * 1.001, half
    args.steps = 2  # the step running on into the forward: the same losses, its share measured
    runs_on = offload_bench._spawn("ours-cpu-hostall-forward", "tiny", args)
    base = offload_bench._spawn("ours-cpu-hostall-overlap", "tiny", args)
    assert runs_on["status"] == "ok" and runs_on["losses"] == base["losses"], (runs_on, base)
    assert 0.0 <= runs_on["overlap_share"] <= 1.0 and runs_on["overlap_total_ms"] > 0, runs_on
    if not torch.cuda.is_available():
        row = offload_bench._spawn("ours-gpu", "tiny", args)
        assert row["status"] == "error" and row["cell"] == "ours-gpu", row
        assert "cuda" in row["detail"].lower(), row


def test_overlap_cells_their_policy_bytes_and_hidden_share() -> None:
    """The -overlap/-clip suffixes pick overlap_step and move the bytes of their base cell; the
    hidden share is the overlapped host time before the backward ended over all of it."""
    assert [offload_cells.overlap_mode(c) for c in ("ours-cpu", "ours-cpu-clip", "ours-gpu-overlap",
                                                    "ours-gpu-overlap-clip", "ours-cpu-hostall-forward")] == [
        False, False, True, "clip", "forward"]
    assert offload_cells.base_cell("ours-cpu-hostall-forward") == "ours-cpu-hostall"
    assert offload_cells.base_cell("ours-gpu-overlap-clip") == "ours-gpu"
    assert offload_cells.offload_bytes("ours-cpu-overlap", 10) == offload_cells.offload_bytes("ours-cpu", 10)
    assert offload_cells.offload_bytes("ours-cpu", 10) == (40, 40)
    # params=True: each of ZeRO-3's two gathers uploads the fp32 host shard, as FSDP2's offload does
    assert offload_cells.offload_bytes("ours-cpu-hostall-overlap", 10) == offload_cells.offload_bytes(
        "fsdp2-offload-fused", 10) == offload_cells.offload_bytes("ours-cpu-hostall-lateup-overlap", 10) == (80, 40)
    assert offload_cells.offload_bytes("ours-cpu-hostall-hostcopy-forward", 10) == (40, 40)  # bf16 up
    assert offload_cells.offload_bytes("ours-cpu-hostall-devcopy-overlap", 10) == (60, 60)  # fp32 + bf16 up, bf16 down
    assert offload_cells.offload_bytes("ours-cpu-hostall-wide-overlap", 10) == (80, 40)
    assert offload_cells.offload_bytes("ours-cpu-hostall-huge-forward", 10) == (80, 40)  # the page size moves no byte
    assert [offload_bench.host_copy_mode(offload_cells.base_cell(c)) for c in (
        "ours-cpu-hostall-overlap", "ours-cpu-hostall-hostcopy-forward", "ours-cpu-hostall-devcopy-overlap")] == [
        False, True, "device"]
    assert [offload_bench.device_step_units(offload_cells.base_cell(c)) for c in (
        "ours-cpu-hostall-overlap", "ours-cpu-hostall-devcopy-overlap", "ours-cpu-hostall-dev12-overlap")] == [0, 0, 12]
    assert "ours-cpu-hostall-dev8-overlap" in offload_cells.CELLS
    busy = [(0.0, 0.004), (0.004, 0.010), (0.012, 0.014)]  # seconds; the backward ended at 8 ms
    hidden, total = offload_bench.overlap_share(busy, 0.008)
    assert hidden == pytest.approx(8.0) and total == pytest.approx(12.0)
    assert offload_bench.overlap_share([], 1.0) == (0.0, 0.0)


def test_host_bandwidth_counts_bytes_read_and_written_and_restores_the_width() -> None:
    """The host memory probe (``--bandwidth``): GB/s of a copy and of fused AdamW, at the caller's
    width and one thread narrower; the caller's width is left as it was."""
    width = torch.get_num_threads()
    a, b = torch.empty(1 << 20), torch.empty(1 << 20)
    out = offload_bench.host_bandwidth(a, b, repeat=2)
    assert torch.get_num_threads() == width
    keys = {f"host_{kind}{tag}_gbps" for kind in ("copy", "adam") for tag in ("", "_spare")}
    assert set(out) == keys and all(0 < v < 1e5 for v in out.values()), out
    assert torch.isfinite(a).all()  # the probe's AdamW ran on zeros: nothing non-finite left behind


def test_clip_cells_are_put_against_the_anchor_clipping_too() -> None:
    ok = {"status": "ok", "size": "1.3b", "params": 10, "step_ms": 1.0, "fwd_bwd_ms": 1.0, "opt_ms": 0.0,
          "peak_gib": 1.0, "rest_gib": 0.5, "loss_first": 1.0, "loss_last": 0.5}
    rows = [{**ok, "cell": "fsdp2-offload-fused", "tokens_per_s": 100.0},
            {**ok, "cell": "fsdp2-offload-fused-clip", "tokens_per_s": 80.0},
            {**ok, "cell": "ours-cpu-overlap-clip", "tokens_per_s": 120.0, "overlap_share": 0.756,
             "overlap_total_ms": 41.2, "overlap_hidden_ms": 31.1},
            {**ok, "cell": "ours-cpu-overlap", "tokens_per_s": 150.0}]
    lines = offload_bench._table(rows, None).splitlines()
    assert lines[4].startswith("| ours-cpu-overlap-clip | 1.3b | 120 | 1.50x c |")  # 120 / 80, the clipping anchor
    assert lines[4].endswith("| 41 (76 %) |")
    assert lines[5].startswith("| ours-cpu-overlap | 1.3b | 150 | 1.50x |")  # 150 / 100
    no_clip_anchor = offload_bench._table([rows[0], rows[2]], None).splitlines()
    assert no_clip_anchor[3].startswith("| ours-cpu-overlap-clip | 1.3b | 120 | 1.20x |")  # falls back to the anchor


def test_a_size_sweep_steps_each_cell_up_until_it_does_not_train(capsys: pytest.CaptureFixture) -> None:
    """Rounds alternate the cells at each size (issue 48: a drift of the host's speed falls on all)."""
    fits = {"ours-gpu-hostall": ["1.3b", "7b"], "fsdp2-offload": ["1.3b"]}  # what each cell trains
    calls: list[tuple[str, str]] = []

    def spawn(cell: str, size: str, args: argparse.Namespace) -> dict:
        calls.append((cell, size))
        if size in fits[cell]:
            return {"cell": cell, "size": size, "status": "ok", "tokens_per_s": 100.0 * len(calls), "peak_gib": 9.0}
        return {"cell": cell, "size": size, "status": "OOM", "detail": "CUDA out of memory"}

    sizes = ["1.3b", "7b", "13b"]
    seen: list[int] = []
    rows = offload_bench.sweep(list(fits), sizes, argparse.Namespace(reps=1), spawn=spawn,
                               on_row=lambda so_far: seen.append(len(so_far)))
    assert seen == [1, 2, 3, 4, 5]  # the rows so far after each run (what --out keeps if stopped)
    # fsdp2-offload stops at its first failure: 13b is not tried after 7b ran out of memory
    assert calls == [("ours-gpu-hostall", "1.3b"), ("fsdp2-offload", "1.3b"), ("ours-gpu-hostall", "7b"),
                     ("fsdp2-offload", "7b"), ("ours-gpu-hostall", "13b")]
    assert len(capsys.readouterr().out.splitlines()) == len(rows) == 5  # each row printed as it ends
    assert offload_bench.largest(rows, list(fits), sizes).splitlines() == [
        "Largest size trained:", "- ours-gpu-hostall: 7b (300 tokens/s, peak 9.00 GiB)",
        "- fsdp2-offload: 1.3b (200 tokens/s, peak 9.00 GiB)"]
    assert offload_bench.largest([], ["ours"], sizes).endswith("- ours: none of 1.3b,7b,13b")


def test_results_are_replaced_whole(tmp_path) -> None:
    out = tmp_path / "r.json"
    offload_bench.write_results(out, {"cells": [1], "complete": False})
    offload_bench.write_results(out, {"cells": [1, 2], "complete": True})
    assert json.loads(out.read_text()) == {"cells": [1, 2], "complete": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left


def test_medians_of_fresh_runs_are_put_against_fsdp2_with_its_fused_adamw() -> None:
    """Three runs a cell: the median run stands for it, and every row is divided by the anchor's
    median at the same size (FSDP2 + CPUOffloadPolicy + AdamW(fused=True), not its unfused cell)."""
    speeds = {"fsdp2-offload-fused": [100.0, 300.0, 200.0], "fsdp2-offload": [60.0, 50.0, 70.0],
              "ours-gpu": [250.0, 210.0, 400.0]}
    seen: dict[str, int] = {}

    def spawn(cell: str, size: str, args: argparse.Namespace) -> dict:
        i = seen[cell] = seen.get(cell, -1) + 1
        return {"cell": cell, "size": size, "status": "ok", "tokens_per_s": speeds[cell][i], "params": 10,
                "step_ms": 1.0, "fwd_bwd_ms": 1.0, "opt_ms": 0.0, "peak_gib": 1.0, "rest_gib": 0.5,
                "loss_first": 1.0, "loss_last": 0.5}

    runs = offload_bench.sweep(list(speeds), ["1.3b"], argparse.Namespace(reps=3), spawn=spawn)
    assert [r["rep"] for r in runs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    rows = offload_bench.medians(runs)
    assert [(r["cell"], r["tokens_per_s"], r["runs"]) for r in rows] == [
        ("fsdp2-offload-fused", 200.0, 3), ("fsdp2-offload", 60.0, 3), ("ours-gpu", 250.0, 3)]
    assert offload_bench.versus_anchor(rows) == {("fsdp2-offload-fused", "1.3b"): 1.0,
                                                 ("fsdp2-offload", "1.3b"): 0.3, ("ours-gpu", "1.3b"): 1.25}
    lines = offload_bench._table(rows, None).splitlines()
    assert "vs fsdp2-offload-fused" in lines[0]
    assert lines[3].startswith("| fsdp2-offload | 1.3b | 60 | 0.30x |")
    assert lines[4].startswith("| ours-gpu | 1.3b | 250 | 1.25x |")
    assert offload_cells.DEFAULT_CELLS[0] == offload_bench.ANCHOR == "fsdp2-offload-fused"


def test_a_failed_run_stands_for_its_cell_and_the_cell_leaves_the_race() -> None:
    def spawn(cell: str, size: str, args: argparse.Namespace) -> dict:
        if cell == "ours-gpu" and size == "7b":
            return {"cell": cell, "size": size, "status": "OOM", "detail": "CUDA out of memory"}
        return {"cell": cell, "size": size, "status": "ok", "tokens_per_s": 1.0}

    runs = offload_bench.sweep(["ours-gpu", "ours"], ["1.3b", "7b", "13b"], argparse.Namespace(reps=2), spawn=spawn)
    assert [(r["cell"], r["size"]) for r in runs if r["size"] != "1.3b"] == [
        ("ours-gpu", "7b"), ("ours", "7b"), ("ours", "7b"), ("ours", "13b"), ("ours", "13b")]
    rows = offload_bench.medians(runs)
    assert [(r["cell"], r["size"], r["status"]) for r in rows if r["cell"] == "ours-gpu"] == [
        ("ours-gpu", "1.3b", "ok"), ("ours-gpu", "7b", "OOM")]


def test_adam_rates_split_each_units_elements_at_the_end_of_the_backward() -> None:
    """The worker's host Adam rate during the backward and after it: a unit stepped across the
    end counts its elements in proportion to its time on each side; no Adam on a side: None."""
    stepped = [(0.0, 1.0, 100), (1.0, 3.0, 400), (3.0, 4.0, 100)]  # seconds, elements; bwd ended at 2 s
    during, after = offload_bench.adam_rates(stepped, 2.0, bytes_per_elem=1)
    assert during == pytest.approx((100 + 200) / 2.0 / 1e9) and after == pytest.approx((200 + 100) / 2.0 / 1e9)
    assert offload_bench.adam_rates(stepped, 10.0, bytes_per_elem=1)[1] is None
    assert offload_bench.adam_rates(stepped, -1.0)[0] is None
    assert offload_bench.adam_rates(stepped, 4.0)[0] == pytest.approx(600 * offload_bench.ADAM_BYTES / 4.0 / 1e9)
    assert offload_bench.adam_rates([], 1.0) == (None, None)
