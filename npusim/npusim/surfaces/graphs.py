"""torch_npu's ``NPUGraph`` and ``torch.npu.graph`` (``torch_npu/npu/graphs.py``), on the simulator.

:class:`NPUGraph` is torch_npu's Python graph over the runtime's graph
(:class:`~npusim.runtime.graph._NPUGraph`, what ``torch_npu._C._NPUGraph`` is): it adds
the graph dispatch mode and ``update``.  Captured with ``auto_dispatch_capture=True``, each
op a registered handler knows (:mod:`.npugraph_handlers`) is captured behind an
``ExternalEvent`` wait and reset, in a task group of its own, and remembered as a
:class:`_GraphDispatchRecord` (device tensors as non-owning aliases, anything else copied);
``update(cpu_update_input)`` rewrites each record's arguments, re-issues its op inside
``graph_task_update_begin/end`` on the one update stream every graph shares, and records
its event, so that the next replay runs with the new values.  Same names, order of calls,
errors and messages as torch_npu v26.1 (Ascend/pytorch).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from torch.utils._python_dispatch import TorchDispatchMode

from npusim.runtime import state as rt
from npusim.runtime.external import ExternalEvent
from npusim.runtime.graph import _NPUGraph
from npusim.runtime.taskgroups import (
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)
from npusim.surfaces import npugraph_utils
from npusim.surfaces.npugraph_handlers.npugraph_handler import _NPU_GRAPH_OP_HANDLERS, kept
from npusim.surfaces.streams import StreamContext

__all__ = ["NPUGraph", "graph"]

logger = logging.getLogger(__name__)

# torch_npu's errors end with its error-code text (pta_error(ErrCode.PARAM))
_PARAM_ERROR = "\n[ERROR] ERR00001 PTA invalid parameter"


@dataclasses.dataclass
class _GraphDispatchRecord:
    """One op captured through the dispatch mode: its event, task group, arguments and the
    overload captured (``.out`` where the handler swapped it)."""

    event: Any = None
    handle: Any = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    args: Any = dataclasses.field(default_factory=tuple)
    op_cache_entry: Any = None


class _GraphDispatchMode(TorchDispatchMode):
    """The dispatch mode ``auto_dispatch_capture`` enters: it captures each handled op with
    its event and task group, and keeps the records ``update`` rewrites.  Every graph's
    mode shares one update stream (a class attribute, as torch_npu's)."""

    tensor_schema_name: ClassVar[dict[str, list[str]]] = {}
    update_stream: ClassVar[Any] = None
    # the simulator's kernels are Python entry points, not torch ops: this asks them to come
    # here first, as torch ops do (npusim.runtime.launch.SimOverload)
    dispatches_sim_ops = True

    def __new__(cls, *args: Any, **kwargs: Any) -> _GraphDispatchMode:
        stream = cls.update_stream
        if stream is None or stream._state is not rt.get_state():  # the device was reset since
            cls.update_stream = rt.Stream()
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        self.graph_dispatch_records: list[_GraphDispatchRecord] = []

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    @classmethod
    def update_schema(cls, name: str, schema: str) -> None:
        if name not in cls.tensor_schema_name:
            cls.tensor_schema_name[name] = re.findall(r"Tensor(?:\(a!\)|\?)?\s+(\w+)", schema)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _NPU_GRAPH_OP_HANDLERS.get(func.__name__)
        if handler is None:
            return func(*args, **kwargs)
        should_handle = getattr(handler, "should_handle", None)
        if should_handle is not None and not should_handle(func, args, kwargs):
            return func(*args, **kwargs)
        stream = rt.get_state().current_stream
        event = ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        func, args, kwargs = handler.prepare_capture(func, args, kwargs)
        self.update_schema(str(func.__name__), str(func._schema))
        graph_task_group_begin(stream)
        result = func(*args, **kwargs)
        handle = graph_task_group_end(stream)
        self.graph_dispatch_records.append(self._append_dispatch_record(event, handle, args, kwargs, func, handler))
        return handler.postprocess_result(result, kwargs)

    def _append_dispatch_record(
        self, event: Any, handle: Any, args: Any, kwargs: dict[str, Any], func: Any, handler: Any
    ) -> _GraphDispatchRecord:
        names = self.tensor_schema_name.get(func.__name__, [])
        return _GraphDispatchRecord(
            event=event,
            handle=handle,
            kwargs={k: handler.record_wrap_kwarg(k, v, names) for k, v in kwargs.items()},
            args=[kept(a) for a in args],
            op_cache_entry=func,
        )

    def update_capture_record(self, cpu_update_input: list[dict[str, Any]]) -> None:
        update_records(self.graph_dispatch_records, cpu_update_input, self.update_stream)


def update_records(
    records: list[_GraphDispatchRecord],
    cpu_update_input: list[dict[str, Any]],
    update_stream: Any,
    *,
    begin: Callable[[Any, Any], None] = graph_task_update_begin,
    end: Callable[[Any], None] = graph_task_update_end,
    on_stream: Callable[[Any], AbstractContextManager[Any]] = StreamContext,
) -> None:
    """torch_npu's ``update_capture_record`` over ``records``: one input dict is copied per
    record; then per record, on ``update_stream``: begin, the generic rewrite of the record's
    keyword arguments, its handler's spec rewrite, the op re-issued with the record's
    arguments, end, the record's event.  ``begin``/``end``/``on_stream``: the device API
    (the simulator's; ``npugraph bench`` passes its recording device's)."""
    if len(cpu_update_input) == 1:
        cpu_update_input = [cpu_update_input[0].copy() for _ in records]
    if len(cpu_update_input) != len(records):
        raise RuntimeError(
            f"Currently, there are {len(records)} operators that need to be updated by capture, and there "
            f"are only {len(cpu_update_input)} elements in the incoming cpu_update_input list",
            _PARAM_ERROR,
        )
    with on_stream(update_stream):
        for record, update_input in zip(records, cpu_update_input):
            begin(update_stream, record.handle)
            for key in update_input:
                if key in record.kwargs:
                    record.kwargs[key] = update_input[key]
            name = record.op_cache_entry.__name__
            handler = _NPU_GRAPH_OP_HANDLERS.get(name)
            if handler is None:
                raise RuntimeError(
                    f"No handler for recorded op: {name}. This indicates the handler was unregistered "
                    "between capture and update.",
                    _PARAM_ERROR,
                )
            handler.update_args(record, update_input)
            record.op_cache_entry(*record.args, **record.kwargs)
            end(update_stream)
            record.event.record(update_stream)


class NPUGraph(_NPUGraph):
    """torch_npu's ``torch.npu.NPUGraph``: the runtime's graph, with the dispatch mode that
    ``auto_dispatch_capture`` enters and ``update``."""

    def __init__(self) -> None:
        self.graph_dispatch_mode = _GraphDispatchMode()
        # set by the graph context manager (in its constructor), as torch_npu does
        self.auto_dispatch_capture = False
        super().__init__()

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """Rewrite the arguments of every op captured through the dispatch mode: one dict
        per op, or one for all; keys an op does not have are ignored."""
        if not self.auto_dispatch_capture:
            raise RuntimeError(
                "The current graph configuration does not support update,Try to capture by setting "
                "auto_dispatch_capture=True during capture",
                _PARAM_ERROR,
            )
        self.graph_dispatch_mode.update_capture_record(cpu_update_input)

    def debug_dump(self, debug_path: str) -> None:
        """Dump the captured graph to ``debug_path`` and, where that wrote the file, its
        aligned form beside it (``<stem>.aligned.json``); an alignment that fails is logged
        and the dump kept, as torch_npu does."""
        before = _stat(debug_path)
        result = super().debug_dump(debug_path)
        after = _stat(debug_path)
        if after is None or after == before:
            return result
        try:
            npugraph_utils.align_trace_json(debug_path, None)
        except Exception as exc:  # the aligned file is derived data: never a reason to fail
            logger.warning("NPUGraph.debug_dump: aligning %s failed: %s", debug_path, exc)
        return result


def _stat(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class graph:
    """Context manager that captures the work of its body into ``npu_graph``.

    Entering synchronizes the device and makes the capture stream current
    (``stream``, default: one class-level side stream shared by all captures, as
    in torch, so that graphs sharing a pool are captured on one stream).  As torch_npu's,
    it sets ``npu_graph.auto_dispatch_capture`` (in its constructor), calls
    ``npu_graph.capture_begin(*pool, capture_error_mode=...)`` with the graph's dispatch
    mode entered when ``auto_dispatch_capture``, and on exit calls ``capture_end()`` whether
    or not the body raised (reset the graph after a failure).

    The dispatch mode sits above the simulator's capture recorder (itself a dispatch mode,
    where a device captures below torch), so it is entered after ``capture_begin`` and left
    before ``capture_end``: what it issues (workspaces, the ``.out`` op) is then recorded
    into the graph, as on a device.
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
        self.pool: tuple[Any, ...] = () if pool is None else (pool,)
        self.capture_stream = stream
        self.capture_error_mode = capture_error_mode
        self._ctx = StreamContext(stream)
        self._auto = auto_dispatch_capture
        self._mode: Any = None
        npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self) -> None:
        st = rt.get_state()
        st.charge("synchronize")
        st.drain("entering torch.npu.graph (which synchronizes the device)")
        gc.collect()
        self._ctx.__enter__()
        try:
            self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)  # type: ignore[misc]
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise
        self._mode = getattr(self.npu_graph, "graph_dispatch_mode", None) if self._auto else None
        if self._mode is not None:
            self._mode.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(exc_type, exc, tb)
            self.npu_graph.capture_end()
        except Exception:
            if exc_type is None:
                raise
            # the body's error is the one to see (ending the capture still happened)
        finally:
            self._ctx.__exit__(None, None, None)
