"""A rank's answer for one test, kept small enough for the store: large output is spilled to files.

A TCPStore value is capped at 8 MiB, and each phase's report repeats the captured output of the
phases before it, so a test printing a few megabytes used to break the harness. Here every captured
section or failure text longer than ``SECTION_LIMIT`` characters is written in full to a file under
the rank's spill directory and replaced by a note naming that file plus the text's last
``TAIL_CHARS`` characters. If the encoded answer is still over ``PAYLOAD_LIMIT`` bytes, every text
longer than ``SMALL_TAIL`` is spilled the same way; an answer that is still too large (huge
``record_property`` values) becomes an error naming its size, never a broken store.
"""
from __future__ import annotations

import hashlib
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest

from harness import protocol

SECTION_LIMIT = 256 * 1024
TAIL_CHARS = 64 * 1024
SMALL_TAIL = 4 * 1024
PAYLOAD_LIMIT = 4 * 1024 * 1024


class Spiller:
    """Writes texts that are too long for the answer to files named after the test and the section.
    ``host``: named with the path when the reader may be on another machine (torchrun across nodes)."""

    def __init__(self, directory: pathlib.Path, label: str, host: str | None = None) -> None:
        self.directory = directory
        self.label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[-60:]
        self.where = f" on host {host}" if host else ""

    def spill(self, text: str, title: str, keep: int) -> str:
        """Write ``text`` in full; return a note naming the file followed by its last ``keep`` characters."""
        self.directory.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(text[-4096:].encode(errors="replace")).hexdigest()[:8]
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", title)[:40]
        path = self.directory / f"{self.label}-{name}-{digest}.txt"
        path.write_text(text, errors="replace")
        return (f"[harness: {len(text)} characters, too long for the report; the full text is in {path}{self.where}; "
                f"its last {keep} characters follow]\n" + text[-keep:])


def _shrink_report(data: dict[str, Any], longreprtext: str, spiller: Spiller, limit: int, keep: int) -> None:
    sections = data.get("sections") or []
    data["sections"] = [[title, spiller.spill(content, f"{data.get('when')}-{title}", keep)
                         if len(content) > limit else content] for title, content in sections]
    if len(longreprtext) > limit:
        data["longrepr"] = spiller.spill(longreprtext, f"{data.get('when')}-failure", keep)


def serialize_reports(config: pytest.Config, reports: list[pytest.TestReport],
                      spiller: Spiller) -> list[dict[str, Any]]:
    """Serialised reports whose encoded total stays under ``PAYLOAD_LIMIT`` when at all possible."""
    out: list[dict[str, Any]] = []
    for limit, keep in ((SECTION_LIMIT, TAIL_CHARS), (SMALL_TAIL, SMALL_TAIL)):
        out = [config.hook.pytest_report_to_serializable(config=config, report=r) for r in reports]
        for data, rep in zip(out, reports, strict=True):
            _shrink_report(data, rep.longreprtext, spiller, limit, keep)
        if len(protocol.encode(out)) <= PAYLOAD_LIMIT:
            break
    return out


def fit(payload: dict[str, Any], describe: Callable[[int], str]) -> dict[str, Any]:
    """``payload`` itself if its encoding fits a store value, else an error payload saying why."""
    size = len(protocol.encode(payload))
    if size <= PAYLOAD_LIMIT:
        return payload
    return {**payload, "reports": [], "error": describe(size)}
