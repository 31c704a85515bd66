"""A step's metadata made ready for the device, with no device call: a bad step changes nothing.

Each task's metadata is found by its layer name, then its KV-cache group
(:func:`resolve`); each distinct metadata object is validated and padded once per cache
geometry (:func:`~npugraph.metadata.convert`), and turned once into the host values of
each kernel that reads it; the block tables to copy into captured buffers are listed once
per buffer; block-id checks of device-resident tables are deferred to the device.
Unchanged lengths keep their objects, so the update skips the tasks that hold them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import attrs
import torch

from npugraph.capture import CapturedGraph, CaptureManager
from npugraph.errors import BatchRefused, MetadataError
from npugraph.metadata import AttentionMetadata, StepLens, convert
from npugraph.replay.blockcheck import DeferredBlockChecks, DeferredCheck
from npugraph.replay.phases import GraphState, StepMetadata
from npugraph.replay.plan import Geometry, TaskPlan, UpdatePlan

__all__ = ["PreparedStep", "StepPreparer", "resolve", "same_table", "stage"]


@attrs.frozen(kw_only=True)
class PreparedStep:
    """One update, prepared: host values per task, block tables to copy, deferred checks."""

    host: list[dict[str, Any]]
    copies: tuple[tuple[Any, AttentionMetadata], ...]  # (captured buffer, metadata whose table it gets)
    deferred: tuple[DeferredCheck, ...]


@attrs.define(kw_only=True)
class StepPreparer:
    """Resolves, validates and converts a step's metadata for the graphs of one manager.

    ``validate``: check lengths and block ids (off only for benchmarks of the bare update);
    ``defer_block_check``: ``None`` checks the block ids of device-resident tables on the
    device and those of host tables on the host; ``True`` treats every table as device
    memory (the simulator's tables live on the CPU).
    """

    manager: CaptureManager
    device: Any
    validate: bool = True
    defer_block_check: bool | None = None

    def prepare(
        self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, metadata: StepMetadata
    ) -> PreparedStep:
        """Resolve, validate and convert metadata; no device call here."""
        metas = resolve(entry, plan, metadata)
        if plan.uniform and metas.count(metas[0]) == len(metas):
            return self._prepare_one(entry, plan, state, metas[0])
        copies: dict[int, tuple[Any, AttentionMetadata, str]] = {}
        deferred: list[DeferredCheck] = []
        lens_by: dict[tuple[int, Any], StepLens] = {}
        host_by: dict[tuple[int, str], dict[str, Any]] = {}
        lens_seen: dict[int, tuple[StepLens, str]] = {}
        new_lens: dict[str, StepLens] = {}
        host: list[dict[str, Any]] = []
        for i, meta in enumerate(metas):
            # each distinct metadata once per cache geometry (a layer's own cache bounds its block ids)
            t = plan.tasks[i]
            lens_key = (id(meta), t.geometry)
            lens = lens_by.get(lens_key)
            if lens is None:
                lens = lens_by[lens_key] = self._convert(entry, plan, state, i, meta, deferred)
                new_lens[t.slot] = lens
            buf = t.block_table
            seen = copies.get(id(buf))
            if seen is None:
                copies[id(buf)] = (buf, meta, t.layer)
            elif seen[1] is not meta and not same_table(seen[1], meta, readable=not self.resident(meta)):
                raise MetadataError(
                    f"{entry.namespace}/{entry.key!r} layer {t.layer!r}: its metadata has another "
                    f"block table than layer {seen[2]!r}, but both layers "
                    "read one captured block-table buffer; give those layers their own buffers (capture "
                    "them with separate block tables or KV-cache groups) or the same block table"
                )
            if t.lens is not None:
                other = lens_seen.setdefault(id(t.lens), (lens, t.layer))
                if other[0] is not lens and (other[0].kv_lens, other[0].q_ends) != (lens.kv_lens, lens.q_ends):
                    raise MetadataError(
                        f"{entry.namespace}/{entry.key!r} layer {t.layer!r}: its metadata has other lengths than "
                        f"layer {other[1]!r}, but both layers read one device-length buffer (KV-cache group "
                        f"{t.group!r}); pass one metadata per KV-cache group, or capture those layers in "
                        "separate groups"
                    )
            name = t.spec.name
            cached = state.host_of[i]
            if cached is not None and cached[0] is lens:
                host_values = cached[1]  # task i's own lengths, unchanged
            else:
                found = host_by.get((id(lens), name))
                host_values = found if found is not None else t.spec.host_values(lens)
                host_by[(id(lens), name)] = host_values
                state.host_of[i] = (lens, host_values)
            state.lens_of[i] = lens
            host.append(host_values)
        state.last_lens.update(new_lens)
        return PreparedStep(host=host, copies=tuple((b, m) for b, m, _ in copies.values()), deferred=tuple(deferred))

    def _convert(
        self,
        entry: CapturedGraph,
        plan: UpdatePlan,
        state: GraphState,
        i: int,
        meta: Any,
        deferred: list[DeferredCheck],
    ) -> StepLens:
        """Validate and pad the metadata of task ``i`` (and of every task sharing it)."""
        t = plan.tasks[i]
        geometry = t.geometry
        defer = self.validate and self.resident(meta)
        lens = self.task_lens(t, meta, validate=self.validate, check_block_ids=not defer)
        if defer and lens.num_reqs:
            width = geometry.width
            # update-free: the kernel reads the whole width of every row the step copies in
            rows = min(meta.num_reqs, geometry.batch, int(meta.block_table.shape[0]))
            deferred.append(
                DeferredCheck(
                    table=meta.block_table,
                    kv=lens.kv_lens[: lens.num_reqs] if width is None else (width,) * rows,
                    block_size=geometry.block_size,
                    num_blocks=geometry.num_blocks,
                    columns=geometry.table_cols,
                    step=state.steps + 1,
                    where=t.where,
                )
            )
        prev = state.lens_of[i]
        if prev is not None and prev.kv_lens == lens.kv_lens and prev.q_ends == lens.q_ends:
            return prev  # unchanged: identity lets tasks skip the re-issue
        return lens

    def task_lens(self, t: TaskPlan, meta: Any, *, validate: bool, check_block_ids: bool) -> StepLens:
        """``meta`` checked against task ``t``'s graph and padded to it (:func:`convert`: the one
        place the padding rule is applied to a step, so a refusal is a :class:`BatchRefused`)."""
        geometry = t.geometry
        return convert(
            meta,
            batch=geometry.batch,
            tokens=geometry.tokens,
            max_model_len=self.manager.max_model_len,
            block_size=geometry.block_size,
            num_blocks=geometry.num_blocks,
            capacity_blocks=geometry.table_cols,
            table_device=self.device.memory,
            where=t.where,
            validate=validate,
            check_block_ids=check_block_ids,
            tokens_per_request=geometry.tokens_per_request,
            one_query_token=t.one_query_token,
            width=geometry.width,
        )

    def refusal(self, entry: CapturedGraph, plan: UpdatePlan, metadata: StepMetadata) -> str | None:
        """Why the graph cannot run the batch ``metadata`` holds (the step's own
        :class:`~npugraph.errors.BatchRefused`), or ``None`` (malformed metadata too: the step
        refuses it with its reason); no state is touched."""
        if not plan.tasks:
            return None
        try:
            seen: set[tuple[int, Geometry, bool]] = set()
            for t, meta in zip(plan.tasks, resolve(entry, plan, metadata)):
                if (id(meta), t.geometry, t.one_query_token) not in seen:
                    seen.add((id(meta), t.geometry, t.one_query_token))
                    self.task_lens(t, meta, validate=False, check_block_ids=False)
        except BatchRefused as refused:
            return str(refused)
        except MetadataError:
            return None
        return None

    def resident(self, meta: Any) -> bool:
        """Whether ``meta``'s block table is device memory, which the host must not read
        (a read would synchronize); ``defer_block_check`` overrides the table's device."""
        if self.defer_block_check is not None:
            return self.defer_block_check
        table = getattr(meta, "block_table", None)
        return isinstance(table, torch.Tensor) and self.device.is_device_memory(table)

    def _prepare_one(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, meta: Any) -> PreparedStep:
        """The common step: one metadata object for every task of one kernel and one cache geometry."""
        deferred: list[DeferredCheck] = []
        lens = self._convert(entry, plan, state, 0, meta, deferred)
        cached = state.host_of[0]  # the first task stands for all: the others follow it
        if cached is not None and cached[0] is lens:
            host_values = cached[1]
        else:
            host_values = plan.tasks[0].spec.host_values(lens)
            state.host_of[0] = (lens, host_values)
        state.lens_of[0] = lens
        for slot in plan.slots:
            state.last_lens[slot] = lens
        return PreparedStep(
            host=[host_values] * len(plan.tasks),
            copies=tuple(zip(plan.buffers, repeat(meta))),
            deferred=tuple(deferred),
        )


