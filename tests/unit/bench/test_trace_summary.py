"""bench.trace_summary on synthetic chrome traces: every number has a closed form.

Times in the traces are microseconds; the summary reports milliseconds, so a 10 us interval is
0.010 ms. Layout of step 1 (host range [0, 100), GPU stream 7 = compute, 20/21/22 = NCCL):

    compute (7):   [1000,1010] [1020,1030] [1040,1050]   -> 30 us
    all-gather:    [1005,1025]          overlap 5 + 5    -> exposed 10 us
    reduce-scatter [1052,1060]          no compute there -> exposed 8 us
    all-reduce     [1045,1048]          inside compute   -> exposed 0
    memcpy (7):    [1060,1062]                           -> copy 2 us
    step = 1062 - 1000 = 62 us; busy = [1000,1030] + [1040,1050] + [1052,1062] = 50 us -> idle 12 us
"""
from __future__ import annotations

import gzip
import json

import pytest

from bench import trace_summary as ts


class TraceBuilder:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.corr = 0

    def host(self, name: str, start: float, end: float, tid: int = 1) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 99, "tid": tid,
                            "ts": start, "dur": end - start})

    def gpu(self, name: str, start: float, end: float, stream: int, launch: float | None,
            cat: str = "kernel", tid: int = 1, device: int = 0) -> None:
        self.corr += 1
        args = {"device": device, "stream": stream}
        if launch is not None:
            args["correlation"] = self.corr
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 99,
                                "tid": tid, "ts": launch, "dur": 1, "args": {"correlation": self.corr}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream,
                            "ts": start, "dur": end - start, "args": args})

    def doc(self) -> dict:
        return {"traceEvents": self.events, "displayTimeUnit": "ms"}


AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AR = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)"


def one_step(b: TraceBuilder, offset: float = 0.0, host: float = 0.0) -> None:
    b.host(f"ProfilerStep#{int(host // 100) + 1}", host, host + 100)
    for s, e in ((1000, 1010), (1020, 1030)):
        b.gpu("ampere_bf16_gemm", s + offset, e + offset, 7, host + 10)
    b.host("Optimizer.step#AdamW.step", host + 50, host + 60)
    b.gpu("multi_tensor_apply_kernel", 1040 + offset, 1050 + offset, 7, host + 55)  # launched in the optimizer
    b.gpu(AG, 1005 + offset, 1025 + offset, 20, host + 5)
    b.gpu(RS, 1052 + offset, 1060 + offset, 21, host + 40)
    b.gpu(AR, 1045 + offset, 1048 + offset, 22, host + 41)
    b.gpu("Memcpy DtoD (Device -> Device)", 1060 + offset, 1062 + offset, 7, host + 42, cat="gpu_memcpy")


def test_closed_form_exposed_times() -> None:
    b = TraceBuilder()
    one_step(b)
    [step] = ts.summarise(ts.parse(b.doc()))
    want_us = {"step": 62, "compute": 30, "copy": 2, "all_gather": 20, "all_gather_exposed": 10,
               "reduce_scatter": 8, "reduce_scatter_exposed": 8, "all_reduce": 3, "all_reduce_exposed": 0,
               "other_comm": 0, "other_comm_exposed": 0, "comm": 31, "comm_exposed": 18, "idle": 12}
    for key, us in want_us.items():
        assert step.ms[key] == pytest.approx(us / 1e3, abs=1e-9), key
    count, host_ms, gpu_ms = step.labels["Optimizer.step"]
    assert (count, host_ms, gpu_ms) == (1, pytest.approx(0.010), pytest.approx(0.010))


def test_fully_hidden_and_fully_exposed_comm() -> None:
    """An all-gather inside a compute kernel is hidden; the same all-gather in a gap is all exposed,
    and two overlapping all-gathers count once (union)."""
    b = TraceBuilder()
    b.host("ProfilerStep#1", 0, 100)
    b.gpu("sm90_gemm", 0, 100, 7, 1)
    b.gpu(AG, 10, 40, 20, 2)
    b.gpu(AG, 30, 60, 21, 3)
    b.gpu(AG, 150, 170, 20, 4)  # after the compute: exposed
    [step] = ts.summarise(ts.parse(b.doc()))
    assert step.ms["all_gather"] == pytest.approx(0.070)
    assert step.ms["all_gather_exposed"] == pytest.approx(0.020)
    assert step.ms["step"] == pytest.approx(0.170)
    assert step.ms["idle"] == pytest.approx(0.050)


