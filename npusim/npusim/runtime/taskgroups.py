"""Task groups (capture side) and task updates (replay side).

A task group holds the tasks of one op call; an update re-issues that op inside
``graph_task_update_begin/end`` on a non-capturing stream, replacing all of the task's
arguments when the stream reaches it.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any

import torch

from npusim.errors import ConcurrentUpdateError, RaceError, UpdateMismatchError
from npusim.runtime import state as rt
from npusim.runtime.memory import ArgRef, hold_params
from npusim.runtime.nodes import KernelTask

__all__ = [
    "TaskGroup",
    "NPUTaskGroupHandle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "issue_update",
    "reissues_previous",
]


class TaskGroup:
    """The tasks of one captured op call, updatable between replays."""

    def __init__(self, graph: Any, group_id: int) -> None:
        self.graph = graph
        self.group_id = group_id
        self.task: KernelTask | None = None  # set by the capture
        # (node index, ExternalEvent) of the wait right before the task, if there is one
        self.guard: tuple[int, Any] | None = None
        self.pending_update = False
        self.executions = 0
        self.updates = 0
        self.label: str | None = None  # simulator-only: its capturer's name for it, in error messages
        self.previous: _PreviousCall | None = None  # the last update issued to it

    def __repr__(self) -> str:
        op = self.task.op.qualname if self.task else "empty"
        return f"<task group #{self.group_id} of graph #{self.graph.graph_id}: {op}>"


class NPUTaskGroupHandle:
    """Opaque handle of a captured task group (``_NPUTaskGroupHandle``)."""

    __slots__ = ("_group",)

    def __init__(self, group: TaskGroup) -> None:
        self._group = group

    def __repr__(self) -> str:
        return f"<_NPUTaskGroupHandle #{self._group.group_id}>"

    @property
    def label(self) -> str | None:
        """Simulator-only: a name for the group in the device's error messages (a runtime's layer)."""
        return self._group.label

    @label.setter
    def label(self, value: str | None) -> None:
        self._group.label = value


class _TaskUpdate:
    """A parameter rewrite of one task group, landing when its stream reaches it.

    It replaces *all* of the task's arguments (device addresses included), as hardware does.
    """

    def __init__(self, group: TaskGroup, params: dict[str, Any], refs: tuple[ArgRef, ...], stream: rt.Stream) -> None:
        self.group, self.params, self.refs, self.stream = group, params, refs, stream

    def ready(self) -> bool:
        return True

    def step(self, max_nodes: int) -> bool:
        rt.get_state().updates_in_flight[self.stream] -= 1  # landed (or dropped, if it raises)
        g = self.group
        task = g.task
        assert task is not None
        if g.pending_update and any(_runs_previous(g, r.pc) for r in g.graph._inflight):
            raise RaceError(
                f"update of {g!r} landed while the previous update of this group has not "
                "been executed yet and a queued replay has still to run it: that replay "
                "would run with this update's arguments (silent wrong output on hardware). "
                "Order the update stream after the previous replay "
                "(update_stream.wait_stream(main_stream) or an event).",
                task_group=g,
                graph=g.graph,
            )
        task.params = self.params
        task.refs = self.refs
        g.pending_update = True
        g.updates += 1
        return True

    def describe(self) -> dict[str, Any]:
        return {"text": f"update of {self.group!r}", "task_group": self.group}


class _UpdateOf:
    """``update of <group>``, formatted only for an error message (not at every re-issue)."""

    __slots__ = ("group",)

    def __init__(self, group: TaskGroup) -> None:
        self.group = group

    def __str__(self) -> str:
        return f"update of {self.group!r}"


def _runs_previous(g: TaskGroup, pc: int) -> bool:
    """Whether a queued replay at node ``pc`` will run group ``g`` with the arguments of an
    earlier update than one landing now: it has not run ``g`` yet, and it is past the wait
    that guards ``g`` or that wait's flag is already set (an earlier record pairs it with
    an earlier update).  A replay still waiting for an unset flag pairs with a later
    record, which follows this update: it runs this update's arguments, as it should."""
    task = g.task
    assert task is not None
    if pc > task.index:
        return False
    if g.guard is None:
        return True
    wait_at, event = g.guard
    return pc > wait_at or bool(event._flag)


