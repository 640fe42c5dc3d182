"""torchrun mode's directories: the session directory every rank shares, and one directory per node
for the ranks' logs and spilled output.

- Session directory (``shared_tmp_path``, ``session_shared_tmp_path``): rank 0 creates it under
  ``--harness-shared-dir`` (env ``HARNESS_SHARED_DIR``) when one is given, else in its own pytest
  basetemp, writes a token file into it and posts path and token to the store.
- Node directory: each node's local rank 0 checks whether the session directory is visible there
  (the token file reads back), and then uses ``<session>/node<g>-<host>``; on a node that cannot
  see it (several machines, no shared directory) a directory of that node's own temp dir
  (``harness-torchrun-node<g>-*``). Every rank of the node writes ``rank<r>.log`` (its placement,
  each test's start and outcome, the watchdog's messages) and ``rank<r>-output/`` (spilled
  output) there; reports name the node, host and directory.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import re
import tempfile
import uuid
from typing import IO, TYPE_CHECKING, Any

from harness import protocol

if TYPE_CHECKING:
    import pytest
    from torch.distributed import Store

TOKEN_FILE = ".harness-session"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[-60:]


def make_session_dir(config: pytest.Config, store: Store, rank: int, shared: str | None) -> dict[str, str]:
    """Rank 0 creates the session directory and posts it; every rank returns ``{"path", "token"}``."""
    key = protocol.key_dir("session")
    if rank == 0:
        if shared:
            root = pathlib.Path(shared).expanduser().resolve()
            root.mkdir(parents=True, exist_ok=True)
            run_id = _safe(os.environ.get("TORCHELASTIC_RUN_ID", "run"))
            path = pathlib.Path(tempfile.mkdtemp(prefix=f"torchrun-{run_id}-", dir=root))
        else:
            factory = config._tmp_path_factory  # type: ignore[attr-defined]
            path = factory.mktemp("harness-torchrun", numbered=True)
        token = uuid.uuid4().hex
        (path / TOKEN_FILE).write_text(token)
        protocol.put(store, key, {"path": str(path), "token": token})
    return protocol.get(store, key)


def _sees(session: dict[str, str]) -> bool:
    try:
        return (pathlib.Path(session["path"]) / TOKEN_FILE).read_text() == session["token"]
    except OSError:
        return False


def make_node_dir(store: Store, node: int, local_rank: int, host: str, session: dict[str, str]) -> dict[str, Any]:
    """The node's directory (its local rank 0 creates it): ``{"path", "shared"}``, ``shared`` saying
    whether this node sees the session directory."""
    key = protocol.key_dir(f"node{node}")
    if local_rank == 0:
        shared = _sees(session)
        if shared:
            path = pathlib.Path(session["path"]) / f"node{node}-{_safe(host)}"
            path.mkdir(exist_ok=True)
        else:
            path = pathlib.Path(tempfile.mkdtemp(prefix=f"harness-torchrun-node{node}-"))
        protocol.put(store, key, {"path": str(path), "shared": shared})
    return protocol.get(store, key)


class RankLog:
    """``rank<r>.log`` in the node directory: one timestamped line per event, flushed at once."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        try:
            self._file = path.open("a", encoding="utf-8", buffering=1)
        except OSError:
            self._file = None

    def write(self, message: str) -> None:
        if self._file is None:
            return
        stamp = datetime.datetime.now().isoformat(timespec="milliseconds")
        try:
            self._file.write(f"{stamp} {message}\n")
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
