"""Naming what a device error is about: the graph, layer and task behind it, and the caller's line.

A device reports a hang, a race or a kernel fault by its event, task group or text; these
find the captured task each one names, so every error npugraph raises says which graph
(namespace and key) and which layer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from npugraph.capture import CapturedGraph, CaptureManager, TaskRecord

__all__ = ["caller_level", "describe_device_error", "failed_task", "named_tasks"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def named_tasks(
    manager: CaptureManager, exc: BaseException, entries: Sequence[CapturedGraph]
) -> list[tuple[CapturedGraph, TaskRecord]]:
    """The captured tasks a device error names, most specific first.

    By the event, else the task group, of each stream it blocked (a hang) or of the
    error itself (a race); else by the task group its text names (the device adapter reads
    it: the simulator's kernel and memory errors), searched in ``entries``.
    """
    sources = getattr(exc, "blocked", None) or [
        {"event": getattr(exc, "event", None), "task_group": getattr(exc, "task_group", None)}
    ]
    found: list[tuple[CapturedGraph, TaskRecord]] = []
    for src in sources:
        hit = manager.task_for_event(src.get("event"))
        if hit is None and src.get("task_group") is not None:
            hit = manager.task_for_group(src["task_group"])
        if hit is not None and all(hit[1] is not t for _, t in found):
            found.append(hit)
    if found:
        return found
    text = str(exc)
    for e in entries:
        for t in e.tasks:
            if manager.device.names_task(text, t.handle):
                return [(e, t)]
    return []


def failed_task(manager: CaptureManager, exc: BaseException, entry: CapturedGraph) -> TaskRecord | None:
    """The first task of ``entry`` a device error names, if any."""
    return next((t for e, t in named_tasks(manager, exc, [entry]) if e is entry), None)


def describe_device_error(manager: CaptureManager, exc: BaseException, entry: CapturedGraph | None = None) -> str:
    """Name the namespace, key and layer of each captured task behind a device error."""
    found = named_tasks(manager, exc, [entry] if entry is not None else manager.entries())
    where = "; ".join(
        f"namespace {e.namespace!r}, key {e.key!r}, layer {t.layer!r} (task {t.index}, {t.spec.name})" for e, t in found
    )
    return f"{where or 'no captured task matched'}: {exc}"


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside npugraph: the line that made the call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level
