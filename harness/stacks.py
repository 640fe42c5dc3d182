"""Python stacks of every thread of this process, as text, without a signal.

Used where a stuck main thread cannot be asked anything: a watchdog thread formats them (torchrun
mode). Native frames are not shown; a thread blocked in C code shows the Python call that entered it.
pytest's and pluggy's own frames (the same two dozen above every test) are left out.
"""
from __future__ import annotations

import sys
import threading
import traceback
from types import FrameType

_INTERNAL = ("/_pytest/", "/pluggy/", "/pytest/__main__.py", "<frozen runpy>")


def _frames(frame: FrameType) -> list[traceback.FrameSummary]:
    summary = traceback.extract_stack(frame)
    return [f for f in summary if not any(part in f.filename for part in _INTERNAL)]

def format_stacks(skip: frozenset[int] = frozenset()) -> str:
    """Every thread's stack (most recent call last), the main thread first; ``skip``: thread idents."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main)
    parts = []
    for ident, frame in frames:
        if ident in skip:
            continue
        tag = " (main)" if ident == main else ""
        parts.append(f'Thread {ident:#x} "{names.get(ident, "?")}"{tag}, most recent call last '
                     "(pytest and pluggy frames left out):\n" + "".join(traceback.format_list(_frames(frame))))
    return "\n".join(parts)
