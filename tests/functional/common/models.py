"""Tiny models shared by the functional suites.

Each model is built so that its eager init equals a meta-device build materialised in
post-order with ``reset_parameters()`` (every initialiser lives in a submodule's reset method and
submodules are registered in construction order), so one seed gives identical weights both ways.
Each ``build_*`` returns ``(model, unit_classes, batch_fn)`` where ``batch_fn(n, generator)``
makes ``(inputs_tuple, target)`` for ``n`` samples and ``loss_fn(output, target)`` is the model's
``LOSS`` attribute. All losses are means over samples, so averaging per-rank grads equals the
full-batch grad.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class SmallCNN(nn.Module):
    """Two 3x3 convs (an uneven 4-channel weight) and a linear head; units: Conv2d, Linear."""

    def __init__(self, dtype: torch.dtype = torch.float32, channels: int = 3, hidden: int = 5,
                 classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, hidden, 3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv2d(hidden, hidden, 3, padding=1, dtype=dtype)
        self.head = nn.Linear(hidden, classes, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), target)

    @staticmethod
    def batch(n: int, gen: torch.Generator, dtype: torch.dtype) -> Batch:
        x = torch.randn(n, 3, 6, 6, generator=gen).to(dtype)
        return (x,), torch.randn(n, 3, generator=gen)


class _Block(nn.Module):
    """Pre-norm attention (+ optional cross-attention) and MLP; biasless attention so no
    parameter has a mathematically-zero gradient (key bias) whose rounding noise Adam amplifies."""

    def __init__(self, d: int, heads: int, dtype: torch.dtype, cross: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d, dtype=dtype)
        self.attn = nn.MultiheadAttention(d, heads, bias=False, batch_first=True, dtype=dtype)
        self.cross = nn.MultiheadAttention(d, heads, bias=False, batch_first=True, dtype=dtype) if cross else None
        self.norm2 = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, 2 * d, dtype=dtype)
        self.fc2 = nn.Linear(2 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        h = self.norm1(x)
        mask = None
        if causal:
            s = x.shape[1]
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        if self.cross is not None:
            x = x + self.cross(x, memory, memory, need_weights=False)[0]
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class EncoderLayer(_Block):
    def __init__(self, d: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__(d, heads, dtype, cross=False)


class DecoderLayer(_Block):
    def __init__(self, d: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__(d, heads, dtype, cross=True)


class SmallTransformer(nn.Module):
    """Encoder-decoder on float sequences; units: EncoderLayer, DecoderLayer."""

    def __init__(self, dtype: torch.dtype = torch.float32, d_in: int = 5, d: int = 16, heads: int = 2,
                 layers: int = 1, d_out: int = 3) -> None:
        super().__init__()
        self.src_in = nn.Linear(d_in, d, dtype=dtype)
        self.tgt_in = nn.Linear(d_in, d, dtype=dtype)
        self.encoder = nn.ModuleList([EncoderLayer(d, heads, dtype) for _ in range(layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d, heads, dtype) for _ in range(layers)])
        self.out = nn.Linear(d, d_out, dtype=dtype)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.src_in(src)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.tgt_in(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.out(x)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), target)

    @staticmethod
    def batch(n: int, gen: torch.Generator, dtype: torch.dtype) -> Batch:
        src = torch.randn(n, 4, 5, generator=gen).to(dtype)
        tgt = torch.randn(n, 3, 5, generator=gen).to(dtype)
        return (src, tgt), torch.randn(n, 3, 3, generator=gen)


class GPTBlock(_Block):
    def __init__(self, d: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__(d, heads, dtype, cross=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, causal=True)


class SmallGPT(nn.Module):
    """Decoder-only LM with the output projection tied to the token embedding; units: GPTBlock.

    ``tie_module=True`` ties through a second module (``lm_head.weight is tok.weight``), so the
    shared param has two owners; its eager init then differs from a meta build (lm_head's
    init draws RNG that a meta build skips), so use it with eager init only.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, vocab: int = 13, d: int = 16, heads: int = 2,
                 layers: int = 2, seq: int = 6, tie_module: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d, dtype=dtype)
        self.pos = nn.Embedding(seq, d, dtype=dtype)
        self.blocks = nn.ModuleList([GPTBlock(d, heads, dtype) for _ in range(layers)])
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.lm_head: nn.Linear | None = None
        if tie_module:
            self.lm_head = nn.Linear(d, vocab, bias=False, dtype=dtype)
            self.lm_head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x)
        return F.linear(x, self.tok.weight)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1))

    @staticmethod
    def batch(n: int, gen: torch.Generator, dtype: torch.dtype) -> Batch:
        idx = torch.randint(0, 13, (n, 7), generator=gen)
        return (idx[:, :-1],), idx[:, 1:]


MODELS = {
    "cnn": (SmallCNN, (nn.Conv2d, nn.Linear)),
    "transformer": (SmallTransformer, (EncoderLayer, DecoderLayer)),
    "gpt": (SmallGPT, (GPTBlock,)),
}


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                device: str | None = None, **kwargs) -> nn.Module:
    """Build model ``name`` with ``torch.manual_seed(seed)`` (``device="meta"`` for meta init)."""
    cls, _ = MODELS[name]
    torch.manual_seed(seed)
    if device is None:
        return cls(dtype=dtype, **kwargs)
    with torch.device(device):
        return cls(dtype=dtype, **kwargs)


def unit_classes(name: str) -> tuple:
    return MODELS[name][1]


def make_batch(name: str, n: int, seed: int, dtype: torch.dtype = torch.float32) -> Batch:
    """``n`` samples of fixed data for model ``name`` (same on every rank for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    return MODELS[name][0].batch(n, gen, dtype)


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return MODELS[name][0].loss
