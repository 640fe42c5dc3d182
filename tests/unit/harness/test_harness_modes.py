"""The harness's named states are enums whose wire values stay the plain words: a rank's stack
answer carries its phase as JSON, and messages name phases and take-over reasons."""
from __future__ import annotations

import json

import pytest

from harness import protocol
from harness.protocol import RunMode, run_mode
from harness.torchrun.state import Phase, TakeOver


def test_wire_values_are_the_plain_words():
    assert [p.value for p in Phase] == ["idle", "running", "waiting", "finishing", "abandoned"]
    assert [t.value for t in TakeOver] == ["timeout", "peer_failed", "terminated", "lost"]
    assert [m.value for m in RunMode] == ["rank", "torchrun", "controller"]
    assert json.dumps({"phase": Phase.RUNNING}) == '{"phase": "running"}'
    assert f"still {Phase.WAITING}; ({TakeOver.PEER_FAILED})" == "still waiting; (peer_failed)"
    assert Phase("running") is Phase.RUNNING and Phase.RUNNING == "running"


@pytest.mark.parametrize(("env", "mode"), [
    ({protocol.ENV_RANK_PROCESS: "1", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"},
     RunMode.RANK),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, RunMode.TORCHRUN),
    ({"TORCHELASTIC_RUN_ID": "x"}, RunMode.TORCHRUN),
    ({"RANK": "0", "WORLD_SIZE": "2"}, RunMode.CONTROLLER),
    ({}, RunMode.CONTROLLER),
])
def test_run_mode_from_the_environment(monkeypatch, env, mode):
    for name in (protocol.ENV_RANK_PROCESS, "TORCHELASTIC_RUN_ID", *protocol.TORCHRUN_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_mode() is mode
