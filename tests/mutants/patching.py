"""How a mutant replaces its target: by name, checked, so a target that was renamed or removed
makes the mutant fail to apply (and count as SURVIVED) instead of silently testing the real code."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class MutantDoesNotApply(RuntimeError):
    """The mutant's target is missing, or the replacement would change nothing."""


APPLIED: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, replacement) per patch


def replace(target: str, make: Callable[[Any], Any]) -> None:
    """Replace ``module.path:Attr.name`` (or ``module.path:name``) by ``make(original)``."""
    module_name, _, attr_path = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise MutantDoesNotApply(f"{target}: cannot import {module_name} ({exc})") from None
    *owners, name = attr_path.split(".")
    for part in owners:
        if not hasattr(owner, part):
            raise MutantDoesNotApply(f"{target}: {owner!r} has no attribute {part!r}")
        owner = getattr(owner, part)
    if name not in vars(owner):
        raise MutantDoesNotApply(f"{target}: {owner!r} defines no {name!r} (renamed or moved?)")
    original = vars(owner)[name]
    replacement = make(original)
    if replacement is original:
        raise MutantDoesNotApply(f"{target}: the replacement is the original")
    setattr(owner, name, replacement)
    APPLIED.append((owner, name, original, replacement))


def verify() -> list[str]:
    """Each applied patch is still in place (nothing re-imported or re-assigned it)."""
    return [f"{owner!r}.{name} is no longer the mutant" for owner, name, _, new in APPLIED
            if vars(owner).get(name) is not new]


def undo(down_to: int = 0) -> None:
    """Restore patched attributes, newest first, until ``down_to`` patches remain (0: all; a test
    applying a mutant for a block keeps the patches made before it)."""
    while len(APPLIED) > down_to:
        owner, name, original, _ = APPLIED.pop()
        setattr(owner, name, original)
