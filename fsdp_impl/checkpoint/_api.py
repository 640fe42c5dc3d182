"""``save`` / ``load``: exact-resume checkpoints of a sharded model and its optimizer via DCP."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from . import _comm, _files, _layout
from ._dcp_out import save_torch_dcp
from ._errors import CheckpointCorruptedError, CheckpointError, CheckpointFormatError, CheckpointWriteError
from ._foreign_load import load_foreign
from ._formats import DCP, HF, detect
from ._state import (
    MODEL_KEY,
    OPTIM_KEY,
    OptimizerSnapshot,
    check_optimizer_class,
    check_optimizer_matches,
    empty_optimizer_state,
    install_optimizer_state,
    model_state,
    snapshot_optimizer,
    unwrap_optimizer,
)
from ._validate import check_model_matches

__all__ = ["save", "load", "data_dir", "FORMATS"]


FORMATS = ("fsdp_impl", "torch_dcp")


def save(path: str | os.PathLike, model: nn.Module, optimizer: Any, extra: dict | None = None, *,
         format: str = "fsdp_impl") -> None:
    """Write model + optimizer state (and ``extra``) to the directory ``path``; collective.

    All ranks must call it with the same ``path`` on a filesystem they share. ``extra`` (epoch,
    RNG states, LR-scheduler and data-loader state ...) is pickled by rank 0, so it must be the
    same on all ranks or only meaningful on rank 0; store per-rank values (e.g. each rank's RNG
    state) as a list gathered with ``dist.all_gather_object``. Tensors in ``extra`` come back on
    the CPU.

    ``format``:

    * ``"fsdp_impl"`` (default): data goes into a new data directory inside ``path``; once every
      file is written and hashed, rank 0 commits it by atomically replacing
      ``path/manifest.json``, so at any instant ``path`` holds a complete checkpoint (the
      previous one until the commit). Other files in ``path`` are never touched.
    * ``"torch_dcp"``: FSDP2's own layout (``model.<fqn>``, ``optim.state.<fqn>.*``,
      ``optim.param_groups.*`` in the model's own names), DCP files directly in ``path``, which
      FSDP2's ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` load as their own;
      ``manifest.json`` and ``extra.pt`` are sidecars DCP readers ignore. Written once: ``path``
      must not exist or be empty (see ``_dcp_out``). ``load`` reads it too.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}; got {format!r}")
    path = _files.as_path(path)
    _refuse_expert_parallel(model)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None; got {type(extra).__name__}")
    torch_optimizer = unwrap_optimizer(optimizer)
    model_sd, _ = model_state(model)
    snapshot = snapshot_optimizer(model, torch_optimizer, placeholders=format == "torch_dcp")
    if format == "torch_dcp":
        save_torch_dcp(path, model, snapshot, extra)
        return

    data, error = None, None
    if _comm.rank() == 0:
        try:
            data = _layout.prepare(path)
        except (OSError, CheckpointError) as e:
            error = e
    _comm.raise_if_any_failed(error, f"preparing checkpoint directory {path}", CheckpointWriteError)
    data = Path(_comm.broadcast_from_rank0(None if data is None else str(data)))
    try:
        _write(data, path, {MODEL_KEY: model_sd, OPTIM_KEY: snapshot.state}, snapshot, extra)
    except BaseException:
        if _comm.rank() == 0:
            _layout.discard(data)
        raise


def _refuse_expert_parallel(model: nn.Module) -> None:
    """Expert-parallel models keep each EP rank's local experts under the same names, which one
    DCP checkpoint cannot tell apart (its planner would keep one EP rank's experts): refuse
    rather than write or read a checkpoint that silently loses experts."""
    index = getattr(model, "dist_index", None)
    if getattr(index, "expt_device_mesh", None) is not None:
        raise NotImplementedError(
            "fsdp_impl.checkpoint does not support expert-parallel models yet (wrapped with "
            "expt_device_mesh): every EP rank's local experts have the same parameter names, so one "
            "DCP checkpoint would keep only one EP rank's experts")


