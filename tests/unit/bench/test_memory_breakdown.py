"""bench.memory: allocator-history replay (closed-form peaks), stack classification, storage counting."""
from __future__ import annotations

import pytest
import torch

from bench import memory as mem

GPT_FWD = [{"filename": "/r/bench/gpt.py", "name": "forward", "line": 40},
           {"filename": "/t/torch/nn/modules/module.py", "name": "_call_impl", "line": 1},
           {"filename": "/r/bench/impls.py", "name": "forward_loss", "line": 70}]
OURS_GATHER = [{"filename": "/r/fsdp_impl/unit.py", "name": "unshard", "line": 3},
               {"filename": "/r/fsdp_impl/hooks.py", "name": "__call__", "line": 9},
               {"filename": "/r/bench/gpt.py", "name": "forward", "line": 60}]
FSDP2_REDUCE = [{"filename": "/t/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
                 "name": "foreach_reduce", "line": 1}]


def alloc(addr: int, size: int, frames=()) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int, size: int, action: str = "free_requested") -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_replay_peak_closed_form() -> None:
    """base 1000; +A100 +B50 -A -P30(pre-existing) +C200 -> peak 1000+220 with B, C live; then
    -B +D40 stays under it. free_completed entries are ignored when free_requested exist."""
    events = [alloc(1, 100, GPT_FWD), alloc(2, 50, OURS_GATHER), free(1, 100), free(1, 100, "free_completed"),
              free(99, 30), alloc(3, 200), free(2, 50), alloc(4, 40, FSDP2_REDUCE)]
    r = mem.replay_peak(events, base=1000)
    assert r.peak_bytes == 1220
    assert sorted(b["addr"] for b in r.live) == [2, 3]
    assert r.freed_before_peak == 30
    assert mem.transient_by_category(r.live) == {mem.BACKWARD: 200, mem.GATHERED: 50}


def test_replay_uses_free_completed_without_free_requested() -> None:
    events = [alloc(1, 10), free(1, 10, "free_completed"), alloc(2, 5), alloc(3, 7)]
    r = mem.replay_peak(events, base=0)
    assert r.peak_bytes == 12 and sorted(b["addr"] for b in r.live) == [2, 3]


def test_replay_of_nothing() -> None:
    r = mem.replay_peak([], base=123)
    assert (r.peak_bytes, r.live, r.freed_before_peak) == (123, [], 0)


@pytest.mark.parametrize("frames, want", [
    (GPT_FWD, mem.ACTIVATIONS),
    (OURS_GATHER, mem.GATHERED),
    (FSDP2_REDUCE, mem.GRADS),
    ([{"filename": "/t/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "name": "alloc_storage"}], mem.GATHERED),
    ([], mem.BACKWARD),
    ([{"filename": "/t/torch/optim/adamw.py", "name": "_multi_tensor_adamw"}], mem.OPTIMIZER),
    ([{"filename": "/r/bench/impls.py", "name": "backward"}], mem.BACKWARD),
    ([{"filename": "/r/fsdp_impl/engine.py", "name": "finish_step"}], mem.ENGINE_OTHER),
    ([{"filename": "/x/other.py", "name": "f"}], "unattributed (other.py:f)"),
])
def test_classify(frames, want) -> None:
    assert mem.classify(frames) == want


def test_top_sites_skip_torch_plumbing() -> None:
    live = [alloc(1, 5, GPT_FWD), alloc(2, 7, OURS_GATHER), alloc(3, 1, GPT_FWD)]
    assert mem.top_sites(live) == [("unit.py:unshard", 7), ("gpt.py:forward", 6)]


class _Model:
    def __init__(self, params, buffers) -> None:
        self._p, self._b = params, buffers

    def parameters(self):
        return iter(self._p)

    def buffers(self):
        return iter(self._b)


def test_storages_count_each_flat_buffer_once_with_padding() -> None:
    """Two params viewing one 10-float flat buffer (2 floats of padding) count 40 bytes, not 32;
    a grad and two optimizer-state tensors count at their own dtypes."""
    flat = torch.zeros(10)
    p1, p2 = torch.nn.Parameter(flat[:4]), torch.nn.Parameter(flat[4:8])
    p1.grad = torch.zeros(4, dtype=torch.float32)
    opt = torch.optim.SGD([p1, p2], lr=0.1)
    opt.state[p1] = {"momentum_buffer": torch.zeros(4, dtype=torch.bfloat16), "step": torch.tensor(1.0)}
    got = mem.storages(_Model([p1, p2], [torch.zeros(3, dtype=torch.int64)]), opt)
    assert got == {("params", "float32"): 40, ("grads", "float32"): 16, ("optimizer state", "bfloat16"): 8,
                   ("optimizer state", "float32"): 4, ("module buffers", "int64"): 24}


def test_markdown_lists_every_category() -> None:
    a = mem.MemoryReport("ours-z3", {("params", "float32"): 2**30},
                         {"rest": 2**31, "peak": 3 * 2**30, "end_of_backward": 2**31 + 2**29},
                         {mem.GATHERED: 2**29}, [("unit.py:unshard", 2**29)], 0, ["a note"])
    b = mem.MemoryReport("fsdp2", {("params", "float32"): 2**30}, {"rest": 2**31})
    text = mem.markdown([a, b])
    assert "| peak (max_memory_allocated) | 3.000 | – |" in text
    assert f"| at peak, allocated in the step: {mem.GATHERED} | 0.500 | – |" in text
    assert "- ours-z3: a note" in text
    assert "| end of backward − tensors above (held elsewhere: unsharded params, engine buffers) | 1.500 | – |" in text


def test_report_survives_json() -> None:
    """A profile child hands its report to the driver as JSON: every field comes back equal."""
    import json

    rep = mem.MemoryReport("ours-z3", {("params", "float32"): 40, ("grads", "bfloat16"): 8}, {"rest": 7, "peak": 9},
                           {mem.GATHERED: 5}, [("unit.py:unshard", 5)], 3, ["a note"])
    assert mem.from_dict(json.loads(json.dumps(mem.to_dict(rep)))) == rep
