"""``save(..., format="torch_dcp")``: a checkpoint FSDP2 loads as its own.

The layout is what ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives for the
same module, under the keys PyTorch's examples use::

    {"model": model_state_dict, "optim": optimizer_state_dict}
    # keys: model.<fqn>, optim.state.<fqn>.<key>, optim.param_groups.<i>.<key> (params: FQNs)

with the model's own names (no ``module.`` of our wrapper), written by DCP directly into
``path``, so an FSDP2 run resumes with::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

Two sidecar files that DCP readers ignore: ``manifest.json`` (format version 3; optimizer
description, size and SHA-256 of every file) and ``extra.pt`` (the ``extra`` dict). The save
fills a sibling directory ``<path>.tmp-<id>`` and publishes it with one ``os.rename``, so
``path`` is either absent or complete. A ``torch_dcp`` checkpoint is written once: ``path`` must
not exist or be an empty directory (per-step directories, as torchtitan's ``step-<n>``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from . import _comm, _files, _once
from ._errors import CheckpointError, CheckpointWriteError
from ._names import own_name, own_state, wrapper_prefix
from ._state import OptimizerSnapshot

MODEL_KEY = "model"
OPTIM_KEY = "optim"
LAYOUT = "torch_dcp"
WHAT = "torch_dcp checkpoint"


def state_for_fsdp2(model: nn.Module, snapshot: OptimizerSnapshot) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` exactly as ``get_state_dict`` nests it, own names."""
    prefix = wrapper_prefix(model)
    model_sd, _ = own_state(model)
    groups = snapshot.description["param_groups"]
    state = {own_name(name, prefix): entry for name, entry in snapshot.state.items()}
    param_groups = [dict(hyper, params=[own_name(n, prefix) for n in names])
                    for hyper, names in zip(snapshot.hyperparameters, groups, strict=True)]
    return {MODEL_KEY: model_sd, OPTIM_KEY: {"state": state, "param_groups": param_groups}}


def save_torch_dcp(path: Path, model: nn.Module, snapshot: OptimizerSnapshot, extra: dict | None) -> None:
    """Collective: write ``path`` in FSDP2's layout (module docstring)."""
    tmp = _once.prepare(path, WHAT)
    try:
        _write(tmp, path, state_for_fsdp2(model, snapshot), snapshot, extra)
    except BaseException:
        _once.discard(tmp)
        raise


def _write(tmp: Path, path: Path, state: dict, snapshot: OptimizerSnapshot, extra: dict | None) -> None:
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not _comm.is_distributed())
    except CheckpointException as e:
        raise CheckpointWriteError(f"writing checkpoint data to {tmp} failed: {e}") from e
    error, names = None, None
    if _comm.rank() == 0:
        try:
            buffer = io.BytesIO()
            torch.save({"extra": extra}, buffer)
            _files.write_file_durably(tmp / _files.EXTRA_NAME, buffer.getvalue())
            names = _files.data_files(tmp)
        except Exception as e:  # unpicklable extra, disk full ...
            error = e
    _comm.raise_if_any_failed(error, f"writing {_files.EXTRA_NAME}", CheckpointWriteError)
    names = _comm.broadcast_from_rank0(names)
    files = _comm.gathered_digests(names, tmp, CheckpointWriteError)
    error = None
    if _comm.rank() == 0:
        try:
            manifest = _files.new_manifest(snapshot.description, files, _comm.world_size(), torch.__version__,
                                           version=_files.TORCH_DCP_VERSION)
            manifest["layout"] = LAYOUT
            _files.write_file_durably(tmp / _files.MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
            _once.publish(tmp, path, WHAT)
        except (OSError, CheckpointError) as e:
            error = e
    _comm.raise_if_any_failed(error, f"publishing checkpoint {path}", CheckpointWriteError)

