"""The golden cells: short fixed-seed training runs whose per-step numbers are kept as reviewed
per-platform files (``tests/golden/<platform>/<cell>.json``, ``harness.golden``).

Each cell trains ``STEPS`` steps and records per step: the loss (mean over the data-parallel
ranks), the global grad norm (``fsdp_impl.clip_grad_norm`` at ``CLIP``, which also clips), and a
checksum of the parameters (the global sum of squares of every full parameter, in float64). Every
rank computes the same numbers (they are reduced), so the comparison is the same on every rank.
Runs use one intra-op thread, so a CPU result does not depend on the machine's core count, and
the golden tests run them with pinned numerics (``harness.numerics``), so CPU results do not
depend on the machine's CPU either. For that, CPU cells step with torch's *fused* Adam(W): the
default Adam's ``sqrt`` runs in MKL's vector math library, whose bits follow the CPU (the one cell
with the precision-aware AdamW, ``zero3_decoupled_adamw``, still calls it: its fingerprint names the
CPU kind, so on another kind it is compared within its band). bf16 models are built in fp32 and
cast, so a torch release that changes the bf16 random path does not change them.

Together the cells cover the matrix axes: ZeRO 0-3, HSDP and HFSDP, CP and TP meshes, bf16
compute with fp32 main params, decoupled grads with the precision-aware AdamW (bf16 moments),
activation recompute, and the torch-native FP8 recipes (``GPU_CELLS`` add TransformerEngine
recipes on GPUs; ``GPU_CELLS`` run at world 1). Five cells exist so that the golden cells see
bug classes of training patterns the others do not use (``python -m tests.mutants.runner
--golden``): ``zero3_meta_init`` builds the model on the meta device (an RNG that differs per rank
or repeats per shard changes the weights; its numbers equal ``zero3``'s, meta init being
bit-identical to eager init); ``zero2_layer_drop`` skips a block in every third forward (layer
drop: a ZeRO-1/2 refresh gather prefetched for a unit that did not run must not be used after the
next step); ``zero3_hand_grad`` zeroes grads with ``set_to_none=False`` and adds a hand-written
weight-decay gradient into ``.grad`` before each backward (the reduction must add to it, not
overwrite it); ``zero1_fused_adamw`` steps with torch's fused AdamW and weight decay (a fused
kernel bumps no version counter: the engine must still learn that the weights changed);
``zero3_offload`` keeps optimizer state and main params in host memory and streams the step in
small chunks (``OffloadPolicy(step="gpu")``, on a CPU mesh through ``fsdp_impl._testing.STREAMED_STEP_ON_CPU``:
every chunk's update must reach the host); ``zero3_offload_overlap`` is the same run with
``overlap_step="clip"`` (grads copied and normed as each unit's reduction lands, during the
backward): the same numbers bit for bit, so its file equals ``zero3_offload``'s.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_impl
from fsdp_impl._testing import STREAMED_STEP_ON_CPU
from fsdp_impl.placement import local_tensor

from . import fp8_training
from .mesh import data_group, data_position, seed_kwargs, seed_mesh
from .models import SmallGPT, build_model, loss_fn, make_batch, unit_classes
from .recompute import RecomputeBlock, build_net

STEPS = 20
CLIP = 1.0
LOCAL_BATCH = 2
LR = 1e-2
HAND_DECAY = 1e-2  # zero3_hand_grad: the weight-decay gradient added into .grad by hand
WEIGHT_DECAY = 1e-2  # zero1_fused_adamw
OFFLOAD_CHUNK_BYTES = 4096  # small, so the tiny model's streamed step has several chunks
# A deliberate learning-rate perturbation for the whole run (e.g. ``1.000001``): the sign-off's
# acceptance test proves a 1e-6 change drifts. Never honoured under --golden-update (it would write
# perturbed golden files).
ENV_LR_SCALE = "FSDP_GOLDEN_LR_SCALE"


@dataclass(frozen=True)
class Cell:
    """One golden cell. ``mesh``: ``(dp_outer, dp_shard, cp, tp)`` (None: a 1-D mesh over the world)."""

    name: str
    world: int
    model: str = "gpt"  # "gpt" (tied embedding), "gpt_layer_drop", "recompute" (inside-unit recompute), "fp8", "te"
    zero: int = 3
    mesh: tuple[int, int, int, int] | None = None
    outer: str | None = None
    dtype: torch.dtype = torch.float32  # compute dtype (main params and grads stay fp32)
    # "adam_fused" / "adamw_fused": torch's fused Adam / AdamW (weight decay ``WEIGHT_DECAY``); "adam": torch's
    # default Adam (GPU cells: on CPU its sqrt runs in MKL VML, whose bits follow the CPU, see harness.numerics);
    # "adamw_decoupled": fsdp_impl AdamW, decoupled grads, bf16 moments
    optimizer: str = "adam_fused"
    recipe: str | None = None  # FP8 recipe (model "fp8": torch-native; "te": TransformerEngine's)
    meta_init: bool = False  # build on the meta device, materialised shard by shard (model "gpt")
    hand_grad: bool = False  # zero_grad(set_to_none=False), then a gradient added into .grad by hand
    offload: str | None = None  # OffloadPolicy(step=...): optimizer state and main params in host memory
    overlap: bool | str = False  # OffloadPolicy(overlap_step=...) (the cells clip: "clip")
    keep_transpose: bool = False  # keep_fp8_transpose_cache=True (model "fp8" / "te")
    # every third step, between the backward and the optimizer step, one more forward whose loss
    # never runs a backward (at one rank with kept FP8 transposes it leaves its units gathered)
    dropped_forward: bool = False
    # the dtype the weights are drawn in before the cast to ``dtype`` (models "gpt", "fp8"): fp32 so
    # that a torch release's bf16 sampling cannot change the cell; the two bf16 H200 cells keep the
    # bf16 draw their committed files were made with until they are remade on an H200
    # (tests/golden/README.md: the command)
    init_dtype: torch.dtype = torch.float32


CELLS = (
    Cell("zero0", 2, zero=0),
    Cell("zero1", 2, zero=1),
    Cell("zero2", 2, zero=2),
    Cell("zero3", 2),
    Cell("zero3_bf16", 2, dtype=torch.bfloat16),
    Cell("zero3_decoupled_adamw", 2, optimizer="adamw_decoupled"),
    Cell("zero3_recompute", 2, model="recompute"),
    Cell("zero3_meta_init", 2, meta_init=True),
    Cell("zero2_layer_drop", 2, zero=2, model="gpt_layer_drop"),
    Cell("zero3_hand_grad", 2, hand_grad=True),
    Cell("zero1_fused_adamw", 2, zero=1, optimizer="adamw_fused"),
    Cell("zero3_offload", 2, offload="gpu"),
    Cell("zero3_offload_overlap", 2, offload="gpu", overlap="clip"),
    Cell("fp8_current", 2, model="fp8", recipe="current"),
    Cell("fp8_delayed", 2, model="fp8", recipe="delayed"),
    Cell("fp8_blockwise", 2, model="fp8", recipe="blockwise"),
    Cell("fp8_current_held", 1, model="fp8", recipe="current", keep_transpose=True, dropped_forward=True),
    Cell("hsdp", 4, mesh=(2, 2, 1, 1), outer="no_shard"),
    Cell("hfsdp", 4, mesh=(2, 2, 1, 1), outer="optim"),
    Cell("cp2", 4, mesh=(1, 2, 2, 1)),
    Cell("tp2", 4, mesh=(1, 2, 1, 2)),
)
# One GPU (world 1): the same engine paths on CUDA/NCCL, plus TransformerEngine FP8 parameters.
GPU_CELLS = (
    Cell("gpu_zero3", 1, optimizer="adam"),
    Cell("gpu_zero3_bf16", 1, dtype=torch.bfloat16, optimizer="adam"),
    Cell("gpu_zero2", 1, zero=2, optimizer="adam"),
    Cell("gpu_zero3_recompute", 1, model="recompute", optimizer="adam"),
    Cell("gpu_fp8_current", 1, model="fp8", recipe="current", optimizer="adam"),
    Cell("gpu_te_current", 1, model="te", recipe="current", optimizer="adam"),
    Cell("gpu_te_block", 1, model="te", recipe="block", optimizer="adam"),
    Cell("gpu_te_delayed", 1, model="te", recipe="delayed", optimizer="adam"),
)


def band_dtype(cell: Cell) -> str:
    """The precision a cell's numbers have, for its golden band's floor: ``fp8`` for FP8 models,
    else its compute dtype (``fp32``, ``bf16``)."""
    if cell.model in ("fp8", "te"):
        return "fp8"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[cell.dtype]


class LayerDropGPT(SmallGPT):
    """``SmallGPT`` whose forward skips block ``drop`` when it is set: a unit some forwards do not run."""

    drop: int | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for i, block in enumerate(self.blocks):
            if i != self.drop:
                x = block(x)
        return F.linear(self.norm(x), self.tok.weight)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build(cell: Cell, device: torch.device) -> tuple[nn.Module, list[type[nn.Module]], Any, Any]:
    """The model, its unit classes, a batch function ``(step, slot, slots) -> (inputs, target)``
    and the loss function."""
    if cell.model == "fp8":
        def fp8_batch(step: int, slot: int, slots: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            x, y = fp8_training.batch(step, slot, 0)
            return (x,), y
        model = fp8_training.build(cell.recipe, init_dtype=cell.init_dtype)
        return model, [fp8_training.Fp8Block], fp8_batch, fp8_training.loss_fn
    if cell.model == "te":
        from . import te_fp8

        def te_batch(step: int, slot: int, slots: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            x, y = te_fp8.te_batch(step, slot)
            return (x,), y
        return (te_fp8.build_te(te_fp8.te_recipe(cell.recipe or ""), fp8_params=True), te_fp8.unit_classes(),
                te_batch, lambda out, y: F.mse_loss(out.float(), y))
    if cell.model == "recompute":
        model = build_net("inside", dtype=cell.dtype)

        def recompute_batch(step: int, slot: int, slots: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            gen = torch.Generator().manual_seed(1000 * step + slot)
            return (torch.randn(LOCAL_BATCH, 4, 3, generator=gen).to(cell.dtype),), torch.randn(
                LOCAL_BATCH, 4, 2, generator=gen)
        return model, [RecomputeBlock], recompute_batch, lambda out, y: F.mse_loss(out.float(), y)
    if cell.model == "gpt_layer_drop":
        torch.manual_seed(0)  # as build_model does
        model: nn.Module = LayerDropGPT(dtype=cell.dtype)
    else:
        model = build_model("gpt", cell.dtype, seed=0, device="meta" if cell.meta_init else None,
                            init_dtype=cell.init_dtype)

    def gpt_batch(step: int, slot: int, slots: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        inputs, target = make_batch("gpt", LOCAL_BATCH * slots, seed=1000 + step)
        sl = slice(slot * LOCAL_BATCH, (slot + 1) * LOCAL_BATCH)
        return tuple(x[sl] for x in inputs), target[sl]
    return model, list(unit_classes("gpt")), gpt_batch, loss_fn("gpt")


def _optimizer(cell: Cell, params: Any) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    if cell.optimizer == "adamw_decoupled":
        opt = fsdp_impl.optim.AdamW(params, lr=LR, use_decoupled_grad=True, exp_avg_dtype=torch.bfloat16,
                                    exp_avg_sq_dtype=torch.bfloat16)
        return opt, {"use_decoupled_grad": True}
    if cell.optimizer == "adamw_fused":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True), {}
    return torch.optim.Adam(params, lr=LR, fused=cell.optimizer == "adam_fused" or None), {}


def _te_autocast(cell: Cell) -> Any:
    """``te.autocast`` with the cell's recipe for TE cells, else a no-op context."""
    if cell.model != "te":
        return contextlib.nullcontext
    import transformer_engine.pytorch as te

    from .te_fp8 import te_recipe

    recipe = te_recipe(cell.recipe or "")
    return lambda: te.autocast(recipe=recipe)


