"""The implementations the benchmark compares, each built fresh on the bench GPT.

All of them train the same model (``bench.gpt``, units = blocks) from the same init (seed 0) on
the same per-rank tokens with AdamW (lr 1e-4, torch defaults otherwise), bf16 compute and fp32
main params, grads and optimizer state:

- ``ours-z3`` / ``ours-z2``: ``fsdp_impl.fully_shard`` on a bf16 module (compute in the module's
  dtype) with ``MixedPrecisionPolicy(main_params_dtype=fp32, main_grads_dtype=fp32)``, ZeRO-3
  (``optim_grads_params``) / ZeRO-2 (``optim_grads``) over all ranks.
- ``ours-hsdp``: the same on a (dp_outer=world, dp_shard=1) mesh, outer ``no_shard``, inner
  ``optim_grads_params``: replicated, one all-reduce per unit across dp_outer (world >= 2).
- ``megatron-fsdp``: megatron_fsdp.fully_shard with the same arguments as ``ours-z3``.
- ``fsdp2`` / ``fsdp2-noreshard``: ``torch.distributed.fsdp.fully_shard`` per block and root on the
  fp32 module, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
  ``reshard_after_forward`` True / False on the blocks; the root keeps FSDP2's own default
  (``None``: not resharded after forward, its params are needed again at the start of backward),
  which is what ``fsdp_impl`` does with its root unit too. Passing ``True`` to the root as well
  (what this bench did before 2026-12-02) frees the root's 0.13 GiB at 1.3B before the backward
  peak and re-gathers it when the logits' grad arrives: a different trade, not a different engine.
- ``ddp``: DistributedDataParallel over the fp32 module under ``torch.autocast(bf16)``, fp32
  all-reduce (``gradient_as_bucket_view=True``).
- ``ceiling``: the fp32 module under ``torch.autocast(bf16)``, no data parallelism (every rank
  trains its own copy, no communication): the one-GPU speed of the same model and batch.

Autocast (``ddp``, ``ceiling``) keeps norms, softmax and the loss in fp32 and casts weights per
matmul; the FSDP runs compute every op in bf16. Same storage dtypes, not bit-identical math.
The ours/megatron bf16 module is the bf16 rounding of the fp32 init the others start from.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bench.gpt import GPT, Block, GPTConfig, apply_recompute
from bench.runtime import Env
from bench.te_modules import TeAutocast, te_linears, te_recipe

SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab=512, hidden=64, layers=2, heads=4, seq=64),  # CPU smoke runs
    "0.35b": GPTConfig(hidden=1024, layers=24, heads=16),
    "1.3b": GPTConfig(hidden=2048, layers=24, heads=16),
    "2.7b": GPTConfig(hidden=2560, layers=32, heads=32),
    "7b": GPTConfig(hidden=4096, layers=32, heads=32),
    "9b": GPTConfig(hidden=4608, layers=36, heads=36),  # offload runs: 9.3B, between 7b and 13b
    "13b": GPTConfig(hidden=5120, layers=40, heads=40),  # offload runs (bench.offload_bench)
}
LR = 1e-4


@dataclass
class Trainee:
    """A built implementation: the step is split in phases so memory snapshots can name them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    target: torch.Tensor
    vocab: int
    autocast: bool

    def forward_loss(self) -> torch.Tensor:
        ctx = (torch.autocast(self.inputs.device.type, dtype=torch.bfloat16) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            logits = self.model(self.inputs)
        return F.cross_entropy(logits.float().view(-1, self.vocab), self.target.reshape(-1))

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def step(self) -> torch.Tensor:
        loss = self.forward_loss()
        self.backward(loss)
        self.optimizer_step()
        return loss.detach()


@dataclass(frozen=True)
class Impl:
    name: str
    setup: str  # one line for the report
    build: Callable[[nn.Module, Env], tuple[nn.Module, torch.optim.Optimizer]]
    module_dtype: torch.dtype  # dtype the fresh module is cast to before wrapping
    autocast: bool
    min_world: int = 1
    needs_module: str | None = None  # an importable module this impl needs
    # bytes per parameter that stay on each GPU (params, grads, optimizer state), for the fit check
    persistent_bytes: Callable[[int], float] = lambda world: 16.0


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _ours(strategy: str, hsdp: bool, module: nn.Module, env: Env, **extra: object):
    import fsdp_impl

    kwargs: dict = flat_mesh(env)
    if hsdp:
        mesh = _hsdp_mesh(env)
        kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                      hybrid_fsdp_group=mesh["hsdp"].get_group(), outer_dp_sharding_strategy="no_shard")
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    model, opt = fsdp_impl.fully_shard(module, _adamw(module.parameters()), fsdp_unit_modules=[Block],
                                       zero_dp_strategy=strategy, mixed_precision_policy=policy, **kwargs, **extra)
    return model, opt


