"""``torch.npu``-shaped API of the simulated device (streams, events, graphs, task groups)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from npugraph.sim import _runtime as rt
from npugraph.sim._graph import NPUGraph, graph, graph_pool_handle
from npugraph.sim._runtime import Event, ExternalEvent, Stream
from npugraph.sim._taskgroups import (
    NPUTaskGroupHandle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)

__all__ = [
    "NPUGraph",
    "NPUTaskGroupHandle",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "Event",
    "ExternalEvent",
    "Stream",
    "current_stream",
    "default_stream",
    "stream",
    "synchronize",
    "set_device",
    "current_device",
    "device_count",
    "is_available",
    "is_current_stream_capturing",
    "empty_cache",
]


def current_stream(device: Any = None) -> Stream:
    """Return the stream that work is issued on now."""
    return rt.get_state().current_stream


def default_stream(device: Any = None) -> Stream:
    """Return the device's default (legacy) stream."""
    return rt.get_state().default_stream


@contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Issue the body's work on ``s``."""
    with rt.use_stream(s):
        yield


@rt.locked
def synchronize(device: Any = None) -> None:
    """Wait for all queued work; raises :class:`~npugraph.sim.DeadlockError` if it cannot finish."""
    st = rt.get_state()
    st.charge("synchronize")
    st.drain("torch.npu.synchronize()")


def set_device(device: Any) -> None:
    """Select the device (the simulator has one: ``npu:0``)."""
    idx = device if isinstance(device, int) else int(str(device).rpartition(":")[2] or 0)
    if idx != 0:
        raise RuntimeError(f"invalid device ordinal {idx}: the simulator has one device (0)")
    rt.get_state().device_index = idx


def current_device() -> int:
    return rt.get_state().device_index


def device_count() -> int:
    return 1


def is_available() -> bool:
    return True


def is_current_stream_capturing() -> bool:
    """True while the current stream is capturing a graph."""
    st = rt.get_state()
    return st.capture is not None and st.capture.stream is st.current_stream


def empty_cache() -> None:
    """Release cached free memory (the simulator caches none: a no-op).

    Graph pools are not affected, as on hardware.
    """
