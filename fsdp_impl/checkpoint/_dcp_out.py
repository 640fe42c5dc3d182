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
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from . import _comm, _files
from ._errors import CheckpointError, CheckpointWriteError
from ._names import own_name, own_state, wrapper_prefix
from ._state import OptimizerSnapshot

MODEL_KEY = "model"
OPTIM_KEY = "optim"
LAYOUT = "torch_dcp"


def state_for_fsdp2(model: nn.Module, snapshot: OptimizerSnapshot) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` exactly as ``get_state_dict`` nests it, own names."""
    prefix = wrapper_prefix(model)
    model_sd, _ = own_state(model)
    groups = snapshot.description["param_groups"]
    state = {own_name(name, prefix): entry for name, entry in snapshot.state.items()}
    param_groups = [dict(hyper, params=[own_name(n, prefix) for n in names])
                    for hyper, names in zip(snapshot.hyperparameters, groups, strict=True)]
    return {MODEL_KEY: model_sd, OPTIM_KEY: {"state": state, "param_groups": param_groups}}


def _check_target(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointWriteError(
            f"checkpoint path {path} exists and is not an empty directory: a torch_dcp checkpoint is written "
            "once (DCP readers take the files in place, so it cannot be replaced atomically); save each one "
            "to a new directory (e.g. step-<n>) or remove the old one first")


def _prepare(path: Path) -> Path:
    """Rank 0: check the target, remove leftovers of our own interrupted saves, make the temp dir."""
    _check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    own = re.compile(re.escape(path.name) + r"\.tmp-[0-9a-f]{12}")
    for entry in sorted(path.parent.iterdir()):
        if own.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    tmp = path.parent / f"{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def save_torch_dcp(path: Path, model: nn.Module, snapshot: OptimizerSnapshot, extra: dict | None) -> None:
    """Collective: write ``path`` in FSDP2's layout (module docstring)."""
    tmp, error = None, None
    if _comm.rank() == 0:
        try:
            tmp = _prepare(path)
        except (OSError, CheckpointError) as e:
            error = e
    _comm.raise_if_any_failed(error, f"preparing checkpoint directory {path}", CheckpointWriteError)
    tmp = Path(_comm.broadcast_from_rank0(None if tmp is None else str(tmp)))
    try:
        _write(tmp, path, state_for_fsdp2(model, snapshot), snapshot, extra)
    except BaseException:
        if _comm.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
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
    digests, error = {}, None
    try:
        for name in _files.my_share(names, _comm.rank(), _comm.world_size()):
            digests[name] = _files.file_digest(tmp / name)
    except OSError as e:
        error = e
    _comm.raise_if_any_failed(error, "hashing checkpoint files", CheckpointWriteError)
    files: dict[str, Any] = {}
    for part in _comm.all_gather(digests):
        files.update(part)
    error = None
    if _comm.rank() == 0:
        try:
            manifest = _files.new_manifest(snapshot.description, files, _comm.world_size(), torch.__version__,
                                           version=_files.TORCH_DCP_VERSION)
            manifest["layout"] = LAYOUT
            _files.write_file_durably(tmp / _files.MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
            _files.fsync_dir(tmp)
            _check_target(path)
            if path.exists():
                path.rmdir()  # empty (checked): rename cannot replace it on every platform
            tmp.rename(path)
            _files.fsync_dir(path.parent)
        except (OSError, CheckpointError) as e:
            error = e
    _comm.raise_if_any_failed(error, f"publishing checkpoint {path}", CheckpointWriteError)

