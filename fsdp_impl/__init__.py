"""fsdp_impl: a fully sharded data parallel engine for PyTorch (see README.md).

``import fsdp_impl`` also makes ``fsdp_impl.optim`` (the decoupled-grad optimizers),
``fsdp_impl.checkpoint`` and ``fsdp_impl.cuda_graph`` (``capture_train_step``) available, and imports
``torch.distributed.checkpoint``, so scripts written for Megatron-FSDP (which imports it too) can call
``torch.distributed.checkpoint.save`` / ``load`` without importing that submodule themselves.
"""
import torch.distributed.checkpoint  # noqa: F401  (makes torch.distributed.checkpoint an attribute)

from . import checkpoint, cuda_graph, optim
from .api import fully_shard, fully_shard_model, fully_shard_optimizer
from .clip_grad import clip_grad_norm
from .compile_step import compile_train_step
from .offload.host import OffloadPolicy
from .offload.overlap import wait_for_step
from .policy import MixedPrecisionPolicy

__all__ = ["fully_shard", "fully_shard_model", "fully_shard_optimizer", "MixedPrecisionPolicy", "OffloadPolicy",
           "clip_grad_norm", "checkpoint", "compile_train_step", "cuda_graph", "optim", "wait_for_step"]
