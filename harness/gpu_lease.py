"""Node-wide GPU leases for distributed test buckets under ``pytest -n K``.

xdist workers on one node must never give the same GPU to two buckets at once, and a
bucket of N ranks needs N GPUs at the same time. The leaser keeps one lock file per
GPU index in a directory shared by every process of the node and holds an ``flock``
on each leased GPU's file for the lease's lifetime, so the kernel frees the lease when
the holder dies (even by SIGKILL). Choosing which GPUs to take happens under a
directory-wide ``flock``, and a chooser either gets all N GPUs or takes none, so
concurrent acquirers cannot deadlock holding partial sets.

GPU ids are indices into the devices the session sees (``CUDA_VISIBLE_DEVICES`` order);
``Lease.cuda_visible_devices`` maps them back to what a rank process should be given.
Lock files are named after the physical device (the mask's entry), so sessions with
different masks on one node still exclude each other exactly where they overlap.
Linux/macOS only (``fcntl``), like the CUDA nodes it serves.

Waiters poll; there is no queue, so a large request may wait while smaller ones keep
the GPUs busy (it gets them once the smaller buckets drain). That costs throughput,
never correctness: no GPU is shared, and nothing is held while waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType

ENV_FAKE_GPUS = "HARNESS_FAKE_GPUS"
ENV_FORCE_CPU = "HARNESS_FORCE_CPU"
ENV_LOCK_DIR = "HARNESS_LOCK_DIR"
POLL_INTERVAL_S = 0.05
_DIR_LOCK_NAME = "leaser.lock"
_LOCK_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class GpuLeaseError(RuntimeError):
    """Base class of lease failures."""


class NotEnoughGpusError(GpuLeaseError):
    """More GPUs were requested than the node has; the message is a skip reason."""

    def __init__(self, requested: int, total: int) -> None:
        self.requested, self.total = requested, total
        super().__init__(f"needs {requested} GPU(s) but only {total} visible on this node")


class LeaseTimeoutError(GpuLeaseError, TimeoutError):
    """Not enough GPUs became free before the timeout."""


def default_lock_dir(env: Mapping[str, str] | None = None) -> pathlib.Path:
    """``$HARNESS_LOCK_DIR/<host name>``, else one directory per user in the node's temp dir. Leases
    are node-local: GPU 0 of one node is not GPU 0 of another, so even a lock directory on a
    filesystem several nodes share keeps each node's locks apart."""
    env = os.environ if env is None else env
    if env.get(ENV_LOCK_DIR):
        return pathlib.Path(env[ENV_LOCK_DIR]) / socket.gethostname()
    return pathlib.Path(tempfile.gettempdir()) / f"harness-gpu-locks-{os.getuid()}"


