"""bench/host_profile.py ``--phases``: each phase's host time is measured where it runs, the
forward's CPU time tells computing from waiting, and the reading follows host against step time."""
from __future__ import annotations

import time
from typing import Any

import torch

from bench import host_profile
from bench.runtime import Env


def _spin(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's CPU time (so at least as much wall time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Trainee:
    """Phases with known host costs: the forward computes 30 ms then sleeps 20 ms (waiting, no
    CPU), the backward computes 15 ms, the optimizer 5 ms."""

    def forward_loss(self) -> torch.Tensor:
        _spin(0.030)
        time.sleep(0.020)
        return torch.zeros(())

    def backward(self, loss: Any) -> None:
        _spin(0.015)

    def optimizer_step(self) -> None:
        _spin(0.005)


def test_phase_times_measure_each_phase() -> None:
    env = Env(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    p = host_profile.phase_times(env, _Trainee(), steps=3)  # type: ignore[arg-type]
    # only lower bounds, each exact (CPU spins and sleeps last at least that long), so a loaded
    # machine cannot fail it; a phase timed in another's slot breaks one of them
    assert p.forward >= 50 and p.forward_cpu >= 30
    assert p.forward - p.forward_cpu >= 19  # the sleep: wall time without CPU time
    assert p.backward >= 15 and p.optimizer >= 5
    assert p.host >= 70 and p.step >= p.host  # medians of per-step sums: each step's wall covers its phases
    assert "host-bound" in p.line("x")  # no device: the host is all there is


def test_reading_follows_host_against_step() -> None:
    device_bound = host_profile.Phases(forward=10, forward_cpu=10, backward=10, optimizer=5, host=25, step=100)
    assert "device-bound" in device_bound.line("a")
    bound = host_profile.Phases(forward=40, forward_cpu=40, backward=45, optimizer=10, host=95, step=100)
    assert "host-bound" in bound.line("c")
    between = host_profile.Phases(forward=30, forward_cpu=30, backward=30, optimizer=10, host=70, step=100)
    assert "in between" in between.line("b")
    assert host_profile.PHASE_HEADER.splitlines()[0].count("|") == between.line("b").count("|")



class _HookedTrainee:
    """A step with known op counts: forward 3 ``mm``, a backward whose post-accumulate-grad hook
    (what the engine's grad hook is) runs one ``bmm`` per grad: 2 leaves, so 2 ``bmm``."""

    def __init__(self) -> None:
        self.w = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]

        def hook(t: torch.Tensor) -> None:
            torch.bmm(t.grad[None], t.grad[None])

        for w in self.w:
            w.register_post_accumulate_grad_hook(hook)

    def step(self) -> None:
        x = torch.randn(4, 8)
        out = torch.mm(torch.mm(x, self.w[0]), self.w[1])
        torch.mm(out, out.t()).sum().backward()
        for w in self.w:
            w.grad = None


def test_op_table_counts_forward_backward_and_hook_ops() -> None:
    """``--ops``: calls per step are exact for the forward's ops and for ops inside the backward's
    grad hooks (on CUDA the backward runs on autograd's device thread; the profiler's state goes
    with it, unlike cProfile's)."""
    env = Env(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    table = host_profile.op_table(env, _HookedTrainee(), steps=2, top=100)  # type: ignore[arg-type]
    rows = {cells[1].strip(): cells for line in table.splitlines()[2:] if (cells := line.split("|"))}
    assert float(rows["aten::bmm"][4]) == 2, table
    assert float(rows["aten::mm"][4]) >= 3, table  # the forward's 3, plus the backward's
    accumulate = rows["torch::autograd::AccumulateGrad"]
    assert float(accumulate[4]) == 2, table  # one per leaf
    assert float(accumulate[3]) >= float(rows["aten::bmm"][3]), table  # the hook's bmm inside its total
