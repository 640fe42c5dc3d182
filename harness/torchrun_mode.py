"""torchrun mode (phase 2): placeholder until implemented; distributed tests are skipped with a reason."""
from __future__ import annotations

import pytest


class TorchrunSession:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
