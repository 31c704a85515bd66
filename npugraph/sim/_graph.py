"""Simulated NPU graphs: capture by recording, replay by re-execution, task groups and updates.

Capture pushes a ``TorchDispatchMode`` that records every aten op issued during the
capture instead of running it: view ops (metadata only) run at once; every other op
has its outputs shaped on meta tensors, allocated as graph-owned buffers (poisoned
with NaN so that a read before replay shows), and is re-executed in order by
``replay``.  In-place ops and ``out=`` variants are recorded against the real
tensors they mutate, so nothing (the KV cache included) changes until replay.
Reading a captured result on the host during capture raises, as on the device.
"""

from __future__ import annotations

import gc
import json
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from npugraph.sim import _runtime as rt
from npugraph.sim._memory import ArgRef, Memory, check_refs
from npugraph.sim.errors import CaptureError, RaceError, UpdateMismatchError

__all__ = ["NPUGraph", "graph", "graph_pool_handle", "NPUTaskGroupHandle"]

_aten = torch.ops.aten
_ALLOC_PACKETS = {
    _aten.empty,
    _aten.empty_strided,
    _aten.empty_like,
    _aten.new_empty,
    _aten.new_empty_strided,
}
_HOST_READ_OPS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_HOST_READ_METHODS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__array__,
}
_pool_ids = iter(range(1, 1 << 62))


def graph_pool_handle() -> tuple[int, int]:
    """Return an opaque memory-pool id that several graphs may share."""
    pid = (0, next(_pool_ids))
    rt.get_state().memory.pool(pid)
    return pid


def hold_tree(memory: Memory, name: str, v: Any, refs: list[ArgRef], *, checked: bool = True) -> Any:
    """Replace every tensor in ``v`` by a non-owning alias; note a liveness check for each.

    A graph keeps memory, not Python objects: what a node holds must not keep the
    capturing code's tensors alive.  0-d eager tensors are host scalars, passed by value.
    """
    if isinstance(v, torch.Tensor):
        if v.device.type != "cpu":
            return v
        if v.dim() == 0:
            owner = memory.owners.get(int(v.untyped_storage()._cdata))
            if owner is None or owner.pool is None:
                return v
        alias, ref = memory.hold(name, v, checked=checked)
        refs.append(ref)
        return alias
    if isinstance(v, (list, tuple)) and any(isinstance(x, (torch.Tensor, list, tuple)) for x in v):
        held = [hold_tree(memory, f"{name}[{i}]", x, refs, checked=checked) for i, x in enumerate(v)]
        return held if isinstance(v, list) else tuple(held)
    return v


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# --- graph nodes ---------------------------------------------------------------------


class _OpNode:
    __slots__ = ("args", "fresh", "func", "graph", "kwargs", "refs")

    def __init__(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        fresh: list[tuple[int, Any]],
        refs: tuple[ArgRef, ...],
        graph: NPUGraph,
    ) -> None:
        self.func, self.args, self.kwargs, self.fresh = func, args, kwargs, fresh
        self.refs, self.graph = refs, graph

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        if self.refs:
            check_refs(self.refs, f"replay of graph #{self.graph.graph_id}: aten op {self.func}")
        t0 = time.perf_counter()
        res = self.func(*self.args, **self.kwargs)
        rt.get_state().device_clock += time.perf_counter() - t0
        if not self.fresh:
            return
        outs = res if isinstance(res, (tuple, list)) else (res,)
        for i, buf in self.fresh:
            if isinstance(buf, list):
                for b, r in zip(buf, outs[i]):
                    b.copy_(r)
            else:
                buf.copy_(outs[i])

    def describe(self) -> str:
        return f"aten op {self.func}"


