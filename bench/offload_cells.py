"""The offload bench's cells (``bench.offload_bench``): what each name runs, read back into the
``OffloadPolicy`` fields its name encodes, and the bytes a step of each must move (the floors
``--report-limit`` prints). Kept apart from the runner so the cell vocabulary is one table."""
from __future__ import annotations

import re

import torch

CELLS = {
    "ours": "fsdp_impl ZeRO-3, bf16 module, fp32 main params and grads, torch AdamW (foreach), no offload",
    "ours-gpu": ("as ours + OffloadPolicy() (step='gpu': main params, grads and moments on the host, streamed step; "
                 "a bf16 compute shard stays on the device)"),
    "ours-gpu-hostall": "as ours + OffloadPolicy(params=True, grads=True) (nothing rests on the device)",
    "ours-cpu": "as ours + OffloadPolicy(step='cpu') (host step, torch's fused CPU AdamW)",
    "ours-cpu-lateup-overlap": ("as ours-cpu-overlap with upload_ahead=False (the new weights go up in the next "
                                "forward's gathers, not from the worker after each unit's step)"),
    "ours-cpu-hostall": ("as ours-cpu + params=True (every gather uploads its fp32 host shard, as FSDP2's offload "
                         "does: nothing rests on the device, the device peak FSDP2's)"),
    "ours-cpu-hostall-overlap": ("as ours-cpu-hostall + overlap_step=True (with upload_ahead: each unit's new weights "
                                 "go up after its host step into a copy the next forward's gather consumes; the "
                                 "backward's gathers upload from the host)"),
    "ours-cpu-hostall-hostcopy-overlap": ("as ours-cpu-hostall-overlap + compute_copy_on_host=True (the worker casts "
                                          "each unit's new weights to bf16 in host memory; every upload sends 2 bytes "
                                          "a param instead of 4; +2 host bytes a param)"),
    "ours-cpu-hostall-hostcopy-forward": "as ours-cpu-hostall-hostcopy-overlap with overlap_step='forward'",
    "ours-cpu-hostall-devcopy-overlap": ("as ours-cpu-hostall-overlap + compute_copy_on_host='device' (the device's "
                                         "bf16 cast of each copy uploaded ahead goes down to the host; the backward's "
                                         "gathers send it: 2 bytes a param up, not 4, 2 more down, no host cast)"),
    "ours-cpu-hostall-devcopy-forward": "as ours-cpu-hostall-devcopy-overlap with overlap_step='forward'",
    "ours-cpu-hostall-devcopy-wide-overlap": "as ours-cpu-hostall-devcopy-overlap with step_threads as -wide",
    "ours-cpu-hostall-narrow-overlap": ("as ours-cpu-hostall-overlap with step_threads = one fewer than the caller's "
                                        "throughout (before 2026-12-06's widening: the worker kept one core fewer "
                                        "while step() waited for it)"),
    "ours-cpu-hostall-wide-overlap": ("as ours-cpu-hostall-overlap with step_threads = the caller's width (the "
                                      "default leaves one core to the thread driving the device)"),
    **{f"ours-cpu-hostall-dev{k}-overlap": (f"as ours-cpu-hostall-overlap + device_step_units={k} (the first {k} "
                                             "units in forward order step on the device inside the overlapped step)")
       for k in (4, 8, 12)},
    "ours-cpu-hostall-lateup-overlap": ("as ours-cpu-hostall-overlap with upload_ahead=False (both gathers upload "
                                        "from the host)"),
    "ours-cpu-forward": ("as ours-cpu + overlap_step='forward' (the host step overlaps the backward and runs on "
                         "into the next forward: step() returns at once, each unit's gather waits for its step)"),
    "ours-cpu-hostall-forward": "as ours-cpu-hostall + overlap_step='forward'",
    "ours-cpu-hostall-huge-forward": ("as ours-cpu-hostall-forward with huge_pages=True (host buffers of 2 MiB and "
                                      "more in transparent huge pages)"),
    "ours-cpu-hostall-devcopy-huge-forward": "as ours-cpu-hostall-devcopy-forward with huge_pages=True",
    "ours-cpu-hostall-narrow-forward": ("as ours-cpu-hostall-forward with step_threads = one fewer than the caller's "
                                        "throughout (before 2026-12-06's fifth session \"forward\" did not widen)"),
    "ours-cpu-hostall-overlap-clip": "as ours-cpu-hostall + clip_grad_norm(model, 1.0) + overlap_step='clip'",
    "ours-gpu-lean": ("as ours-gpu with bf16 main grads read as decoupled grads by fsdp_impl.optim.AdamW with bf16 "
                      "moments (10 host bytes a param instead of 16: the largest models)"),
    "ours-gpu-overlap": ("as ours-gpu + overlap_step=True (each unit's streamed step starts as its grads land, "
                         "during the backward)"),
    "ours-cpu-overlap": "as ours-cpu + overlap_step=True (each unit's host step runs during the backward)",
    "ours-gpu-clip": "as ours-gpu + fsdp_impl.clip_grad_norm(model, 1.0) before every step",
    "ours-cpu-clip": "as ours-cpu + fsdp_impl.clip_grad_norm(model, 1.0) before every step",
    "ours-gpu-overlap-clip": ("as ours-gpu-clip + overlap_step='clip' (grad copies and norms during the backward, "
                              "the step after the norm)"),
    "ours-cpu-overlap-clip": "as ours-cpu-clip + overlap_step='clip'",
    "fsdp2": "torch fully_shard per block + root, fp32 module, param bf16 / reduce fp32, AdamW (foreach)",
    "fsdp2-offload": ("as fsdp2 + CPUOffloadPolicy(pin_memory=True), AdamW default (CPU: single-tensor; a secondary "
                      "row: informed users pass fused=True)"),
    "fsdp2-offload-fused": ("THE ANCHOR: as fsdp2-offload with AdamW(fused=True) (torch's fused CPU kernel, as torch's "
                            "documentation suggests for offload)"),
    "fsdp2-offload-fused-clip": ("the anchor with torch.nn.utils.clip_grad_norm_(params, 1.0) before every step (what "
                                 "the -clip cells are put against)"),
}
DEFAULT_CELLS = ("fsdp2-offload-fused", "ours", "ours-gpu", "ours-gpu-hostall", "ours-cpu", "ours-gpu-overlap",
                 "ours-cpu-overlap", "ours-cpu-hostall-overlap", "fsdp2", "fsdp2-offload")
