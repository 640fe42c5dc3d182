"""Exceptions raised by :mod:`fsdp_impl.checkpoint`.

Each one also derives from the built-in exception a caller would naturally catch
(``FileNotFoundError``, ``ValueError``, ``RuntimeError``), so generic handlers keep working
while tests and users can match the precise failure.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, or a file that a complete checkpoint must contain, is missing."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was written for a different model or optimizer (names or shapes differ)."""


class CheckpointCorruptedError(CheckpointError, RuntimeError):
    """A checkpoint file is truncated, altered or unreadable."""


class CheckpointWriteError(CheckpointError, RuntimeError):
    """Saving failed; any previous checkpoint at the target path is left untouched."""


class CheckpointFormatError(CheckpointError, ValueError):
    """``path`` holds no checkpoint in a format this package reads (named in the message), or its
    layout is ambiguous (several candidate prefixes: pass ``model_key=`` / ``optim_key=``)."""