def test_events_go_to_the_step_that_launched_them() -> None:
    """Step 2's kernels are launched in step 2's host range even though step 1's last kernel still
    runs when they start; a kernel without a launch record falls back to its start time."""
    b = TraceBuilder()
    one_step(b, offset=0.0, host=0.0)
    one_step(b, offset=100.0, host=100.0)
    b.gpu("orphan_kernel", 1150, 1151, 7, launch=None)  # no correlation: start 1150 -> step 2?
    steps = ts.summarise(ts.parse(b.doc()))
    assert [s.name for s in steps] == ["ProfilerStep#1", "ProfilerStep#2"]
    assert steps[0].ms["compute"] == pytest.approx(0.030)
    # the orphan starts at 1150 us, which is not inside any host step range [0,100) or [100,200)
    # as a host time, so it lands in the last step that started before it: step 2
    assert steps[1].ms["compute"] == pytest.approx(0.031)
    mean = ts.mean_step(steps)
    assert mean.ms["all_gather_exposed"] == pytest.approx(0.010)


def test_classification_by_kernel_name_only() -> None:
    cases = {AG: "all_gather", RS: "reduce_scatter", AR: "all_reduce",
             "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "other_comm",
             "void at::native::elementwise_kernel<128, 4>": "compute"}
    for name, cls in cases.items():
        assert ts.gpu_class({"cat": "kernel", "name": name}) == cls
    assert ts.gpu_class({"cat": "gpu_memset", "name": "Memset (Device)"}) == "copy"


def test_other_devices_are_ignored_and_labels_nest() -> None:
    b = TraceBuilder()
    b.host("ProfilerStep#1", 0, 100)
    b.host("FSDP::pre_forward (blocks.0)", 0, 20)  # one unit's phase: grouped under the phase
    b.host("FSDP::pre_forward (blocks.1)", 20, 50)
    b.host("FSDP::all_gather", 5, 15)
    b.gpu(AG, 0, 10, 20, 6)
    b.gpu("gemm", 10, 30, 7, 20)
    b.gpu("gemm", 10, 30, 7, 20)  # same interval twice: counted once
    b.gpu("gemm", 0, 500, 7, 20, device=1)  # another GPU with fewer events: not rank 0's
    [step] = ts.summarise(ts.parse(b.doc()))
    assert step.ms["step"] == pytest.approx(0.030)
    assert step.labels["FSDP::all_gather"][2] == pytest.approx(0.010)
    assert step.labels["FSDP::pre_forward"][2] == pytest.approx(0.030)


def test_markdown_and_gzip_round_trip(tmp_path) -> None:
    b = TraceBuilder()
    one_step(b)
    path = tmp_path / "ours.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(b.doc(), f)
    steps = ts.summarise(ts.load(path))
    text = ts.markdown({"ours-z3": steps, "fsdp2": steps})
    assert "| all-gather exposed | 0.01 (16.1%) | 0.01 (16.1%) |" in text
    assert "Optimizer.step" in text


