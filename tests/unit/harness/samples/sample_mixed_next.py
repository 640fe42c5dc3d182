"""Runs right after ``sample_mixed_module.py`` (self-test sample)."""
import os


def test_mixed_next_module_sees_teardown():
    assert os.environ.get("HARNESS_SAMPLE_MIXED_TORN_DOWN") == "yes"