@rt.locked
def graph_task_group_begin(stream: rt.Stream) -> None:
    """Open a task group on the capturing ``stream`` (one op call per group)."""
    st = rt.get_state()
    session = st.capture
    if session is None or session.stream is not stream:
        raise RuntimeError(
            "graph_task_group_begin: the stream is not capturing; task groups can only be "
            "opened on the stream of a capture in progress"
        )
    if session.open_group is not None:
        raise RuntimeError(
            f"graph_task_group_begin: task group #{session.open_group.group_id} is still "
            "open; call graph_task_group_end first"
        )
    group = TaskGroup(session.graph, rt._new_id())
    session.open_group = group


@rt.locked
def graph_task_group_end(stream: rt.Stream) -> NPUTaskGroupHandle:
    """Close the open task group of ``stream`` and return its handle."""
    st = rt.get_state()
    session = st.capture
    if session is None or session.stream is not stream or session.open_group is None:
        raise RuntimeError(
            "graph_task_group_end: no task group is open on this stream (call "
            "graph_task_group_begin on the same capturing stream)"
        )
    group = session.open_group
    session.open_group = None
    if group.task is None:
        raise RuntimeError(
            f"graph_task_group_end: task group #{group.group_id} is empty; it must hold exactly one op call"
        )
    session.graph._groups.append(group)
    return NPUTaskGroupHandle(group)


@rt.locked
def graph_task_update_begin(stream: rt.Stream, handle: NPUTaskGroupHandle) -> None:
    """Start rewriting task group ``handle``: the next op on ``stream`` is not executed."""
    st = rt.get_state()
    st.charge("update_begin")
    if not isinstance(handle, NPUTaskGroupHandle):
        raise TypeError(f"graph_task_update_begin: expected a task group handle, got {handle!r}")
    group = handle._group
    if st.capture is not None and st.capture.stream is stream:
        raise RuntimeError("graph_task_update_begin: the update stream must not be capturing")
    if stream is group.graph._capture_stream:
        raise RuntimeError(
            "graph_task_update_begin: the update stream must not be the graph's capture "
            "stream; create a dedicated torch.npu.Stream() for updates"
        )
    if not group.graph._captured:
        raise RuntimeError(f"graph_task_update_begin: {group.graph!r} of {group!r} has no completed capture")
    if stream._updating is not None:
        raise RuntimeError(
            f"graph_task_update_begin: {stream!r} is already updating "
            f"{stream._updating!r}; call graph_task_update_end first"
        )
    me = threading.get_ident()
    if st.update_session is not None:
        other, thread = st.update_session
        who = "another host thread" if thread != me else f"this thread on {other!r}"
        raise ConcurrentUpdateError(
            f"graph_task_update_begin on {stream!r}: {who} has an update session open "
            f"({other._updating!r}). {_ONE_UPDATER} Finish that update (graph_task_update_end) first."
        )
    busy = [s for s, n in st.updates_in_flight.items() if n > 0 and s is not stream]
    if busy:
        raise ConcurrentUpdateError(
            f"graph_task_update_begin on {stream!r}: task updates queued on {busy[0]!r} have not landed "
            f"yet, so the two streams would update concurrently. {_ONE_UPDATER} Issue every update "
            "on one update stream (or order the streams with an event)."
        )
    st.update_session = (stream, me)
    stream._updating = handle
    stream._update_ops = 0


