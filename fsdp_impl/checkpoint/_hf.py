"""Hugging Face safetensors out of and into a sharded model, never whole on one rank.

``save_hf`` writes what ``save_pretrained`` writes: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json`` when the model
exceeds ``max_shard_size``; the names are the model's own (``_names``), a tied parameter once
under its first name. The files are streamed tensor by tensor: each tensor is gathered
(``DTensor.full_tensor``), appended by the rank that writes its file (files are dealt round-robin
over the ranks) and dropped, so no rank holds more than one full tensor beside its shards.

``load_hf`` fills a wrapped model (typically built on the meta device and wrapped with
``init_model_with_meta_device=True``) from such files: each rank reads, through
``safetensors``' ``get_slice``, only the rows of the shards it owns, and the values are installed
with ``model.load_state_dict``. Every name, shape and dtype is checked first.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import _comm, _files, _once
from ._errors import CheckpointFormatError, CheckpointMismatchError, CheckpointNotFoundError, CheckpointWriteError
from ._names import aliases, own_state, tensor_items
from ._safetensors import BY_NAME, Entry, append, header

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
WHAT = "Hugging Face export"
_EXACT_UPCASTS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float64),
                  (torch.float16, torch.float64), (torch.float32, torch.float64)}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``max_shard_size`` as ``save_pretrained`` takes it: bytes, or ``"5GB"`` / ``"500MiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"max_shard_size must be a positive int (bytes) or a size such as '5GB' or '500MiB'; "
                         f"got {size!r}")
    return int(float(match[1]) * _UNITS[(match[2] or "B").upper()])


def _plan(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Consecutive entries per file, each file at most ``limit`` bytes (a bigger tensor alone)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def _file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def save_hf(path: str | os.PathLike, model: nn.Module, *, dtype: torch.dtype | None = None,
            max_shard_size: int | str = "5GB", config: Any = None) -> None:
    """Export the model's weights as Hugging Face safetensors into the new directory ``path``;
    collective. ``dtype`` casts floating tensors (e.g. ``torch.bfloat16``; default: as trained);
    ``config`` (e.g. a ``transformers`` config) is saved beside them with its
    ``save_pretrained(path)``, so ``AutoModelForCausalLM.from_pretrained(path)`` works."""
    path = _files.as_path(path)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype; got {dtype!r}")
    limit = parse_size(max_shard_size)
    if config is not None and not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(f"config must have a save_pretrained(directory) method; got {type(config).__name__}")
    state, _ = own_state(model)
    tied = aliases(model)
    values = {n: v for n, v in tensor_items(state) if n not in tied}
    entries = [Entry(n, tuple(v.shape), dtype if dtype is not None and v.is_floating_point() else v.dtype)
               for n, v in values.items()]
    files = _plan(entries, limit)
    names = _file_names(len(files))
    tmp = _once.prepare(path, WHAT)
    try:
        error: BaseException | None = None
        for k, (name, group) in enumerate(zip(names, files, strict=True)):
            error = _stream_file(tmp / name, group, values, writer=k % _comm.world_size(), error=error)
        if error is None and _comm.rank() == 0:
            error = _finish(tmp, path, names, files, config)
        _comm.raise_if_any_failed(error, f"exporting {path}", CheckpointWriteError)
    except BaseException:
        _once.discard(tmp)
        raise


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _stream_file(file: Path, group: list[Entry], values: dict[str, torch.Tensor], writer: int,
                 error: BaseException | None) -> BaseException | None:
    """Gather each tensor of one file (a collective on every rank, also after an error, so no
    rank is left waiting); the writer appends it. Returns this rank's first error."""
    handle = None
    if _comm.rank() == writer and error is None:
        try:
            handle = open(file, "wb")
            handle.write(header(group, {"format": "pt"}))
        except OSError as e:
            error = e
    try:
        for entry in group:
            full = _full(values[entry.name])
            if handle is not None and error is None:
                try:
                    append(handle, entry, full)
                except (OSError, ValueError) as e:
                    error = e
            del full
        if handle is not None and error is None:
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        if handle is not None:
            handle.close()
    return error


def _finish(tmp: Path, path: Path, names: list[str], files: list[list[Entry]], config: Any) -> BaseException | None:
    """Rank 0: the index (several files), the config, then publish the directory."""
    try:
        if len(names) > 1:
            weight_map = {e.name: name for name, group in zip(names, files, strict=True) for e in group}
            total = sum(e.nbytes for group in files for e in group)
            body = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            _files.write_file_durably(tmp / INDEX, body.encode())
        if config is not None:
            config.save_pretrained(str(tmp))
        _once.publish(tmp, path, WHAT)
    except Exception as e:  # disk full, a config that fails to save ...
        return e
    return None


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("fsdp_impl.checkpoint.load_hf reads safetensors files with the `safetensors` package: "
                          "pip install 'fsdp-harness[hf]' (or safetensors)") from e
    return safe_open


def weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> file name of the export in ``path``."""
    if not path.is_dir():
        raise CheckpointNotFoundError(f"Hugging Face checkpoint directory {path} does not exist")
    if (path / INDEX).is_file():
        try:
            mapping = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{path / INDEX} is not a safetensors index (no weight_map): {e}") from e
        return {str(k): str(v) for k, v in mapping.items()}
    if (path / SINGLE).is_file():
        with _safe_open()(str(path / SINGLE), framework="pt") as f:
            return {k: SINGLE for k in f.keys()}
    raise CheckpointNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}")


def _headers(path: Path, mapping: dict[str, str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    safe_open = _safe_open()
    for file in sorted(set(mapping.values())):
        with safe_open(str(path / file), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                dtype = BY_NAME.get(s.get_dtype())
                if dtype is None:
                    raise CheckpointFormatError(f"{path / file}: tensor {key} has dtype {s.get_dtype()}, which "
                                                "this reader does not map to torch")
                out[key] = (tuple(s.get_shape()), dtype)
    return out


def _match(state: dict[str, Any], tied: dict[str, str], saved: dict[str, tuple[tuple[int, ...], torch.dtype]],
           path: Path) -> dict[str, str]:
    """Own tensor name -> file key; ``CheckpointMismatchError`` naming every difference. A tied
    parameter is looked up under its first name only (``save_pretrained`` drops the others)."""
    found, missing, reshaped, retyped = {}, [], [], []
    for name, value in tensor_items(state):
        if name in tied and tied[name] in state:
            continue  # a tied parameter's second name: filled with its first name (load_hf)
        key = name
        if key not in saved:
            missing.append(name)
            continue
        shape, dtype = saved[key]
        if shape != tuple(value.shape):
            reshaped.append(f"{key}: model {tuple(value.shape)}, file {shape}")
        elif dtype != value.dtype and (dtype, value.dtype) not in _EXACT_UPCASTS:
            retyped.append(f"{key}: model {value.dtype}, file {dtype} (only exact upcasts are applied)")
        else:
            found[name] = key
    unexpected = sorted(set(saved) - set(state) - set(tied))
    parts = []
    for title, items in (("in the model but not in the files", missing), ("in the files but not in the model",
                         unexpected), ("shape differs", reshaped), ("dtype differs", retyped)):
        if items:
            shown = "\n    ".join(items[:5]) + (f"\n    ... and {len(items) - 5} more" if len(items) > 5 else "")
            parts.append(f"  {title} ({len(items)}):\n    {shown}")
    if parts:
        raise CheckpointMismatchError(f"Hugging Face weights in {path} do not fit the model:\n" + "\n".join(parts))
    return found


def _local_slice(f: Any, key: str, value: torch.Tensor) -> torch.Tensor:
    """The part of tensor ``key`` that this rank's ``value`` holds, read from the file alone."""
    if not isinstance(value, DTensor):
        return f.get_tensor(key).to(device=value.device, dtype=value.dtype)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if any(s == 0 for s in shape):
        local = torch.empty(shape, dtype=value.dtype)
    else:
        local = f.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    local = local.to(device=value.to_local().device, dtype=value.dtype).contiguous()
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=value.stride())


def load_hf(path: str | os.PathLike, model: nn.Module) -> None:
    """Fill ``model`` from a Hugging Face safetensors export (``save_hf`` or ``save_pretrained``
    in the model's own names); collective only through ``load_state_dict``'s DTensor copies. Each
    rank reads just its shards' rows. Non-persistent buffers (e.g. rotary ``inv_freq``) are not
    in such files: a model built on the meta device must compute them itself."""
    path = _files.as_path(path)
    mapping = weight_map(path)
    state, original = own_state(model)
    found = _match(state, aliases(model), _headers(path, mapping), path)
    safe_open = _safe_open()
    loaded: dict[str, Any] = {}
    by_file: dict[str, list[str]] = {}
    for name, key in found.items():
        by_file.setdefault(mapping[key], []).append(name)
    for file in sorted(by_file):
        with safe_open(str(path / file), framework="pt") as f:
            for name in by_file[file]:
                loaded[original[name]] = _local_slice(f, found[name], state[name])
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            loaded[original[name]] = value
    for second, first in aliases(model).items():
        if second in original and first in original:
            loaded[original[second]] = loaded[original[first]]
    model.load_state_dict(loaded, strict=True)
