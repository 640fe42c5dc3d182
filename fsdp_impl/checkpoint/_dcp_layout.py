"""Where model and optimizer state sit in a DCP checkpoint another engine wrote.

DCP flattens nested state dicts into dotted keys, and each engine nests differently:

* FSDP2 + ``get_state_dict``: model ``<m>.<fqn>``, optimizer state ``<o>.state.<fqn>.<key>``,
  param groups ``<o>.param_groups.<i>.<key>`` (``params``: the FQNs);
* torchtitan: model ``<fqn>`` (older releases: ``model.<fqn>``), optimizer state
  ``optimizer.state.<fqn>.<key>``, hyperparameters per parameter
  ``optimizer.param_groups.<fqn>.<key>`` (``flatten_optimizer_state_dict``);
* Megatron-FSDP (``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``): model
  ``model.module.<fqn>``, optimizer state ``optimizer.state.<position>.<key>``, param groups
  ``optimizer.param_groups.<i>.<key>`` (``params``: positions, as ``Optimizer.state_dict`` numbers).

``<m>`` and ``<o>`` are whatever names the user's script gave (``model``/``optim``, ``app.model``
...). This module finds them from the checkpoint's keys and the model's own parameter names, so a
checkpoint loads without the user spelling its layout out; everything else in the checkpoint
(torchtitan's ``lr_scheduler``, ``dataloader``, ``train_state``) is an *other* entry, handed
back to the caller.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import CheckpointFormatError, CheckpointMismatchError

_INDEX_STATE = re.compile(r"^(?P<base>(?:.*\.)?)state\.(?P<index>\d+)\.[^.]+$")


@dataclass(frozen=True)
class OptimLayout:
    """Where the optimizer lives: ``state_prefix + <fqn or position> + "." + <state key>`` and
    the param groups under ``groups_prefix`` (``<i>.<key>`` nested, ``<fqn>.<key>`` flat)."""

    base: str  # what precedes "state." and "param_groups." (e.g. "optim.", "optimizer.")
    state_prefix: str
    groups_prefix: str
    by_position: bool  # Megatron-FSDP: state keyed by the parameter's position in the optimizer
    flat_groups: bool  # torchtitan / flatten_optimizer_state_dict: hyperparameters per parameter


@dataclass(frozen=True)
class DcpLayout:
    """A DCP checkpoint's layout: its writer's name (for messages), the model's key prefix, the
    optimizer's (None: a model-only checkpoint) and the other entries by top-level name."""

    writer: str
    model_prefix: str
    optim: OptimLayout | None
    model_keys: list[str] = field(default_factory=list)  # every key counted as the model's
    other: dict[str, list[str]] = field(default_factory=dict)


def _suffix_prefixes(keys: Iterable[str], name: str) -> set[str]:
    """Every ``p`` with ``p + name`` a key and ``p`` empty or ending in a dot."""
    out = set()
    for key in keys:
        if key.endswith(name) and (len(key) == len(name) or key[-len(name) - 1] == "."):
            out.add(key[: len(key) - len(name)])
    return out


def find_model_prefix(keys: set[str], names: list[str], forced: str | None) -> str:
    """The prefix under which the model's tensors are stored; the one covering most of
    ``names`` (ties: refused, naming the candidates)."""
    if forced is not None:
        return forced
    candidates: set[str] = set()
    for name in names[:8]:  # a few names suffice; a missing one is reported by the key check
        candidates |= _suffix_prefixes(keys, name)
    scored = sorted(((sum(p + n in keys for n in names), p) for p in candidates), key=lambda t: (-t[0], t[1]))
    if not scored or scored[0][0] == 0:
        sample = ", ".join(sorted(keys)[:6])
        raise CheckpointMismatchError(
            f"no entry of the checkpoint is one of the model's tensors under any prefix (model: "
            f"{', '.join(names[:3])} ...; checkpoint: {sample} ...): it was saved from a different model")
    best = [p for score, p in scored if score == scored[0][0]]
    if len(best) > 1:
        raise CheckpointFormatError(
            f"the checkpoint holds the model's tensors under several prefixes ({', '.join(repr(p) for p in best)}, "
            "e.g. a model and its EMA copy): pass model_key= to choose one")
    return best[0]


