"""fsdp_impl: a fully sharded data parallel engine for PyTorch (see README.md).

``import fsdp_impl`` also makes ``fsdp_impl.optim`` (the decoupled-grad optimizers) and
``fsdp_impl.checkpoint`` available, and imports ``torch.distributed.checkpoint``, so scripts
written for Megatron-FSDP (which imports it too) can call ``torch.distributed.checkpoint.save``
/ ``load`` without importing that submodule themselves.
"""
import torch.distributed.checkpoint  # noqa: F401  (makes torch.distributed.checkpoint an attribute)

from . import checkpoint, optim
from .api import fully_shard, fully_shard_model, fully_shard_optimizer
from .clip_grad import clip_grad_norm
from .policy import MixedPrecisionPolicy

__all__ = ["fully_shard", "fully_shard_model", "fully_shard_optimizer", "MixedPrecisionPolicy",
           "clip_grad_norm", "optim", "checkpoint"]
