"""A plain GPT for benchmarks: pre-norm blocks, causal SDPA attention, tied embeddings.

Kept separate from the test models: the benchmark needs realistic sizes (1.3B) while tests need tiny ones.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 32000
    hidden: int = 2048
    layers: int = 24
    heads: int = 16
    seq: int = 2048


def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Selective recompute: keep the matmul and attention outputs, recompute norms, GELU, adds."""
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default)


class Block(nn.Module):
    """One pre-norm transformer block; the FSDP unit of the benchmark. ``selective=True``: its
    forward runs under a non-reentrant checkpoint that saves matmul and attention outputs and
    recomputes the rest in the backward (``create_selective_checkpoint_contexts``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.selective = False
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc2 = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selective:
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=context)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight
        # GPT-2 style init keeps the tied logits small (N(0, 1) embeddings give losses near 100+).
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def apply_recompute(model: nn.Module, style: str, block: type[nn.Module] = Block) -> None:
    """Activation recompute of every block (``block``: its class), the same way for every
    implementation (before it wraps the model): ``full``: ``checkpoint_wrapper`` around each block
    (non-reentrant, torch's ``apply_activation_checkpointing``); ``selective``: each block's own
    selective checkpoint (``bench.gpt.Block`` only); ``none``: nothing."""
    if style == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block))
    elif style == "selective":
        for m in model.modules():
            if isinstance(m, Block):
                m.selective = True
    elif style != "none":
        raise ValueError(f"recompute style {style!r}; allowed: none, full, selective")


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
