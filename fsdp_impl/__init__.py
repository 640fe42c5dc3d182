"""fsdp_impl: a fully sharded data parallel engine for PyTorch (see README.md).

``import fsdp_impl`` also makes ``fsdp_impl.optim`` (the decoupled-grad optimizers) and
``fsdp_impl.cuda_graph`` (``capture_train_step``) available.
"""
from . import cuda_graph, optim
from .api import fully_shard, fully_shard_model, fully_shard_optimizer
from .clip_grad import clip_grad_norm
from .policy import MixedPrecisionPolicy

__all__ = ["fully_shard", "fully_shard_model", "fully_shard_optimizer", "MixedPrecisionPolicy",
           "clip_grad_norm", "cuda_graph", "optim"]
