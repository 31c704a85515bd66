"""Per-layer task updates: each captured kernel re-issued with this step's host values.

Inside ``graph_task_update_begin/end`` on the update stream, a task is given its new host
arguments (lengths) and records its ``ExternalEvent``; a task whose host values did not
change since its last update is not re-issued (its event is still recorded).  Tiling-sink
groups come first: their lengths are written to the device and their plan made once per
group, and the graph's one event for them recorded.  FIA tasks go through the device's
4-in-1 update where there is one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import attrs

from npugraph.replay.phases import GraphState
from npugraph.replay.plan import TaskPlan, UpdatePlan

__all__ = ["TaskFailed", "issue_tasks", "null_tasks", "reissue"]


@attrs.define
class TaskFailed(Exception):
    """A device call of an update failed at task ``index`` (-1: before the first task)."""

    index: int
    error: Exception


def issue_tasks(
    npu: Any,
    update_stream: Any,
    plan: UpdatePlan,
    state: GraphState,
    host: list[dict[str, Any]],
    *,
    skip_unchanged: bool,
    fused: Callable[..., Any] | None,
) -> int:
    """Re-issue every task whose host values changed; record every task's event once.

    Returns how many tasks (each tiling-sink group counting as one) were re-issued; a
    failure is raised as :class:`TaskFailed` naming its task."""
    applied, pending, skip = state.applied, state.pending, skip_unchanged
    reissued = 0
    for w in plan.lens_writes:
        i = w.task
        host_values = host[i]
        if skip and applied[i] is host_values:
            continue
        try:
            w.write(host_values)
        except Exception as exc:
            raise TaskFailed(i, exc) from exc
        applied[i] = host_values
        reissued += 1
    rec = plan.lens_recorder
    if rec is not None and not pending[rec.index]:
        try:
            rec.event.record(update_stream)
        except Exception as exc:
            raise TaskFailed(rec.index, exc) from exc
        pending[rec.index] = True
    for t in plan.updatable:
        i = t.index
        try:
            host_values = host[i]
            if skip and applied[i] is host_values:
                if t.records and not pending[i]:
                    pending[i] = True  # once record() is called the flag will be set
                    t.event.record(update_stream)
                continue
            reissued += 1
            if t.fused and not pending[i]:
                kw = t.kwargs
                kw.update(host_values)  # the plan's own dict: host entries are rewritten in place
                fused(update_stream, t.handle, t.event, *t.qkv, **kw)  # type: ignore[misc]
                applied[i] = host_values
                pending[i] = True
                continue
            reissue(npu, update_stream, t, host_values)
            applied[i] = host_values
            if t.records and not pending[i]:
                pending[i] = True
                t.event.record(update_stream)
        except Exception as exc:
            raise TaskFailed(i, exc) from exc
    return reissued


def reissue(npu: Any, update_stream: Any, t: TaskPlan, host_values: dict[str, Any]) -> None:
    """Rewrite task ``t``'s arguments with host values ``host_values`` (no event record)."""
    kw = t.kwargs
    kw.update(host_values)  # the plan's own dict: host entries are rewritten in place
    npu.graph_task_update_begin(update_stream, t.handle)
    try:
        if t.qkv is not None:
            t.kernel(*t.qkv, **kw)
        else:
            t.kernel(**kw)
    except BaseException:
        with contextlib.suppress(Exception):
            npu.graph_task_update_end(update_stream)  # close the update; the kernel's error is the one to report
        raise
    npu.graph_task_update_end(update_stream)


def null_tasks(
    npu: Any, update_stream: Any, plan: UpdatePlan, state: GraphState, keep: list[dict[str, Any]] | None
) -> bool:
    """Give every task key lengths 0 (it then reads no block, whatever the block-table
    buffer holds now), except those ``keep`` says this step already wrote, and record
    every event not yet recorded, on ``update_stream`` (the caller makes it current and orders it).

    Returns whether every task took it; one the device refuses even that is left
    unknown (``applied`` is ``None``: the next update re-issues it)."""
    ok = True

    def reset(i: int, null: dict[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
        nonlocal ok
        if state.applied[i] is null or (keep is not None and state.applied[i] is keep[i]):
            return
        try:
            write(null)
            state.applied[i] = null
        except Exception:
            state.applied[i] = None
            ok = False

    for w in plan.lens_writes:  # a tiling-sink group: its lengths and plan, once
        reset(w.task, plan.tasks[w.task].null_host, w.write)
    for t in plan.tasks:
        if t.lens is None:
            reset(t.index, t.null_host, functools.partial(reissue, npu, update_stream, t))
        if t.records and not state.pending[t.index]:
            state.pending[t.index] = True
            with contextlib.suppress(Exception):
                t.event.record(update_stream)
    return ok
