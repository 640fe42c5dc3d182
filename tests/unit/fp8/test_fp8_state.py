"""Deferred delayed scaling across simulated data-parallel ranks equals one process that sees
the whole batch: same histories and scales after every step.

Weights and the first layer's input are cast from identical values, so their state matches bit
for bit. Later activations and grads come out of fp32 GEMMs over 6 rows (a rank) or 12 rows (the
whole batch), which BLAS may sum in a different order: their amaxes may differ in the last bit
(rtol 1e-6 allows a few ulps; a missed reduction changes them by whole percents).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fsdp_impl.fp8 import DelayedScaling, convert_to_fp8
from fsdp_impl.fp8.state import advance_all, delayed_quantizers, pack_pending, set_deferred


def test_deferred_ranks_match_full_batch():
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)),
                           DelayedScaling(amax_history_len=3))
    ranks = [copy.deepcopy(model) for _ in range(2)]
    for r in ranks:
        set_deferred(delayed_quantizers(r))
    for step in range(4):
        x = torch.randn(12, 16) * (step + 1)
        model(x).sum().backward()  # sum loss: each row's output grad does not depend on the batch
        for r, part in zip(ranks, x.chunk(2), strict=True):
            r(part).sum().backward()
        reduced = torch.stack([pack_pending(delayed_quantizers(r)) for r in ranks]).amax(dim=0)
        for r in ranks:
            advance_all(delayed_quantizers(r), reduced)
        for r in ranks:
            for (key, ours), theirs in zip(r.state_dict().items(), model.state_dict().values(), strict=True):
                if "fp8_" not in key:
                    continue
                if "weight" in key or key.startswith("0.fp8_input"):
                    assert torch.equal(ours, theirs), (step, key)
                else:
                    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0, msg=f"{step} {key}")
    assert len(delayed_quantizers(model)) == 6