def visible_device_entries(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA would use, or None if unset.

    CUDA stops at the first invalid entry, so ``"0,1,-1,3"`` means devices 0 and 1.
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    entries = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


def _nvidia_smi_count() -> int | None:
    """GPUs listed by ``nvidia-smi -L`` (no CUDA context is created), None if unusable."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _torch_count() -> int:
    """torch's count, NVML-based in recent torch, so CUDA is not initialised here."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())  # 0 on a CPU-only build


def cpu_forced(env: Mapping[str, str] | None = None) -> bool:
    """``HARNESS_FORCE_CPU`` set to anything but empty or ``0``: the one reader of that variable."""
    env = os.environ if env is None else env
    return env.get(ENV_FORCE_CPU, "") not in ("", "0")


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """How many GPUs this process may use.

    ``HARNESS_FAKE_GPUS=N`` wins (tests of the scheduling on CPU); ``HARNESS_FORCE_CPU=1``
    means none; else the physical count (nvidia-smi, else torch), capped by
    ``CUDA_VISIBLE_DEVICES``.
    """
    env = os.environ if env is None else env
    fake = env.get(ENV_FAKE_GPUS)
    if fake is not None and fake.strip() != "":
        try:
            count = int(fake)
        except ValueError:
            count = -1
        if count < 0:
            raise ValueError(f"{ENV_FAKE_GPUS} must be a non-negative integer, got {fake!r}")
        return count
    if cpu_forced(env):
        return 0
    entries = visible_device_entries(env)
    if entries is not None and not entries:
        return 0
    physical = _nvidia_smi_count()
    if physical is None:
        return _torch_count()  # torch already honours CUDA_VISIBLE_DEVICES
    return physical if entries is None else min(physical, len(entries))


def _unlock_all(fds: list[int]) -> None:
    """Drop the flocks and close the descriptors (closing alone would also unlock)."""
    for fd in fds:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


class Lease:
    """GPUs held by this process until ``release()`` (or the process dies)."""

    def __init__(self, gpu_ids: list[int], fds: list[int]) -> None:
        self.gpu_ids = gpu_ids
        self._fds = fds
        self.released = False

    def release(self) -> None:
        """Free the GPUs; safe to call more than once."""
        fds, self._fds = self._fds, []
        self.released = True
        _unlock_all(fds)

    def cuda_visible_devices(self, env: Mapping[str, str] | None = None) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value for a rank process using this lease."""
        entries = visible_device_entries(env)
        if entries is None:
            return ",".join(str(gid) for gid in self.gpu_ids)
        return ",".join(entries[gid] for gid in self.gpu_ids)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease(gpu_ids={self.gpu_ids}, released={self.released})"


class GpuLeaser:
    """Hands out all-or-nothing leases of GPU indices ``0..total_gpus-1`` on this node."""

    def __init__(self, lock_dir: pathlib.Path | None = None, total_gpus: int | None = None,
                 device_names: Sequence[str] | None = None) -> None:
        """``device_names[i]`` names the physical GPU behind index i in the lock files.

        By default the ``CUDA_VISIBLE_DEVICES`` entries (when they cover every index), so
        two sessions on one node with different masks lock the same physical GPU under
        the same name, and sessions with disjoint masks never wait for each other.
        """
        total = visible_gpu_count() if total_gpus is None else total_gpus
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise ValueError(f"total_gpus must be a non-negative int, got {total!r}")
        if device_names is None:
            entries = visible_device_entries()
            device_names = entries[:total] if entries and len(entries) >= total else None
        names = [str(i) for i in range(total)] if device_names is None else list(device_names)
        if len(names) != total or len(set(names)) != total:
            raise ValueError(f"device_names must be {total} distinct names, got {names!r}")
        self.lock_dir = pathlib.Path(lock_dir) if lock_dir is not None else default_lock_dir()
        self.total_gpus = total
        self._lock_names = [_LOCK_NAME_UNSAFE.sub("_", name) for name in names]
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _gpu_path(self, gpu_id: int) -> pathlib.Path:
        return self.lock_dir / f"gpu-{self._lock_names[gpu_id]}.lock"

    @contextlib.contextmanager
    def _dir_lock(self) -> Iterator[None]:
        """Serialise choosers (and holder probes) across every process of the node."""
        dir_fd = os.open(self.lock_dir / _DIR_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(dir_fd)  # closing drops the lock

    def _try_take(self, n: int) -> Lease | None:
        """Under the directory lock, take n free GPUs (lowest ids first) or none."""
        with self._dir_lock():
            taken: list[tuple[int, int]] = []
            try:
                for gpu_id in range(self.total_gpus):
                    if len(taken) == n:
                        break
                    fd = os.open(self._gpu_path(gpu_id), os.O_RDWR | os.O_CREAT, 0o600)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        continue
                    taken.append((gpu_id, fd))
                if len(taken) < n:
                    return None
                for _, fd in taken:  # who holds it, for timeout messages
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                lease = Lease([gid for gid, _ in taken], [fd for _, fd in taken])
                taken = []  # the lease owns them now
                return lease
            finally:
                _unlock_all([fd for _, fd in taken])  # all-or-nothing

    def holders(self) -> dict[int, str]:
        """GPU id -> pid recorded by its current holder (for error messages)."""
        found = {}
        with self._dir_lock():
            for gpu_id in range(self.total_gpus):
                path = self._gpu_path(gpu_id)
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    found[gpu_id] = path.read_text().strip() or "?"
                finally:
                    os.close(fd)  # also drops the probe's lock when the GPU was free
        return found

    def acquire(self, n: int, timeout_s: float | None = None) -> Lease:
        """Wait until n GPUs are free and lease them all; ``timeout_s=None`` waits forever.

        Raises NotEnoughGpusError at once if n exceeds the node's GPUs (a skip reason),
        LeaseTimeoutError if they do not become free in time.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be None or >= 0, got {timeout_s!r}")
        if n > self.total_gpus:
            raise NotEnoughGpusError(n, self.total_gpus)
        if n == 0:
            return Lease([], [])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            lease = self._try_take(n)
            if lease is not None:
                return lease
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                held = ", ".join(f"GPU {g} by pid {p}" for g, p in self.holders().items())
                raise LeaseTimeoutError(
                    f"timed out after {timeout_s:g}s waiting for {n} of {self.total_gpus} "
                    f"GPU(s) in {self.lock_dir} (held: {held or 'none now'})")
            wait = POLL_INTERVAL_S if deadline is None else min(POLL_INTERVAL_S, deadline - now)
            time.sleep(max(wait, 0.0))
