"""Tiny models shared by the functional suites.

Each model is built so that its eager init equals a meta-device build materialised in
post-order with ``reset_parameters()`` (every initialiser lives in a submodule's reset method and
submodules are registered in construction order), so one seed gives identical weights both ways.
``build_model(name)`` builds one by name, ``make_batch(name, n, seed)`` makes ``(inputs_tuple,
target)`` for ``n`` samples and ``loss_fn(name)`` is its loss. All losses are means over samples,
so averaging per-rank grads equals the full-batch grad.

``ToyCNN`` and ``ToyTransformer`` are the toy models of Megatron-FSDP's ``fully_shard`` test (the
"seed" test; ``build_toy``), used by the suites that port that test call for call.
``ResidualMLP`` is the one residual MLP block the suites build their unit classes from.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "tanh": torch.tanh}
RECOMPUTE = (None, "inside", "inside_reentrant", "selective")  # how ResidualMLP recomputes its MLP


def _save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Selective recompute's policy: keep matmul outputs, recompute the cheap rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class ResidualMLP(nn.Module):
    """``x + fc2(act(fc1(norm(x))))`` (``norm``: a LayerNorm first, else none).

    ``recompute`` runs the MLP under ``torch.utils.checkpoint`` in the backward: ``"inside"``
    (non-reentrant), ``"inside_reentrant"``, ``"selective"`` (non-reentrant, matmul outputs saved by
    ``create_selective_checkpoint_contexts``); ``None``: no recompute."""

    def __init__(self, d: int, hidden: int, act: str = "gelu", norm: bool = False,
                 dtype: torch.dtype | None = None, recompute: str | None = None) -> None:
        super().__init__()
        if act not in ACTIVATIONS or recompute not in RECOMPUTE:
            raise ValueError(f"act {act!r} (allowed {sorted(ACTIVATIONS)}), recompute {recompute!r} "
                             f"(allowed {RECOMPUTE})")
        self.act, self.recompute = ACTIVATIONS[act], recompute
        self.norm = nn.LayerNorm(d, dtype=dtype) if norm else None
        self.fc1 = nn.Linear(d, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, d, dtype=dtype)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x) if self.norm is not None else x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute is None:
            return x + self._mlp(x)
        if self.recompute == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return x + checkpoint(self._mlp, x, use_reentrant=False, context_fn=context)
        return x + checkpoint(self._mlp, x, use_reentrant=self.recompute == "inside_reentrant")


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
                device: str | None = None, init_dtype: torch.dtype = torch.float32, **kwargs) -> nn.Module:
    """Build model ``name`` with ``torch.manual_seed(seed)`` (``device="meta"`` for meta init).
    An eager model is drawn in ``init_dtype`` (fp32 by default) and cast to ``dtype``, so its weights
    do not depend on torch's random path for ``dtype`` (a torch release may change bf16 sampling)."""
    cls, _ = MODELS[name]
    torch.manual_seed(seed)
    if device is None:
        model = cls(dtype=init_dtype, **kwargs)
        return model if init_dtype == dtype else model.to(dtype)
    with torch.device(device):
        return cls(dtype=dtype, **kwargs)


def unit_classes(name: str) -> tuple:
    """The ``fsdp_unit_modules`` of model ``name``."""
    return MODELS[name][1]


def make_batch(name: str, n: int, seed: int, dtype: torch.dtype = torch.float32) -> Batch:
    """``n`` samples of fixed data for model ``name`` (same on every rank for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    return MODELS[name][0].batch(n, gen, dtype)


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return MODELS[name][0].loss


TOY_SIZE = 2  # the seed's DIM_SIZE: inputs, outputs and the Transformer's d_model are 2 wide


class ToyCNN(nn.Module):
    """The seed's toy CNN: same-padded convs on a (1, channels, size, size) broadcast of the
    input and a linear head over channels; high-rank params and inputs."""

    def __init__(self, channels: int = 3, size: int = TOY_SIZE, num_layers: int = 2) -> None:
        super().__init__()
        self.channels, self.size = channels, size
        self.cnn_layers = nn.ModuleList(
            [nn.Conv2d(channels, channels, 3, padding="same") for _ in range(num_layers)])
        self.dense = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.broadcast_to(1, self.channels, self.size, self.size)
        for layer in self.cnn_layers:
            x = layer(x)
        return self.dense(x.permute(0, 2, 3, 1)).reshape(1, self.size, self.size)


class ToyTransformer(nn.Module):
    """The seed's toy ``nn.Transformer`` + linear head, with dropout 0 (random dropout masks
    differ per rank, so parity would be meaningless). ``dim_feedforward`` defaults to
    ``nn.Transformer``'s, as in the seed."""

    def __init__(self, model_dim: int = TOY_SIZE, num_heads: int = 2, num_layers: int = 2,
                 dim_feedforward: int = 2048) -> None:
        super().__init__()
        self.transformer = nn.Transformer(d_model=model_dim, nhead=num_heads, num_encoder_layers=num_layers,
                                          num_decoder_layers=num_layers, dim_feedforward=dim_feedforward,
                                          dropout=0.0)
        self.fc_out = nn.Linear(model_dim, TOY_SIZE)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.transformer(x, y))


TOY_MODELS: dict[str, tuple[type[nn.Module], list[type[nn.Module]]]] = {
    "cnn": (ToyCNN, [nn.Conv2d, nn.Linear]),  # the seed's fsdp_unit_modules
    "transformer": (ToyTransformer, [nn.Transformer]),
}


def build_toy(model_type: str, device: str = "cpu", **kwargs) -> tuple[nn.Module, list[type[nn.Module]]]:
    """The seed's toy ``model_type`` built with ``torch.manual_seed(0)`` on ``device`` ("meta"
    for meta init), and its unit classes."""
    if model_type not in TOY_MODELS:
        raise ValueError(f"model_type {model_type!r} has no CPU build; allowed values: {sorted(TOY_MODELS)}")
    cls, units = TOY_MODELS[model_type]
    torch.manual_seed(0)
    with torch.device(device):
        return cls(**kwargs), list(units)


def run_toy(model: nn.Module, model_type: str, x: torch.Tensor) -> torch.Tensor:
    """The seed's call: the CNN takes the input, the Transformer takes it as source and target."""
    return model(x) if model_type == "cnn" else model(x, x)
