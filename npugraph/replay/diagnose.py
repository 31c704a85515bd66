"""Naming what a device error is about: the graph, layer and task behind it, and the caller's line.

A device reports a hang, a race or a kernel fault by its event, task group or text; these
find the captured task each one names, so every error npugraph raises says which graph
(namespace and key) and which layer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from npugraph.capture import CapturedGraph, CaptureManager, TaskRecord
from npugraph.errors import GraphRace, NotReplayableError, NpuGraphError, ReplayFailed, UpdateFailed
from npugraph.replay.plan import UpdatePlan
from npugraph.replay.tasks import TaskFailed

__all__ = [
    "caller_level",
    "describe_device_error",
    "failed_task",
    "faulted_replays",
    "named_tasks",
    "replay_fault_message",
    "not_replayable",
    "release_stuck",
    "replay_error",
    "unissued_update",
    "update_error",
]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def named_tasks(
    manager: CaptureManager, exc: BaseException, entries: Sequence[CapturedGraph]
) -> list[tuple[CapturedGraph, TaskRecord]]:
    """The captured tasks a device error names, most specific first.

    By the event, else the task group, of each stream it blocked (a hang) or of the
    error itself (a race, a fault), as the device adapter reads them
    (:meth:`~npugraph.device.Device.fault_info`); else by the task group its text names
    (the simulator's kernel and memory errors), searched in ``entries``.
    """
    found: list[tuple[CapturedGraph, TaskRecord]] = []
    for site in manager.device.fault_info(exc).sites:
        hit = manager.task_for_event(site.event)
        if hit is None and site.task_group is not None:
            hit = manager.task_for_group(site.task_group)
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


def _by_graph(manager: CaptureManager) -> dict[int, CapturedGraph]:
    """npugraph's captured graphs by the id of their device graph (what a device error names)."""
    return {id(e.graph): e for e in manager.entries()}


def faulted_replays(manager: CaptureManager, exc: BaseException) -> list[tuple[CapturedGraph, tuple[Any, ...]]]:
    """Each of npugraph's graphs whose replay a device fault cancelled (the error's own, then
    the later ones the same synchronize found), with the ExternalEvents whose waits it skipped."""
    fault, by_graph = manager.device.fault_info(exc), _by_graph(manager)
    return [
        (entry, site.skipped_waits)
        for site in (*fault.sites, *fault.later)
        if (entry := by_graph.get(id(site.graph))) is not None
    ]


def replay_fault_message(manager: CaptureManager, exc: BaseException) -> tuple[str, CapturedGraph | None]:
    """A replay fault in words (which graph and layer, the device's cause, what happens
    next), and npugraph's graph it happened in, if any."""
    sites = manager.device.fault_info(exc).sites
    graph = sites[0].graph if sites else None
    entry = _by_graph(manager).get(id(graph))
    failed = failed_task(manager, exc, entry) if entry is not None else None
    after = " The rest of that replay was cancelled; the graph's next complete step runs it again."
    if entry is not None:
        where = f"replay of {entry.namespace}/{entry.key!r} failed" + (
            "" if failed is None else f" in layer {failed.layer!r} (task {failed.index}, {failed.spec.name})"
        )
    elif graph is not None:
        where = "a replay of a graph npugraph did not capture failed"
    else:  # no replay: the engine's own eager work on a stream
        where, after = "device work outside npugraph's graphs (an eager op or kernel on a stream) failed", ""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return f"{where}: {type(cause).__name__}: {str(cause).rstrip('.')}.{after}", entry


def release_stuck(manager: CaptureManager, hang: BaseException) -> tuple[list[CapturedGraph], bool]:
    """After a hang the device reported (an event record that never landed: a device fault,
    as npugraph records every event it waits on), record each ExternalEvent one of npugraph's
    replays is stuck on, so that the device drains.  The graphs that were stuck (BROKEN until
    their next complete step: the caller marks them), and whether the device then drained."""
    by_graph, npu = _by_graph(manager), manager.device.npu
    stuck = [
        (entry, site.event)
        for site in manager.device.fault_info(hang).sites
        if (entry := by_graph.get(id(site.graph))) is not None and any(t.event is site.event for t in entry.tasks)
    ]
    if not stuck:
        return [], False
    # on a stream of their own: the update stream may itself wait behind the stuck replay
    # (the next step's update is ordered after it); made only here, after a device fault
    side = npu.Stream()
    with npu.stream(side):
        for _, event in stuck:
            event.record(side)
    graphs = list({id(e): e for e, _ in stuck}.values())
    try:
        npu.synchronize()
    except Exception:  # still stuck elsewhere: the error already says where
        return graphs, False
    return graphs, True


def unissued_update(released: Sequence[CapturedGraph], order: str, flagged: str | None) -> str:
    """A synchronize found replays waiting for updates never issued (they were released)."""
    names = ", ".join(f"{e.namespace}/{e.key!r} (first layer {e.tasks[0].layer!r})" for e in released)
    return (
        f"the replay of {names} waited on the device for its update, which was never issued: "
        "synchronize would have blocked forever (on hardware: event-wait timeout 507011 after "
        f"~30 min). It was released and ran with no request (its outputs are zeros). In {order} "
        "order a replay that no update preceded waits for the update after it: call update() after "
        "replay(), or use step(), which orders both."
        + (f" A device-side block-id check also failed: {flagged}." if flagged else "")
    )


def replay_error(manager: CaptureManager, entry: CapturedGraph, exc: BaseException) -> NpuGraphError:
    """A replay the device refused to enqueue, in words (a race names its layer)."""
    if isinstance(exc, manager.device.race_errors):
        return GraphRace(describe_device_error(manager, exc, entry))
    return ReplayFailed(
        f"replay of {entry.namespace}/{entry.key!r} failed: {type(exc).__name__}: "
        f"{str(exc).rstrip('.')}. The next complete step replays it again."
    )


def not_replayable(entry: CapturedGraph, *, broken: bool) -> NotReplayableError:
    """A replay in update-first order with no complete update since the graph's last replay."""
    why = (
        "its last update or replay failed part-way, so its layers may hold several steps' lengths"
        if broken
        else "it has no update since its last replay"
    )
    return NotReplayableError(
        f"{entry.namespace}/{entry.key!r} is not replayable: {why}. In update-first order call update() "
        "with complete, valid metadata before each replay() (or use step())."
    )


def update_error(manager: CaptureManager, entry: CapturedGraph, plan: UpdatePlan, failed: TaskFailed) -> NpuGraphError:
    """A failed update in words: the graph, the layer (or the block tables' check or copy), the cause."""
    cause, i = failed.error, failed.index
    where = "checking or copying block tables" if i < 0 else f"layer {plan.tasks[i].layer!r} (task {i})"
    name = f"{entry.namespace}/{entry.key!r}"
    if isinstance(cause, manager.device.race_errors):
        return GraphRace(f"update of {name} at {where}: " + describe_device_error(manager, cause, entry))
    return UpdateFailed(
        f"update of {name} failed at {where}: {type(cause).__name__}: {str(cause).rstrip('.')}. "
        "The next complete update re-issues every layer."
    )


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside npugraph: the line that made the call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level
