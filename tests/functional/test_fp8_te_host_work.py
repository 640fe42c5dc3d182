"""Per-step host work of the TransformerEngine FP8-parameter path, on CPU with a stand-in for TE.

The stand-in (``common/te_standin.py``'s ``Float8Tensor`` and linear module) gets what the
current-scaling requantisation (``fsdp_impl.fp8.te.CurrentScalingCast``) calls in TE 2.20.2: a
``Float8CurrentScalingQuantizer`` on each weight, ``transformer_engine_torch`` (``DType``,
``multi_tensor_compute_scale_and_scale_inv``, ``quantize``), ``multi_tensor_applier``'s chunk size
and ``Float8Quantizer`` (``create_tensor_from_data``), each counting its calls. They do the
arithmetic of ``fsdp_impl.fp8.CurrentQuantizer`` (the reference's), so training must also stay
bit-identical to the quantise-dequantise reference.

Checks, over 6 steps on 2 ranks:
- per-weight objects (``Float8Quantizer``, the FP8 view of this rank's rows) are built once, not
  once per step; per step exactly one scale computation and one cast per weight, and TE's generic
  ``quantize_master_weights`` is never used for current scaling;
- with ``keep_fp8_transpose_cache`` one ``post_all_gather_processing`` call per unit gather (a
  list of the unit's weights), none in the backward (the transposes are kept);
- no host synchronisation inside the engine's FP8 hooks (``.item()``, ``.tolist()``, ``.cpu()``,
  ``bool(tensor)``, ``int``/``float`` of a tensor, ``torch.cuda.synchronize`` are counted there);
- losses equal the reference bit for bit.
And ``CurrentScalingCast`` run twice on new values with an empty shard on one rank writes the
full tensors' scales and this rank's bytes.
"""
from __future__ import annotations

import enum
import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_impl import MixedPrecisionPolicy, fully_shard
from fsdp_impl.fp8 import E4M3, CurrentQuantizer
from fsdp_impl.fp8.params import ModelFp8, UnitFp8
from fsdp_impl.fp8.te import CurrentScalingCast
from tests.functional import matrix_axes as axes
from tests.functional.common import fp8_training as ft
from tests.functional.common import te_standin as standin

pytestmark = [pytest.mark.distributed(world_size=2, timeout=300),
              pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="fp8_net", dtype="bf16",
                                 recipe="current")]
STEPS = 6
CALLS: Counter[str] = Counter()
_HOOK_DEPTH = [0]  # > 0 inside the engine's FP8 hooks (outside the stand-in's own functions)


@contextmanager
def _outside_hooks() -> Iterator[None]:
    """The stand-in's own arithmetic is not the engine's host work."""
    depth, _HOOK_DEPTH[0] = _HOOK_DEPTH[0], 0
    try:
        yield
    finally:
        _HOOK_DEPTH[0] = depth


def _stand_in(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        CALLS[fn.__name__] += 1
        with _outside_hooks():
            return fn(*args, **kwargs)
    return run


class DType(enum.Enum):
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


class Float8CurrentScalingQuantizer:
    def __init__(self) -> None:
        self.dtype, self.force_pow_2_scales, self.amax_epsilon = DType.kFloat8E4M3, False, 0.0


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return CurrentQuantizer(E4M3).scale_for(amax.reshape(1, 1)).reshape(())


@_stand_in
def multi_tensor_compute_scale_and_scale_inv(chunk: int, noop: torch.Tensor, lists: list, max_fp8: float,
                                             pow2: bool, epsilon: float) -> None:
    assert chunk == MultiTensorApply.chunk_size and max_fp8 == 448.0 and not pow2 and epsilon == 0.0
    for amax, scale, scale_inv in zip(*lists, strict=True):
        s = _scale(amax)
        scale.copy_(s.reshape(1))
        scale_inv.copy_(torch.reciprocal(s).reshape(1))


@_stand_in
def quantize(src: torch.Tensor, quantizer: Any, out: Any, noop: Any) -> None:
    assert src.dtype == torch.bfloat16 and noop is None and quantizer.rowwise and not quantizer.columnwise
    q = (src.float() * quantizer.scale.reshape(())).clamp(-448, 448).to(E4M3)
    out._data.copy_(q.view(torch.uint8))


class MultiTensorApply:
    chunk_size = 2048 * 32

    def __call__(self, op: Callable[..., None], noop: torch.Tensor, lists: list, *args: Any) -> None:
        CALLS["multi_tensor_applier"] += 1
        op(self.chunk_size, noop, lists, *args)


multi_tensor_applier = MultiTensorApply()


class Float8Quantizer:
    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: DType, *, rowwise: bool = True,
                 columnwise: bool = True) -> None:
        CALLS["Float8Quantizer"] += 1
        self.scale, self.amax, self.dtype = scale, amax, fp8_dtype
        self.rowwise, self.columnwise = rowwise, columnwise

    def create_tensor_from_data(self, data: torch.Tensor, fake_dtype: torch.dtype = torch.float32) -> Any:
        CALLS["create_tensor_from_data"] += 1
        return SimpleNamespace(_data=data, _scale_inv=torch.reciprocal(self.scale), dtype=fake_dtype)