def _name_keyed_optim(keys: set[str], params: list[str]) -> OptimLayout | None:
    """FSDP2 / torchtitan: ``...state.<fqn>.<key>``; the state prefix covering most params."""
    pattern = re.compile(r"^(?P<before>(?:.*\.)?state\.(?:module\.)?)$")
    counts: dict[str, int] = {}
    for name in params:
        found = set()
        needle = name + "."
        for key in keys:
            i = key.find(needle)
            while i >= 0:
                if (i == 0 or key[i - 1] == ".") and pattern.match(key[:i]):
                    found.add(key[:i])
                i = key.find(needle, i + 1)
        for prefix in found:
            counts[prefix] = counts.get(prefix, 0) + 1
    if not counts:
        return None
    top = max(counts.values())
    best = sorted(p for p, c in counts.items() if c == top)
    if len(best) > 1:
        raise CheckpointFormatError(
            f"the checkpoint holds optimizer state under several prefixes ({', '.join(repr(p) for p in best)}); "
            "pass optim_key= to choose one")
    state_prefix = best[0]
    base = re.sub(r"state\.(module\.)?$", "", state_prefix)
    groups = base + "param_groups."
    flat = any(key.startswith(groups + params[0] + ".") for key in keys) if params else False
    return OptimLayout(base=base, state_prefix=state_prefix, groups_prefix=groups, by_position=False, flat_groups=flat)


def _position_keyed_optim(keys: set[str]) -> OptimLayout | None:
    """Megatron-FSDP: ``<base>state.<position>.<key>`` with ``<base>param_groups.<i>.params``."""
    bases = set()
    for key in keys:
        match = _INDEX_STATE.match(key)
        if match and f"{match['base']}param_groups.0.params" in keys:
            bases.add(match["base"])
    if not bases:
        return None
    if len(bases) > 1:
        raise CheckpointFormatError(
            f"the checkpoint holds position-keyed optimizer state under several prefixes ({sorted(bases)}); "
            "pass optim_key= to choose one")
    base = bases.pop()
    return OptimLayout(base=base, state_prefix=base + "state.", groups_prefix=base + "param_groups.",
                       by_position=True, flat_groups=False)


def _forced_optim(keys: set[str], base: str, params: list[str]) -> OptimLayout:
    if not base.endswith(".") and base:
        base += "."
    if not any(k.startswith(base + "state.") for k in keys):
        raise CheckpointFormatError(f"optim_key={base[:-1]!r}: the checkpoint has no entry {base}state.*")
    by_position = any(_INDEX_STATE.match(k) and k.startswith(base + "state.") for k in keys)
    groups = base + "param_groups."
    flat = any(k.startswith(groups + params[0] + ".") for k in keys) if params else False
    state_prefix = base + "state."
    if not by_position and params and not any(k.startswith(state_prefix + params[0] + ".") for k in keys) and any(
            k.startswith(state_prefix + "module." + params[0] + ".") for k in keys):
        state_prefix += "module."
    return OptimLayout(base, state_prefix, groups, by_position, flat)


def _writer(optim: OptimLayout | None, model_prefix: str) -> str:
    if optim is None:
        return "a model-only DCP checkpoint"
    if optim.by_position:
        return "Megatron-FSDP (position-keyed optimizer state)"
    if optim.flat_groups:
        return "torchtitan (flattened optimizer state)"
    return "torch.distributed.checkpoint.state_dict (FSDP2 layout)"


def _top(key: str, planner_data: Mapping[str, Any]) -> str:
    path = planner_data.get(key)
    if isinstance(path, (tuple, list)) and path:
        return str(path[0])
    return key.split(".", 1)[0]


def describe(keys: set[str], planner_data: Mapping[str, Any], names: list[str], params: list[str],
             model_key: str | None = None, optim_key: str | None = None) -> DcpLayout:
    """The layout of a checkpoint whose keys are ``keys``, for a model whose own tensor names
    are ``names`` and trainable parameter names ``params`` (both in model order)."""
    model_prefix = find_model_prefix(keys, names, None if model_key is None else
                                     (model_key + "." if model_key and not model_key.endswith(".") else model_key))
    if optim_key is not None:
        optim: OptimLayout | None = _forced_optim(keys, optim_key, params)
    else:
        optim = _position_keyed_optim(keys) or _name_keyed_optim(keys, params)
    optim_bases = () if optim is None else (optim.base + "state.", optim.groups_prefix)
    model_roots = {n.split(".", 1)[0] for n in names}
    model_keys: list[str] = []
    other: dict[str, list[str]] = {}
    for key in sorted(keys):
        if optim_bases and key.startswith(optim_bases):
            continue
        if key.startswith(model_prefix) and (model_prefix or key.split(".", 1)[0] in model_roots):
            model_keys.append(key)
        else:
            other.setdefault(_top(key, planner_data), []).append(key)
    return DcpLayout(writer=_writer(optim, model_prefix), model_prefix=model_prefix, optim=optim,
                     model_keys=model_keys, other=other)
