"""Hugging Face safetensors from a sharded run and back (``save_hf`` / ``load_hf``), on tiny
``transformers`` models built locally from configs (no hub download): Llama, Qwen3 with tied
embeddings, Qwen3-MoE (3-D expert weights).

Each model is wrapped with ZeRO-3 on 2 ranks and trained 2 steps of AdamW (so the weights are no
longer the init), then exported. References, all independent of our engine's loaders:

* ``AutoModelForCausalLM.from_pretrained`` on the export (transformers' own reader, one process)
  gives the same logits as our sharded model, bit for bit (fp32 CPU, the same modules on the same
  full weights);
* the files hold exactly the gathered parameters (read back with the ``safetensors`` library);
* a second model built on the meta device and wrapped with ``init_model_with_meta_device=True``
  loads the export (each rank reading only its rows) and then holds exactly the trained
  parameters, and gives the same logits again.

Skips, naming the module, when ``transformers`` or ``safetensors`` is missing (extra ``hf-test``).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_impl
from fsdp_impl import checkpoint
from tests.functional import matrix_axes as axes

pytestmark = [pytest.mark.distributed(world_size=2, bucket="ckpt-hf", timeout=600),
              pytest.mark.requires_module("transformers", "safetensors"),
              pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", dtype="fp32")]

SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=32)


def _config(name: str) -> Any:
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(intermediate_size=32, **SMALL)
    if name == "qwen3_tied":
        return transformers.Qwen3Config(intermediate_size=32, head_dim=8, tie_word_embeddings=True, **SMALL)
    return transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                                       num_experts_per_tok=2, head_dim=8, **SMALL)


def _layer_class(model: torch.nn.Module) -> type:
    return type(model.model.layers[0])


def _wrap(module: torch.nn.Module, meta: bool = False) -> tuple[Any, Any]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    return fsdp_impl.fully_shard(module, optimizer, fsdp_unit_modules=[_layer_class(module)], zero_dp_strategy=3,
                                 init_model_with_meta_device=meta)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 7), generator=torch.Generator().manual_seed(100 + step))


def _train(model: Any, optimizer: Any, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        ids = _batch(step)[rank * 4 // world:(rank + 1) * 4 // world]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_batch(99)).logits


def _full_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}


def _meta_initialisable(model: torch.nn.Module, config: Any) -> None:
    """Our meta init calls ``reset_parameters()`` on every module that owns tensors; transformers'
    modules initialise through ``_init_weights`` instead, and its RMSNorms, MoE experts and rotary
    embedding have none. Give them one, as a user of meta init would: the rotary embedding's
    non-persistent buffers (``inv_freq``, in no checkpoint) computed as its constructor does, every
    other tensor zeroed (the files provide all of them)."""
    for module in model.modules():
        owns = next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None)
        if owns is None or hasattr(module, "reset_parameters") or hasattr(module, "_reset_parameters"):
            continue
        module.reset_parameters = functools.partial(  # type: ignore[method-assign]
            _rotary_reset if "RotaryEmbedding" in type(module).__name__ else _zero_reset, module, config)


def _rotary_reset(module: torch.nn.Module, config: Any) -> None:
    fresh = type(module)(config=config)
    for name, buffer in fresh.named_buffers():
        getattr(module, name).copy_(buffer)


def _zero_reset(module: torch.nn.Module, config: Any) -> None:
    for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
        tensor.zero_()


MODELS = [pytest.param("qwen3_tied", marks=pytest.mark.matrix(model="qwen3_tied"), id="qwen3_tied"),
          pytest.param("llama", marks=[pytest.mark.matrix(model="llama"), pytest.mark.slow], id="llama"),
          pytest.param("qwen3_moe", marks=[pytest.mark.matrix(model="qwen3_moe"), pytest.mark.slow], id="qwen3_moe")]


@pytest.mark.parametrize("name", MODELS)
def test_hf_export_matches_from_pretrained_and_imports_exactly(name: str, dist_env: Any, shared_tmp_path: Path) -> None:
    import safetensors.torch
    import transformers

    config = _config(name)
    torch.manual_seed(0)
    model, optimizer = _wrap(transformers.AutoModelForCausalLM.from_config(config))
    _train(model, optimizer, 2)
    trained = _full_params(model)
    ours = _logits(model)
    path = shared_tmp_path / "export"
    checkpoint.save_hf(path, model, config=config, max_shard_size="8KB")

    files = {}
    for file in sorted(path.glob("*.safetensors")):
        files.update(safetensors.torch.load_file(file))
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert files.keys() == trained.keys() - tied
    assert all(torch.equal(files[n], trained[n]) for n in files), "the files differ from the gathered parameters"
    assert len(list(path.glob("*.safetensors"))) > 1, "max_shard_size 8KB must give several files and an index"

    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(_logits(reference), ours), "from_pretrained on the export gives other logits"

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    _meta_initialisable(skeleton, config)
    imported, _ = _wrap(skeleton, meta=True)
    checkpoint.load_hf(path, imported)
    loaded = _full_params(imported)
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[n], trained[n]) for n in trained), "the import differs from the trained model"
    assert torch.equal(_logits(imported), ours), "the imported model gives other logits"
