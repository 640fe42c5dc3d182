"""A pytest plugin for comparison runs without the harness (``-p per_rank_junit``, with this
directory on PYTHONPATH): under torchrun every rank writes JUnit, so ``RANK`` in the
``--junitxml`` path is replaced by the rank's number."""
import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if config.option.xmlpath:
        config.option.xmlpath = config.option.xmlpath.replace("RANK", os.environ.get("RANK", "0"))
