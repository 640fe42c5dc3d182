"""A Llama-style model for the compile benchmark, written the way torchtitan's Llama 3 is: RMSNorm
in plain tensor ops, rotary position embeddings, SwiGLU feed-forward, no biases, untied output.

``bench.gpt``'s blocks run almost entirely in fused eager kernels (``nn.LayerNorm``, GELU, SDPA),
which leaves ``torch.compile`` little to fuse; this model's norm, rotary and gating are chains of
small elementwise kernels, which is where torchtitan's published compile speed-up comes from.
Sizes reuse ``bench.gpt.GPTConfig`` (hidden, layers, heads, vocab, seq); the feed-forward width is
Llama's ``8/3 * hidden`` rounded up to a multiple of 256.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bench.gpt import GPTConfig

ROPE_THETA = 500000.0  # Llama 3
NORM_EPS = 1e-5


def ffn_width(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: two thirds of 4 * hidden, rounded up to ``multiple_of``."""
    width = int(2 * 4 * hidden / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    """Llama's reference RMSNorm: normalised in fp32, scaled in the input dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position and frequency, (seq, head_dim / 2), fp32."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` (batch, seq, heads, head_dim) by its position's angle."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class LlamaBlock(nn.Module):
    """One Llama block (the FSDP unit): attention with rotary embeddings, then SwiGLU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attention_norm = RMSNorm(cfg.hidden)
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.ffn_norm = RMSNorm(cfg.hidden)
        width = ffn_width(cfg.hidden)
        self.w1 = nn.Linear(cfg.hidden, width, bias=False)
        self.w2 = nn.Linear(width, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, width, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.hidden // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.attention_norm(x)
        shape = (b, s, self.heads, h // self.heads)
        cos, sin = self.cos[:s].float(), self.sin[:s].float()
        q = apply_rope(self.wq(y).view(shape), cos, sin)
        k = apply_rope(self.wk(y).view(shape), cos, sin)
        v = self.wv(y).view(shape)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, h))
        y = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    """Token embedding, ``cfg.layers`` Llama blocks (``self.blocks``, as ``bench.gpt.GPT``), a
    final norm and an untied output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=cfg.hidden ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def llama_params(cfg: GPTConfig) -> int:
    """Parameter count of ``Llama(cfg)`` in closed form: embedding and head (untied), per block
    four h x h projections, three SwiGLU matrices and two norms, the final norm."""
    h, f = cfg.hidden, ffn_width(cfg.hidden)
    return 2 * cfg.vocab * h + cfg.layers * (4 * h * h + 3 * h * f + 2 * h) + h
