"""Process groups a test left behind: found after each test, destroyed before the next on every rank.

Why: a suite that builds a ``DeviceMesh`` per test and never destroys its groups (Megatron's
``test_mfsdp_fully_shard.py``: its ``destroy_device_mesh`` clears the mesh caches only) keeps every
group alive in ``torch.distributed``'s registries for the rest of the session. Each gloo group owns a
TCP device whose event-loop thread wakes every 10 ms (gloo's ``tcp::Loop`` polls ``epoll_wait`` with
a 10 ms timeout) besides two worker threads. Measured on 2 cores with 8 ranks: idle CPU grows by
~0.085 % of a core per group and rank, and once about 350 groups per rank are alive the run falls off a
cliff (the load average passed 1,000; ten ``all_gather_object`` + ``barrier`` rounds on a 2-rank
subgroup took 32 s instead of 0.14 s). Megatron's file creates ~6.5 groups per rank and test, so after
~85 tests each collective hop waited seconds behind thousands of runnable threads and a test ran past
its timeout, its ranks caught in whatever collective they were in (``all_gather_object`` on the
sharding group, the ``barrier`` after it). Nothing was out of order; the ranks starved.

The rule, so that a group anything can still use is never touched: after each test (and
``gc.collect()``, since meshes hold reference cycles), a gloo group other than the default one is
*orphaned* on a rank when torch's own registries are all that refer to it: no Python reference
outside ``torch.distributed.distributed_c10d``'s tables (counted exactly, see ``_outside_refs``) and no
live ``DeviceMesh`` naming it (a mesh may hold names only and resolve them later). Every rank reports
what it holds; rank 0 releases the names orphaned on some rank and kept on none, and every rank
destroys those of them it reported orphaned, in name order, when it reads the next test's ``go``
(every rank has finished the previous test then, and no test runs). ``destroy_process_group`` of a
subgroup is no collective; the peers' sockets just close.

Torch's own DTensor caches keep meshes of earlier tests alive (after a ``torch.compile``d Megatron
case the C++ fast path of sharding propagation held its mesh, which Python's ``gc`` cannot see): when
a survey finds groups still held, it empties those memo caches (``_clear_dtensor_caches``) and looks
again. A cache recomputes what it held; afterwards no entry can hand out a mesh whose groups are gone.

Only gloo groups are released: they are the ones that poll, and destroying an NCCL communicator may
block on its peers in some NCCL versions (left for a GPU check). A group reachable only through its
name kept as a string elsewhere (not a mesh) would fail loudly if resolved later ("could not resolve
the process group"), never silently.
"""
from __future__ import annotations

import gc
import importlib
import re
import sys
from collections.abc import Iterable
from typing import Any

Survey = dict[str, list[str]]
EMPTY: Survey = {"orphaned": [], "kept": []}


def _c10d() -> Any | None:
    """``torch.distributed.distributed_c10d`` when a default process group exists, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d


def _gloo_only(config: object) -> bool:
    """``pg_backend_config`` text (``gloo`` or ``cpu:gloo,cuda:gloo``): every backend is gloo."""
    parts = [p.strip() for p in str(config).split(",") if p.strip()]
    return bool(parts) and all(p.rsplit(":", 1)[-1] == "gloo" for p in parts)


def _candidates(c10d: Any) -> list[Any]:
    """This rank's gloo groups other than the default group."""
    world = c10d._world
    default = c10d.GroupMember.WORLD
    configs = world.pg_backend_config
    return [pg for pg in list(world.pg_map) if pg is not default and _gloo_only(configs.get(pg, ""))]


def _name(c10d: Any, pg: Any) -> str:
    return str(c10d._world.pg_names.get(pg, ""))


def _registries(c10d: Any) -> list[dict | list]:
    """Torch's own tables that hold process groups: the module's dicts and lists, the ``_world``
    object's, and the lists inside them (``tags_to_pg``). Whatever refers to a group from here is
    bookkeeping, not a user."""
    tables: dict[int, dict | list] = {}
    for source in (vars(c10d), vars(c10d._world)):
        for value in list(source.values()):
            if issubclass(type(value), dict | list):  # type(): a module attribute's __class__ may warn
                tables[id(value)] = value
    for table in list(tables.values()):
        if isinstance(table, dict):
            for value in list(table.values()):
                if issubclass(type(value), list):
                    tables[id(value)] = value
    return list(tables.values())


def _registry_refs(pg: object, tables: list[dict | list]) -> int:
    """How many references torch's tables hold to ``pg`` (as a key or a value, by identity)."""
    count = 0
    for table in tables:
        if isinstance(table, dict):
            count += sum(1 for key in table if key is pg) + sum(1 for value in table.values() if value is pg)
        else:
            count += sum(1 for value in table if value is pg)
    return count


def _refcounts(objs: list[object]) -> list[int]:
    return [sys.getrefcount(obj) for obj in objs]


def _outside_refs(groups: list[Any], tables: list[dict | list]) -> list[int]:
    """Per group, the references held by anything but torch's tables and this function. Calibrated
    with a probe object that goes through the same path, so the count does not depend on how the
    interpreter counts its own temporaries."""
    probe = object()  # referred to by this name as each group is by the ``groups`` list
    counts = _refcounts([*groups, probe])
    return [count - counts[-1] - _registry_refs(pg, tables) for pg, count in zip(groups, counts[:-1], strict=True)]


