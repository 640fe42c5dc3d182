"""Drop-in compatibility with Megatron-FSDP 0.6.1's entry points, checked without a process group.

The three entry points must take Megatron-FSDP's arguments, in its order, with its defaults:
a frozen copy of that list runs everywhere; when ``megatron_fsdp`` is installed (the optional
``megatron-fsdp`` test extra), the live signatures are compared too, so drift is caught.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_impl

ROOT = Path(__file__).resolve().parents[3]

# Megatron-FSDP 0.6.1, fully_shard_model (fully_shard takes ``module, optimizer`` and then the rest).
MODEL_ARGS: list[tuple[str, Any]] = [
    ("module", inspect.Parameter.empty), ("device_mesh", None), ("dp_shard_dim", None), ("dp_outer_dim", None),
    ("tp_dim", None), ("hybrid_fsdp_group", None), ("hybrid_fsdp_expt_group", None), ("expt_device_mesh", None),
    ("fsdp_group_ag", None), ("expt_fsdp_group_ag", None), ("fsdp_unit_modules", None), ("zero_dp_strategy", 3),
    ("outer_dp_sharding_strategy", 0), ("device", None), ("init_model_with_meta_device", False),
    ("mixed_precision_policy", "MixedPrecisionPolicy()"), ("overlap_grad_reduce", True),
    ("overlap_param_gather", True), ("sync_model_each_microbatch", True), ("preproc_state_dict_for_dcp_ckpt", True),
    ("report_nan_in_param_grad", False), ("average_in_collective", False), ("disable_bucketing", False),
    ("calculate_per_token_loss", False), ("keep_fp8_transpose_cache", False), ("nccl_ub", False),
    ("fsdp_double_buffer", False), ("fsdp_db_use_persist_buf_on_alloc_fail", False),
    ("disable_symmetric_registration", False), ("enable_fine_grained_param_gather", False),
    ("use_decoupled_grad", False), ("cuda_graph_mode", False), ("maxpool_double_buffer", False),
]
FULLY_SHARD_ARGS = MODEL_ARGS[:1] + [("optimizer", inspect.Parameter.empty)] + MODEL_ARGS[1:]
OPTIMIZER_ARGS: list[tuple[str, Any]] = [("optimizer", inspect.Parameter.empty),
                                         ("preproc_state_dict_for_dcp_ckpt", True)]
POLICY_FIELDS = ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype")


def _comparable(default: Any) -> Any:
    """Defaults as comparable values: a MixedPrecisionPolicy by its dtype fields (the two
    packages' classes differ), everything else as it is."""
    if type(default).__name__ == "MixedPrecisionPolicy":
        return ("MixedPrecisionPolicy", tuple(getattr(default, f) for f in POLICY_FIELDS))
    return default


# Our keyword-only extensions after Megatron-FSDP's arguments (not part of the drop-in signature).
KEYWORD_ONLY = {"fully_shard_model": [("offload_policy", None)],
                "fully_shard": [("offload_policy", None), ("compile_units", None)],
                "fully_shard_optimizer": []}


def _ours(fn: Any) -> list[tuple[str, Any]]:
    """Our positional-or-keyword parameters (what Megatron-FSDP's signature must match)."""
    return [(p.name, _comparable(p.default)) for p in inspect.signature(fn).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY]


def _frozen(args: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    policy = ("MixedPrecisionPolicy", (torch.float32, None, None))
    return [(n, policy if d == "MixedPrecisionPolicy()" else d) for n, d in args]


@pytest.mark.parametrize("name,expected", [("fully_shard_model", MODEL_ARGS), ("fully_shard", FULLY_SHARD_ARGS),
                                           ("fully_shard_optimizer", OPTIMIZER_ARGS)])
def test_signature_matches_the_frozen_megatron_fsdp_list(name: str, expected: list) -> None:
    assert _ours(getattr(fsdp_impl, name)) == _frozen(expected)
    params = list(inspect.signature(getattr(fsdp_impl, name)).parameters.values())
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert {p.kind for p in positional} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}  # positional calls line up
    assert params[:len(positional)] == positional  # extensions come after Megatron-FSDP's arguments
    assert [(p.name, p.default) for p in params[len(positional):]] == KEYWORD_ONLY[name]


@pytest.mark.parametrize("name", ["fully_shard_model", "fully_shard", "fully_shard_optimizer"])
def test_signature_matches_installed_megatron_fsdp(name: str) -> None:
    megatron_fsdp = pytest.importorskip("megatron_fsdp", reason="needs the optional megatron-fsdp test extra")
    theirs = inspect.signature(getattr(megatron_fsdp, name)).parameters.values()
    assert _ours(getattr(fsdp_impl, name)) == [(p.name, _comparable(p.default)) for p in theirs]


def test_torch_distributed_checkpoint_is_usable_after_importing_fsdp_impl() -> None:
    """Megatron-FSDP imports it, and its users call ``torch.distributed.checkpoint.save`` right
    after ``import megatron_fsdp``; a fresh interpreter shows what ``import fsdp_impl`` alone gives."""
    code = ("import torch, fsdp_impl; import sys; "
            "assert 'torch.distributed.checkpoint' in sys.modules; "
            "torch.distributed.checkpoint.save, torch.distributed.checkpoint.load, fsdp_impl.checkpoint.save")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