def _param_checksum(model: nn.Module) -> float:
    return float(sum(p.full_tensor().double().pow(2).sum() for p in model.module.parameters()))


@dataclass
class CellRun:
    """A wrapped cell being trained: what ``train_steps`` needs."""

    cell: Cell
    model: nn.Module
    opt: torch.optim.Optimizer
    batch: Any
    loss: Any
    autocast: Any
    slot: int
    slots: int
    device: torch.device


def env_lr_scale() -> float:
    """``FSDP_GOLDEN_LR_SCALE`` (1.0 when unset); refused while golden files are being rewritten."""
    from harness.golden import ENV_UPDATE

    raw = os.environ.get(ENV_LR_SCALE, "").strip()
    if not raw:
        return 1.0
    if os.environ.get(ENV_UPDATE) == "1":
        raise RuntimeError(f"{ENV_LR_SCALE}={raw} perturbs the golden cells: unset it before --golden-update")
    return float(raw)


def start_cell(cell: Cell, device: torch.device, lr_scale: float = 1.0) -> CellRun:
    """Build and wrap ``cell`` (``lr_scale``, times ``FSDP_GOLDEN_LR_SCALE``, perturbs the learning
    rate: the golden tests' proof that a drift is caught)."""
    model, units, batch, loss = _build(cell, device)
    opt, opt_kwargs = _optimizer(cell, model.parameters())
    lr_scale *= env_lr_scale()
    for group in opt.param_groups:
        group["lr"] = group["lr"] * lr_scale
    kwargs: dict[str, Any] = dict(fsdp_unit_modules=units, zero_dp_strategy=cell.zero,
                                  init_model_with_meta_device=cell.meta_init, **opt_kwargs)
    if cell.keep_transpose:
        kwargs["keep_fp8_transpose_cache"] = True
    if cell.offload is not None:
        kwargs["offload_policy"] = fsdp_impl.OffloadPolicy(step=cell.offload, chunk_bytes=OFFLOAD_CHUNK_BYTES,
                                                           pin_memory=device.type == "cuda",
                                                           overlap_step=cell.overlap)
    slot, slots = dist.get_rank(), dist.get_world_size()
    if cell.mesh is not None:
        mesh = seed_mesh(cell.mesh, device.type)
        kwargs.update(seed_kwargs(mesh, cell.outer))
        slot, slots = data_position(data_group(mesh, cell.outer))
    wrapped, opt = fsdp_impl.fully_shard(model, opt, **kwargs)
    return CellRun(cell, wrapped, opt, batch, loss, _te_autocast(cell), slot, slots, device)