# What the -clip cells clip to (every step, so the step always waits for the global norm)
CLIP_NORM = 1.0
# Every offloaded cell is put against FSDP2 offloading as its informed users run it (issue 48).
ANCHOR = "fsdp2-offload-fused"
ADAM_BYTES = 28  # fused AdamW with fp32 params, grads and moments: p, g, m, v read; p, m, v written


def base_cell(cell: str) -> str:
    """The cell without its ``-overlap``/``-forward``/``-clip`` suffixes (they move the same bytes)."""
    for suffix in ("-clip", "-overlap", "-forward"):
        cell = cell.removesuffix(suffix)
    return cell


def overlap_mode(cell: str) -> bool | str:
    """``OffloadPolicy.overlap_step`` of ``cell``."""
    if cell.endswith("-forward"):
        return "forward"
    if "-overlap" not in cell:
        return False
    return "clip" if cell.endswith("-clip") else True


def host_copy_mode(base: str) -> bool | str:
    """``OffloadPolicy.compute_copy_on_host`` of a cell: -hostcopy casts on the host, -devcopy on the device."""
    return True if "hostcopy" in base else "device" if "devcopy" in base else False


def device_step_units(base: str) -> int:
    """``OffloadPolicy.device_step_units`` of a cell: ``-dev<N>``."""
    found = re.search(r"-dev(\d+)", base)
    return int(found.group(1)) if found else 0


def step_threads(base: str) -> int | None:
    """``OffloadPolicy.step_threads`` of a cell: the caller's width (``-wide``), one fewer
    throughout (``-narrow``), else None (one fewer during the backward, the caller's once
    ``step()`` waits)."""
    width = torch.get_num_threads()
    return width if "-wide" in base else max(1, width - 1) if "-narrow" in base else None


def offload_bytes(cell: str, n: int) -> tuple[int, int]:
    """(H2D, D2H) bytes one training step of ``cell`` moves between host and device, per rank of
    1, fp32 main params/grads/moments, bf16 compute, ZeRO-3 (two gathers per step)."""
    # neither the host step's width nor the page size moves a byte
    cell = base_cell(cell).replace("-wide", "").replace("-narrow", "").replace("-huge", "")
    if cell == "ours-gpu":  # window: main + 2 moments + grads in, main + 2 moments out; grads down after the
        return 16 * n, 12 * n + 4 * n  # backward; gathers from the device compute shard (refreshed from the window)
    if cell == "ours-gpu-hostall":  # window also streams the grads in; grads down after backward; 2 gathers from host
        return 16 * n + 2 * 4 * n, 12 * n + 4 * n
    if cell == "ours-gpu-lean":  # as ours-gpu with 2-byte grads and moments: in 4 + 2 + 2 * 2, out 4 + 2 * 2 + 2
        return 10 * n, 10 * n
    if cell in ("ours-cpu", "ours-cpu-lateup"):  # grads down; the bf16 compute shard refreshed once per step (fp32 up)
        return 4 * n, 4 * n
    if cell in ("ours-cpu-hostall", "ours-cpu-hostall-lateup"):  # fp32 host shard up for each of 2 gathers
        # (made ahead by the worker or by the forward's gather: the same bytes), grads down (FSDP2's bytes)
        return 2 * 4 * n, 4 * n
    if cell == "ours-cpu-hostall-hostcopy":  # the host bf16 copy up for each of 2 gathers, grads down
        return 2 * 2 * n, 4 * n
    if cell == "ours-cpu-hostall-devcopy":  # fp32 up ahead, its bf16 cast down, that copy up again; grads down
        return 4 * n + 2 * n, 4 * n + 2 * n
    if cell.startswith("fsdp2-offload"):  # fp32 sharded params up for each of 2 gathers, grads down
        return 2 * 4 * n, 4 * n
    return 0, 0


def host_bytes(cell: str, n: int) -> int:
    """Bytes the host's cores move in one training step of ``cell`` where the optimizer steps on
    the host (``ours-cpu*``, FSDP2's offload): the fused Adam's (``ADAM_BYTES`` a param) and
    ``-hostcopy``'s cast (fp32 read, bf16 written: 6 a param); 0 for the other cells and for those
    whose bytes ``offload_bytes`` does not model (``-dev{k}``: part of the step on the device).
    The DMA is left out: the copy engines add traffic the Adam's threads could not have used (on
    one H100 host a 6.6B step ran in 2,396 ms under a floor that counted it, 2,854)."""
    base = base_cell(cell)
    h2d, d2h = offload_bytes(cell, n)
    if not base.startswith(("ours-cpu", "fsdp2-offload")) or not (h2d or d2h):
        return 0
    return ADAM_BYTES * n + (6 * n if "-hostcopy" in base else 0)
