"""Process-group set-up, timing and memory probes shared by the benchmark scripts.

One process per GPU under ``torchrun`` (NCCL), or CPU with gloo for a smoke run on a machine
without a GPU (``--device cpu``): the same code path, only the timer and the memory probes change
(CUDA events and the caching allocator's counters on GPU; a host clock and zeros on CPU).
"""
from __future__ import annotations

import datetime
import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast can take a host's GPUs out of service; every benchmark keeps it off.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GIB = 2**30


@dataclass(frozen=True)
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    # A one-process run pretending to be rank 0 of ``world`` ranks (``init(fake_world=N)``):
    # collectives move nothing between processes, so everything but communication is measured.
    fake: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def check_no_multicast() -> None:
    """Refuse to run with NVLink multicast enabled (or not explicitly disabled)."""
    wrong = {k: os.environ.get(k) for k, v in NO_MULTICAST.items() if os.environ.get(k) != v}
    if wrong:
        want = " ".join(f"{k}={v}" for k, v in NO_MULTICAST.items())
        raise SystemExit(f"NVLink multicast must stay off: export {want} (found {wrong})")


def load_te_first() -> bool:
    """Import TransformerEngine, where installed, before anything uses cuDNN.

    TE brings its own cuDNN (the H200 kit's is 9.14); a process that first ran SDPA on the
    system cuDNN and imports TE later mixes the two libraries and fails with ``libcudnn_cnn.so.9:
    undefined symbol`` (seen for the FP8 cells and megatron-fsdp, which imports TE). Importing TE
    first makes every later cuDNN user resolve to TE's. Returns whether TE was imported."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a broken TE must not stop the non-TE cells; the TE cells report it
        print(f"[bench] transformer_engine is installed but does not import: {type(err).__name__}: {err}",
              flush=True)
        return False
    return True


def init(device: str, timeout_s: int = 180, fake_world: int = 0) -> Env:
    """Initialise the default process group (a 1-rank group when not under torchrun).

    ``device`` is ``auto`` (CUDA when present), ``cuda`` or ``cpu``. The collective timeout is
    short so that a rank stuck in a collective (another rank failed) ends the run instead of
    eating the whole GPU lease; results already written survive.

    ``fake_world=N`` (N >= 2, no torchrun) makes this one process rank 0 of N over torch's
    ``fake`` backend. Shards, buffers, casts, copies, compute and the optimizer step run at their
    world-N sizes on one device, and nothing moves between processes (torch's fake all-gather
    copies the input into the other ranks' chunks, a device copy per gather; the other
    collectives return at once; an engine that gathers out of place pays one copy more): the
    step time is the step with communication free and fully hidden (a lower bound of the real
    one), and the memory is a rank's at that world size less the communication library's
    buffers. Gathered values are whatever the buffers held, so losses mean nothing;
    implementations that need real collective results (DDP's reducer) are refused by
    ``bench.impls.unavailable_reason``. Made for a machine with one GPU: the non-communication
    cost of each engine at the world size it would run at.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be one of auto, cuda, cpu; got {device!r}")
    if fake_world:
        if fake_world < 2:
            raise ValueError(f"fake_world must be >= 2 (a 1-rank run needs no fake), got {fake_world}")
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise SystemExit("fake_world is one process pretending to be rank 0: run it without torchrun")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        check_no_multicast()
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda asked for, but torch sees no CUDA GPU")
        load_te_first()
    local = 0 if fake_world else int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        _init_group(dev, timeout_s, fake_world)
    env = Env(dist.get_rank(), dist.get_world_size(), local, dev, fake=bool(fake_world))
    prime_libraries(env)
    return env


def _init_group(dev: torch.device, timeout_s: int, fake_world: int) -> None:
    """The default group: fake (``fake_world`` ranks, this one rank 0), else NCCL on CUDA, gloo on CPU.

    Outside torchrun the one-rank group uses an in-process store: no port to pick, so concurrent
    bench processes on one machine never collide on a rendezvous port."""
    if fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    # device_id: NCCL communicators are made eagerly, outside any timed region
    kwargs: dict = {"device_id": dev} if dev.type == "cuda" else {}
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend, timeout=timeout, **kwargs)


def prime_libraries(env: Env) -> None:
    """Let cuBLAS/cuBLASLt allocate their per-stream workspaces (~65 MiB on an H200, kept for the
    process's life) before any cell is measured. Otherwise the first cell's peak and "not returned"
    memory carry them, and whichever implementation runs first looks 65 MiB heavier."""
    if not env.is_cuda:
        return
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 128, device=env.device, dtype=dtype, requires_grad=True)
        w = torch.randn(128, 128, device=env.device, dtype=dtype, requires_grad=True)
        b = torch.zeros(128, device=env.device, dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(x, w, b).square().sum().backward()
        (x.detach() @ w.detach()).sum().item()
    sync(env)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def sync(env: Env) -> None:
    if env.is_cuda:
        torch.cuda.synchronize(env.device)


def all_max(env: Env, values: list[float]) -> list[float]:
    """Element-wise max over ranks (the slowest rank sets throughput; the fullest GPU the memory)."""
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rank0_decides(env: Env, decision: bool) -> bool:
    """Rank 0's decision, on every rank (keeps skip/run choices identical, so no rank waits alone)."""
    t = torch.tensor([1 if decision else 0], dtype=torch.int32, device=env.device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def reset_te_fp8_state() -> None:
    """``fsdp_impl.fp8.te.reset_te_fp8_state`` (TE's process-global FP8 registry), imported when
    called so that importing ``bench`` does not import the engine."""
    from fsdp_impl.fp8.te import reset_te_fp8_state as reset

    reset()


def free_memory(env: Env) -> None:
    """Drop what the last cell left: TransformerEngine's global FP8 state (it keeps every
    delayed-scaling module's amax buffers, alive and all-reduced at each later FP8 step), reference
    cycles (hooks, closures), then cached blocks."""
    reset_te_fp8_state()
    gc.collect()
    if env.is_cuda:
        torch.cuda.synchronize(env.device)
        torch.cuda.empty_cache()


def allocated(env: Env) -> int:
    return torch.cuda.memory_allocated(env.device) if env.is_cuda else 0


def reset_peak(env: Env) -> None:
    if env.is_cuda:
        torch.cuda.reset_peak_memory_stats(env.device)


def peak_allocated(env: Env) -> int:
    return torch.cuda.max_memory_allocated(env.device) if env.is_cuda else 0


def peak_reserved(env: Env) -> int:
    return torch.cuda.max_memory_reserved(env.device) if env.is_cuda else 0


def total_memory(env: Env) -> int:
    return torch.cuda.get_device_properties(env.device).total_memory if env.is_cuda else 0


def device_name(env: Env) -> str:
    return torch.cuda.get_device_name(env.device) if env.is_cuda else "cpu"


class StepTimer:
    """Per-step durations in seconds: CUDA events on GPU (no sync inside the loop), host clock on CPU."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.marks: list = []

    def mark(self) -> None:
        if self.env.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds between consecutive marks (synchronises once, at the end)."""
        sync(self.env)
        if self.env.is_cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
