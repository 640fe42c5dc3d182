"""``save_hf`` / ``load_hf`` on one process: the files ``save_pretrained`` writes, read back by the
``safetensors`` library itself (the independent reader), and exact round trips. Skips without
``safetensors`` (``pip install 'fsdp-harness[hf]'``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_impl import checkpoint
from fsdp_impl.checkpoint import CheckpointMismatchError, CheckpointWriteError

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (extra 'hf')")


class TiedLM(nn.Module):
    """Embedding tied to the output head (second name of one parameter), a buffer, 3-D weight."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4, dtype=dtype)
        self.experts = nn.Parameter(torch.randn(3, 4, 5, dtype=dtype))
        self.head = nn.Linear(4, 11, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0], dtype=dtype))


def _model(seed: int, dtype: torch.dtype = torch.float32) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(dtype)


def test_single_file_is_what_safetensors_reads(tmp_path: Path) -> None:
    model = _model(0)
    checkpoint.save_hf(tmp_path / "hf", model)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    files = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied: once, first name
    assert files.keys() == expected.keys()
    assert all(torch.equal(files[k], v) for k, v in expected.items())


def test_sharded_files_and_index_as_save_pretrained_writes_them(tmp_path: Path) -> None:
    model = _model(0)
    checkpoint.save_hf(tmp_path / "hf", model, max_shard_size=50, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    names = sorted(p.name for p in (tmp_path / "hf").iterdir() if p.suffix == ".safetensors")
    assert names == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)], names
    assert set(index["weight_map"].values()) == set(names)
    loaded: dict[str, torch.Tensor] = {}
    for name in names:
        loaded.update(safetensors_torch.load_file(tmp_path / "hf" / name))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())
    assert index["weight_map"] == {k: n for n in names for k in safetensors_torch.load_file(tmp_path / "hf" / n)}
    for key, value in model.state_dict().items():
        if key != "head.weight":
            assert loaded[key].dtype == torch.bfloat16 and torch.equal(loaded[key], value.to(torch.bfloat16)), key


def test_round_trip_is_exact_and_bf16_files_upcast_exactly(tmp_path: Path) -> None:
    source = _model(0)
    checkpoint.save_hf(tmp_path / "fp32", source, max_shard_size="300B")
    target = _model(1)
    checkpoint.load_hf(tmp_path / "fp32", target)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())
    assert target.head.weight is target.embed.weight
    checkpoint.save_hf(tmp_path / "bf16", source, dtype=torch.bfloat16)
    checkpoint.load_hf(tmp_path / "bf16", target)
    assert torch.equal(target.experts, source.experts.to(torch.bfloat16).float())


def test_mismatches_name_the_tensors(tmp_path: Path) -> None:
    checkpoint.save_hf(tmp_path / "fp32", _model(0))
    narrow = _model(2, torch.bfloat16)
    with pytest.raises(CheckpointMismatchError, match=r"dtype differs \(3\):\n    experts: model torch.bfloat16, "
                                                      r"file torch.float32 \(only exact upcasts are applied\)"):
        checkpoint.load_hf(tmp_path / "fp32", narrow)
    other = _model(3)
    other.extra = nn.Linear(2, 2)
    other.experts = nn.Parameter(torch.zeros(2, 4, 5))
    with pytest.raises(CheckpointMismatchError, match=r"(?s)in the model but not in the files \(2\):\n    extra.weight"
                                                      r".*shape differs \(1\):\n    experts: model \(2, 4, 5\), file "
                                                      r"\(3, 4, 5\)"):
        checkpoint.load_hf(tmp_path / "fp32", other)


def test_export_is_written_once_and_arguments_are_checked(tmp_path: Path) -> None:
    model = _model(0)
    checkpoint.save_hf(tmp_path / "hf", model)
    with pytest.raises(CheckpointWriteError, match="is written once"):
        checkpoint.save_hf(tmp_path / "hf", model)
    with pytest.raises(ValueError, match=r"max_shard_size must be a positive int \(bytes\) or a size"):
        checkpoint.save_hf(tmp_path / "x", model, max_shard_size="lots")
    with pytest.raises(TypeError, match="dtype must be None or a floating torch.dtype"):
        checkpoint.save_hf(tmp_path / "x", model, dtype=torch.int8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
