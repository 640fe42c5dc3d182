"""The model's own names for its state: what other engines and Hugging Face call each tensor.

Our wrapper holds the user's module as ``.module``, so ``model.state_dict()`` says
``module.layers.0.w`` where FSDP2, torchtitan and ``transformers`` say ``layers.0.w``. Wrappers
that insert a path segment of their own (``torch.compile``'s ``_orig_mod``, activation
checkpointing's ``_checkpoint_wrapped_module``, FSDP1's ``_fsdp_wrapped_module``) are dropped
as ``torch.distributed.checkpoint.state_dict`` drops them, so the names agree with what
``get_state_dict`` writes for the same module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def wrapper_prefix(model: nn.Module) -> str:
    """``"module."`` for our ``fully_shard`` wrapper (the user's module is ``model.module``), else ``""``."""
    inner = getattr(model, "module", None)
    if hasattr(model, "_fsdp_engine") and isinstance(inner, nn.Module):
        return "module."
    return ""


def own_name(key: str, prefix: str) -> str:
    """``key`` of ``model.state_dict()`` without the wrapper prefix and wrapper segments."""
    if prefix and key.startswith(prefix):
        key = key[len(prefix):]
    for segment in _WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key


def own_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """``model.state_dict()`` under the model's own names, plus own name -> original key."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    prefix = wrapper_prefix(model)
    state: dict[str, Any] = {}
    original: dict[str, str] = {}
    for key, value in model.state_dict().items():
        name = own_name(key, prefix)
        state[name] = value
        original[name] = key
    return state, original


def own_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Own name -> parameter; a tied parameter appears once, under its first name."""
    prefix = wrapper_prefix(model)
    return {own_name(n, prefix): p for n, p in model.named_parameters()}


def aliases(model: nn.Module) -> dict[str, str]:
    """Every own name of a tied parameter that is not its first name -> its first name (e.g.
    ``lm_head.weight`` -> ``model.embed_tokens.weight``): the entries a reader may find once."""
    prefix = wrapper_prefix(model)
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        name = own_name(key, prefix)
        if id(param) in first:
            if first[id(param)] != name:
                out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def tensor_items(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensor entries of a state dict, in its order (non-tensor extra state left out)."""
    return [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
