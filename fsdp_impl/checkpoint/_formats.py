"""What a checkpoint directory holds, decided from its files before anything is read.

``load`` accepts our checkpoints (``manifest.json``: the default layout or ``torch_dcp``) and a
bare DCP directory (``.metadata``: FSDP2, torchtitan, Megatron-FSDP); Hugging Face weights
(``model.safetensors`` / its index) go through ``load_hf``. Anything else is named as what it
is, so a wrong path says so instead of failing deep inside a reader.
"""

from __future__ import annotations

from pathlib import Path

from ._errors import CheckpointFormatError, CheckpointNotFoundError
from ._files import DCP_METADATA_NAME, MANIFEST_NAME, require_directory

OURS = "fsdp_impl"
DCP = "dcp"
HF = "hf_safetensors"
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def detect(path: Path) -> str:
    """``OURS``, ``DCP`` or ``HF`` for the directory ``path``; clear errors otherwise."""
    require_directory(path)
    if (path / MANIFEST_NAME).is_file():
        return OURS
    if (path / DCP_METADATA_NAME).is_file():
        return DCP
    if (path / HF_SINGLE).is_file() or (path / HF_INDEX).is_file():
        return HF
    names = sorted(p.name for p in path.iterdir())
    if not names:  # e.g. a resume script's fresh run directory: "not found", as before
        raise CheckpointNotFoundError(f"{path} has no {MANIFEST_NAME}: it is not a checkpoint (an empty directory)")
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
    if any(n.endswith(".distcp") for n in names):
        what = "DCP data files without their .metadata (an interrupted or partial copy of a DCP checkpoint)"
    elif any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        what = "torch.save files, not a sharded checkpoint"
    else:
        what = "no checkpoint this package reads"
    raise CheckpointFormatError(
        f"{path} holds {what} (it contains {shown}); readable formats: fsdp_impl.checkpoint ({MANIFEST_NAME}), "
        f"torch.distributed.checkpoint ({DCP_METADATA_NAME}: FSDP2, torchtitan, Megatron-FSDP), Hugging Face "
        f"safetensors ({HF_SINGLE} or {HF_INDEX}, through load_hf)")
