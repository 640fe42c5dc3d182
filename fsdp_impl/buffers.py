"""Contiguous per-unit buffers and the DTensor views the optimizer sees.

One ``DataParallelBuffer`` is a flat tensor holding this rank's segment of a ``FlatLayout``;
every parameter's local shard (or grad shard) is a view into it, so a whole unit moves in one
collective and later features (CUDA graphs, checkpoint, FP8) can address it as one tensor.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .sharding import FlatLayout


class DataParallelBuffer:
    """A flat local segment (``.data``) laid out by ``layout`` for shard ``rank``."""

    def __init__(self, layout: FlatLayout, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.rank = rank
        self.data = torch.zeros(layout.segment_numel, dtype=dtype, device=device)
        # Set by ``zero(token)``: (token, data's version right after zeroing); see take_zeroed.
        self._zeroed: tuple[object | None, int] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def is_allocated(self) -> bool:
        return self.data.untyped_storage().size() > 0 or self.data.numel() == 0

    def free(self) -> None:
        """Release the storage (``data`` keeps its shape and dtype); views become invalid."""
        self.data.untyped_storage().resize_(0)

    def ensure_allocated(self) -> None:
        """Re-allocate a freed buffer, zero-filled."""
        if self.allocate_for_overwrite():
            self.data.zero_()

    def zero(self, token: object | None) -> None:
        """Fill with zeros (``zero_grad(set_to_none=False)``) and remember it for ``take_zeroed``."""
        self.data.zero_()
        self._zeroed = (token, self.data._version)

    def take_zeroed(self, token: object | None) -> bool:
        """True when ``data`` still holds the zeros of the last ``zero`` (no in-place write since,
        through ``data`` or any view of it: they share its version counter) and that ``zero``
        was made under the same ``token``, so the caller may overwrite instead of adding (adding
        to zeros gives the same values). Forgets the mark either way.

        The token says in which CUDA-graph capture the zeroing was recorded (None: eagerly).
        A graph that overwrites must also contain the zeroing, or a replay without it would
        overwrite grads it should accumulate; a zero made eagerly before a capture does not
        count inside that capture."""
        mark, self._zeroed = self._zeroed, None
        return mark is not None and mark[0] is token and mark[1] == self.data._version

    def allocate_for_overwrite(self) -> bool:
        """Re-allocate a freed buffer without filling it. True when it was freed: it then holds
        no values (nothing can have written to freed memory) and the caller must write all of
        ``data`` (e.g. a reduce-scatter straight into it instead of into a temporary + add)."""
        if self.is_allocated:
            return False
        self.data.untyped_storage().resize_(self.data.numel() * self.data.element_size())
        return True

    def local_view(self, index: int) -> torch.Tensor:
        """This rank's shard of parameter ``index`` as a view into ``data``."""
        return self.layout.local_view(self.data, index, self.rank)


def contiguous_stride(shape: Sequence[int]) -> tuple:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


class ParameterGroup:
    """The buffers of one FSDP unit, named as in Megatron-FSDP.

    ``model_weight_buffer`` always holds the sharded weights; ``main_weight_buffer`` is the same
    object when a separate ``main_params_dtype`` was requested and ``None`` otherwise (then the
    model's own dtype is the optimizer's dtype). ``main_grad_buffer`` is ``None`` for a unit
    without trainable params.
    """

    def __init__(self, name: str, weight: DataParallelBuffer, grad: DataParallelBuffer | None,
                 has_main_params: bool) -> None:
        self.name = name
        self.model_weight_buffer = weight
        self.main_weight_buffer = weight if has_main_params else None
        self.main_grad_buffer = grad


class ParamAndGradBuffer:
    """``model.param_and_grad_buffer``: all units' buffers plus the decoupled-grad switch."""

    def __init__(self, parameter_groups: list[ParameterGroup], use_decoupled_grad: bool) -> None:
        self.parameter_groups = parameter_groups
        self.use_decoupled_grad = use_decoupled_grad