class KernelTask:
    """A captured launch of a simulator kernel (PA / FIA): the op and its parameters.

    ``params`` hold non-owning aliases of the tensor arguments; ``refs`` say which of
    them must still be alive when the task runs (data, not the workspace scratch).
    """

    __slots__ = ("graph", "group", "index", "op", "params", "refs")

    def __init__(self, op: Any, params: dict[str, Any], refs: tuple[ArgRef, ...], graph: NPUGraph, index: int) -> None:
        self.op, self.params, self.refs, self.graph, self.index = op, params, refs, graph, index
        self.group: TaskGroup | None = None

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        where = self.describe()
        check_refs(self.refs, where)
        self.op.execute(self.params, where=where)
        if self.group is not None:
            self.group.pending_update = False
            self.group.executions += 1

    def describe(self) -> str:
        g = f" (task group #{self.group.group_id})" if self.group else ""
        return f"{self.op.qualname} at node {self.index} of graph #{self.graph.graph_id}{g}"


class _ExtWaitNode:
    __slots__ = ("event", "group")

    def __init__(self, event: rt.ExternalEvent) -> None:
        self.event = event
        self.group: TaskGroup | None = None  # the task group that follows, if any

    def ready(self) -> bool:
        return bool(self.event._flag)

    def run(self) -> None:
        self.event._flag = 0

    def describe(self) -> str:
        return f"wait on {rt.external_event_name(self.event)}"


class _ExtRecordNode:
    __slots__ = ("event", "graph")

    def __init__(self, event: rt.ExternalEvent, graph: NPUGraph) -> None:
        self.event = event
        self.graph = graph

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        rt.fire_external_record(self.event, where=f"by a replay of {self.graph!r}")

    def describe(self) -> str:
        return f"record of {rt.external_event_name(self.event)}"


class TaskGroup:
    """The tasks of one captured op call, updatable between replays."""

    def __init__(self, graph: NPUGraph, group_id: int) -> None:
        self.graph = graph
        self.group_id = group_id
        self.task: KernelTask | None = None
        self.pending_update = False
        self.executions = 0
        self.updates = 0

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


class _GraphRun:
    """One replay of a graph, queued on a stream and executed node by node."""

    def __init__(self, g: NPUGraph) -> None:
        self.graph = g
        self.pc = 0
        self.nodes = g._nodes

    def ready(self) -> bool:
        return self.pc >= len(self.nodes) or self.nodes[self.pc].ready()

    def step(self, max_nodes: int) -> bool:
        nodes, n = self.nodes, len(self.nodes)
        try:
            # A device graph has no autograd: replay like the no-grad work it recorded.
            with torch.no_grad():
                self._run(nodes, n, max_nodes)
        except BaseException:
            self._finish()
            raise
        if self.pc >= n:
            self._finish()
            return True
        return False

    def _run(self, nodes: list[Any], n: int, max_nodes: int) -> None:
        done = 0
        while self.pc < n and done < max_nodes:
            node = nodes[self.pc]
            if not node.ready():
                return
            node.run()
            self.pc += 1
            done += 1

    def _finish(self) -> None:
        if self in self.graph._inflight:
            self.graph._inflight.remove(self)

    def describe(self) -> dict[str, Any]:
        node = self.nodes[self.pc]
        group = getattr(node, "group", None)
        text = f"replay of graph #{self.graph.graph_id} at node {self.pc}: {node.describe()}"
        if isinstance(node, _ExtWaitNode):
            text += ", which is never recorded"
            if group is not None and group.task is not None:
                text += f" (it guards task group #{group.group_id}, {group.task.op.qualname})"
        return {
            "text": text,
            "graph": self.graph,
            "event": getattr(node, "event", None),
            "task_group": group,
        }


class _TaskUpdate:
    """A parameter rewrite of one task group, landing when its stream reaches it.

    It replaces *all* of the task's arguments (device addresses included), as hardware does.
    """

    def __init__(self, group: TaskGroup, params: dict[str, Any], refs: tuple[ArgRef, ...]) -> None:
        self.group, self.params, self.refs = group, params, refs

    def ready(self) -> bool:
        return True

    def step(self, max_nodes: int) -> bool:
        g = self.group
        task = g.task
        assert task is not None
        if g.pending_update and any(r.pc <= task.index for r in g.graph._inflight):
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


