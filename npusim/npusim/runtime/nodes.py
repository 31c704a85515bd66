"""The nodes a captured graph is made of, and one replay of it (run node by node)."""

from __future__ import annotations

import time
from typing import Any

import torch

from npusim.device.backend import on_host
from npusim.errors import ReplayFault
from npusim.runtime import state as rt
from npusim.runtime.aten import run_planned
from npusim.runtime.external import ExternalEvent, external_event_name, fire_external_record
from npusim.runtime.memory import ArgRef, check_refs

__all__ = ["CollectiveNode", "OpNode", "KernelTask", "ExtWaitNode", "ExtRecordNode", "GraphRun", "storage_key"]


def graph_name(graph: Any) -> str:
    """``graph #N``, with the label its capturer gave it (simulator-only, for error messages)."""
    label = getattr(graph, "label", None)
    return f"graph #{graph.graph_id}" + (f" [{label}]" if label else "")


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class OpNode:
    __slots__ = ("args", "fresh", "func", "graph", "kwargs", "on_host", "refs")

    def __init__(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        fresh: list[tuple[int, Any]],
        refs: tuple[ArgRef, ...],
        graph: Any,
    ) -> None:
        self.func, self.args, self.kwargs, self.fresh = func, args, kwargs, fresh
        self.refs, self.graph = refs, graph
        # what a replay runs: the same op on CPU views of the same memory (made once), without
        # the npu backend's per-op fallback at every replay
        self.on_host = (on_host(args), on_host(kwargs), on_host(fresh))

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        if self.refs:
            check_refs(self.refs, f"replay of {graph_name(self.graph)}: aten op {self.func}")
        t0 = time.perf_counter()
        run_planned(self.func, *self.on_host)
        rt.get_state().device_clock += time.perf_counter() - t0

    def describe(self) -> str:
        return f"aten op {self.func}"


class KernelTask:
    """A captured launch of a simulator kernel (PA / FIA): the op and its parameters.

    ``params`` hold non-owning aliases of the tensor arguments; ``refs`` say which of
    them must still be alive when the task runs (data, not the workspace scratch).
    """

    __slots__ = ("graph", "group", "index", "op", "params", "refs")

    def __init__(self, op: Any, params: dict[str, Any], refs: tuple[ArgRef, ...], graph: Any, index: int) -> None:
        self.op, self.params, self.refs, self.graph, self.index = op, params, refs, graph, index
        self.group: Any | None = None

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        where = self.describe()
        check_refs(self.refs, where)
        rt.get_state().injected.replayed_kernel(self.op.name, where)
        try:
            self.op.execute(self.params, where=where)
        except ValueError as exc:  # a kernel's own argument check: say which node of which graph
            raise ValueError(f"{str(exc).rstrip('.')} (in {where})") from exc
        if self.group is not None:
            self.group.pending_update = False
            self.group.executions += 1

    def describe(self) -> str:
        group = self.group
        g = ""
        if group is not None:
            g = f" (task group #{group.group_id}" + (f" [{group.label}])" if group.label else ")")
        return f"{self.op.qualname} at node {self.index} of {graph_name(self.graph)}{g}"


class CollectiveNode:
    """A captured collective (``hccl``): each replay runs it again, meeting the other ranks'
    replays of theirs, as HCCL's tasks in an ACL graph do.  ``call`` issues it on CPU views
    of the captured tensors' memory (taken at capture: a graph's addresses do not move)."""

    __slots__ = ("call", "graph", "name", "refs")

    def __init__(self, name: str, call: Any, graph: Any, refs: tuple[ArgRef, ...]) -> None:
        self.name, self.call, self.graph, self.refs = name, call, graph, refs

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        if self.refs:
            check_refs(self.refs, f"replay of {graph_name(self.graph)}: hccl {self.name}")
        t0 = time.perf_counter()
        self.call().wait()
        rt.get_state().device_clock += time.perf_counter() - t0

    def describe(self) -> str:
        return f"hccl {self.name}"


class ExtWaitNode:
    __slots__ = ("event", "group")

    def __init__(self, event: ExternalEvent) -> None:
        self.event = event
        self.group: Any | None = None  # the task group that follows, if any

    def ready(self) -> bool:
        return bool(self.event._flag)

    def run(self) -> None:
        self.event._flag = 0

    def describe(self) -> str:
        return f"wait on {external_event_name(self.event)}"


class ExtRecordNode:
    __slots__ = ("event", "graph")

    def __init__(self, event: ExternalEvent, graph: Any) -> None:
        self.event = event
        self.graph = graph

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        fire_external_record(self.event, where=f"by a replay of {self.graph!r}")

    def describe(self) -> str:
        return f"record of {external_event_name(self.event)}"


class GraphRun:
    """One replay of a graph, queued on a stream and executed node by node."""

    def __init__(self, g: Any) -> None:
        self.graph = g
        self.pc = 0
        self.nodes = g._nodes

    def ready(self) -> bool:
        return self.pc >= len(self.nodes) or self.nodes[self.pc].ready()

    def step(self, max_nodes: int) -> bool:
        nodes, n = self.nodes, len(self.nodes)
        if self.pc == 0:
            # nodes compute on CPU views taken at capture, past the device's own guard
            # (npu_device.cpp): in a forked child, one OpenMP thread
            torch.ops.npugraph_sim.one_thread_if_forked()
        try:
            # A device graph has no autograd: replay like the no-grad work it recorded.
            with torch.no_grad():
                self._run(nodes, n, max_nodes)
        except Exception as exc:
            # The device cancels the rest of this replay and reports the fault at the next
            # synchronize (the replay was asynchronous); the stream goes on.
            rt.get_state().faults.append(self._fault(exc))
            self._finish()
            return True
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

    def _fault(self, exc: Exception) -> ReplayFault:
        node = self.nodes[self.pc]
        group = getattr(node, "group", None)
        skipped = tuple(w.event for w in self.nodes[self.pc + 1 :] if isinstance(w, ExtWaitNode))
        if isinstance(node, ExtWaitNode):
            skipped = (node.event, *skipped)
        fault = ReplayFault(
            f"replay of {graph_name(self.graph)} failed at node {self.pc} ({node.describe()}); the rest of "
            f"the replay was cancelled: {type(exc).__name__}: {exc}",
            graph=self.graph,
            node=self.pc,
            task_group=group,
            waits_skipped=skipped,
        )
        fault.__cause__ = exc
        return fault

    def _finish(self) -> None:
        if self in self.graph._inflight:
            self.graph._inflight.remove(self)

    def describe(self) -> dict[str, Any]:
        node = self.nodes[self.pc]
        group = getattr(node, "group", None)
        text = f"replay of {graph_name(self.graph)} at node {self.pc}: {node.describe()}"
        if isinstance(node, ExtWaitNode):
            text += ", which is never recorded"
            if group is not None and group.task is not None:
                text += f" (it guards task group #{group.group_id}, {group.task.op.qualname})"
        return {
            "text": text,
            "graph": self.graph,
            "event": getattr(node, "event", None),
            "task_group": group,
        }
