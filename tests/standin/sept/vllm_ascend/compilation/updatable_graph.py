"""Stand-in of vllm_ascend/compilation/updatable_graph.py (Sept 2026, PRs #15908/#16798):
UpdatableGraph, register_task, get_capture_resource, ContextSource and the active-graph
ContextVar, with their names and signatures; bodies of our own."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch
import torch_npu

_ACTIVE_GRAPH: ContextVar[UpdatableGraph | None] = ContextVar("capturing_updatable_graph", default=None)


@dataclass(frozen=True)
class ContextSource:
    context: object

    def get(self, provider, _index):
        return provider.resolve(self.context)


@dataclass
class GraphUpdateTask:
    operation: object
    kwargs: dict
    provider: object
    handle: object
    event: object

    def bind(self, params):
        return replace(self, kwargs={**self.kwargs, **params})

    def apply(self, update_stream):
        torch.npu.graph_task_update_begin(update_stream, self.handle)
        self.operation(**self.kwargs)
        torch.npu.graph_task_update_end(update_stream)
        self.event.record(update_stream)


class UpdatableGraph(torch.npu.NPUGraph):
    def __init__(self):
        super().__init__()
        self.tasks = []
        self.capture_resources = {}
        self.capture_token = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        self.capture_token = _ACTIVE_GRAPH.set(self)

    def capture_end(self):
        try:
            super().capture_end()
        finally:
            _ACTIVE_GRAPH.reset(self.capture_token)
            self.capture_token = None

    def get_capture_resource(self, key, factory, use_max_workspace=False):
        if key not in self.capture_resources:
            self.capture_resources[key] = factory()
        return self.capture_resources[key]

    def register_task(self, operation, kwargs, provider):
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        operation(**kwargs)
        handle = torch.npu.graph_task_group_end(stream)
        self.tasks.append(GraphUpdateTask(operation, dict(kwargs), provider, handle, event))

    def resolve_tasks(self, source):
        return tuple(task.bind(source.get(task.provider, i)) for i, task in enumerate(self.tasks))

    def update(self, update_stream, resolved_tasks):
        with torch.npu.stream(update_stream):
            for task in resolved_tasks:
                if task.operation == torch_npu._npu_paged_attention:
                    ws = dict(task.kwargs)
                    ws.pop("workspace", None)
                    task.kwargs["workspace"] = torch_npu._npu_paged_attention_get_workspace(**ws)
                task.apply(update_stream)


def register_task(operation, kwargs, provider):
    graph = _ACTIVE_GRAPH.get()
    if graph is None:
        operation(**kwargs)
    else:
        graph.register_task(operation, kwargs, provider)


def get_capture_resource(key, factory, use_max_workspace=False):
    graph = _ACTIVE_GRAPH.get()
    if graph is None:
        return factory()
    return graph.get_capture_resource(key, factory, use_max_workspace)
