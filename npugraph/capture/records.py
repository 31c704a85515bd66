"""What capture recorded: frozen facts about each graph and each updatable task."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import attrs
import torch

from npugraph.ops import LensGroup, OpSpec
from npugraph.policy import KernelChoice

__all__ = ["CapturedGraph", "TaskRecord", "WidthKey"]


@attrs.frozen(repr=False)
class WidthKey:
    """The key of an update-free graph: the size ``key`` it runs, captured with FIA's lengths
    frozen to ``width`` keys (``Runtime.capture(..., width=W)``; ``Runtime.step(key, ...)``
    picks among a key's widths)."""

    key: Hashable
    width: int

    def __repr__(self) -> str:
        return f"{self.key!r}@w{self.width}"


@attrs.frozen(kw_only=True)
class TaskRecord:
    """One captured updatable attention task.

    ``args`` are the kernel's arguments as captured, every tensor a *non-owning alias*
    (``Device.weak_ref_tensor``): the graph's pool keeps the memory of its own
    intermediates, and the model keeps its KV caches; the record keeps nothing alive.
    ``host_at_capture`` are the host-side arguments the task was captured with.
    A tiling-sink task (``spec.sink`` set) has no task group (``handle`` is None) and
    reads ``lens``; all of a graph's such tasks share one event, waited before the first.
    """

    index: int
    layer: str
    group: str
    spec: OpSpec
    handle: Any
    event: Any
    args: Mapping[str, Any]
    host_at_capture: Mapping[str, tuple[int, ...]]
    workspace_bytes: int
    ubatch: int = 0  # micro-batch index (0 unless one forward runs several)
    # event grouping: the graph waits on ``event`` before this task (the first of its group)
    # and the update records ``event`` after this task (the last of its group)
    waits: bool = True
    records: bool = True
    lens: LensGroup | None = None

    @property
    def slot(self) -> str:
        """The name this task's step lengths are tracked under: its KV-cache group,
        qualified by the micro-batch when there are several."""
        return self.group if self.ubatch == 0 else f"{self.group}#ubatch{self.ubatch}"

    def kwargs(self) -> dict[str, Any]:
        """The kernel's arguments as captured (aliases; lists copied)."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self.args.items()}

    def tensor(self, name: str) -> torch.Tensor | None:
        v = self.args.get(name)
        return v if isinstance(v, torch.Tensor) else None


@attrs.frozen(kw_only=True, eq=False)  # identity: the updater keys its per-graph state by graph
class CapturedGraph:
    """One captured graph of ``(namespace, key)``: what capture recorded, nothing per step.

    ``outputs`` mirror the callable's return value with every tensor a non-owning
    alias into the graph's pool: valid until another graph of the same pool replays.
    ``static_inputs`` are the engine's input buffers a step copies into (held).
    """

    namespace: str
    key: Hashable
    graph: Any
    choice: KernelChoice
    tasks: tuple[TaskRecord, ...]
    tokens: int
    batch: int
    workspace_bytes: int
    outputs: Any
    static_inputs: Mapping[str, torch.Tensor]
    capture_seconds: float
    pool: Any
    # the device memory its tiling-sink tasks read their lengths and plan from: held here,
    # as the graph reads it on every replay (one per KV-cache group and shape)
    lens_groups: tuple[LensGroup, ...] = ()
    # the device memory its capture took and kept (the device's free memory before less
    # after: pool blocks, workspaces, driver memory), never below 0; the first graph of a
    # shared pool takes the blocks the smaller ones reuse
    memory_bytes: int = 0

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(t.layer for t in self.tasks)

    @property
    def width(self) -> int | None:
        """An update-free graph's width (its key a :class:`WidthKey`), else None."""
        return self.key.width if isinstance(self.key, WidthKey) else None

    @property
    def size_label(self) -> str:
        """Its size as reports name it: the token count, and an update-free graph's width."""
        return f"{self.tokens}" if self.width is None else f"{self.tokens}@w{self.width}"

    @property
    def block_size(self) -> int | None:
        """The block size of its first attention task's KV cache (None: no attention)."""
        if not self.tasks:
            return None
        t = self.tasks[0]
        cache = t.tensor(t.spec.cache_arg)
        return int(cache.shape[1]) if cache is not None else None
