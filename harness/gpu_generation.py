"""GPU generations by name: one list for the golden files' platform and the bench baselines' file
names (standard library only, so the report can use it without torch)."""
from __future__ import annotations

GENERATIONS = ("gb200", "b200", "h200", "h100", "a100")  # longest match first: "gb200" contains "b200"


def generation_of(device: str) -> str | None:
    """The GPU generation in a device name ("NVIDIA H200" -> ``h200``), ``None`` if none is known."""
    name = device.lower()
    return next((gen for gen in GENERATIONS if gen in name), None)
