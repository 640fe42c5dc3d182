"""The names shared by the harness's writers and the sign-off's reader live in two standard-library
modules, so the report can read results on a machine without torch, pytest or junitparser."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["harness.report.junit_format", "harness.report.sidecar_format"])
def test_wire_format_modules_import_only_the_standard_library(module):
    probe = (f"import sys; before = set(sys.modules); import {module}; "
             "print(' '.join(sorted(m.split('.')[0] for m in set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    third_party = sorted(set(out) - set(sys.stdlib_module_names) - {"harness"})
    assert third_party == [], f"{module} pulled in {third_party}"


def test_writers_and_reader_share_one_definition():
    from harness import matrix, regression_marker, rerun, sidecar
    from harness.report import junit_format, junit_read, regressions

    assert rerun.FLAKY_PROPERTY is junit_format.FLAKY_PROPERTY is junit_read.FLAKY_PROPERTY
    assert sidecar.AXIS_PROPERTY_PREFIX is matrix.AXIS_PROPERTY_PREFIX is junit_read.AXIS_PROPERTY_PREFIX
    assert regression_marker.REGRESSION_PROPERTY is regressions.REGRESSION_PROPERTY
    assert sidecar.FLAKY is junit_read.FLAKY