@functools.cache
def _mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], flatten: str | None = None):
    """One mesh per process and shape: building it again would create new communicators every cell."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if flatten is not None:
        mesh[names]._flatten(flatten)
    return mesh


def flat_mesh(env: Env) -> dict:
    """``fully_shard`` arguments for a 1-D mesh over the world on the run's device. Passed
    explicitly: the mesh ``fsdp_impl`` builds for ``device_mesh=None`` is CUDA whenever CUDA is
    available and the backend is NCCL or fake, so a ``--device cpu --fake-world`` run on a GPU
    node would shard a CPU model over a CUDA mesh and fail."""
    return {"device_mesh": _mesh(env.device.type, (env.world,), ("dp_shard",)), "dp_shard_dim": "dp_shard"}


def _hsdp_mesh(env: Env):
    return _mesh(env.device.type, (env.world, 1), ("dp_outer", "dp_shard"), "hsdp")


def _megatron(module: nn.Module, env: Env):
    """The mesh megatron_fsdp would build itself for device_mesh=None, made once and reused."""
    import megatron_fsdp

    mesh = _mesh(env.device.type, (env.world, 1), ("fsdp", "tp"))
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    return megatron_fsdp.fully_shard(module, _adamw(module.parameters()), device_mesh=mesh, dp_shard_dim="fsdp",
                                     tp_dim="tp", fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
                                     mixed_precision_policy=policy)


def _fsdp2(reshard: bool, module: nn.Module, env: Env):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The run's device, explicitly: FSDP2's default mesh is CUDA whenever CUDA is available, also
    # under ``--device cpu`` (gloo) on a GPU node.
    mesh = _mesh(env.device.type, (env.world,), ("dp",))
    blocks: nn.ModuleList = module.blocks  # type: ignore[assignment]
    for blk in blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(module, mesh=mesh, mp_policy=mp)  # the root: FSDP2's default (see the module docstring)
    return module, _adamw(module.parameters())


def _ddp(module: nn.Module, env: Env):
    from torch.nn.parallel import DistributedDataParallel

    ids = [env.device.index] if env.is_cuda else None
    model = DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=True)
    return model, _adamw(model.parameters())


def _ceiling(module: nn.Module, env: Env):
    return module, _adamw(module.parameters())


_FSDP_BF16 = "bf16 module, fp32 main params + grads (MixedPrecisionPolicy), units = blocks"
def _recomputed(style: str, build: Callable[[nn.Module, Env], tuple[nn.Module, torch.optim.Optimizer]],
                module: nn.Module, env: Env) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``build`` after ``bench.gpt.apply_recompute(style)`` (the same recompute for every engine)."""
    apply_recompute(module, style)
    return build(module, env)


def _with_recompute(impl: Impl, style: str, label: str) -> Impl:
    return dataclasses.replace(impl, name=f"{impl.name}+{label}",
                               setup=f"{impl.setup}; activation recompute: {style} (bench.gpt.apply_recompute)",
                               build=functools.partial(_recomputed, style, impl.build))


