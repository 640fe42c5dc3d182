"""The safetensors file format, written tensor by tensor.

A file is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` and ``__metadata__``), padded with spaces to a multiple of 8, then the tensors'
raw little-endian bytes back to back in header order. Knowing every name, shape and dtype up
front, the header is written first and each tensor appended as it arrives, so an export holds
one full tensor at a time instead of a whole file's worth (the ``safetensors`` library's
``save_file`` takes them all at once). Reading uses the ``safetensors`` library
(``pip install 'fsdp-harness[hf]'``), whose ``get_slice`` reads only the requested rows.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
BY_NAME = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, global shape and the dtype it is stored in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPES:
        raise TypeError(f"safetensors cannot store {dtype}; allowed: {', '.join(str(d) for d in DTYPES)}")
    return DTYPES[dtype]


def header(entries: Sequence[Entry], metadata: dict[str, str]) -> bytes:
    """The length prefix and padded JSON header for ``entries`` in this order."""
    table: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        table[e.name] = {"dtype": dtype_name(e.dtype), "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    body = json.dumps(table, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in memory order (CPU, contiguous; little-endian hosts)."""
    t = tensor.detach().contiguous().cpu()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def append(f: BinaryIO, entry: Entry, tensor: torch.Tensor) -> None:
    """Write the next tensor of the file (``entry``'s dtype and shape are checked)."""
    if tuple(tensor.shape) != entry.shape:
        raise ValueError(f"{entry.name}: shape {tuple(tensor.shape)} is not the header's {entry.shape}")
    f.write(raw_bytes(tensor.to(entry.dtype)))
