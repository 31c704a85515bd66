"""What an update of one captured graph touches: one frozen record per task, built once.

The plan is built when the capture ends (:func:`build_plan`), so a step only walks it:
no lookups, no sorting, no string matching on the step path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from npugraph.capture import CapturedGraph
from npugraph.metadata import batch_refusal, pad_lens
from npugraph.ops import LensGroup, OpSpec
from npugraph.replay.lenswrite import LensWrite

__all__ = ["Geometry", "TaskPlan", "UpdatePlan", "build_plan"]


@attrs.frozen(kw_only=True)
class Geometry:
    """The shapes one task's lengths and block ids are validated against."""

    block_size: int
    num_blocks: int  # blocks of the task's KV cache: block ids must be below it
    table_cols: int  # columns of its captured block-table buffer
    batch: int  # request rows of the graph (its table's rows)
    tokens: int  # query tokens of the graph
    width: int | None = None  # update-free: the keys the kernel reads of every request
    # query tokens per request where the step's metadata gives no query_start_loc (1: decode;
    # more: speculative verification), the graph's tokens over its rows
    tokens_per_request: int = attrs.field(init=False)

    @tokens_per_request.default
    def _tokens_per_request(self) -> int:
        return max(1, self.tokens // max(1, self.batch))


@attrs.frozen(kw_only=True, eq=False)
class TaskPlan:
    """How to re-issue one captured task.

    ``kwargs`` is the task's captured arguments less the host ones (and less query, key
    and value when the 4-in-1 ``fused`` update applies: they are ``qkv``); the updater
    writes each step's host values into this dict before re-issuing, so nothing is
    allocated per task.  ``block_table`` is the captured buffer a step's table is copied
    into (one object per distinct buffer).  ``records``: the update records ``event`` after
    this task (the last of its event group; with one event per task, every task).
    ``null_host`` are the host values of a step
    with no real request (every key length 0: the kernel reads no block and writes
    zeros), used to release a replay whose step failed.
    """

    index: int
    layer: str
    group: str
    ubatch: int
    slot: str
    spec: OpSpec
    handle: Any
    event: Any
    records: bool
    kernel: Callable[..., Any]
    fused: bool
    kwargs: dict[str, Any]
    qkv: tuple[Any, Any, Any] | None
    block_table: Any
    geometry: Geometry
    null_host: dict[str, Any]
    where: str  # "namespace/key layer name", for errors (made once, not per step)
    one_query_token: bool  # as captured, it runs one query token per request (OpSpec.runs_one_query_token)
    lens: LensGroup | None = None  # a tiling-sink task's lengths and plan (never re-issued)


@attrs.frozen(kw_only=True, eq=False)
class UpdatePlan:
    """The tasks of one graph in layer order, and what a step does once for all of them.

    ``uniform``: one kernel and one cache geometry for every task, so one metadata
    object converts once for the whole graph.
    """

    tasks: tuple[TaskPlan, ...]
    buffers: tuple[Any, ...]  # the distinct block-table buffers
    spans: tuple[tuple[int, int], ...]  # their device byte ranges [start, end)
    slots: tuple[str, ...]  # the distinct length slots
    uniform: bool
    shapes: tuple[tuple[int, int, bool], ...]  # distinct (request rows, query tokens, one query token each)
    tokens: int  # the graph's token count (what a graph without attention takes)
    updatable: tuple[TaskPlan, ...] = ()  # the tasks re-issued in task updates (not tiling-sink ones)
    lens_writes: tuple[LensWrite, ...] = ()  # one per tiling-sink group: written once per step
    lens_recorder: TaskPlan | None = None  # the tiling-sink task that records the graph's shared event

    def refusal(self, num_tokens: int, num_reqs: int) -> str | None:
        """Why a step of ``num_reqs`` real requests and ``num_tokens`` real query tokens
        cannot run on this graph (:func:`~npugraph.metadata.batch_refusal` for each task's
        shape), or ``None`` if its update accepts it.  A graph without attention takes
        any batch of up to its tokens."""
        if not self.shapes:
            return None if num_tokens <= self.tokens else f"{num_tokens} tokens do not fit the captured {self.tokens}"
        for rows, tokens, one in self.shapes:
            refused = batch_refusal(rows, tokens, num_reqs, num_tokens, one_query_token=one)
            if refused is not None:
                return refused
        return None

    def shares_buffer_with(self, other: UpdatePlan) -> bool:
        """Whether a block-table copy into one graph's buffers changes the other's."""
        return any(a < d and c < b for a, b in self.spans for c, d in other.spans)


def build_plan(entry: CapturedGraph, device: Any, fused_fn: Any) -> UpdatePlan:
    """The update plan of ``entry`` on ``device`` (``fused_fn``: the 4-in-1, or None)."""
    tasks = []
    # Aliases are per task; one buffer (by address and layout) is copied into once per step.
    buffers: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Any] = {}
    for t in entry.tasks:
        kw = {k: v for k, v in t.kwargs().items() if k not in t.spec.host_args}
        # the 4-in-1 always records the event: only for the task that ends its event group
        fused = bool(t.spec.fused_update and fused_fn is not None and t.records and t.lens is None)
        qkv = (kw.pop("query"), kw.pop("key"), kw.pop("value")) if fused else None
        (table_arg,) = t.spec.refreshed_buffers  # the block table, refreshed by copy
        bt, kc, q = t.args[table_arg], t.args[t.spec.cache_arg], t.args["query"]  # every spec has them
        geometry = Geometry(
            block_size=int(kc.shape[1]),
            num_blocks=int(kc.shape[0]),
            table_cols=int(bt.shape[1]),
            batch=int(bt.shape[0]),
            tokens=int(q.shape[0]),
            width=t.lens.width if t.lens is not None else None,
        )
        tasks.append(
            TaskPlan(
                index=t.index,
                layer=t.layer,
                group=t.group,
                ubatch=t.ubatch,
                slot=t.slot,
                spec=t.spec,
                handle=t.handle,
                event=t.event,
                records=t.records,
                kernel=_not_reissued if t.lens is not None else t.spec.kernel_fn(device),
                fused=fused,
                kwargs=kw,
                qkv=qkv,
                block_table=buffers.setdefault((bt.data_ptr(), tuple(bt.shape), tuple(bt.stride())), bt),
                geometry=geometry,
                null_host=t.spec.host_values(pad_lens([], None, geometry.batch, geometry.tokens)),
                where=f"{entry.namespace}/{entry.key!r} layer {t.layer!r}",
                one_query_token=t.spec.runs_one_query_token(t.args),
                lens=t.lens,
            )
        )
    specs = {t.spec.name for t in tasks}
    distinct = tuple({id(t.block_table): t.block_table for t in tasks}.values())
    writes: dict[int, LensWrite] = {}
    for tp in tasks:
        if tp.lens is not None and id(tp.lens) not in writes:
            writes[id(tp.lens)] = LensWrite(group=tp.lens, spec=tp.spec, task=tp.index, device=device)
    return UpdatePlan(
        tasks=tuple(tasks),
        buffers=distinct,
        spans=tuple(_span(b) for b in distinct),
        slots=tuple(dict.fromkeys(t.slot for t in tasks)),
        uniform=len(specs) == 1 and len({t.geometry for t in tasks}) == 1,
        shapes=tuple(dict.fromkeys((t.geometry.batch, t.geometry.tokens, t.one_query_token) for t in tasks)),
        tokens=entry.tokens,
        updatable=tuple(t for t in tasks if t.lens is None),
        lens_writes=tuple(writes.values()),
        lens_recorder=next((t for t in tasks if t.lens is not None and t.records), None),
    )


def _not_reissued(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a tiling-sink task is never re-issued: its lengths are written to the device")


def _span(t: Any) -> tuple[int, int]:
    """The bytes a (strided) tensor covers: [first, one past its last element)."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    return int(t.data_ptr()), int(t.data_ptr() + (last + 1) * t.element_size())
