"""The records of one capture in progress, and what a task keeps of its arguments.

:class:`Request` is what :meth:`~npugraph.capture.CaptureManager.capture` was asked, the same
for every try; :class:`How` how one try captures; :class:`Capture` the state of the try in
progress.  A task keeps its tensor arguments, and a graph its outputs, as non-owning aliases
(:func:`alias`, :func:`alias_tree`): the graph's pool and the model own the memory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from npugraph.capture.events import EventSchedule
from npugraph.capture.records import TaskRecord
from npugraph.capture.sink import SinkCapture
from npugraph.device import Device
from npugraph.ops import AttentionCall, OpSpec
from npugraph.policy import KernelChoice

__all__ = [
    "MOST_TRIES",
    "Capture",
    "How",
    "Request",
    "alias",
    "alias_tree",
    "batch_of",
    "call_shape",
    "collector_walks_only_new",
    "host_tuple",
]


@attrs.frozen
class How:
    """How a capture tries: its event schedule, why the tiling-sink path is refused (empty:
    it is not), and the room its device lengths get (None: the namespace's default)."""

    schedule: EventSchedule | None
    sink_refusal: str = ""
    lens_room: tuple[int, int] | None = None


# A bound, not a count: each reason to try again (CaptureManager._try_capture's list) is settled by the
# next try, and only the lengths' room can come back, once, after the task count's.
MOST_TRIES = 8


@attrs.define
class Capture:
    """State of the one capture in progress."""

    namespace: str
    key: Hashable
    tokens: int
    choices: dict[tuple[Any, ...], tuple[OpSpec, KernelChoice]] = attrs.field(factory=dict)
    needs: dict[tuple[Any, ...], int] = attrs.field(factory=dict)
    workspace: torch.Tensor | None = None  # allocated inside the capture: the graph's pool owns it
    tasks: list[TaskRecord] = attrs.field(factory=list)
    layer: str | None = None
    seen: set[tuple[int, str]] = attrs.field(factory=set)
    # event grouping: which task indices start a group (the graph waits there) and end one
    # (the update records there); None: one event per task
    schedule: EventSchedule | None = None
    group_event: Any = None  # the ExternalEvent of the group being recorded
    sink: SinkCapture = attrs.field(factory=SinkCapture)  # the tiling-sink path's state
    width: int | None = None  # update-free: every attention call is FIA with lengths frozen to it

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.key!r}"

    @property
    def choice(self) -> KernelChoice | None:
        return next(iter(self.choices.values()))[1] if self.choices else None


@attrs.frozen
class Request:
    """What :meth:`CaptureManager.capture` was asked, the same for every try."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    namespace: str
    key: Hashable
    tokens: int
    static_inputs: Mapping[str, torch.Tensor] | None
    require_attention: bool
    free_before: int  # device memory free before the first try (a capture done again counts from it)
    width: int | None = None  # update-free: FIA's lengths frozen to this many keys


def call_shape(call: AttentionCall) -> tuple[Any, ...]:
    """What a kernel choice depends on: calls alike in all of it share one choice."""
    return (
        tuple(call.query.shape),
        tuple(call.key_cache.shape),
        tuple(call.value_cache.shape),
        tuple(call.block_table.shape),
        call.query.dtype,
        call.tokens_per_request,
        call.window,
        None if call.query_rope is None else tuple(call.query_rope.shape),
    )


def alias(device: Device, v: Any) -> Any:
    """``v`` as a task records it: a tensor (or a list of them) as a non-owning alias."""
    if isinstance(v, torch.Tensor):
        return device.weak_ref_tensor(v)
    if isinstance(v, list) and v and all(isinstance(x, torch.Tensor) for x in v):
        return [device.weak_ref_tensor(x) for x in v]
    return v


def alias_tree(device: Device, v: Any) -> Any:
    """``v`` with every tensor a non-owning alias, its structure kept: any pytree
    (tuples, namedtuples, lists, dicts) and dataclasses."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return device.weak_ref_tensor(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            y = copy.copy(x)
            for f in dataclasses.fields(x):
                object.__setattr__(y, f.name, alias_tree(device, getattr(x, f.name)))
            return y
        return x

    return pytree.tree_map(leaf, v)


def host_tuple(v: Any) -> tuple[int, ...]:
    if isinstance(v, torch.Tensor):
        return tuple(int(x) for x in v.tolist())
    return tuple(int(x) for x in v)


def batch_of(tasks: Sequence[TaskRecord]) -> int:
    """The graph's request slots: rows of its first task's block table (0 without attention)."""
    return int(tasks[0].args[tasks[0].spec.refreshed_buffers[0]].shape[0]) if tasks else 0


@contextlib.contextmanager
def collector_walks_only_new() -> Iterator[None]:
    """Every capture starts with ``gc.collect()`` (the graph context does, as torch's
    does); in a serving process that walks the whole heap once per graph.  While many
    graphs are captured, what existed before is frozen out of those walks (vLLM's model
    runner does the same) and thawed after.  A process that froze objects itself is left
    as it is: thawing would undo its freeze."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
