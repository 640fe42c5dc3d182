"""CPU offload: ``OffloadPolicy`` (``fully_shard(..., offload_policy=...)``), its wrap-time checks,
and the host buffers of one unit (``UnitOffload``).

What lives where (per rank, for its shards only):

* ``main_params``: the unit's weight shard (``unit.weight``, what ``model.parameters()`` are
  DTensor views of and what the optimizer updates) is allocated in host memory.
* ``params``: whether the all-gathers start from that host shard (one host-to-device copy per
  gather, then the usual cast and all-gather). With ``params=False`` the engine keeps a copy of
  the shard in the compute dtype on the device instead (a bf16 shard is half the fp32 one),
  refreshed whenever the main weights changed: by the streamed step straight from its device
  window, otherwise by one host-to-device copy before the next gather.
* ``grads``: the reduced grad shards are copied to a host buffer at the end of the sync backward
  and the device buffer is freed; ``.grad`` (or ``.decoupled_grad``) are views of the host buffer.
* ``optimizer_state``: the optimizer's state tensors live in host memory.
* ``step``: ``"cpu"`` runs the user's optimizer on the host tensors (FSDP2's ``CPUOffloadPolicy``);
  ``"gpu"`` streams the host state through a small device window in chunks and does the Adam math
  on the device (``step.py``).
* ``overlap_step``: whether the step overlaps the backward (``overlap.py``): ``True`` steps each
  unit as its reduced grads land, ``"clip"`` overlaps only the grads' copies and their norms.

Host buffers are pinned (page-locked) with ``pin_memory=True``, so copies run asynchronously on
side streams; without pinning they are synchronous copies. Pinned buffers hold exactly their bytes
(``device.pinned_zeros``), not torch's power-of-two-rounded pinned blocks.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _testing
from ..buffers import DataParallelBuffer
from ..device import (
    CommStream,
    current_stream_wait,
    free_memory,
    host_device,
    host_zeros,
    pinned_memory_available,
    synchronize,
)
from ..policy import ResolvedDtypes
from ..sharding import FlatLayout
from .step import WINDOW_SLOTS, window_capacity, window_too_large

if TYPE_CHECKING:
    from ..param import ManagedParam
    from ..unit_context import UnitContext
    from .overlap import OverlappedStep

# Where the optimizer steps (``OffloadPolicy.step``): streamed through the device, or on the host
StepMode = Literal["gpu", "cpu"]
STEPS: tuple[StepMode, ...] = get_args(StepMode)
# What overlaps the backward (``OffloadPolicy.overlap_step``): nothing, the whole step, or (for
# ``clip_grad_norm``, which needs every grad before any step) the grads' copies and norms only
OverlapMode = Literal[False, True, "clip", "forward"]
OVERLAP_MODES: tuple[OverlapMode, ...] = (False, True, "clip", "forward")
# Where the host compute-dtype copy is cast (``OffloadPolicy.compute_copy_on_host``): none, on the
# host by the worker (True), or on the device from the copy uploaded ahead, then downloaded
HostCopyMode = Literal[False, True, "device"]
HOST_COPY_MODES: tuple[HostCopyMode, ...] = (False, True, "device")
MIN_CHUNK_BYTES = 4096
DEFAULT_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class OffloadPolicy:
    """Which per-rank state ``fully_shard`` keeps in host memory, and where the optimizer steps.

    * ``optimizer_state`` (True): optimizer state (Adam's moments) in host memory.
    * ``main_params`` (True): the main-parameter shards (``model.parameters()``) in host memory.
    * ``grads`` (None): the reduced grad shards in host memory between the backward and the step;
      None means on the host whenever the main params are (torch keeps ``.grad`` on its param's
      device, so host main params take host grads), else on the device (``main_params=False``).
    * ``params`` (False): True gathers every unit straight from its host shard (no copy of the
      weights stays on the device); False keeps a compute-dtype copy of the shard on the device.
    * ``step`` (``"gpu"``): ``"gpu"`` streams host state through the device in chunks and does
      the math there (``fsdp_impl.optim.Adam/AdamW``, ``torch.optim.Adam/AdamW``); ``"cpu"`` runs
      the optimizer on the host (any optimizer; Adam/AdamW use torch's fused CPU kernel).
    * ``pin_memory`` (True): page-locked host buffers (asynchronous copies); needs CUDA.
    * ``huge_pages`` (False): the host buffers the engine makes (main params, grads, compute-dtype
      copies, the streamed step's state, and with ``overlap_step`` the moments of torch's
      Adam/AdamW) of 2 MiB and more get their own mappings advised for transparent huge pages
      (``device.host_zeros``; Linux with THP in ``madvise`` or ``always`` mode, else ordinary
      pages). The host step streams all of them every step. Same bytes, same numbers. Off by
      default: its A/B on three H100 hosts was within the rounds' noise (``fsdp_impl/README.md``).
    * ``chunk_bytes`` (64 MiB): device bytes of one chunk of the streamed step (all streamed
      tensors of the chunk together), an upper bound: a chunk never holds more than the step
      streams, and the window holds ``WINDOW_SLOTS`` chunks (fewer when the step has fewer). A
      window that cannot fit the device's free memory is refused at wrap time
      (``check_window``) and again, exactly, before the first step allocates it.
    * ``upload_ahead`` (True): with ``overlap_step`` True/``"forward"`` and ``step="cpu"``, the
      worker uploads each unit's new weights to the device right after the unit's host step
      (``UnitOffload.refresh_ahead``) instead of leaving the upload to the next forward's gather:
      into the compute shard (``params=False``), or (``params=True``) into a compute-dtype copy
      that lives only until that gather consumes it (the backward's gather uploads from the host
      again), so the device peak, at the end of the forward, stays that of ``params=True``. It
      shortens the forward, and costs the host step the copy's host-memory traffic while both
      run; False keeps the upload in the forward. Same numbers either way.
    * ``compute_copy_on_host`` (False): with ``step="cpu"`` and ``overlap_step`` True/``"forward"``,
      also keep a compute-dtype copy of each shard in (pinned) host memory, for 2 more host bytes
      a param. ``True``: the worker casts it on the host right after the unit's host step, and
      every upload of the new weights (made ahead, the gathers') sends it: 2 bytes a param
      instead of 4 at bf16 compute, for a host pass of 6 bytes a param on the worker.
      ``"device"`` (``params=True`` with ``upload_ahead``): the copy is the device's cast of the
      upload made ahead, downloaded right after it on the worker's stream: the ahead upload stays
      fp32, the backward's gathers send 2 bytes a param, the link carries 2 bytes a param more
      down, and the host does no cast. Both casts round as the gathers' device cast: same bits.
    * ``step_threads`` (None): intra-op threads of the overlapped host step (``step="cpu"`` with
      ``overlap_step`` True/``"forward"``); None takes one fewer than the caller's, leaving a
      core to the thread that drives the device, and the caller's full width for the units
      still to step from ``optimizer.step()`` on (the caller then waits for them: in ``step()``
      with ``True``, in the next forward's gathers with ``"forward"``). Adam is elementwise:
      same bits at any width.
    * ``device_step_units`` (0): with ``step="cpu"``, ``overlap_step=True`` and ``params=True``
      (``upload_ahead``), the first N units of each model in forward order (the root first) step on
      the device instead: their shard, grads and moments go up on a side stream, the
      optimizer's kernel runs there, shard and moments come back down, and the cast new weights
      are the next forward's copy (``device_step.py``). For those units the link carries 16
      bytes a param up (instead of the 4 of the upload made ahead) and 12 more down: measured
      slower than the host step on PCIe H100 hosts (README), so off unless the link outruns the
      host Adam. On a GPU their bits are the device kernel's. An int >= 0, else an error.
    * ``overlap_step`` (False): overlap the optimizer step with the backward (``overlap.py``);
      needs the grads in host memory and Adam/AdamW. ``True``: as each unit's reduced grads land
      (the sync backward of an accumulation only), that unit steps in a worker thread
      (``step="cpu"``: the host kernel; ``step="gpu"``: the unit's chunks through the window),
      and ``optimizer.step()`` waits for it; ``clip_grad_norm`` after such a backward raises.
      ``"clip"``: the grads' device-to-host copies and their partial norms overlap the backward,
      ``clip_grad_norm`` uses those norms and ``optimizer.step()`` steps as without overlap.
      ``"forward"`` (``step="cpu"``): as ``True``, and the units still stepping when the backward
      ends go on stepping (first unit first) while the next forward runs: ``optimizer.step()``
      returns at once, each unit's gather in the next forward waits for that unit's step. Until
      that forward, read params or optimizer state only after ``fsdp_impl.wait_for_step(optimizer)``
      (``state_dict``/``load_state_dict``, ``zero_grad(set_to_none=False)``, ``clip_grad_norm``,
      another ``step()`` and the next backward wait by themselves); a scheduler may change ``lr``
      at once (the units step with the values of ``step()`` time). On a GPU as fast as ``True``
      at 1.3B and slower at 6.6B (see the README); ``True`` has fewer rules.
      Every mode gives the numbers of ``overlap_step=False``, bit for bit.
    """

    optimizer_state: bool = True
    main_params: bool = True
    grads: bool | None = None
    params: bool = False
    step: StepMode = "gpu"
    pin_memory: bool = True
    huge_pages: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    overlap_step: OverlapMode = False
    upload_ahead: bool = True
    compute_copy_on_host: HostCopyMode = False
    step_threads: int | None = None
    device_step_units: int = 0

    def __post_init__(self) -> None:
        for name in ("optimizer_state", "main_params", "params", "pin_memory", "upload_ahead", "huge_pages"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"OffloadPolicy.{name} must be True or False, got {getattr(self, name)!r}")
        self._check_host_step()
        if self.grads is not None and not isinstance(self.grads, bool):
            raise TypeError(f"OffloadPolicy.grads must be None, True or False, got {self.grads!r}")
        if self.step not in STEPS:
            raise ValueError(f"OffloadPolicy.step must be one of {STEPS}, got {self.step!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int):
            raise TypeError(f"OffloadPolicy.chunk_bytes must be an int (bytes), got {self.chunk_bytes!r}")
        if self.chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"OffloadPolicy.chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {self.chunk_bytes}")
        if self.step == "cpu" and not (self.main_params and self.optimizer_state):
            raise ValueError("OffloadPolicy(step='cpu') runs the optimizer on the host, so main_params and "
                             f"optimizer_state must be True (got main_params={self.main_params}, "
                             f"optimizer_state={self.optimizer_state}); use step='gpu' to keep either on the device")
        if self.step == "cpu" and self.grads is False:
            raise ValueError("OffloadPolicy(step='cpu') reads the grads on the host: grads must be None or True, "
                             "got False")
        if self.main_params and self.grads is False:
            raise ValueError("OffloadPolicy(main_params=True) keeps model.parameters() in host memory, and torch "
                             "requires .grad on its parameter's device: grads must be None or True, got False "
                             "(use main_params=False to keep grads and main params on the device)")
        if self.params and not self.main_params:
            raise ValueError("OffloadPolicy.params=True gathers from the host main-parameter shards, so it "
                             "needs main_params=True")
        if not (self.overlap_step is False or self.overlap_step is True or self.overlap_step in ("clip", "forward")):
            raise ValueError(f"OffloadPolicy.overlap_step must be one of {OVERLAP_MODES}, got {self.overlap_step!r}")
        if self.overlap_step == "forward" and self.step != "cpu":
            raise ValueError("OffloadPolicy(overlap_step='forward') lets the host step run on into the next forward, "
                             f"which needs step='cpu', got step={self.step!r}")
        if self.overlap_step is not False and not self.grads_on_host:
            raise ValueError(f"OffloadPolicy(overlap_step={self.overlap_step!r}) overlaps the step with the grads' "
                             "copies to host memory, so the grads must be on the host: pass grads=True or None "
                             "with main_params=True, or overlap_step=False")
        if not (self.optimizer_state or self.main_params or self.grads):
            raise ValueError("OffloadPolicy offloads nothing (optimizer_state, main_params and grads are all "
                             "off); pass offload_policy=None instead")

    def _check_host_step(self) -> None:
        """``compute_copy_on_host`` and ``step_threads``: what they take and what they need."""
        copy = self.compute_copy_on_host
        if not (copy is False or copy is True or copy == "device"):
            raise ValueError(f"OffloadPolicy.compute_copy_on_host must be one of {HOST_COPY_MODES}, got {copy!r}")
        overlapped = self.step == "cpu" and self.steps_in_backward
        if copy is not False and not overlapped:
            raise ValueError(f"OffloadPolicy(compute_copy_on_host={copy!r}) keeps a copy that the overlapped host "
                             "step refreshes after each unit's update, so it needs step='cpu' and overlap_step True "
                             f"or 'forward', got step={self.step!r}, overlap_step={self.overlap_step!r}")
        if copy == "device" and not (self.params and self.upload_ahead):
            raise ValueError("OffloadPolicy(compute_copy_on_host='device') downloads the device's cast of the copy "
                             "uploaded ahead, so it needs params=True and upload_ahead=True, got "
                             f"params={self.params}, upload_ahead={self.upload_ahead}")
        units = self.device_step_units
        if isinstance(units, bool) or not isinstance(units, int) or units < 0:
            raise ValueError(f"OffloadPolicy.device_step_units must be an int >= 0, got {units!r}")
        if units and not (self.step == "cpu" and self.overlap_step is True and self.params and self.upload_ahead
                          and copy is False):
            raise ValueError(f"OffloadPolicy(device_step_units={units}) steps units on the device inside the "
                             "overlapped host step, so it needs step='cpu', overlap_step=True, params=True, "
                             f"upload_ahead=True and compute_copy_on_host=False, got step={self.step!r}, "
                             f"overlap_step={self.overlap_step!r}, params={self.params}, "
                             f"upload_ahead={self.upload_ahead}, compute_copy_on_host={copy!r}")
        threads = self.step_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"OffloadPolicy.step_threads must be None or an int >= 1, got {threads!r}")
        if threads is not None and not overlapped:
            raise ValueError(f"OffloadPolicy(step_threads={threads}) sets the width of the overlapped host step, so "
                             f"it needs step='cpu' and overlap_step True or 'forward', got step={self.step!r}, "
                             f"overlap_step={self.overlap_step!r}")

    @property
    def steps_in_backward(self) -> bool:
        """Whether each unit steps as its grads land (``overlap_step`` True or ``"forward"``)."""
        return self.overlap_step is True or self.overlap_step == "forward"

    @property
    def grads_on_host(self) -> bool:
        """Where the reduced grad shards wait for the step (``grads`` resolved)."""
        return self.grads if self.grads is not None else (self.step == "cpu" or self.main_params)

    @property
    def device_compute_shard(self) -> bool:
        """Whether each unit keeps a compute-dtype copy of its (host) shard on the device."""
        return self.main_params and not self.params


def checked_policy(policy: object) -> OffloadPolicy | None:
    """``offload_policy`` itself, refused unless it is an ``OffloadPolicy`` or None."""
    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a fsdp_impl.OffloadPolicy or None, got {policy!r}")
    return policy


def check_offload(policy: object, device: torch.device, cuda_graph_mode: bool, module: nn.Module) -> None:
    """Wrap-time checks of ``offload_policy`` against the device and the other switches."""
    policy = checked_policy(policy)
    if policy is None:
        return
    if cuda_graph_mode:
        raise ValueError("offload_policy cannot be combined with cuda_graph_mode=True: the offloaded step "
                         "synchronises with the host and moves state between host and device buffers that "
                         "a captured graph cannot follow; pass offload_policy=None or cuda_graph_mode=False")
    if policy.step == "gpu" and device.type != "cuda" and not _testing.STREAMED_STEP_ON_CPU.active:
        raise ValueError(f"offload_policy.step='gpu' streams the optimizer state through a CUDA device, but "
                         f"the model runs on {device.type!r}; use OffloadPolicy(step='cpu'), or run on GPUs")
    if policy.pin_memory and not pinned_memory_available(device):
        raise ValueError(f"offload_policy.pin_memory=True needs page-locked host memory for a CUDA device, "
                         f"but the model runs on {device.type!r}"
                         f"{'' if device.type != 'cuda' else ' and CUDA is not available'}; pass "
                         "OffloadPolicy(pin_memory=False)")
    from ..fp8.params import has_fp8_params  # FP8 is refused; imported here to keep offload light
    if has_fp8_params(module):
        raise NotImplementedError("offload_policy with FP8 parameters is not implemented yet: their FP8 bytes are "
                                  "quantised from device-resident main shards; pass offload_policy=None")


# The narrowest moments a streamed Adam may keep (fsdp_impl.optim takes any floating dtype, FP8
# included): the wrap-time bound counts them at this width so that it never exceeds the window
# the step will allocate; the step checks the exact window before allocating it.
_MIN_MOMENT_BYTES = 1


def window_lower_bound(policy: OffloadPolicy, parts: Sequence[tuple[Sequence[ManagedParam], UnitContext]]) -> int:
    """Bytes of the streamed step's window for a model of these units on this rank, before the
    optimizer is known: every trainable param steps, the moments at their narrowest width."""
    total, per_elem = 0, 0
    for params, ctx in parts:
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            continue
        dtypes = ResolvedDtypes.resolve(ctx.config.mixed_precision_policy, params[0].dtype)
        layout = FlatLayout([p.layout_shape for p in trainable], ctx.num_shards)
        total += sum(math.prod(slot.local_shape(ctx.num_shards, ctx.layout_rank)) for slot in layout.slots)
        unit_bytes = ((dtypes.main_params.itemsize if policy.main_params else 0)
                      + (dtypes.main_grads.itemsize if policy.grads_on_host else 0)
                      + (2 * _MIN_MOMENT_BYTES if policy.optimizer_state else 0))
        per_elem = max(per_elem, unit_bytes)
    if total == 0 or per_elem == 0:
        return 0
    capacity = window_capacity(policy.chunk_bytes, per_elem, total)
    return min(WINDOW_SLOTS, -(-total // capacity)) * capacity * per_elem


def check_window(policy: OffloadPolicy | None, parts: Sequence[tuple[Sequence[ManagedParam], UnitContext]],
                 device: torch.device) -> None:
    """Wrap time, before any buffer exists: refuse a ``step="gpu"`` window that cannot fit the
    free memory of ``device`` on some rank, naming ``OffloadPolicy.chunk_bytes``. Free memory
    differs between ranks, so every rank's (needed, free) pair is shared (one all-reduce over
    the world) and every rank raises the same error: one rank refusing alone would leave the
    others waiting in the wrap's next collective."""
    if policy is None or policy.step != "gpu":
        return
    needed = window_lower_bound(policy, parts)
    limit = free_memory(device)
    rows = torch.zeros(dist.get_world_size(), 2, dtype=torch.int64, device=device)
    rows[dist.get_rank()] = torch.tensor([needed, -1 if limit is None else limit])
    dist.all_reduce(rows)
    for rank, (need, free) in enumerate(rows.tolist()):
        if free >= 0 and need > free:
            raise window_too_large(policy.chunk_bytes, need, free, device, rank)


def host_buffer(like: DataParallelBuffer, policy: OffloadPolicy) -> DataParallelBuffer:
    """A zero-filled host buffer with ``like``'s layout, rank and dtype (pinned and in huge pages
    as ``policy`` asks)."""
    buf = DataParallelBuffer(like.layout, like.rank, like.dtype, host_device())
    if policy.pin_memory or policy.huge_pages:
        buf.data = host_zeros(buf.data.numel(), buf.dtype, policy.pin_memory, policy.huge_pages)
    return buf


def host_weight(policy: OffloadPolicy, like: DataParallelBuffer) -> DataParallelBuffer:
    """A unit's weight buffer: on the host with ``main_params``, else ``like`` itself."""
    return host_buffer(like, policy) if policy.main_params else like


class AheadCopy(NamedTuple):
    """``params=True`` with ``upload_ahead``: a unit's new weights uploaded by the worker for
    its next gather: the device tensor (compute dtype), the weights' version it was made from,
    the stream that made it and that stream's event once the copy is done."""

    tensor: torch.Tensor
    version: int
    stream: CommStream
    ready: Any


class UnitOffload:
    """The host side of one unit: its host grad buffer, the device compute-dtype copy of its
    shard, and the copies between them. It is given the unit's buffers (``weight``, the host
    main shard with ``main_params``; ``grad``, the device grad buffer, freed here: the first
    reduction allocates it), the compute dtype and ``version``, the unit's version signature of
    the main weights (``FSDPUnit.version_signature``), so it never needs the unit itself."""

    def __init__(self, policy: OffloadPolicy, device: torch.device, weight: DataParallelBuffer,
                 grad: DataParallelBuffer | None, compute_dtype: torch.dtype, version: Callable[[], int]) -> None:
        self.policy = policy
        self.device = device
        self.weight = weight
        self.version = version
        self.host_grad: DataParallelBuffer | None = None
        self.compute_shard: torch.Tensor | None = None  # params=False: the shard in the compute dtype
        self.shard_version = -1  # version() the compute shard was built from
        self.shard_ready: Any = None  # overlap_step: the event of an upload made ahead (refresh_ahead)
        self.ahead: AheadCopy | None = None  # params=True with upload_ahead (consumed by one gather)
        self.compute_dtype = compute_dtype
        # compute_copy_on_host: the shard in the compute dtype in host memory, and the version it was cast from
        self.host_copy: torch.Tensor | None = None
        self.host_copy_version = -1
        self.host_copy_ready: Any = None  # "device": the event of its download (an upload from it waits)
        self.weight_ready: Any = None  # device_step_units: the event of the new shard's download
        if policy.compute_copy_on_host is not False:
            numel = weight.data.numel()
            self.host_copy = host_zeros(numel, compute_dtype, policy.pin_memory, policy.huge_pages)
        self.await_step: Callable[[], None] | None = None  # overlap_step="forward": waits for this unit's step
        self.host_grad_fresh = True  # the host grads were zeroed or consumed since the last copy
        self.landed = False  # overlap_step: this sync backward's grads were copied when they landed
        if grad is not None and policy.grads_on_host:
            self.host_grad = host_buffer(grad, policy)
            grad.free()
        if policy.device_compute_shard:
            self.compute_shard = torch.empty(weight.data.numel(), dtype=compute_dtype, device=device)

    @property
    def non_blocking(self) -> bool:
        return self.policy.pin_memory

    # --------------------------------------------------------------------- params
    def gather_source(self) -> torch.Tensor:
        """The device tensor a gather of the unit starts from (call on the gather stream): the
        compute shard, refreshed from the host if the main weights changed, or (``params=True``)
        the copy uploaded ahead if one waits (``refresh_ahead``), else a fresh device copy of the
        host main shard in its own dtype. With ``overlap_step="forward"``
        it first waits for the unit's host step, which may still be running."""
        if self.await_step is not None:
            wait, self.await_step = self.await_step, None
            wait()
        if not self.policy.main_params:
            return self.weight.data
        if self.compute_shard is None:
            ahead = self._take_ahead()
            return ahead if ahead is not None else self.upload(self._upload_source())
        version = self.version()
        if version != self.shard_version:
            self.compute_shard.copy_(self.upload(self._upload_source()))
            self.shard_version = version
        if self.shard_ready is not None:  # uploaded ahead on another stream: the gather waits for it
            current_stream_wait(self.device, self.shard_ready)
            self.shard_ready = None
        return self.compute_shard

    def refresh_ahead(self, stream: CommStream, after: Any) -> None:
        """``overlap_step=True`` with ``step="cpu"`` (the worker thread, right after this unit's
        host step): upload the new weights into the compute shard now, on ``stream`` once
        ``after`` (the unit's grad landing, so its backward, the shard's last reader this step,
        is done) has passed, instead of in the next forward's gather. The same cast copy as
        ``gather_source``, so the same bits; the next gather waits for ``shard_ready``. A later
        edit of the weights still shows: its version differs and the gather refreshes again.
        With ``params=True`` the upload goes into a new compute-dtype copy that the next gather
        alone takes (the forward's; the backward's uploads from the host as without it): the
        copy lives from the step to that gather, while the activations are small."""
        if not (self.policy.upload_ahead and self.policy.main_params):
            return
        self.ahead = None  # params=True: one not consumed since the last step is stale now
        with stream.enter():
            stream.wait(after)
            upload = self.upload(self._upload_source())
            if self.compute_shard is not None:
                self.compute_shard.copy_(upload)
            else:  # params=True: a copy for the next gather only
                upload = upload.to(self.compute_dtype)
            ready = stream.record()
            if self.policy.compute_copy_on_host == "device":
                self._download_host_copy(upload, stream)
        if self.compute_shard is not None:
            self.shard_ready, self.shard_version = ready, self.version()
        else:
            self.ahead = AheadCopy(upload, self.version(), stream, ready)

    def refresh_host_copy(self) -> None:
        """``compute_copy_on_host=True`` (the worker, right after this unit's host step): cast the
        new weights into the host copy. Nothing still reads it: the unit's gathers of this step
        came before its grads landed, and the last upload made ahead was waited for by the forward."""
        if self.host_copy is None or self.policy.compute_copy_on_host is not True:
            return
        self.host_copy.copy_(self.weight.data)
        self.host_copy_version = self.version()

    def _download_host_copy(self, cast: torch.Tensor, stream: CommStream) -> None:
        """``compute_copy_on_host="device"`` (on ``stream``, after the copy uploaded ahead was cast):
        download that cast into the host copy for the gathers that upload again (the backward's).
        Ordered after the unit's grad landing (``refresh_ahead``'s wait), so after this step's
        uploads from the host copy; ``cast`` was made on ``stream``, so it is not reused before."""
        assert self.host_copy is not None
        self.host_copy.copy_(cast, non_blocking=self.non_blocking)
        self.host_copy_version = self.version()
        self.host_copy_ready = stream.record()

    def _upload_source(self) -> torch.Tensor:
        """What an upload of the current weights sends (call on the stream that uploads): the
        host compute-dtype copy when it was cast from them (``compute_copy_on_host``; a download
        in flight is waited for), else the main shard (cast on the device; after its download
        when the unit stepped on the device)."""
        if self.host_copy is not None and self.host_copy_version == self.version():
            current_stream_wait(self.device, self.host_copy_ready)
            return self.host_copy
        current_stream_wait(self.device, self.weight_ready)
        return self.weight.data

    def device_stepped(self, ahead: torch.Tensor, stream: CommStream, ready: Any, done: Any) -> None:
        """``device_step_units`` (the worker, after this unit's device step on ``stream``):
        ``ahead``, the new weights cast on the device, is the copy the next forward's gather takes
        (``ready``: its event); an upload from the host shard waits for ``done``, the download."""
        self.ahead = AheadCopy(ahead, self.version(), stream, ready)
        self.weight_ready = done

    def _take_ahead(self) -> torch.Tensor | None:
        """``params=True``: the copy uploaded ahead, handed to this one gather (then the unit
        holds no device copy again), or None when there is none or the weights changed since."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead.version != self.version():
            return None
        current_stream_wait(self.device, ahead.ready)
        ahead.stream.used_by_current(ahead.tensor)  # made on the worker's stream: not reused before this gather read it
        return ahead.tensor

    @property
    def has_ahead_copy(self) -> bool:
        """``params=True``: whether a copy uploaded ahead waits for the next gather."""
        return self.ahead is not None

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host`` (flat), on the current stream (an explicit copy, so the CPU
        test window copies too)."""
        out = torch.empty(host.numel(), dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=self.non_blocking)
        return out

    def compute_view(self, index: int) -> torch.Tensor | None:
        """Param ``index``'s slice of the compute shard, flat (None without one)."""
        if self.compute_shard is None:
            return None
        return self.weight.layout.local_view(self.compute_shard, index, self.weight.rank).reshape(-1)

    def shard_is_fresh(self) -> bool:
        return self.compute_shard is not None and self.shard_version == self.version()

    def mark_shard_fresh(self) -> None:
        """The streamed step wrote the new weights into the compute shard as well."""
        if self.compute_shard is not None:
            self.shard_version = self.version()

    # ---------------------------------------------------------------------- grads
    def grads_to_host(self, grad: DataParallelBuffer) -> DataParallelBuffer:
        """End of a sync backward: move the reduced grads into the host buffer (adding when the
        last ones were neither zeroed nor freed, i.e. the user accumulates across steps) and free
        the device buffer. Returns the host buffer (what ``.grad`` views)."""
        host = self.host_grad
        assert host is not None
        grad.ensure_allocated()
        if self.host_grad_fresh:
            host.data.copy_(grad.data, non_blocking=self.non_blocking)
        else:
            host.data.add_(grad.data.to(host.data.device))
        grad.free()  # later allocations on this stream come after the copy: safe without a sync
        self.host_grad_fresh = False
        return host

    def zero_host_grads(self, free: bool) -> None:
        """``zero_grad``: the next copy overwrites; ``set_to_none=False`` also shows zeros now."""
        if self.host_grad is not None:
            if not free:
                self.host_grad.data.zero_()
            self.host_grad_fresh = True


class ModelOffload:
    """The offload state of one wrapped model: its policy and what the host must wait for."""

    def __init__(self, policy: OffloadPolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.overlap: OverlappedStep | None = None  # overlap_step: set when an optimizer is bound

    def after_grads_to_host(self) -> None:
        """The grads' device-to-host copies must be done before user code reads ``.grad`` on the
        host (clipping, the host step)."""
        if self.policy.grads_on_host and self.policy.pin_memory:
            synchronize(self.device)
