"""Tests that leave their rank changed (self-test sample): the next test must not notice, and the
report of the test that changed it must say so; what a library set for itself is not the test's."""
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=2)
START_CVD = os.environ.get("CUDA_VISIBLE_DEVICES")
START_CWD = os.getcwd()


def test_destroys_process_group(record_property):
    record_property("pid", os.getpid())
    dist.barrier()
    dist.destroy_process_group()


def test_after_destroy(record_property):
    record_property("pid", os.getpid())
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0


def test_changes_env_cwd_dtype(record_property, tmp_path):
    record_property("pid", os.getpid())
    os.environ["CUDA_VISIBLE_DEVICES"] = "7"
    os.environ["HARNESS_SAMPLE_LEAK"] = "leaked"
    os.environ["SAMPLE_LEAK"] = "leaked"
    os.chdir(tmp_path)
    torch.set_default_dtype(torch.float64)


def test_after_changes(record_property):
    record_property("pid", os.getpid())
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == START_CVD
    assert "SAMPLE_LEAK" not in os.environ and "HARNESS_SAMPLE_LEAK" not in os.environ
    assert os.getcwd() == START_CWD
    assert torch.get_default_dtype() == torch.float32


def test_library_sets_env_for_itself(record_property, tmp_path):
    """A library's first import inside the test sets a variable for itself (as TransformerEngine's
    NVTE_CUDA_INCLUDE_DIR), inductor's internal variable is set; the test's own change is still caught."""
    record_property("pid", os.getpid())
    lib = tmp_path / "sample_env_lib.py"
    lib.write_text('import os\nos.environ["SAMPLE_LIB_AT_IMPORT"] = "set by the library"\n')
    spec = importlib.util.spec_from_file_location("sample_env_lib", lib)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = "12345"
    os.environ["SAMPLE_LEAK_AFTER_IMPORT"] = "leaked"


def test_after_library(record_property):
    record_property("pid", os.getpid())
    assert os.environ.get("SAMPLE_LIB_AT_IMPORT") == "set by the library"  # kept: the library reads it later
    assert "SAMPLE_LEAK_AFTER_IMPORT" not in os.environ