# --- capture -------------------------------------------------------------------------


class _HostReadGuard(TorchFunctionMode):
    def __init__(self, session: CaptureSession) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
            self.session.check_host_read(args[0], func.__name__)
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, session: CaptureSession) -> None:
        super().__init__()
        self.session = session
        self.passthrough = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.passthrough:
            return func(*args, **kwargs)
        return self.session.record_aten(func, tuple(args), kwargs)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class CaptureSession:
    """State of one capture in progress (the simulator's ``aclmdlRICapture``)."""

    def __init__(self, g: NPUGraph, stream: rt.Stream, auto: bool) -> None:
        self.graph = g
        self.stream = stream
        self.auto = auto
        self.open_group: TaskGroup | None = None
        self.pending: set[int] = set()
        self.recorder = _Recorder(self)
        self.guard = _HostReadGuard(self)
        self.last_wait: _ExtWaitNode | None = None

    # host reads
    def check_host_read(self, t: torch.Tensor, how: str) -> None:
        if t.device.type != "meta" and _storage_key(t) in self.pending:
            raise CaptureError(
                f"operation not permitted when stream is capturing: {how}() reads a "
                f"{tuple(t.shape)} {t.dtype} tensor produced inside NPU graph capture on the "
                "host; its value only exists after replay. Move the host read out of the "
                "captured region."
            )

    def alloc(self, shape: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        """Allocate from the graph's pool; the graph keeps the memory, the caller the object."""
        memory = rt.get_state().memory
        with torch.utils._python_dispatch._disable_current_modes():
            t = memory.allocate(self.graph._pool, shape, stride, dtype)
            if t.numel():
                self.graph._blocks.add(memory.owner(t))
                self.pending.add(_storage_key(t))
        return t

    def hold(self, name: str, v: Any, refs: list[ArgRef], *, checked: bool = True) -> Any:
        with torch.utils._python_dispatch._disable_current_modes():
            return hold_tree(rt.get_state().memory, name, v, refs, checked=checked)

    def suspended(self) -> _Suspend:
        return _Suspend(self.recorder)

    def append(self, node: Any) -> None:
        if self.open_group is not None and not isinstance(node, KernelTask):
            raise CaptureError(
                f"{node.describe()} issued inside task group #{self.open_group.group_id}: a "
                "task group holds the tasks of exactly one op call"
            )
        self.graph._nodes.append(node)

    def record_external(self, event: rt.ExternalEvent, wait: bool) -> None:
        if wait:
            node = _ExtWaitNode(event)
            self.last_wait = node
            self.append(node)
        else:
            self.append(_ExtRecordNode(event, self.graph))

    def record_aten(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func in _HOST_READ_OPS:
            for a in args:
                if isinstance(a, torch.Tensor):
                    self.check_host_read(a, str(func.overloadpacket.__name__))
            return func(*args, **kwargs)
        if func.is_view:
            return func(*args, **kwargs)  # metadata only: safe to run now
        schema = func._schema
        try:
            meta_out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except Exception as exc:
            raise CaptureError(
                f"cannot capture {func}: its output shape could not be inferred without "
                f"running it ({type(exc).__name__}: {exc}). Data-dependent shapes cannot be "
                "captured in a device graph."
            ) from exc
        returns = schema.returns
        metas = meta_out if len(returns) > 1 else (meta_out,)
        if func.overloadpacket in _ALLOC_PACKETS:  # nothing to run at replay
            return self.alloc(meta_out.shape, meta_out.stride(), meta_out.dtype)
        named = _bind_args(schema, args, kwargs)
        outs: list[Any] = []
        fresh: list[tuple[int, Any]] = []
        for i, (r, m) in enumerate(zip(returns, metas)):
            if r.alias_info is not None:
                outs.append(_aliased(schema, r.alias_info, named))
            elif isinstance(m, torch.Tensor):
                buf = self.alloc(m.shape, m.stride(), m.dtype)
                outs.append(buf)
                fresh.append((i, buf))
            elif isinstance(m, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in m):
                bufs = [self.alloc(x.shape, x.stride(), x.dtype) for x in m]
                outs.append(bufs)
                fresh.append((i, bufs))
            else:
                raise CaptureError(
                    f"cannot capture {func}: it returns a host value ({type(m).__name__}) computed from device data"
                )
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                v = named.get(arg.name)
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(t, torch.Tensor):
                        self.pending.add(_storage_key(t))
        refs: list[ArgRef] = []
        node_args = self.hold("input", args, refs)
        node_kwargs = {k: self.hold(k, v, refs) for k, v in kwargs.items()}
        node_fresh = [(i, self.hold("output", b, [])) for i, b in fresh]
        self.append(_OpNode(func, node_args, node_kwargs, node_fresh, tuple(refs), self.graph))
        return outs[0] if len(returns) == 1 else tuple(outs)

    def record_kernel(self, op: Any, params: dict[str, Any]) -> KernelTask:
        held, refs = hold_params(op, params)
        task = KernelTask(op, held, refs, self.graph, len(self.graph._nodes))
        group = self.open_group
        if group is not None:
            if group.task is not None:
                raise CaptureError(
                    f"a second op ({op.qualname}) issued inside task group "
                    f"#{group.group_id}, which already holds {group.task.op.qualname}: a "
                    "task group holds the tasks of exactly one op call"
                )
            group.task = task
            task.group = group
            if self.last_wait is not None and self.graph._nodes[-1] is self.last_wait:
                self.last_wait.group = group
        self.graph._nodes.append(task)
        for name in op.output_args:
            v = params.get(name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    self.pending.add(_storage_key(t))
        return task


class _Suspend:
    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> None:
        self.recorder.passthrough += 1

    def __exit__(self, *exc: object) -> None:
        self.recorder.passthrough -= 1


def _bind_args(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    named: dict[str, Any] = {}
    for a, v in zip(schema.arguments, args):
        named[a.name] = v
    named.update(kwargs)
    return named


def _aliased(schema: Any, alias: Any, named: dict[str, Any]) -> Any:
    for arg in schema.arguments:
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            return named[arg.name]
    raise CaptureError(f"cannot resolve the aliased output of {schema.name}")


# --- the graph -----------------------------------------------------------------------


class NPUGraph:
    """A captured sequence of device work that ``replay`` re-issues as one unit.

    Lifecycle: ``capture_begin`` (or the :class:`graph` context manager) → ops are
    recorded, not run → ``capture_end`` → any number of ``replay`` calls, each
    asynchronous on the current stream → ``reset`` frees the capture so that the
    instance can capture again.
    """

    def __init__(self) -> None:
        self.graph_id = rt._new_id()
        self._reset_state()

    def _reset_state(self) -> None:
        self._captured = False
        self._capturing = False
        self._nodes: list[Any] = []
        self._blocks: set[Any] = set()  # pool blocks this graph allocated (it keeps the memory)
        self._pool: tuple[int, int] = (0, 0)
        self._groups: list[TaskGroup] = []
        self._inflight: list[_GraphRun] = []
        self._auto: bool = False
        self._auto_records: list[dict[str, Any]] = []
        self._capture_stream: rt.Stream | None = None
        self._session: CaptureSession | None = None

    def __repr__(self) -> str:
        return f"<sim.npu.NPUGraph #{self.graph_id}>"

    def capture_begin(
        self,
        pool: tuple[int, int] | None = None,
        capture_error_mode: str = "global",
        *,
        auto_dispatch_capture: bool = False,
    ) -> None:
        """Begin recording the current stream's work into this graph."""
        st = rt.get_state()
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(
                f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got {capture_error_mode}"
            )
        if self._captured or self._capturing:
            raise RuntimeError(
                "This NPUGraph instance already owns a captured graph. To capture a new graph, create a new instance."
            )
        stream = st.current_stream
        if stream._is_default:
            raise RuntimeError(
                "NPU graphs must be captured on a non-default stream. (However, after "
                "capture, it's ok to replay them on the default stream.)"
            )
        if st.capture is not None:
            raise CaptureError(f"{st.capture.graph!r} is already capturing; captures do not nest")
        if pool is None:
            pool = graph_pool_handle()
        st.memory.pool(pool)
        self._pool = pool
        self._capture_stream = stream
        self._capturing = True
        self._auto = auto_dispatch_capture
        session = CaptureSession(self, stream, auto_dispatch_capture)
        self._session = session
        st.capture = session
        session.guard.__enter__()
        session.recorder.__enter__()

    def capture_end(self) -> None:
        """Finish recording; the graph can be replayed from now on."""
        st = rt.get_state()
        session = self._session
        if session is None or st.capture is not session:
            raise RuntimeError("capture_end called without a matching capture_begin")
        if st.current_stream is not session.stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        session.recorder.__exit__(None, None, None)
        session.guard.__exit__(None, None, None)
        st.capture = None
        self._session = None
        self._capturing = False
        if session.open_group is not None:
            raise CaptureError(
                f"capture ended with task group #{session.open_group.group_id} still open: "
                "call graph_task_group_end first"
            )
        self._captured = True

    def replay(self) -> None:
        """Enqueue the whole captured graph on the current stream and return at once."""
        if not self._captured:
            raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
        st = rt.get_state()
        st.charge("replay")
        run = _GraphRun(self)
        self._inflight.append(run)
        st.enqueue(st.current_stream, run)

    def reset(self) -> None:
        """Free the captured graph so that this instance can capture again."""
        st = rt.get_state()
        if self._session is not None and st.capture is self._session:
            self._session.recorder.__exit__(None, None, None)
            self._session.guard.__exit__(None, None, None)
            st.capture = None
        self._reset_state()

    def pool(self) -> tuple[int, int]:
        """Return the id of the memory pool this graph allocated from."""
        if not self._captured:
            raise RuntimeError("Called NPUGraph::pool without a preceding successful capture.")
        return self._pool

    def enable_debug_mode(self) -> None:
        """Accepted for compatibility; the simulator always keeps its debug records."""

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """Update every auto-dispatch-captured op's host arguments (one dict per op)."""
        from npugraph.sim._ops import auto_update

        auto_update(self, cpu_update_input)

    def debug_dump(self, debug_path: str) -> None:
        """Write a JSON description of the captured graph to ``debug_path``."""
        if not self._captured:
            warnings.warn("NPUGraph::debug_dump: no captured graph to dump", stacklevel=2)
            return
        nodes = []
        for i, n in enumerate(self._nodes):
            entry: dict[str, Any] = {"index": i, "kind": type(n).__name__.lstrip("_")}
            if isinstance(n, _OpNode):
                entry["op"] = str(n.func)
            elif isinstance(n, KernelTask):
                entry["op"] = n.op.qualname
                entry["task_group"] = n.group.group_id if n.group else None
                if n.group is not None:
                    entry["updates"] = n.group.updates
                    entry["executions"] = n.group.executions
                entry["host_args"] = {k: _jsonable(n.params.get(k)) for k in n.op.host_args}
            else:
                entry["event"] = n.event.event_id
            nodes.append(entry)
        doc = {"graph": self.graph_id, "pool": list(self._pool), "nodes": nodes}
        with open(debug_path, "w") as f:
            json.dump(doc, f, indent=1)


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, tuple):
        return list(v)
    return v


class graph:
    """Context manager that captures the work of its body into ``npu_graph``.

    Entering synchronizes the device and makes the capture stream current
    (``stream``, default: one class-level side stream shared by all captures, as
    in torch, so that graphs sharing a pool are captured on one stream).
    """

    default_capture_stream: rt.Stream | None = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: tuple[int, int] | None = None,
        stream: rt.Stream | None = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if stream is None:
            cls = self.__class__
            if cls.default_capture_stream is None or (cls.default_capture_stream._state is not rt.get_state()):
                cls.default_capture_stream = rt.Stream()
            stream = cls.default_capture_stream
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_stream = stream
        self.auto_dispatch_capture = auto_dispatch_capture
        self.capture_error_mode = capture_error_mode
        self._ctx = rt.use_stream(stream)

    def __enter__(self) -> None:
        st = rt.get_state()
        st.charge("synchronize")
        st.drain("entering torch.npu.graph (which synchronizes the device)")
        gc.collect()
        self._ctx.__enter__()
        try:
            self.npu_graph.capture_begin(
                self.pool,
                self.capture_error_mode,
                auto_dispatch_capture=self.auto_dispatch_capture,
            )
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self.npu_graph.capture_end()
            else:
                self.npu_graph.reset()
        finally:
            self._ctx.__exit__(None, None, None)


# --- task groups ---------------------------------------------------------------------


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
    stream._updating = handle
    stream._update_ops = 0


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
    if stream._update_ops != 1:
        raise UpdateMismatchError(
            f"graph_task_update_end: {stream._update_ops} ops were issued to update "
            f"{handle._group!r}; exactly one (the captured op) must be"
        )


def issue_update(stream: rt.Stream, op: Any, params: dict[str, Any], info: dict[str, Any]) -> None:
    """Check the op issued inside an update against the captured one and queue the rewrite."""
    handle = stream._updating
    group: TaskGroup = handle._group
    task = group.task
    assert task is not None
    stream._update_ops += 1
    if stream._update_ops > 1:
        raise UpdateMismatchError(
            f"a second op ({op.qualname}) issued while updating {group!r}: an update replaces exactly one op call"
        )
    where = f"update of {group!r}"
    if op.qualname != task.op.qualname:
        raise UpdateMismatchError(
            f"{where}: the op issued ({op.qualname}) differs from the op captured "
            f"({task.op.qualname}); number and type of tasks must match"
        )
    for name, value in params.items():
        if name in op.host_args:
            continue
        _check_same(where, name, task.params.get(name), value)
    op.check_workspace(params, where, info)
    held, refs = hold_params(op, params)
    rt.get_state().enqueue(stream, _TaskUpdate(group, held, refs))


def hold_params(op: Any, params: dict[str, Any]) -> tuple[dict[str, Any], tuple[ArgRef, ...]]:
    """A kernel's parameters as a graph keeps them: aliases, and checks for data arguments."""
    memory = rt.get_state().memory
    refs: list[ArgRef] = []
    with torch.utils._python_dispatch._disable_current_modes():
        held = {
            k: v if k in op.host_args else hold_tree(memory, k, v, refs, checked=k != "workspace")
            for k, v in params.items()
        }
    return held, tuple(refs)


def _check_same(where: str, name: str, captured: Any, given: Any) -> None:
    if isinstance(captured, torch.Tensor) or isinstance(given, torch.Tensor):
        if not (isinstance(captured, torch.Tensor) and isinstance(given, torch.Tensor)):
            raise UpdateMismatchError(
                f"{where}: argument {name!r} was {_brief(captured)} at capture, got {_brief(given)}"
            )
        # Hardware rewrites device addresses too (vllm-ascend passes a fresh PA
        # workspace every update); shape and dtype must stay as captured.
        if captured.shape != given.shape or captured.dtype != given.dtype:
            if name == "workspace" and captured.dtype == given.dtype and captured.dim() == given.dim() == 1:
                return  # sized for these lengths: checked against what the kernel needs
            raise UpdateMismatchError(
                f"{where}: tensor argument {name!r} was {_brief(captured)} at capture, got "
                f"{_brief(given)}; an update may pass another tensor, but of the captured shape and dtype"
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


def make_host_copy(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` outside the capture recorder (host-side work of an op entry point)."""
    st = rt.get_state()
    if st.capture is None:
        return fn()
    with st.capture.suspended():
        return fn()