@rt.locked
def graph_task_update_end(stream: rt.Stream) -> None:
    """Finish the update begun on ``stream``."""
    st = rt.get_state()
    st.charge("update_end")
    handle = stream._updating
    if handle is None:
        raise RuntimeError(
            "graph_task_update_end: no update in progress on this stream (begin and end must use the same stream)"
        )
    stream._updating = None
    st.update_session = None
    if stream._update_ops != 1:
        raise UpdateMismatchError(
            f"graph_task_update_end: {stream._update_ops} ops were issued to update "
            f"{handle._group!r}; exactly one (the captured op) must be"
        )


class _TensorSig:
    """A tensor argument as an update passed it: the very object, and where and how it lay."""

    __slots__ = ("ptr", "ref", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)  # the object, without keeping the caller's memory alive
        self.ptr, self.shape, self.stride = t.data_ptr(), t.shape, t.stride()

    def matches(self, t: Any) -> bool:
        # the same object, not moved (set_) or reshaped in place (resize_, as_strided_); its
        # dtype and device cannot change in place
        was = self.ref()
        return (
            was is not None
            and was is t
            and was.data_ptr() == self.ptr
            and was.shape == self.shape
            and was.stride() == self.stride
        )


class _SeqSig:
    __slots__ = ("items", "kind")

    def __init__(self, v: list[Any] | tuple[Any, ...]) -> None:
        self.kind, self.items = type(v), tuple(_signature(x) for x in v)

    def matches(self, v: Any) -> bool:
        return type(v) is self.kind and len(v) == len(self.items) and all(_matches(s, x) for s, x in zip(self.items, v))


