"""CPU offload (``fully_shard(..., offload_policy=OffloadPolicy(...))``), one feature in one package:

* ``host``: ``OffloadPolicy``, its wrap-time checks, a unit's host buffers (``UnitOffload``);
* ``step``: the streamed step of ``OffloadPolicy(step="gpu")`` (host state through a device window);
* ``optim``: the optimizer side (which optimizers each step mode runs, the host step, Adam's state in
  host buffers);
* ``overlap``: ``OffloadPolicy(overlap_step=...)``, the step (or the clip norms) started per unit as
  its reduced grads land during the backward, in one worker thread (``worker``).

Only ``OffloadPolicy`` is imported here (``fsdp_impl.offload.OffloadPolicy``): ``optim`` pulls in the
optimizers and the engine's grad access, which the config (a lower layer) must not load.
"""
from .host import OffloadPolicy

__all__ = ["OffloadPolicy"]