def _write(data: Path, path: Path, state: dict, snapshot: OptimizerSnapshot, extra: dict | None) -> None:
    """Fill the new data directory (DCP files, extra.pt), hash it, and commit it as ``path``."""
    try:
        dcp.save(state, storage_writer=FileSystemWriter(data), no_dist=not _comm.is_distributed())
    except CheckpointException as e:  # DCP raises it on every rank
        raise CheckpointWriteError(f"writing checkpoint data to {data} failed: {e}") from e

    error, names = None, None
    if _comm.rank() == 0:
        try:
            buffer = io.BytesIO()
            torch.save({"param_groups": snapshot.hyperparameters, "extra": extra}, buffer)
            _files.write_file_durably(data / _files.EXTRA_NAME, buffer.getvalue())
            names = _files.data_files(data)
        except Exception as e:  # unpicklable extra, disk full ...
            error = e
    _comm.raise_if_any_failed(error, f"writing {_files.EXTRA_NAME}", CheckpointWriteError)
    names = _comm.broadcast_from_rank0(names)  # rank 0's listing: no stale directory caches

    files = _comm.gathered_digests(names, data, CheckpointWriteError)

    error = None
    if _comm.rank() == 0:
        try:
            manifest = _files.new_manifest(snapshot.description, files, _comm.world_size(), torch.__version__)
            _layout.commit(path, data, manifest)
        except (OSError, CheckpointError) as e:
            error = e
    _comm.raise_if_any_failed(error, f"publishing checkpoint {path}", CheckpointWriteError)


def load(path: str | os.PathLike, model: nn.Module, optimizer: Any, *, model_key: str | None = None,
         optim_key: str | None = None) -> dict | None:
    """Load a checkpoint into ``model`` and ``optimizer`` (``None``: the model only); collective.

    Works on a freshly wrapped model and a never-stepped optimizer, in any world size or
    sharding strategy: DCP reshards into the current parameters' layout, the values are
    installed through ``model.load_state_dict`` (an in-place update the engine sees, so the next
    forward uses them), and the optimizer state is rebuilt from the checkpoint without a
    ``step()``. A checkpoint of another model (names, shapes, dtypes) or optimizer is refused
    naming the differences, before anything is modified.

    What ``path`` may hold:

    * a checkpoint of :func:`save` (either format): every file is checked against the sizes and
      SHA-256 recorded at save before anything is copied. Returns the ``extra`` dict given to
      :func:`save` (``None`` if none was given).
    * a bare ``torch.distributed.checkpoint`` directory written by FSDP2 (``get_state_dict``'s
      model and optimizer), torchtitan, or Megatron-FSDP (``{"model": model.state_dict(),
      "optimizer": optimizer.state_dict()}``); where the model and optimizer sit is found from
      the keys and the model's own names (``model_key`` / ``optim_key`` choose when the
      checkpoint holds several candidates, e.g. an EMA copy). Returns the checkpoint's other
      entries nested as saved (torchtitan: ``lr_scheduler``, ``dataloader``, ``train_state``),
      tensors on the CPU.

    Hugging Face safetensors are loaded with :func:`load_hf`.
    """
    path = _files.as_path(path)
    _refuse_expert_parallel(model)
    kind = detect(path)
    if kind == HF:
        raise CheckpointFormatError(f"{path} holds Hugging Face safetensors weights (no optimizer state): load "
                                    "them with fsdp_impl.checkpoint.load_hf(path, model)")
    if kind == DCP:
        _, others = load_foreign(path, str(path), model, optimizer, model_key=model_key, optim_key=optim_key)
        return others
    torch_optimizer = None if optimizer is None else unwrap_optimizer(optimizer)
    manifest, data, metadata, side = _open(path)
    if manifest["version"] == _files.TORCH_DCP_VERSION:
        if torch_optimizer is not None:  # the groups are matched by name below, wrapped or not
            check_optimizer_class(manifest["optimizer"]["class"], torch_optimizer)
        load_foreign(data, str(path), model, optimizer, model_key="model", optim_key="optim")
        return side["extra"]

    model_sd, original_keys = model_state(model)
    check_model_matches(model_sd, metadata, path)
    state: dict[str, Any] = {MODEL_KEY: model_sd}
    if torch_optimizer is not None:
        check_optimizer_matches(manifest["optimizer"], model, torch_optimizer)

        def entry(name: str, key: str) -> Any:
            full = f"{OPTIM_KEY}.{name}.{key}"
            if full not in metadata.state_dict_metadata:
                raise CheckpointCorruptedError(f"checkpoint {path}: {_files.MANIFEST_NAME} lists '{full}' "
                                               "but the DCP metadata does not")
            return metadata.state_dict_metadata[full]

        state[OPTIM_KEY] = empty_optimizer_state(manifest["optimizer"], model, entry)
    try:
        dcp.load(state, storage_reader=FileSystemReader(data), no_dist=not _comm.is_distributed())
    except CheckpointException as e:
        raise CheckpointCorruptedError(f"reading checkpoint {path} failed: {e}") from e
    _install_model_state(model, state[MODEL_KEY], original_keys)
    if torch_optimizer is not None:
        install_optimizer_state(model, torch_optimizer, state[OPTIM_KEY], side["param_groups"])
    return side["extra"]