@_stand_in
def post_all_gather_processing(weights: Any) -> None:
    standin.post_all_gather_processing(weights)


@_stand_in
def quantize_master_weights(*args: Any, **kwargs: Any) -> None:
    standin.quantize_master_weights(*args, **kwargs)


@pytest.fixture
def stand_in_te(monkeypatch: pytest.MonkeyPatch) -> None:
    CALLS.clear()
    mods = standin.stand_in_modules(("transformer_engine_torch", "transformer_engine.pytorch.tensor.float8_tensor",
                                     "transformer_engine.pytorch.optimizers",
                                     "transformer_engine.pytorch.optimizers.multi_tensor_apply"))
    tex = mods["transformer_engine_torch"]
    tex.DType = DType
    tex.multi_tensor_compute_scale_and_scale_inv = multi_tensor_compute_scale_and_scale_inv
    tex.quantize = quantize
    utils = mods["transformer_engine.pytorch.tensor.utils"]
    utils.quantize_master_weights = quantize_master_weights
    utils.post_all_gather_processing = post_all_gather_processing
    mods["transformer_engine.pytorch.tensor.float8_tensor"].Float8Quantizer = Float8Quantizer
    mods["transformer_engine.pytorch.optimizers.multi_tensor_apply"].multi_tensor_applier = multi_tensor_applier
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


@pytest.fixture
def count_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count host synchronisations inside the engine's FP8 hooks."""
    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if _HOOK_DEPTH[0]:
                CALLS[f"sync:{name}"] += 1
            return original(*args, **kwargs)
        return run

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda.synchronize", torch.cuda.synchronize))

    def hook(cls: type, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def run(*args: Any, **kwargs: Any) -> Any:
            CALLS[f"hook:{name}"] += 1
            _HOOK_DEPTH[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                _HOOK_DEPTH[0] -= 1
        monkeypatch.setattr(cls, name, run)

    for cls, name in ((UnitFp8, "gather"), (UnitFp8, "unpack"), (UnitFp8, "release"), (ModelFp8, "requantize")):
        hook(cls, name)


def _current_linear(linear: torch.nn.Linear) -> standin.TeLinear:
    module = standin.TeLinear(linear)
    module.weight._quantizer = Float8CurrentScalingQuantizer()  # type: ignore[attr-defined]
    weight = module.weight
    weight._get_quantizer = lambda: weight._quantizer  # type: ignore[attr-defined]
    return module


def _wrapped(device: torch.device, keep: bool) -> tuple[torch.nn.Module, Any, list[Any], int]:
    """The stand-in TE model under ``fully_shard`` (fp32 main params, ``keep_fp8_transpose_cache=keep``):
    (model, optimizer, its FP8 units, their FP8 weight count)."""
    module = standin.swap(ft.build(None).to(device), _current_linear)
    model, opt = fully_shard(module, torch.optim.Adam(module.parameters(), lr=1e-2), fsdp_unit_modules=[ft.Fp8Block],
                             mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32),
                             keep_fp8_transpose_cache=keep)
    units = [u for u in model._fsdp_engine.units if u.fp8 is not None]
    return model, opt, units, sum(len(u.fp8.fp8_params) for u in units)


@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep_transpose"])
def test_current_scaling_host_work_is_batched(keep: bool, stand_in_te: None, count_syncs: None, dist_env) -> None:
    ref = ft.train_reference(standin.swap(ft.build(None), standin.qdq), 2, STEPS, 1, dist_env.device)
    model, opt, units, weights = _wrapped(dist_env.device, keep)
    assert len(units) == 2 and weights == 4, "stand-in TE weights not taken as FP8"
    losses = ft.train_fsdp(model, opt, dist_env.rank, STEPS, 1, dist_env.device)
    assert losses == ref.losses, f"{losses} vs reference {ref.losses}"
    steps = CALLS["hook:requantize"]
    assert steps == STEPS, CALLS
    assert CALLS["multi_tensor_compute_scale_and_scale_inv"] == steps, CALLS
    assert CALLS["quantize"] == weights * steps, CALLS  # one cast per weight and step
    assert CALLS["Float8Quantizer"] == weights, f"per-weight quantizers built per step: {CALLS}"
    assert CALLS["create_tensor_from_data"] == weights, f"per-weight FP8 views built per step: {CALLS}"
    assert CALLS["quantize_master_weights"] == 0, CALLS
    # ZeRO-3: every unit gathers FP8 bytes in its forward; with kept transposes, not in its backward
    assert CALLS["post_all_gather_processing"] == (len(units) * steps if keep else 0), CALLS
    syncs = {k: v for k, v in CALLS.items() if k.startswith("sync:")}
    assert not syncs, f"host synchronisations inside the FP8 hooks: {syncs}"


def _kept_transpose_run(device: torch.device, rank: int, dropped_forward: bool) -> list[float]:
    """``STEPS`` steps of the stand-in TE model with kept transposes (this rank's losses);
    ``dropped_forward``: after the second backward, one more forward whose loss never runs a
    backward, so its units keep the transposes of the bytes before the optimizer step."""
    model, opt, _, _ = _wrapped(device, True)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in ft.batch(step, rank, 0))
        loss = ft.loss_fn(model(x), y)
        loss.backward()
        if dropped_forward and step == 1:
            ft.loss_fn(model(2 * x), y)  # never backpropagated
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_transposes_of_old_bytes_are_rebuilt(stand_in_te: None, dist_env) -> None:
    """Two ranks, kept transposes: a forward whose backward never runs keeps its units'
    transposes; after the optimizer step the next forward gathers new bytes, and every transpose
    must be rebuilt from them (``fill_te`` drops the old ones): the stand-in's backward reads
    them, so the losses equal those of the run without that forward bit for bit."""
    plain = _kept_transpose_run(dist_env.device, dist_env.rank, dropped_forward=False)
    dropped = _kept_transpose_run(dist_env.device, dist_env.rank, dropped_forward=True)
    assert dropped == plain, (dropped, plain)