IMPLS: dict[str, Impl] = {i.name: i for i in (
    Impl("ours-z3", f"fsdp_impl ZeRO-3 (optim_grads_params), {_FSDP_BF16}",
         functools.partial(_ours, "optim_grads_params", False), torch.bfloat16, False,
         persistent_bytes=lambda w: 16.0 / w),
    Impl("ours-z2", f"fsdp_impl ZeRO-2 (optim_grads), {_FSDP_BF16}",
         functools.partial(_ours, "optim_grads", False), torch.bfloat16, False,
         persistent_bytes=lambda w: 12.0 / w + 4.0),  # bf16 compute params + grads stay full size
    Impl("ours-hsdp", f"fsdp_impl HSDP mesh (dp_outer=world, dp_shard=1), outer no_shard, inner ZeRO-3, {_FSDP_BF16}",
         functools.partial(_ours, "optim_grads_params", True), torch.bfloat16, False,
         min_world=2, persistent_bytes=lambda w: 16.0),
    Impl("megatron-fsdp", f"megatron_fsdp.fully_shard ZeRO-3, {_FSDP_BF16}", _megatron, torch.bfloat16, False,
         needs_module="megatron_fsdp", persistent_bytes=lambda w: 16.0 / w),
    Impl("fsdp2", "torch fully_shard per block + root, fp32 module, param bf16 / reduce fp32, blocks reshard",
         functools.partial(_fsdp2, True), torch.float32, False, persistent_bytes=lambda w: 16.0 / w),
    Impl("fsdp2-noreshard", "as fsdp2 with reshard_after_forward=False on the blocks",
         functools.partial(_fsdp2, False), torch.float32, False, persistent_bytes=lambda w: 16.0 / w + 2.0),
    Impl("ddp", "DistributedDataParallel, fp32 module under torch.autocast(bf16) (norms, softmax in fp32), "
         "fp32 all-reduce", _ddp, torch.float32, True, persistent_bytes=lambda w: 16.0),
    Impl("ceiling", "fp32 module under torch.autocast(bf16), no data parallelism (each GPU trains its own copy)",
         _ceiling, torch.float32, True, persistent_bytes=lambda w: 16.0),
)}
DEFAULT_IMPLS = tuple(IMPLS)
# NCCL user buffers (not in the default set; NCCL only): ours-z3 with nccl_ub=True, symmetric (window)
# registration (the default) or local registration.
IMPLS["ours-z3+ub"] = dataclasses.replace(
    IMPLS["ours-z3"], name="ours-z3+ub", setup=f"{IMPLS['ours-z3'].setup}; nccl_ub=True (NCCL user buffers)",
    build=functools.partial(_ours, "optim_grads_params", False, nccl_ub=True))
IMPLS["ours-z3+ub-local"] = dataclasses.replace(
    IMPLS["ours-z3"], name="ours-z3+ub-local",
    setup=f"{IMPLS['ours-z3'].setup}; nccl_ub=True, disable_symmetric_registration=True (local registration)",
    build=functools.partial(_ours, "optim_grads_params", False, nccl_ub=True, disable_symmetric_registration=True))
# Recompute variants (not in the default set): "+ac" checkpoint_wrapper around each block, "+sac"
# selective recompute inside each block; FSDP2 gets exactly the same model changes.
IMPLS.update({v.name: v for base in ("ours-z3", "fsdp2") for style, label in (("full", "ac"), ("selective", "sac"))
              for v in (_with_recompute(IMPLS[base], style, label),)})


# FP8 implementations (not in the default set; ``bench.fp8_bench`` runs them): TransformerEngine
# ``te.Linear`` FP8 params (``bench.te_modules``), torch-native ``Float8Linear``, TE's own model
# without data parallelism as the reference, and fused-AdamW variants.
def _fsdp(module: nn.Module, env: Env, keep_transpose: bool, fused: bool = False
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    import fsdp_impl
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, fused=fused or None)  # None: torch's default
    return fsdp_impl.fully_shard(module, optimizer,
                                 fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
                                 mixed_precision_policy=policy, keep_fp8_transpose_cache=keep_transpose,
                                 **flat_mesh(env))


