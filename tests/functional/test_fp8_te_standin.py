"""The engine's TransformerEngine FP8-parameter path on CPU, with a stand-in for TE.

TE needs a GPU, so this file installs a minimal stand-in (``common/te_standin.py``) under the
module names the engine looks up (``transformer_engine.pytorch.quantized_tensor.QuantizedTensor`` and
``transformer_engine.pytorch.tensor.utils.quantize_master_weights`` /
``post_all_gather_processing``): a ``Float8Tensor`` wrapper subclass holding uint8 ``_data``, a
``_scale_inv`` and a transpose cache, with TE's ``get_high_precision_init_val`` protocol, and a
linear module that computes with it. It exercises what does not depend on TE's kernels: a tensor
subclass as the compute parameter (never allocated as a plain tensor, filled and freed through
its byte plane), the main copy taken from the preserved init value, TE-style sharded
quantisation called once per step, the transpose cache kept from forward to backward.

Check: 6 steps on 2 ranks equal, bit for bit, a single process whose linears quantise their own
bf16 weight with the same current scaling in every forward (the emulating reference of
``common/fp8_training.py``), with and without ``keep_fp8_transpose_cache``.
"""
from __future__ import annotations

import sys

import pytest
import torch

from fsdp_impl import MixedPrecisionPolicy, fully_shard
from tests.functional import matrix_axes as axes
from tests.functional.common import fp8_training as ft
from tests.functional.common import te_standin as standin
from tests.functional.common.numerics import max_relative_error

pytestmark = [pytest.mark.distributed(world_size=2, timeout=300),
              pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="fp8_net", dtype="bf16",
                                 recipe="current")]
STEPS = 6


@pytest.fixture
def stand_in_te(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, mod in standin.stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep_transpose"])
def test_te_fp8_params_with_stand_in(keep: bool, stand_in_te: None, dist_env) -> None:
    ref = ft.train_reference(standin.swap(ft.build(None), standin.qdq), 2, STEPS, 1, dist_env.device)
    module = standin.swap(ft.build(None).to(dist_env.device), standin.TeLinear)
    hp = module.blocks[0].fc1.weight.get_high_precision_init_val()
    model, opt = fully_shard(module, torch.optim.Adam(module.parameters(), lr=1e-2), fsdp_unit_modules=[ft.Fp8Block],
                             mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32),
                             keep_fp8_transpose_cache=keep)
    assert sum(u.fp8 is not None for u in model._fsdp_engine.units) == 2, "stand-in TE weights not taken as FP8"
    main = model.module.blocks[0].fc1.weight.full_tensor()
    assert torch.equal(main, hp.to(main.device).float()), "main copy not taken from the preserved init value"
    losses = ft.train_fsdp(model, opt, dist_env.rank, STEPS, 1, dist_env.device)
    assert losses == ref.losses, f"{losses} vs reference {ref.losses}"
    err, where = max_relative_error(ft.full_params(model), ref.params)
    assert err <= 1e-6, f"{where}: {err:.3g}"  # see test_fp8.PARITY_RTOL (CPU)
    assert isinstance(model.module.blocks[0].fc1.weight, torch.distributed.tensor.DTensor)
