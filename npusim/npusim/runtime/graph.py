"""Simulated NPU graphs: capture, replay by re-execution, memory pools.

See :mod:`npusim.runtime.capture` for how work is recorded, :mod:`npusim.runtime.nodes`
for what a graph is made of, :mod:`npusim.runtime.taskgroups` for task groups and updates.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch

from npusim.errors import CaptureError
from npusim.runtime import state as rt
from npusim.runtime.capture import CaptureSession
from npusim.runtime.nodes import GraphRun, KernelTask, OpNode
from npusim.runtime.taskgroups import TaskGroup

__all__ = ["_NPUGraph", "graph_pool_handle"]


_pool_ids = iter(range(1, 1 << 62))


def graph_pool_handle() -> tuple[int, int]:
    """Return an opaque memory-pool id that several graphs may share."""
    pid = (0, next(_pool_ids))
    rt.get_state().memory.pool(pid)
    return pid


class _NPUGraph:
    """A captured sequence of device work that ``replay`` re-issues as one unit: what
    ``torch_npu._C._NPUGraph`` is (torch_npu's Python ``NPUGraph``, with its dispatch mode
    and ``update``, is :class:`npusim.surfaces.graphs.NPUGraph`).

    Lifecycle: ``capture_begin`` (or the :class:`graph` context manager) → ops are
    recorded, not run → ``capture_end`` → any number of ``replay`` calls, each
    asynchronous on the current stream → ``reset`` frees the capture so that the
    instance can capture again.
    """

    def __init__(self) -> None:
        self.graph_id = rt._new_id()
        self.label: str | None = None  # simulator-only: its capturer's name for it, in error messages
        self._reset_state()

    def _reset_state(self) -> None:
        self._captured = False
        self._capturing = False
        self._nodes: list[Any] = []
        self._blocks: set[Any] = set()  # pool blocks this graph allocated (it keeps the memory)
        self._pool: tuple[int, int] = (0, 0)
        self._groups: list[TaskGroup] = []
        self._inflight: list[GraphRun] = []
        self._capture_stream: rt.Stream | None = None
        self._session: CaptureSession | None = None

    def __repr__(self) -> str:
        return f"<sim.npu.NPUGraph #{self.graph_id}" + (f" [{self.label}]>" if self.label else ">")

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global") -> None:
        """Begin recording the current stream's work into this graph.

        torch_npu's signature: subclasses override it as ``capture_begin(self, pool=None,
        capture_error_mode="global")``.
        """
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
        elif not (isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool)):
            # torch_npu's binding takes a MempoolId_t (two integers) or None
            raise TypeError(
                f"capture_begin(): incompatible function arguments: pool must be None or a pool id "
                f"(graph_pool_handle(), or another graph's pool()), got {pool!r}"
            )
        st.memory.pool(pool)
        self._pool = pool
        self._capture_stream = stream
        self._capturing = True
        session = CaptureSession(self, stream)
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
            self._reset_state()
            raise CaptureError(
                f"capture ended with task group #{session.open_group.group_id} still open: "
                "call graph_task_group_end first"
            )
        self._captured = True

    @rt.locked
    def replay(self) -> None:
        """Enqueue the whole captured graph on the current stream and return at once."""
        if not self._captured:
            raise RuntimeError("Called NPUGraph::replay without a preceding successful capture.")
        st = rt.get_state()
        st.charge("replay")
        run = GraphRun(self)
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

    def debug_dump(self, debug_path: str) -> None:
        """Write a JSON description of the captured graph to ``debug_path``."""
        if not self._captured:
            warnings.warn("NPUGraph::debug_dump: no captured graph to dump", stacklevel=2)
            return
        nodes = []
        for i, n in enumerate(self._nodes):
            entry: dict[str, Any] = {"index": i, "kind": type(n).__name__.lstrip("_")}
            if isinstance(n, OpNode):
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