def _mesh_group_names() -> set[str]:
    """Names of the groups every live ``DeviceMesh`` holds (meshes may keep names only)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return set()
    names: set[str] = set()
    for obj in gc.get_objects():
        if DeviceMesh in type(obj).__mro__:  # no isinstance: it may run a proxy's __class__ or a metaclass hook
            names.update(str(n) for n in (getattr(obj, "_dim_group_names", None) or ()))
    return names


def _classify(c10d: Any) -> tuple[list[str], list[str]]:
    """After ``gc.collect()``: the names of this rank's gloo groups nothing reaches, and of the rest."""
    gc.collect()
    groups = _candidates(c10d)
    in_meshes = _mesh_group_names()
    outside = _outside_refs(groups, _registries(c10d))
    orphaned: list[str] = []
    kept: list[str] = []
    for pg, refs in zip(groups, outside, strict=True):
        name = _name(c10d, pg)
        (orphaned if refs <= 0 and name not in in_meshes else kept).append(name)
    return orphaned, kept


def _clear_dtensor_caches() -> bool:
    """Empty DTensor's memo caches (sharding propagation, Python and the C++ fast path; redistribution
    plans; mesh topology), which keep the meshes of earlier tests, and so their groups, alive: after a
    ``torch.compile``d case the C++ fast path's cache alone held each of Megatron's meshes. Caches
    only: what they return is recomputed the same, and afterwards no entry can hand out a mesh whose
    groups are gone. Nothing happens unless DTensor is loaded; each piece is optional (torch
    versions differ). True when something was cleared."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    cleared = False
    for module, name in (("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
                         ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache")):
        try:
            getattr(importlib.import_module(module), name)()
            cleared = True
        except (ImportError, AttributeError):
            continue
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    topology = getattr(sys.modules.get("torch.distributed.tensor._collective_utils"), "MeshTopoInfo", None)
    for cached in (getattr(redistribute, "_gen_transform_infos", None), getattr(topology, "build_from_mesh", None)):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
            cleared = True
    return cleared


def free_destroyed() -> None:
    """Free process groups that were destroyed but are still held by DTensor's memo caches (through
    the meshes of earlier tests), while the interpreter is alive. ``destroy_process_group`` only
    unregisters a group: its gloo threads (two workers and the event loop) run until the last
    reference goes, and the C++ fast-path cache lets go only at process exit, after Python has
    finalized. A rank freeing a gloo group then died now and then with SIGABRT ("terminate called
    without an active exception") after its results were written (issue 52, item 19; a gloo group
    alive at exit right after a collective aborted 1 of 12 runs of a 4-rank script, none once
    destroyed)."""
    if _clear_dtensor_caches():
        gc.collect()


class GroupJanitor:
    """One rank's side: ``survey`` after a test, ``release`` what rank 0 says before the next one."""

    def __init__(self) -> None:
        self._seen: set[str] = set()  # candidate names at the last survey
        self._orphaned: set[str] = set()

    def survey(self) -> Survey:
        """This rank's gloo groups, orphaned or kept. Cheap when no group appeared since the last
        survey: nothing is collected or scanned then (a kept group is looked at again with the next
        new one)."""
        c10d = _c10d()
        if c10d is None:
            self._seen, self._orphaned = set(), set()
            return {"orphaned": [], "kept": []}
        names = {_name(c10d, pg) for pg in _candidates(c10d)}
        if not names or names <= self._seen:
            self._seen = names
            self._orphaned &= names
            return {"orphaned": sorted(self._orphaned, key=_order), "kept": sorted(names - self._orphaned, key=_order)}
        orphaned, kept = _classify(c10d)
        if kept and _clear_dtensor_caches():
            orphaned, kept = _classify(c10d)
        self._seen = set(orphaned) | set(kept)
        self._orphaned = set(orphaned)
        return {"orphaned": sorted(orphaned, key=_order), "kept": sorted(kept, key=_order)}

    def release(self, names: Iterable[str]) -> list[str]:
        """Destroy the groups among ``names`` that this rank reported orphaned, in the given order."""
        c10d = _c10d()
        mine = [n for n in names if n in self._orphaned]
        if c10d is None or not mine:
            return []
        import torch.distributed as dist

        by_name = {_name(c10d, pg): pg for pg in _candidates(c10d)}
        done = []
        for name in mine:
            pg = by_name.pop(name, None)
            if pg is None:
                continue
            dist.destroy_process_group(pg)
            del pg
            done.append(name)
        del by_name
        self._orphaned -= set(done)
        self._seen -= set(done)
        return done


def _order(name: str) -> tuple[int, int | str]:
    """Numeric names (torch's counter) in numeric order, then the rest (hashed names) as text."""
    return (0, int(name)) if re.fullmatch(r"\d+", name) else (1, name)


def merge(surveys: Iterable[Survey | None]) -> list[str]:
    """Rank 0: the names orphaned on some rank and kept on none, in release order. A rank that sent
    no survey (an old payload) blocks nothing it did not report."""
    orphaned: set[str] = set()
    kept: set[str] = set()
    for survey in surveys:
        if not survey:
            continue
        orphaned.update(survey.get("orphaned", ()))
        kept.update(survey.get("kept", ()))
    return sorted(orphaned - kept, key=_order)
