"""pytest entry point of the harness (``pytest11`` entry point ``fsdp_harness`` and the root conftest).

Registers options, markers and fixtures, validates markers at collection, and picks the mode:
rank process (inside a spawned rank), torchrun mode (under ``torchrun -m pytest``) or spawn-mode
controller (plain ``pytest``, also inside each xdist worker).
"""
from __future__ import annotations

import os
import pathlib
from collections.abc import Generator
from typing import Any

import pytest

from harness import backend as backend_mod
from harness import forked_compat, golden, matrix, mutant, nodes, numerics, protocol, rerun, sidecar, spec
from harness.context import RANK_STATE_KEY, DistEnv, RankState

MARKERS = (
    "distributed(world_size=N, bucket=None, timeout=None): run the test on N ranks with the default process "
    "group initialised; tests sharing a bucket (default: module + world size) share rank processes",
    "requires_cuda: skip unless CUDA GPUs are visible and the CPU backend is not forced",
    "requires_gpu_arch(arch): skip unless every visible GPU has at least this compute capability ('sm90' = 9.0)",
    "requires_module(name, ...): skip unless the named Python module(s) can be imported",
    "slow: long-running case (over about a minute on 2 CPU cores) that the quick tiers L0 and L1 deselect "
    "with -m 'not slow'",
)


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    group = parser.getgroup("fsdp_harness", "distributed test harness")
    _register_parts(pluginmanager)
    group.addoption("--harness-backend", dest="harness_backend", choices=backend_mod.BACKEND_CHOICES, default="auto",
                    help="auto: NCCL with one GPU per rank when enough GPUs are visible, else gloo on CPU; "
                         "cpu: always gloo on CPU (same as env HARNESS_FORCE_CPU=1)")
    group.addoption("--harness-timeout", dest="harness_timeout", type=float, default=None,
                    help="default per-test timeout in seconds for distributed tests (default: 120 on gloo, 300 on "
                         "nccl; ini: harness_timeout); distributed(timeout=...) overrides")
    group.addoption("--harness-startup-timeout", dest="harness_startup_timeout", type=float, default=None,
                    help="seconds allowed for a bucket's rank processes to start (join the process group and "
                         "collect) before its first test's own timeout starts (default 120 gloo, 300 nccl)")
    group.addoption("--harness-grace", dest="harness_grace", type=float, default=3.0,
                    help="seconds to wait for the other ranks after one rank failed before tearing the bucket "
                         "down (they are probably blocked in a collective); default 3")
    group.addoption("--harness-shared-dir", dest="harness_shared_dir", default=None,
                    help=f"torchrun mode: a directory every node sees (env {nodes.ENV_SHARED_DIR}); the session's "
                         "shared directories and each node's rank logs and spilled output go under it "
                         "(default: rank 0's basetemp, and a node-local directory on nodes that cannot see it)")
    group.addoption("--harness-heartbeat-timeout", dest="harness_heartbeat_timeout", type=float, default=None,
                    help="torchrun mode: seconds without a heartbeat after which a rank that has not answered is "
                         "declared lost (its node or torchrun agent is gone); a slow rank keeps beating; default 60")
    parser.addini("harness_timeout", "default per-test timeout (s) for distributed tests", default="")
    parser.addini("harness_forbidden_fixtures", "extra fixture names distributed tests may not request",
                  type="args", default=[])


def _register_parts(pluginmanager: pytest.PytestPluginManager) -> None:
    """The harness's own plugin modules with options, ini values or collection hooks."""
    for name, module in (("fsdp_harness_matrix", matrix), ("fsdp_harness_rerun", rerun),
                         ("fsdp_harness_golden", golden)):
        if not pluginmanager.has_plugin(name):
            pluginmanager.register(module, name)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Generator[None, Any, Any]:
    """Keep each bucket on one xdist worker: default ``-n K`` to ``--dist loadgroup``.

    A wrapper, so it runs before xdist's own (tryfirst) hook turns an unset ``--dist`` into ``load``.
    """
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no" \
            and not getattr(config.option, "distload", False):
        config.option.dist = "loadgroup"
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: tell workers to group by ``xdist_group`` when we chose loadgroup for them.

    Workers rebuild their options from the command line, so a ``--dist`` chosen by the wrapper above
    would not reach them otherwise.
    """
    if getattr(node.config.option, "dist", None) == "loadgroup":
        node.workerinput["harness_loadgroup"] = True


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get("harness_loadgroup"):
        config.option.loadgroup = True
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    mutant.apply_from_env()
    mode = protocol.run_mode()
    if mode == protocol.RunMode.CONTROLLER:
        from harness.spawn.controller import Controller

        if workerinput is None:
            nodes.refuse_multinode_spawn(os.environ)

        config.pluginmanager.register(Controller(config), "fsdp_harness_controller")
    elif mode == protocol.RunMode.TORCHRUN:
        from harness.torchrun.session import TorchrunSession, quiet_non_zero_ranks

        quiet_non_zero_ranks(config)
        numerics.apply_from_env()  # a torchrun launched with harness.numerics.PINNED_ENV exported
        config.pluginmanager.register(TorchrunSession(config), "fsdp_harness_torchrun")
    rerun.register(config, mode)
    sidecar.register(config, mode)


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    """Before anything is collected: refuse a pytest that pytest-forked breaks (``forked_compat``)."""
    forked_compat.check(session.config)


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Generator[None, Any, Any]:
    """Validate harness markers as items are made, so bad use is a collection error of that module."""
    result = yield
    items = result if isinstance(result, list) else [result]
    forbidden = spec.CONTROLLER_ONLY_FIXTURES + tuple(collector.config.getini("harness_forbidden_fixtures"))
    for item in items:
        if isinstance(item, pytest.Item):
            try:
                dist = spec.validate_item(item, forbidden)
            except spec.HarnessUsageError as exc:
                raise collector.CollectError(f"fsdp_harness: {exc}") from None
            if dist is not None:
                item.stash[spec.SPEC_KEY] = dist
    return result


def _shared(state: RankState, fixture: str) -> None:
    """A shared directory a node cannot see is not shared: say so instead of handing it out."""
    if state.unshared_reason:
        raise pytest.UsageError(f"fixture {fixture!r}: {state.unshared_reason}")


def _rank_state(request: pytest.FixtureRequest) -> RankState:
    state = request.config.stash.get(RANK_STATE_KEY, None)
    if state is None:
        raise pytest.UsageError(
            f"{request.node.nodeid}: fixture {request.fixturename!r} is only available in tests marked "
            "@pytest.mark.distributed(world_size=N) (or under torchrun)")
    return state


@pytest.fixture
def dist_env(request: pytest.FixtureRequest) -> DistEnv:
    """Rank, world size, local rank, device (torch.device) and backend of this rank."""
    return _rank_state(request).env


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> pathlib.Path:
    """An empty directory that is the same path on every rank of this test (the controller creates it)."""
    state = request.config.stash.get(RANK_STATE_KEY, None)
    if state is None or state.shared_tmp is None:
        return tmp_path
    _shared(state, "shared_tmp_path")
    return state.shared_tmp


@pytest.fixture
def session_shared_tmp_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A directory shared by all ranks of all buckets of this pytest session (e.g. checkpoints)."""
    state = request.config.stash.get(RANK_STATE_KEY, None)
    if state is not None:
        _shared(state, "session_shared_tmp_path")
        return state.session_shared_dir
    controller = request.config.pluginmanager.get_plugin("fsdp_harness_controller")
    if controller is not None:
        return controller.session_shared_dir()
    return tmp_path_factory.getbasetemp() / "harness-session-shared"
