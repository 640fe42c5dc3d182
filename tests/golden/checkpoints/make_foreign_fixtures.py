"""Write the committed checkpoints of other engines (run from the repository root, CPU, gloo):

    python tests/golden/checkpoints/make_foreign_fixtures.py fsdp2 tests/golden/checkpoints/fsdp2
    python tests/golden/checkpoints/make_foreign_fixtures.py megatron_fsdp tests/golden/checkpoints/megatron_fsdp

Both train SmallGPT (``tests.functional.common.models``, seed 0) with AdamW on the fixed batches
of ``tests.functional.common.checkpoint_interop`` for ``K_SAVE`` steps on ``WORLD`` = 4 ranks and
save the way the engine's users do:

* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per block and root, ``checkpoint_interop``'s
  two-group AdamW; ``get_state_dict`` into
  ``dcp.save({"model": ..., "optim": ...})``. Its test's reference is FSDP2 itself resuming the
  committed files, so nothing else is recorded.
* ``megatron_fsdp``: Megatron-FSDP 0.6.1's ``fully_shard`` (ZeRO-3, its 4-D mesh) and its README's
  ``dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})`` (uneven row
  chunks, position-keyed optimizer state). Its ``fully_shard`` replaces the optimizer's param
  groups by one group over ``model.parameters()`` with the optimizer's defaults, so the optimizer
  is one ``AdamW(lr=1e-2)`` group (weight decay 0.01), positions in model order. Megatron-FSDP
  runs CUDA-only code paths, so on CPU its CUDA stream/event calls are stubbed (no-ops on one CPU
  stream) and its fused ``PREMUL_SUM`` gradient reduction, which gloo lacks, is replaced by the
  scale-then-``SUM`` path its own code takes when ``gradient_reduce_div_fusion`` is off (the same
  arithmetic). After the save, 2 fresh ranks resume it as its README says (with one zero-learning-
  rate step first, so the optimizer has state for ``dcp.load`` to fill) and train ``N_AFTER``
  steps; ``reference.pt`` records their losses and full parameters: the reference our load must
  match.
  Needs ``pip install megatron-fsdp==0.6.1 einops`` (CPU torch); not a test dependency.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

WORLD = 4
RESUME_WORLD = 2


def _batches(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.functional.common.checkpoint_interop import GLOBAL_BATCH
    from tests.functional.common.models import make_batch

    (idx,), target = make_batch("gpt", GLOBAL_BATCH, seed=1000 + step)
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return idx[part], target[part]


def _train(model: Any, optimizer: Any, steps: range) -> list[float]:
    from tests.functional.common.models import loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        idx, target = _batches(step, rank, world)
        loss = loss_fn("gpt")(model(idx), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _fsdp2(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.functional.common.checkpoint_interop import K_SAVE, fsdp2

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model, optimizer = fsdp2(seed=0)
        _train(model, optimizer, range(K_SAVE))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


class _Event:
    def wait(self, *args: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: return True
    def record(self, *args: Any) -> None: ...


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_stream(self, *args: Any) -> None: ...
    def wait_event(self, *args: Any) -> None: ...
    def record_event(self, *args: Any) -> _Event: return _Event()
    def synchronize(self) -> None: ...


def _megatron_on_cpu() -> Any:
    """Megatron-FSDP 0.6.1 with its CUDA-only calls made CPU no-ops (module docstring)."""
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]
    torch.cuda.Event = _Event  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    import megatron_fsdp
    import megatron_fsdp.param_and_grad_buffer as buffers

    def scale_then_sum(grad_data: torch.Tensor, scaling_factor: Any, ddp_config: Any) -> Any:
        if scaling_factor is not None:
            grad_data.mul_(scaling_factor)
        return dist.ReduceOp.SUM

    buffers.gradient_reduce_preprocessing = scale_then_sum
    return megatron_fsdp


def _megatron_model(seed: int) -> tuple[Any, Any]:
    from tests.functional.common.checkpoint_interop import LR
    from tests.functional.common.mesh import seed_mesh
    from tests.functional.common.models import GPTBlock, build_model

    megatron_fsdp = _megatron_on_cpu()
    module = build_model("gpt", seed=seed)
    mesh = seed_mesh((1, dist.get_world_size(), 1, 1), "cpu")
    # Megatron-FSDP's fully_shard replaces the param groups by one over model.parameters() with the
    # optimizer's defaults anyway: one group here says so
    return megatron_fsdp.fully_shard(module, torch.optim.AdamW(module.parameters(), lr=LR), device_mesh=mesh,
                                     dp_shard_dim="dp_shard", tp_dim="tp", fsdp_unit_modules=[GPTBlock],
                                     zero_dp_strategy=3, device=torch.device("cpu"))


def _megatron_save(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    from tests.functional.common.checkpoint_interop import K_SAVE

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, optimizer = _megatron_model(seed=0)
    _train(model, optimizer, range(K_SAVE))
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=out)
    dist.barrier()
    os._exit(0)  # Megatron-FSDP's background threads abort a normal interpreter exit on CPU


def _megatron_resume(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    from tests.functional.common.checkpoint_interop import K_SAVE, N_AFTER

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    model, optimizer = _megatron_model(seed=99)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:  # one step that changes nothing, so the optimizer has state to load into
        g["lr"] = 0.0
    idx, target = _batches(0, rank, world)
    from tests.functional.common.models import loss_fn

    (loss_fn("gpt")(model(idx), target) * 0).backward()
    optimizer.step()
    optimizer.zero_grad()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=out)
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    losses = _train(model, optimizer, range(K_SAVE, K_SAVE + N_AFTER))
    params = {n[len("module."):]: _full(p) for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"losses": losses, "params": params, "world": world}, Path(out) / "reference.pt")
    dist.barrier()
    os._exit(0)


def _full(param: Any) -> torch.Tensor:
    """A parameter of Megatron-FSDP's uneven row chunks, whole (gathered as objects: gloo's
    all_gather needs equal sizes)."""
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    chunk = gather_and_compute_chunk_metadata(param)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (tuple(chunk.offsets), param.to_local().detach().cpu().clone()))
    full = torch.zeros(param.shape, dtype=param.dtype)
    for offsets, local in parts:
        full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))] = local
    return full


def _spawn(fn: Any, world: int, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(world, str(Path(tmp) / "store"), str(out)), nprocs=world, join=True,
                           start_method="spawn")


def main(argv: list[str]) -> None:
    which, out = argv[0], Path(argv[1])
    if out.exists():
        raise SystemExit(f"{out} exists: fixtures are never overwritten")
    if which == "fsdp2":
        _spawn(_fsdp2, WORLD, out)
    elif which == "megatron_fsdp":
        _spawn(_megatron_save, WORLD, out)
        _spawn(_megatron_resume, RESUME_WORLD, out)
    else:
        raise SystemExit(f"which must be fsdp2 or megatron_fsdp; got {which!r}")
    (out / "FIXTURE.json").write_text(json.dumps({"writer": which, "world": WORLD, "torch": torch.__version__},
                                                 indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