def _before_forward(run: CellRun, step: int) -> None:
    """Layer drop (block 1 in every third forward) and the hand-written weight-decay gradient."""
    module = run.model.module
    if isinstance(module, LayerDropGPT):
        module.drop = 1 if step % 3 == 1 else None
    if run.cell.hand_grad:
        with torch.no_grad():
            for p in run.model.parameters():
                if p.grad is not None:  # from the second step on (zero_grad keeps the buffers)
                    local_tensor(p.grad).add_(local_tensor(p), alpha=HAND_DECAY)


def train_steps(run: CellRun, steps: range) -> dict[str, list[float]]:
    """Train ``steps`` (the step numbers pick the data); the per-step series a golden file keeps."""
    series: dict[str, list[float]] = {"loss": [], "grad_norm": [], "param_checksum": []}
    for step in steps:
        _before_forward(run, step)
        inputs, target = run.batch(step, run.slot, run.slots)
        with run.autocast():
            out = run.model(*(x.to(run.device) for x in inputs))
        value = run.loss(out, target.to(run.device))
        value.backward()
        if run.cell.dropped_forward and step % 3 == 1:
            with run.autocast():
                run.model(*(2 * x.to(run.device) for x in inputs))  # its loss never runs a backward
        total = value.detach().float().clone()
        dist.all_reduce(total)
        series["loss"].append(total.item() / dist.get_world_size())
        series["grad_norm"].append(float(fsdp_impl.clip_grad_norm(run.model, CLIP)))
        run.opt.step()
        run.opt.zero_grad(set_to_none=not run.cell.hand_grad)
        series["param_checksum"].append(_param_checksum(run.model))
    return series


def run_cell(cell: Cell, device: torch.device, lr_scale: float = 1.0) -> dict[str, list[float]]:
    """Train ``cell`` for ``STEPS`` steps from its seed; the golden series."""
    streamed_on_cpu = cell.offload == "gpu" and device.type == "cpu"
    with one_thread(), STREAMED_STEP_ON_CPU.on() if streamed_on_cpu else contextlib.nullcontext():
        return train_steps(start_cell(cell, device, lr_scale), range(STEPS))