def _signature(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _TensorSig(v)
    if isinstance(v, (list, tuple)):
        return _SeqSig(v)
    return v


def _matches(sig: Any, v: Any) -> bool:
    if type(sig) is _TensorSig or type(sig) is _SeqSig:
        return bool(sig.matches(v))
    return sig is v or (type(sig) is type(v) and bool(sig == v))


class _PreviousCall:
    """The last update issued to a task group: its device arguments (identity and layout)
    and what the graph keeps of them.  An engine re-issues every layer's kernel each step
    with the same query, caches, table, output and workspace tensors and new host lengths:
    those arguments were placed, compared with the captured task and aliased the step
    before, and doing it again was most of a re-issue's host cost (issue #78)."""

    __slots__ = ("get_scalars", "held", "info", "keys", "qualname", "refs", "scalars", "tensors")

    def __init__(
        self, op: Any, params: dict[str, Any], info: dict[str, Any], held: dict[str, Any], refs: tuple[ArgRef, ...]
    ) -> None:
        self.qualname = op.qualname
        self.info = info  # its check's result (the device arguments' part holds for a re-issue)
        self.keys = frozenset(params)
        device = {k: _signature(v) for k, v in params.items() if k not in op.host_args}
        self.tensors = tuple((k, s) for k, s in device.items() if type(s) in (_TensorSig, _SeqSig))
        # the scalars (most of a kernel's arguments: FIA has 43) are compared in one C call
        names = tuple(k for k, s in device.items() if type(s) not in (_TensorSig, _SeqSig))
        self.get_scalars = operator.itemgetter(*names) if names else _nothing
        self.scalars = self.get_scalars(params)
        self.held, self.refs = held, refs

    def passed_again(self, params: dict[str, Any]) -> bool:
        if len(params) != len(self.keys) or not self.keys.issuperset(params):
            return False
        try:
            if self.get_scalars(params) != self.scalars:
                return False
        except (RuntimeError, ValueError):  # an argument whose == is elementwise (an array): compare it whole
            return False
        return all(s.matches(params[k]) for k, s in self.tensors)


def _nothing(params: dict[str, Any]) -> tuple[()]:
    return ()


def reissues_previous(stream: rt.Stream, op: Any, params: dict[str, Any]) -> _PreviousCall | None:
    """The group's previous update, where the op issued in ``stream``'s update session passes
    its device arguments again (the same tensor objects, where and as they lay, and equal
    scalars): every check of them passed then and holds now."""
    prev = stream._updating._group.previous
    return prev if prev is not None and prev.qualname == op.qualname and prev.passed_again(params) else None


def issue_update(
    stream: rt.Stream, op: Any, params: dict[str, Any], info: dict[str, Any], previous: _PreviousCall | None
) -> None:
    """Check the op issued inside an update against the captured one and queue the rewrite
    (``previous``: the group's previous update, whose device arguments these are,
    :func:`reissues_previous`)."""
    handle = stream._updating
    group: TaskGroup = handle._group
    task = group.task
    assert task is not None
    stream._update_ops += 1
    if stream._update_ops > 1:
        raise UpdateMismatchError(
            f"a second op ({op.qualname}) issued while updating {group!r}: an update replaces exactly one op call"
        )
    where = _UpdateOf(group)
    if op.qualname != task.op.qualname:
        raise UpdateMismatchError(
            f"{where}: the op issued ({op.qualname}) differs from the op captured "
            f"({task.op.qualname}); number and type of tasks must match"
        )
    if previous is None:
        captured = task.params
        for name, value in params.items():
            if name in op.host_args:
                continue
            was = captured.get(name)
            if value is not was or isinstance(value, (list, tuple)):  # an identical scalar (None) is the same
                _check_same(where, name, was, value)
    op.check_workspace(params, where, info)
    if previous is not None:
        held = dict(previous.held)
        for name in op.host_args:
            held[name] = params[name]
        refs = previous.refs
    else:
        held, refs = hold_params(rt.get_state().memory, op, params)
        group.previous = _PreviousCall(op, params, info, held, refs)
    st = rt.get_state()
    st.updates_in_flight[stream] += 1
    st.enqueue(stream, _TaskUpdate(group, held, refs, stream))


_ONE_UPDATER = (
    'CANN allows one updater at a time: "a task group is like a critical resource; concurrent '
    "updates from multiple threads or multiple streams are not supported, otherwise the update "
    'results are unexpected" (aclmdlRICaptureTaskUpdateBegin/End guide; sglang-omni PR #2160 saw '
    "graph_task_update_begin fail this way)."
)


def _check_same(where: object, name: str, captured: Any, given: Any) -> None:
    if isinstance(captured, torch.Tensor) or isinstance(given, torch.Tensor):
        if not (isinstance(captured, torch.Tensor) and isinstance(given, torch.Tensor)):
            raise UpdateMismatchError(
                f"{where}: argument {name!r} was {_brief(captured)} at capture, got {_brief(given)}"
            )
        # Hardware rewrites every argument, device addresses and sizes included: vllm-ascend
        # passes a fresh PA workspace every update, and its MTP draft's later steps update
        # an FIA task captured with 3 requests of 3 tokens to 9 requests of one (a block
        # table of 9 rows for 3), which its nightly serves on Ascend (DeepSeek-R1, 3 draft
        # tokens, FULL_DECODE_ONLY).  The new arguments are checked as a launch's are (the
        # op's argument check, done before, and its workspace, after).  The dtype and rank
        # pick the kernel and its layout, which the captured task keeps.
        if captured.dtype != given.dtype or captured.dim() != given.dim():
            raise UpdateMismatchError(
                f"{where}: tensor argument {name!r} was {_brief(captured)} at capture, got "
                f"{_brief(given)}; an update may pass another tensor, of other sizes, but of the "
                "captured dtype and number of dimensions (they choose the captured kernel)"
            )
        return
    if isinstance(captured, (list, tuple)) and isinstance(given, (list, tuple)):
        if len(captured) != len(given):
            raise UpdateMismatchError(
                f"{where}: argument {name!r} has {len(given)} entries, {len(captured)} at capture"
            )
        for i, (c, g) in enumerate(zip(captured, given)):
            _check_same(where, f"{name}[{i}]", c, g)
        return
    if captured != given:
        raise UpdateMismatchError(
            f"{where}: argument {name!r} was {captured!r} at capture, got {given!r}; only the "
            "host-side lengths may change in an update"
        )


def _brief(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor{list(v.shape)} {v.dtype}"
    return repr(v)
