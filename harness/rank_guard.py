"""Between tests a rank returns to the state it had before, so one test's leftovers cannot make the
next one fail (or pass) for the wrong reason; each change is named in the answer of the test that
made it.

Restored in place: the variables that define the rank (``RANK``, ``WORLD_SIZE``, ...,
``CUDA_VISIBLE_DEVICES``, ``HARNESS_*``) whenever they differ from the rank's start; any other
environment variable the test body (call phase) changed and its teardown did not undo (a fixture's
change is left alone: a module-scoped fixture may own it until its module ends); the working
directory, torch's default dtype, default device, grad mode and current CUDA device. Not restorable
in place: the default process group, when a test destroyed or replaced it; that is reported as
``restart`` so the controller starts the bucket afresh before the next test.

Not the test's doing, so neither named nor restored (identity variables excepted): a variable last
written while a module was being imported (a library configuring itself once on its first import
inside a test, e.g. TransformerEngine's ``NVTE_CUDA_INCLUDE_DIR``; undoing it would break the library
in later tests, and the import never runs again), and the library-internal variables in
``LIBRARY_INTERNAL_VARS`` that a library sets at run time as a channel to its own native code.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import pytest

IDENTITY_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
# Set by a library for itself outside an import (so the import rule does not see them), never by a test:
LIBRARY_INTERNAL_VARS = frozenset({
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",  # inductor, before loading each compiled module (codecache)
})
_IMPORT_MACHINERY = "<frozen importlib."


def _is_identity(key: str) -> bool:
    return key in IDENTITY_VARS or key.startswith("HARNESS_")


def _identity(env: dict[str, str]) -> dict[str, str | None]:
    keys = set(IDENTITY_VARS) | {k for k in env if _is_identity(k)}
    return {k: env.get(k) for k in sorted(keys)}


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a module import (importlib's frames are on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
            return True
        frame = frame.f_back
    return False


class EnvWrites:
    """While installed, notes for each environment variable written through ``os.environ`` (set,
    delete, and everything built on them: ``update``, ``pop``, ``setdefault``) whether its last write
    happened during a module import. Patches ``os.environ``'s class, whose methods every thread uses."""

    def __init__(self) -> None:
        self.at_import: dict[str, bool] = {}
        self._cls = type(os.environ)
        self._originals: tuple[Any, Any] | None = None

    def install(self) -> None:
        setitem, delitem = self._cls.__setitem__, self._cls.__delitem__
        self._originals = (setitem, delitem)
        notes = self.at_import

        def set_and_note(env: Any, key: Any, value: Any) -> None:
            setitem(env, key, value)
            if env is os.environ:
                notes[key] = _importing(sys._getframe(1))

        def del_and_note(env: Any, key: Any) -> None:
            delitem(env, key)
            if env is os.environ:
                notes[key] = _importing(sys._getframe(1))

        self._cls.__setitem__ = set_and_note  # type: ignore[method-assign]
        self._cls.__delitem__ = del_and_note  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._originals is not None:
            self._cls.__setitem__, self._cls.__delitem__ = self._originals  # type: ignore[method-assign]
            self._originals = None

    def library_owned(self, key: str) -> bool:
        """Set by a library for itself: last written during an import, or a known internal variable."""
        return key in LIBRARY_INTERNAL_VARS or self.at_import.get(key, False)


def _torch_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled()}
    if hasattr(torch, "get_default_device"):
        state["default device"] = torch.get_default_device()
    if torch.cuda.is_initialized():
        state["current CUDA device"] = torch.cuda.current_device()
    return state


def _restore_torch(name: str, value: Any) -> None:
    import torch

    setters: dict[str, Callable[[Any], Any]] = {
        "default dtype": torch.set_default_dtype, "grad mode": torch.set_grad_enabled,
        "default device": torch.set_default_device, "current CUDA device": torch.cuda.set_device}
    setters[name](value)


class RankGuard:
    """Snapshots before a test, restores after it. A pytest plugin (its ``pytest_runtest_call``
    wrapper sees which environment changes the test body made)."""

    def __init__(self, default_group: Callable[[], object | None] | None = None) -> None:
        self.default_group = default_group
        self.identity = _identity(dict(os.environ))
        self.group = default_group() if default_group is not None else None
        self._before: dict[str, Any] = {}
        self._call_changes: dict[str, tuple[str | None, str | None]] = {}

    def before_test(self) -> None:
        self._before = {"cwd": os.getcwd(), "torch": _torch_state()}
        self._call_changes = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        before = dict(os.environ)
        writes = EnvWrites()
        writes.install()
        try:
            return (yield)
        finally:
            writes.uninstall()
            after = dict(os.environ)
            self._call_changes = {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                                  if before.get(k) != after.get(k) and not writes.library_owned(k)}

    def after_test(self) -> tuple[list[str], bool]:
        """Restore what can be restored; return (descriptions of every change, restart needed)."""
        changes = self._restore_env()
        if self._before and os.getcwd() != self._before["cwd"]:
            changes.append(f"working directory changed to {os.getcwd()!r}; restored to {self._before['cwd']!r}")
            os.chdir(self._before["cwd"])
        for name, value in self._before.get("torch", {}).items():
            now = _torch_state().get(name)
            if now != value:
                changes.append(f"torch {name} changed to {now}; restored to {value}")
                _restore_torch(name, value)
        restart = False
        if self.default_group is not None:
            group = self.default_group()
            if group is not self.group:
                what = "destroyed" if group is None else "replaced"
                changes.append(f"the default process group was {what} (by the test or its fixtures); "
                               "the bucket's rank processes are restarted before the next test")
                restart = True
        return changes, restart

    def _restore_env(self) -> list[str]:
        changes = []
        for key, (start, end) in sorted(self._call_changes.items()):
            if _is_identity(key) or os.environ.get(key) != end:
                continue  # identity variables are handled below; teardown already changed it again
            changes.append(f"environment variable {key} changed by the test ({start!r} -> {end!r}); restored")
            _set_env(key, start)
        now = _identity(dict(os.environ))
        for key in sorted(set(now) | set(self.identity)):
            want, have = self.identity.get(key), now.get(key)
            if want != have:
                changes.append(f"environment variable {key} changed ({want!r} -> {have!r}); restored")
                _set_env(key, want)
        return changes