def test_timeline_png(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="needs matplotlib")
    b = TraceBuilder()
    one_step(b)
    trace = ts.parse(b.doc())
    path = tmp_path / "timeline.png"
    assert ts.timeline_png({"ours": ts.split_steps(trace)[0][1]}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_interval_helpers() -> None:
    assert ts.union([(5, 6), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 6)]
    assert ts.overlap([(0, 10)], [(2, 3), (5, 20)]) == 6
    assert ts.exposed([(0, 10), (20, 30)], [(5, 25)]) == 10


def test_top_kernels_per_step() -> None:
    b = TraceBuilder()
    one_step(b)
    [step] = ts.summarise(ts.parse(b.doc()))
    assert step.kernels["ampere_bf16_gemm"] == (2, pytest.approx(0.020))
    assert ts.short_name("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)") \
        == "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
    text = ts.markdown({"ours": [step]})
    assert "| `ampere_bf16_gemm` | 2 | 0.02 |" in text
    assert ts.short_name("k" * 200) == "k" * 89 + "…"


def test_write_report_from_gpu_like_traces(tmp_path) -> None:
    """The rank-0 report path of bench/trace.py on GPU-shaped traces: side-by-side table, memory table."""
    from bench import memory, trace

    paths = {}
    for name in ("ours-z3", "fsdp2"):
        b = TraceBuilder()
        one_step(b)
        one_step(b, offset=100.0, host=100.0)
        paths[name] = tmp_path / f"trace_{name}.json.gz"
        with gzip.open(paths[name], "wt") as f:
            json.dump(b.doc(), f)
    mems = [memory.MemoryReport("ours-z3", numbers={"rest": 2**30}), memory.MemoryReport("fsdp2")]
    md = trace.write_report(tmp_path, "# header", paths, mems)
    assert (tmp_path / "trace.md").read_text() == md
    assert "| ms per step | ours-z3 | fsdp2 |" in md
    assert "| all-gather exposed | 0.01 (16.1%) | 0.01 (16.1%) |" in md
    assert "Steps profiled: ours-z3: 2; fsdp2: 2" in md
    assert "| at rest (after zero_grad) | 1.000 | – |" in md


def test_profile_drains_the_warm_up_step_before_recording(tmp_path, monkeypatch) -> None:
    """The warm-up step is synchronised before the recorded window opens (else a host running ahead
    leaves its kernels in the window): one sync after it, one at the end; 1 + steps calls."""
    import torch

    from bench import runtime, trace
    calls: list[str] = []
    monkeypatch.setattr(runtime, "sync", lambda env: calls.append("sync"))
    env = runtime.Env(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    trace.profile(env, lambda: calls.append("step"), tmp_path / "t.json", 2)
    assert calls == ["step", "sync", "step", "step", "sync"], calls
    assert (tmp_path / "t.json").stat().st_size > 0


def test_legacy_category_names_are_read() -> None:
    """Older exports name the categories ``Kernel``, ``Memcpy`` and ``Runtime``; they give the same
    numbers as kineto's ``kernel``, ``gpu_memcpy`` and ``cuda_runtime``."""
    b = TraceBuilder()
    one_step(b)
    legacy = {"kernel": "Kernel", "gpu_memcpy": "Memcpy", "cuda_runtime": "Runtime"}
    doc = {"traceEvents": [dict(e, cat=legacy.get(e["cat"], e["cat"])) for e in b.events]}
    [new], [old] = ts.summarise(ts.parse(b.doc())), ts.summarise(ts.parse(doc))
    assert old.ms == pytest.approx(new.ms) and old.ms["copy"] == pytest.approx(0.002)


def test_gpu_events_outside_every_step_still_give_a_table() -> None:
    """GPU events whose launches are not in the trace and that start before the first step range
    (a clock offset between host and device records) are summarised as one step, not dropped."""
    b = TraceBuilder()
    b.host("ProfilerStep#1", 5000, 5100)
    b.gpu("sm90_gemm", 100, 130, 7, launch=None)
    b.gpu(AG, 120, 140, 20, launch=None)
    [step] = ts.summarise(ts.parse(b.doc()))
    assert step.name == "all" and step.ms["step"] == pytest.approx(0.040)
    assert step.ms["all_gather_exposed"] == pytest.approx(0.010)


def test_report_says_why_there_is_no_table(tmp_path) -> None:
    """A profile that failed (an OOM) is named with its error, and a trace without GPU events says
    what it holds instead, never that the run was a CPU run."""
    from bench import trace

    b = TraceBuilder()
    b.host("ProfilerStep#1", 0, 100)
    b.events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1, "dur": 2})
    path = tmp_path / "trace_fsdp2.json"
    path.write_text(json.dumps(b.doc()))
    md = trace.write_report(tmp_path, "# h", {"fsdp2": path}, [],
                            {"ours-z3": "ERROR OutOfMemoryError: CUDA out of memory"})
    assert "- ours-z3: ERROR OutOfMemoryError: CUDA out of memory" in md
    assert "- fsdp2: no GPU events (complete events by category: cpu_op 1, user_annotation 1)" in md
    assert "CPU run" not in md
