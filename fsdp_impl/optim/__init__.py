"""Precision-aware optimizers that can read FSDP's decoupled gradients (``param.decoupled_grad``)."""

from fsdp_impl.optim.adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]