def _ours_te(kind: str, fp8_params: bool, keep: bool, module: nn.Module, env: Env, fused: bool = False
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    recipe = te_recipe(kind)
    te_linears(module, recipe, fp8_params)
    model, opt = _fsdp(module, env, keep_transpose=keep, fused=fused)
    return TeAutocast(model, recipe), opt


def _ours_bf16_fused(module: nn.Module, env: Env) -> tuple[nn.Module, torch.optim.Optimizer]:
    return _fsdp(module, env, keep_transpose=False, fused=True)


def _te_reference(kind: str, module: nn.Module, env: Env) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TE's own FP8 model without data parallelism: ``te.Linear`` FP8 parameters, a plain module,
    TE's ``FusedAdam`` keeping fp32 master weights (AdamW, the suite's lr, torch's default weight
    decay 0.01)."""
    from transformer_engine.pytorch.optimizers import FusedAdam
    recipe = te_recipe(kind)
    te_linears(module, recipe, fp8_params=True)
    for p in module.parameters():  # the optimizer's master copies start from the FP8 values
        clear = getattr(p, "clear_high_precision_init_val", None)
        if callable(clear):
            clear()
    opt = FusedAdam(module.parameters(), lr=LR, weight_decay=0.01, adam_w_mode=True, master_weights=True,
                    master_weight_dtype=torch.float32)
    return TeAutocast(module, recipe), opt


def ours_native(module: nn.Module, env: Env, keep: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Torch-native ``Float8Linear`` FP8 params (current scaling) in the blocks, ZeRO-3
    (``keep``: ``keep_fp8_transpose_cache``); also ``bench.fp8_host_cpu``'s model."""
    from fsdp_impl.fp8 import CurrentScaling, convert_to_fp8
    convert_to_fp8(module, CurrentScaling(), module_filter=lambda name, m: name.startswith("blocks."), fp8_params=True)
    return _fsdp(module, env, keep_transpose=keep)


