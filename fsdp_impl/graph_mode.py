"""Wrap-time checks of ``cuda_graph_mode=True``: everything a captured step could not survive
fails here, before anything is allocated or captured, with a message saying what to change.

What graph mode changes in the engine (``unit.py``, ``engine.py``, ``grad_staging.py``,
``unshard_storage.py``): persistent engine buffers, ZeRO-3 compute params in fixed storage,
ZeRO-1/2 compute params refreshed on every forward (no version-counter agreement), no
``record_stream``, ``zero_grad(set_to_none=True)`` refused, and FP8 parameters requantised in
every root pre-forward (``engine.py``).
"""
from __future__ import annotations

import torch

from . import _testing
from .unshard_storage import UnshardStorage

# Set by fsdp_impl.optimizer_binding on the subclass it swaps in: the user's optimizer class.
USER_CLASS_ATTR = "_fsdp_user_class"


def check_cuda_graph_mode(device_type: str, report_nan: bool, storage: UnshardStorage) -> UnshardStorage:
    """Validate a graph-mode wrap; returns the resolved unshard storage."""
    if device_type != "cuda" and not _testing.GRAPH_MODE_ON_CPU.active:
        raise ValueError(f"cuda_graph_mode=True needs a CUDA device mesh (NCCL process group), but the "
                         f"mesh is on {device_type!r}; CUDA graphs exist only on CUDA devices. Pass "
                         "cuda_graph_mode=False, or run on GPUs")
    if report_nan:
        raise ValueError("cuda_graph_mode=True cannot be combined with report_nan_in_param_grad=True: the "
                         "NaN check reads the flags on the host (a device synchronisation), which a "
                         "captured step cannot do; pass report_nan_in_param_grad=False and check the "
                         "grads outside the graph (e.g. torch.isnan on the static loss)")
    return storage.resolve(True)


def check_optimizer_capturable(optimizer: torch.optim.Optimizer) -> None:
    """A graph-mode model's optimizer must be able to step inside a CUDA graph.

    * optimizers with a ``capturable`` option (``torch.optim.Adam``/``AdamW``, ``fsdp_impl.optim``
      ``Adam``/``AdamW``): ``capturable=True`` in every param group (the step counter then lives
      on the device and the bias corrections are computed there, without host syncs);
    * ``torch.optim.SGD``: no step counter and no host sync; its momentum buffers are created by
      the warm-up steps before capture (``fsdp_impl.cuda_graph.capture_train_step`` runs them);
    * other ``torch.optim`` optimizers without a ``capturable`` option: refused;
    * anything else (e.g. TransformerEngine ``FusedAdam``): its ``capturable`` attribute must not
      be False; the optimizer's own capture support is its responsibility.
    """
    # The engine's optimizer binding subclasses the user's class; judge (and name) the original.
    cls = getattr(type(optimizer), USER_CLASS_ATTR, type(optimizer))
    groups = getattr(optimizer, "param_groups", [])
    if any("capturable" in g for g in groups):
        bad = [i for i, g in enumerate(groups) if not g.get("capturable", False)]
        if bad:
            raise ValueError(f"cuda_graph_mode=True needs an optimizer that can step inside a CUDA graph, but "
                             f"{cls.__name__} has capturable=False in param group(s) {bad}; construct it "
                             "with capturable=True (its step counter then lives on the GPU)")
        return
    if issubclass(cls, torch.optim.SGD):
        return
    if cls.__module__.startswith("torch.optim"):
        raise ValueError(f"cuda_graph_mode=True needs an optimizer that can step inside a CUDA graph; "
                         f"torch.optim.{cls.__name__} has no capturable option. Use torch.optim.SGD, "
                         "torch.optim.Adam/AdamW(capturable=True) or fsdp_impl.optim.Adam/AdamW(capturable=True)")
    if getattr(optimizer, "capturable", None) is False:
        raise ValueError(f"cuda_graph_mode=True needs an optimizer that can step inside a CUDA graph, but "
                         f"{cls.__name__}.capturable is False; construct it with capturable=True")
