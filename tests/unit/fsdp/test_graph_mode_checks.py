"""Wrap-time checks of cuda_graph_mode=True, without a process group: device, NaN report,
unshard storage, and which optimizers can step inside a CUDA graph."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fsdp_impl
from fsdp_impl._testing import GRAPH_MODE_ON_CPU
from fsdp_impl.graph_mode import check_cuda_graph_mode, check_optimizer_capturable
from fsdp_impl.optimizer_binding import attach_engines, bound_engines
from fsdp_impl.unshard_storage import UnshardStorage, UnshardStorageKind


def test_device_nan_report_and_storage() -> None:
    with pytest.raises(ValueError, match=r"needs a CUDA device mesh \(NCCL process group\), but the mesh is on 'cpu'"):
        check_cuda_graph_mode("cpu", False, UnshardStorage())
    with GRAPH_MODE_ON_CPU.on():
        assert check_cuda_graph_mode("cpu", False, UnshardStorage()).kind == UnshardStorageKind.PERSISTENT
    with pytest.raises(ValueError, match="cpu"):  # the test switch does not leak
        check_cuda_graph_mode("cpu", False, UnshardStorage())
    with pytest.raises(ValueError, match="report_nan_in_param_grad=True"):
        check_cuda_graph_mode("cuda", True, UnshardStorage())
    with pytest.raises(ValueError, match="cannot use the RESIZE unshard storage"):
        check_cuda_graph_mode("cuda", False, UnshardStorage(UnshardStorageKind.RESIZE))
    assert check_cuda_graph_mode("cuda", False, UnshardStorage.double_buffer()) == UnshardStorage.double_buffer()


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


class _ThirdParty(torch.optim.Optimizer):
    """Stands in for e.g. TransformerEngine FusedAdam: not torch.optim, a ``capturable`` attribute."""

    def __init__(self, params: Any, capturable: bool | None) -> None:
        super().__init__(params, {"lr": 0.1})
        if capturable is not None:
            self.capturable = capturable


@pytest.mark.parametrize("make", [
    lambda: torch.optim.SGD(_params(), lr=0.1, momentum=0.9),
    lambda: torch.optim.Adam(_params(), capturable=True),
    lambda: torch.optim.AdamW(_params(), capturable=True),
    lambda: fsdp_impl.optim.Adam(_params(), capturable=True),
    lambda: _ThirdParty(_params(), capturable=True),
    lambda: _ThirdParty(_params(), capturable=None),
], ids=["sgd", "torch-adam", "torch-adamw", "fsdp-adam", "third-party", "third-party-silent"])
def test_capturable_optimizers_pass(make) -> None:
    check_optimizer_capturable(make())


def test_non_capturable_optimizers_fail() -> None:
    with pytest.raises(ValueError, match=r"RMSprop has capturable=False in param group\(s\) \[1\]"):
        opt = torch.optim.RMSprop(_params(), capturable=True)
        opt.add_param_group({"params": _params(), "capturable": False})
        check_optimizer_capturable(opt)
    with pytest.raises(ValueError, match="torch.optim.LBFGS has no capturable option"):
        check_optimizer_capturable(torch.optim.LBFGS(_params()))
    with pytest.raises(ValueError, match=r"_ThirdParty.capturable is False"):
        check_optimizer_capturable(_ThirdParty(_params(), capturable=False))


def test_binding_checks_and_keeps_the_user_class_name() -> None:
    """attach_engines checks for a graph-mode engine before it swaps the class; an already
    bound optimizer is still named by the user's class."""
    graph_engine = SimpleNamespace(config=SimpleNamespace(cuda_graph_mode=True))
    plain_engine = SimpleNamespace(config=SimpleNamespace(cuda_graph_mode=False))
    adam = torch.optim.Adam(_params())
    attach_engines(adam, [plain_engine])  # type: ignore[list-item]
    assert type(adam).__name__ == "FSDPAdam" and bound_engines(adam) == [plain_engine]
    with pytest.raises(ValueError, match=r"but Adam has capturable=False"):
        attach_engines(adam, [graph_engine])  # type: ignore[list-item]
    assert bound_engines(adam) == [plain_engine]
    assert bound_engines(torch.optim.SGD(_params(), lr=0.1)) == []