def same_table(first: AttentionMetadata, other: AttentionMetadata, *, readable: bool) -> bool:
    """Whether ``other``'s layer reads its own block table from a buffer ``first``'s was copied into.

    It reads its requests' rows and its table's columns.  Tables the host may not read
    (device memory: a read would synchronize) pass only as views of the same memory."""
    ta, tb = first.block_table, other.block_table
    rows, cols = other.num_reqs, int(tb.shape[1])
    if ta.shape[0] < rows or ta.shape[1] < cols:
        return False
    if ta.data_ptr() == tb.data_ptr() and ta.stride() == tb.stride():
        return True  # views of one table: the leading rows and columns are the same memory
    return readable and bool(torch.equal(ta[:rows, :cols], tb[:rows, :cols]))


def resolve(entry: CapturedGraph, plan: UpdatePlan, metadata: StepMetadata) -> list[AttentionMetadata]:
    """The metadata of every task: by layer name, then by KV-cache group, per micro-batch."""
    if type(metadata) is dict or isinstance(metadata, Mapping):  # a dict: no ABC check per step
        first = plan.tasks[0]
        one = plan.uniform and len(metadata) == 1 and first.layer not in metadata
        if one and metadata.get(first.group) is not None:  # the common step: one group's metadata
            return [metadata[first.group]] * len(plan.tasks)
        get = metadata.get
        metas = [get(t.layer) for t in plan.tasks]
        if None in metas:  # fall back to the KV-cache group name
            metas = [m if m is not None else get(t.group) for m, t in zip(metas, plan.tasks)]
    elif isinstance(metadata, Sequence) and not isinstance(metadata, (str, bytes)):
        per = list(metadata)
        ubatches = max((t.ubatch for t in plan.tasks), default=0) + 1
        if ubatches > len(per):
            raise MetadataError(
                f"{entry.namespace}/{entry.key!r}: the graph has {ubatches} micro-batches "
                f"but the step's metadata lists {len(per)}"
            )
        for u, m in enumerate(per):
            if not isinstance(m, Mapping):
                raise MetadataError(
                    f"{entry.namespace}/{entry.key!r}: micro-batch {u} of the step's metadata is a "
                    f"{type(m).__name__}; expected a mapping of layer or KV-cache group names to AttentionMetadata"
                )
        metas = []
        for t in plan.tasks:
            found = per[t.ubatch].get(t.layer)
            metas.append(found if found is not None else per[t.ubatch].get(t.group))
    else:
        raise MetadataError(
            f"{entry.namespace}/{entry.key!r}: step metadata must map layer or KV-cache group names to "
            f"AttentionMetadata (or be a list of such mappings), got {type(metadata).__name__}"
        )
    if None in metas:
        i = metas.index(None)
        t = plan.tasks[i]
        where = f" of micro-batch {t.ubatch}" if not isinstance(metadata, Mapping) else ""
        keys = sorted(map(str, metadata if isinstance(metadata, Mapping) else metadata[t.ubatch]))
        raise MetadataError(
            f"{entry.namespace}/{entry.key!r}: the step's metadata{where} has no entry for layer "
            f"{t.layer!r} nor for its KV-cache group {t.group!r} (it has {keys[:6]}...); "
            "pass metadata for every captured layer"
        )
    return metas  # type: ignore[return-value]


def stage(device: Any, checks: DeferredBlockChecks, step: PreparedStep) -> None:
    """Queue the step's block-id checks and block-table copies on the current stream (each
    table copied into its captured buffer once, from page-locked memory where it is the host's)."""
    for check in step.deferred:
        checks.flag(check)
    for buf, meta in step.copies:
        src = meta.block_table
        if buf.data_ptr() != src.data_ptr():
            # the step's rows only: what is past them is padding, whose ids were never checked
            # (an update-free graph reads a padding row's blocks too: they keep checked ones)
            rows = min(int(src.shape[0]), int(buf.shape[0]), meta.num_reqs)
            cols = min(int(src.shape[1]), int(buf.shape[1]))
            buf[:rows, :cols].copy_(device.staged(src[:rows, :cols]), non_blocking=True)