_FP8 = "ZeRO-3, bf16 module, fp32 main params + grads, units = blocks, block linears"
FP8_IMPLS = (
    Impl("ours-fp8-te-current", f"fsdp_impl {_FP8} te.Linear FP8 params (Float8CurrentScaling), keep transposes",
               functools.partial(_ours_te, "current", True, True), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    Impl("ours-fp8-te-current-regather", f"fsdp_impl {_FP8} te.Linear FP8 params (Float8CurrentScaling), "
               "FP8 bytes gathered again for the backward", functools.partial(_ours_te, "current", True, False),
               torch.bfloat16, False, needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    Impl("ours-fp8-te-delayed", f"fsdp_impl {_FP8} te.Linear FP8 params (DelayedScaling), keep transposes",
               functools.partial(_ours_te, "delayed", True, True), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    Impl("ours-fp8-te-block", f"fsdp_impl {_FP8} te.Linear FP8 params (Float8BlockScaling), keep transposes",
               functools.partial(_ours_te, "block", True, True), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    *[Impl(f"ours-fp8-te-{kind}-fused", f"fsdp_impl {_FP8} te.Linear FP8 params ({name}), keep transposes, "
                 "torch AdamW fused=True", functools.partial(_ours_te, kind, True, True, fused=True), torch.bfloat16,
                 False, needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w)
      for kind, name in (("current", "Float8CurrentScaling"), ("delayed", "DelayedScaling"),
                         ("block", "Float8BlockScaling"))],
    Impl("ours-z3-fused", "fsdp_impl ZeRO-3 (optim_grads_params), bf16 module, fp32 main params + grads, "
               "units = blocks, torch AdamW fused=True", _ours_bf16_fused, torch.bfloat16, False,
               persistent_bytes=lambda w: 16.0 / w),
    Impl("ours-fp8-te-current-bf16params", f"fsdp_impl {_FP8} te.Linear bf16 params, FP8 compute (current)",
               functools.partial(_ours_te, "current", False, False), torch.bfloat16, False,
               needs_module="transformer_engine", persistent_bytes=lambda w: 16.0 / w),
    Impl("ours-fp8-native-current", f"fsdp_impl {_FP8} Float8Linear FP8 params (torch-native current)",
               ours_native, torch.bfloat16, False, persistent_bytes=lambda w: 16.0 / w),
    *[Impl(f"te-fp8-ref{suffix}", f"TransformerEngine alone, no FSDP / data parallelism: bf16 module, block "
                 f"linears te.Linear FP8 params ({name}), te.FusedAdam(master_weights=True) fp32 master + moments",
                 functools.partial(_te_reference, kind), torch.bfloat16, False, needs_module="transformer_engine",
                 persistent_bytes=lambda w: 16.0)
      for suffix, kind, name in (("", "current", "Float8CurrentScaling"), ("-delayed", "delayed", "DelayedScaling"),
                                 ("-block", "block", "Float8BlockScaling"))],
)
IMPLS.update({i.name: i for i in FP8_IMPLS})


def unavailable_reason(name: str, world: int, fake: bool = False) -> str | None:
    """Why ``name`` cannot run here (None when it can); the same answer on every rank."""
    impl = IMPLS[name]
    if fake and name == "ddp":
        return "DDP's reducer needs real collective results; the fake process group returns none"
    if world < impl.min_world:
        return f"needs world >= {impl.min_world} (have {world})"
    if impl.needs_module and importlib.util.find_spec(impl.needs_module) is None:
        return f"python module {impl.needs_module!r} not installed"
    return None


def estimated_bytes(name: str, cfg: GPTConfig, micro_batch: int, world: int) -> float:
    """A rough per-GPU need (persistent state + activations + fp32 logits) for the fit check.

    Activations: ~34 bytes per token per hidden unit per layer in bf16 (attention through SDPA);
    logits: bf16 logits, their fp32 copy, softmax and its grad.
    """
    n = num_params_of(cfg)
    tokens = micro_batch * cfg.seq
    return (IMPLS[name].persistent_bytes(world) * n + 34.0 * tokens * cfg.hidden * cfg.layers
            + 14.0 * tokens * cfg.vocab)


def num_params_of(cfg: GPTConfig) -> int:
    """Parameter count of ``GPT(cfg)`` in closed form (tied head): embeddings, per block two
    LayerNorms (4h), qkv (3h^2+3h), proj (h^2+h), fc1 (4h^2+4h), fc2 (4h^2+h), final LayerNorm."""
    h = cfg.hidden
    return cfg.vocab * h + cfg.seq * h + cfg.layers * (12 * h * h + 13 * h) + 2 * h


def build(name: str, cfg: GPTConfig, env: Env, micro_batch: int, data_seed: int = 1234) -> Trainee:
    """Fresh module (seed 0, built on the device), wrapped by ``name``, with this rank's tokens."""
    impl = IMPLS[name]
    torch.manual_seed(0)
    with torch.device(env.device):
        module = GPT(cfg)
    if impl.module_dtype != torch.float32:
        module = module.to(impl.module_dtype)
    model, opt = impl.build(module, env)
    g = torch.Generator(device=env.device).manual_seed(data_seed + env.rank)
    tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq + 1), device=env.device, generator=g)
    return Trainee(model, opt, tokens[:, :-1], tokens[:, 1:], cfg.vocab, impl.autocast)


def setups(names: list[str]) -> dict[str, str]:
    """One line per implementation, for the report (all: AdamW lr 1e-4, same init and data)."""
    return {n: IMPLS[n].setup for n in names}
