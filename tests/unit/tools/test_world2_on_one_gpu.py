"""tests/tools/world2_on_one_gpu's case parsing, and bench/shared_gpu's host ``full_tensor`` against DTensor's own.

The tool itself needs a GPU; these parts do not, and a wrong gather would make every emulated
comparison wrong, so it is checked against ``DTensor.full_tensor`` (gloo, CPU) on uneven shards.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from bench import shared_gpu
from tests.tools import world2_on_one_gpu as tool


@pytest.mark.parametrize("text, want", [
    ("optim", "optim"), ("(2,1,1,1)", (2, 1, 1, 1)), ("None", None), ("False", False), ("2", 2),
    ("torch.float32", torch.float32), ("EAGER", dict(fp32_main=False, meta=False, compile=False)),
])
def test_parse_arg(text: str, want: object) -> None:
    assert tool.parse_arg(text) == want


def test_resolve_function_and_method() -> None:
    fn, args, is_method = tool.resolve("test_fp8_te_seed.test_fully_shard_custom_dtype:optim:no_shard:None:(1,2,1,1)")
    assert fn.__name__ == "test_fully_shard_custom_dtype" and not is_method
    assert args == ["optim", "no_shard", None, (1, 2, 1, 1)]
    fn, args, is_method = tool.resolve(
        "test_decoupled_grad_te.TestRegressionsWithFusedAdam.test_mismatch_refused_and_no_op_detected:2")
    assert (fn.__name__, args, is_method) == ("test_mismatch_refused_and_no_op_detected", [2], True)


@pytest.mark.distributed(world_size=2, timeout=120)
@pytest.mark.parametrize("rows, placement", [(5, Shard(0)), (3, Shard(1)), (4, Replicate())])
def test_host_full_tensor_equals_dtensor_full_tensor(rows: int, placement, dist_env) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    dt = distribute_tensor(full, mesh, [placement])
    got = shared_gpu.host_full_tensor(dt)
    assert torch.equal(got, dt.full_tensor()) and torch.equal(got, full)