def _open(path: Path) -> tuple[dict, Path, Any, dict]:
    """Manifest, data directory, DCP metadata and extra.pt, after every file was verified, with
    one agreed error on all ranks."""
    manifest, data = None, None
    error: Exception | None = None
    try:
        manifest = _files.read_manifest(path)
        data = path if manifest["version"] == _files.TORCH_DCP_VERSION else _layout.data_dir(path, manifest)
    except CheckpointError as e:
        error = e
    _comm.raise_if_any_failed(error, f"opening checkpoint {path}", CheckpointCorruptedError)
    assert manifest is not None and data is not None  # else raise_if_any_failed raised

    expected = manifest["files"]
    mine = _files.my_share(sorted(expected), _comm.rank(), _comm.world_size())
    problems = [p for part in _comm.all_gather(_files.verify_files(data, expected, mine)) for p in part]
    if problems:
        raise CheckpointCorruptedError(
            f"checkpoint {path} is damaged ({len(problems)} file problem(s)):\n  " + "\n  ".join(problems)
        )
    metadata_file = data / _files.DCP_METADATA_NAME
    try:
        metadata = FileSystemReader(data).read_metadata()
    except Exception as e:
        raise CheckpointCorruptedError(f"checkpoint file {metadata_file} is unreadable: {e}") from e
    extra_file = data / _files.EXTRA_NAME
    try:
        side = torch.load(extra_file, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointCorruptedError(f"checkpoint file {extra_file} is unreadable: {e}") from e
    return manifest, data, metadata, side


def data_dir(path: str | os.PathLike) -> Path:
    """The directory holding the DCP files (``.metadata``, ``*.distcp``) of the checkpoint at
    ``path``, for tools that read DCP directly (``FileSystemReader(data_dir(path))``). Not a
    collective; the manifest is not verified against the files."""
    path = _files.as_path(path)
    manifest = _files.read_manifest(path)
    return path if manifest["version"] == _files.TORCH_DCP_VERSION else _layout.data_dir(path, manifest)


def _install_model_state(model: nn.Module, loaded: dict[str, Any], original_keys: dict[str, str]) -> None:
    """Hand the loaded tensors to ``model.load_state_dict`` after DCP has filled them.

    DCP writes into the local shards through ``DTensor.to_local()``, whose result does not share
    the parameter's version counter, so an engine that rebuilds its compute weights when the
    parameters' version counters move would not notice the load.  ``load_state_dict`` copies
    DTensor-to-DTensor (a local memcpy, in place when ``state_dict()`` returned views of the
    parameters) like any other in-place update, and also covers a ``state_dict()`` that
    returned copies.
    """
    model.load_state_dict({original_keys[n]: v for n, v in loaded.items()}, strict=True)