def test_current_scaling_cast_reuses_its_state(stand_in_te: None, dist_env) -> None:
    """Two weights, the first with fewer rows than ranks (rank 1's shard is empty), cast twice
    with new main values by the same ``CurrentScalingCast``: scales of the full tensors on every
    rank, each rank's bytes as the full tensor's quantisation."""
    rank, world, device = dist_env.rank, dist.get_world_size(), dist_env.device
    assert world == 2
    shapes = [(1, 16), (6, 8)]
    weights = [standin.Float8Tensor(torch.zeros(s, dtype=torch.uint8, device=device), torch.ones((), device=device))
               for s in shapes]
    for w in weights:
        w._quantizer = Float8CurrentScalingQuantizer()  # type: ignore[attr-defined]
        w._get_quantizer = functools.partial(getattr, w, "_quantizer")  # type: ignore[attr-defined]
    rows = [(0, 1) if rank == 0 else (1, 1), (3 * rank, 3 * rank + 3)]
    shards = [torch.zeros(end - start, s[1], device=device) for (start, end), s in zip(rows, shapes, strict=True)]
    outs = [torch.full((end - start, s[1]), 7, dtype=torch.uint8, device=device)
            for (start, end), s in zip(rows, shapes, strict=True)]
    items = [SimpleNamespace(param=SimpleNamespace(tensor=w), shard=sh, out=[o], row_start=r[0])
             for w, sh, o, r in zip(weights, shards, outs, rows, strict=True)]
    cast = CurrentScalingCast(items)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        fulls = [(torch.randn(s, generator=gen) * 10 ** seed).to(device) for s in shapes]
        for sh, full, (start, end) in zip(shards, fulls, rows, strict=True):
            sh.copy_(full[start:end])
        cast(dist.group.WORLD)
        for w, full, out, (start, end) in zip(weights, fulls, outs, rows, strict=True):
            bf16 = full.to(torch.bfloat16)
            scale = _scale(bf16.abs().amax().float())
            assert torch.equal(w._scale_inv, torch.reciprocal(scale)), (seed, w._scale_inv, scale)
            expect = (bf16[start:end].float() * scale).clamp(-448, 448).to(E4M3).view(torch.uint8)
            assert torch.equal(out, expect), f"seed {seed}: rank {rank}'s bytes differ"
    assert CALLS["Float8Quantizer"] == sum(s.numel() > 0 for s in shards)  # built once, empty shards skipped
