"""Rewrite captured graphs' host-side kernel arguments before each replay."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from npugraph.capture.manager import CaptureManager, GraphEntry
from npugraph.errors import (
    GraphRace,
    MetadataError,
    NotReplayableError,
    NpuGraphError,
    UpdateFailed,
)
from npugraph.ops.base import OpSpec
from npugraph.replay.lens import AttentionMetadata, convert

__all__ = ["ReplayUpdater", "StepMetadata", "UpdatePlan"]

# Layer or KV-cache-group name -> metadata; a list of those with micro-batching.
StepMetadata = Mapping[str, AttentionMetadata] | Sequence[Mapping[str, AttentionMetadata]]


@attrs.frozen(kw_only=True)
class UpdatePlan:
    """What an update of one graph touches, worked out once after capture.

    Per task (in layer order): its layer and KV-cache group names, task-group handle,
    event, op spec, resolved kernel entry point, whether the fused 4-in-1 update
    applies, and the captured block-table buffer (weakly); per task the cache
    geometry its lengths are validated against.
    """

    layers: tuple[str, ...]
    groups: tuple[str, ...]
    ubatches: tuple[int, ...]
    slots: tuple[str, ...]  # where each task's lengths are tracked (group, per micro-batch)
    handles: tuple[Any, ...]
    events: tuple[Any, ...]
    kernels: tuple[Callable[..., Any], ...]
    fused: tuple[bool, ...]
    block_tables: tuple[Any, ...]
    # (block_size, num_blocks, table columns, batch rows, query tokens) of each task
    geometry: tuple[tuple[int, int, int, int, int], ...]
    spec_set: tuple[OpSpec, ...]  # the distinct specs of the graph
    spec_names: tuple[str, ...]
    statics: tuple[dict[str, Any], ...]  # non-tensor kernel arguments
    tensor_refs: tuple[tuple[tuple[str, Any], ...], ...]  # (name, weakref) per task
    list_refs: tuple[tuple[tuple[str, tuple[Any, ...]], ...], ...]  # tensor lists (FIA out)


@attrs.define
class _NamespaceSteps:
    """Step bookkeeping of one namespace: which replay the next update must follow."""

    done: tuple[Any, Any]
    step: int = 0
    updated: bool = False
    replayed: bool = False

    def advance_if_complete(self) -> None:
        if self.updated and self.replayed:
            self.step += 1
            self.updated = self.replayed = False


class ReplayUpdater:
    """Apply each step's lengths and block tables to captured graphs, then replay them.

    Workflow per step (either order of 2 and 3 works):

    1. the engine builds per-layer (or per-KV-cache-group) :class:`AttentionMetadata`;
    2. :meth:`update` — validates and pads every distinct metadata object once, copies
       block tables into the captured buffers once per group, then on its own update
       stream, ordered after the namespace's previous replay by an event (never a host
       synchronize), re-issues each task whose host arguments changed inside
       ``graph_task_update_begin/end`` and records each task's ``ExternalEvent``;
    3. :meth:`replay` — enqueues the graph on the current stream.

    FIA tasks are updated through the device's 4-in-1 ``_npu_fused_infer_attention_score_out_graph``
    where it has one (``fused_update``; default: on hardware).  A graph whose update
    failed (bad metadata, device error) refuses to replay until a complete update
    succeeds.  The updater never captures and never synchronizes.
    """

    def __init__(
        self,
        manager: CaptureManager,
        *,
        validate: bool = True,
        skip_unchanged: bool = True,
        fused_update: bool | None = None,
        on_error: Callable[[NpuGraphError, GraphEntry | None], None] | None = None,
    ) -> None:
        self.manager = manager
        self.device = manager.device
        self.validate = validate
        self.skip_unchanged = skip_unchanged
        if fused_update is None:
            # The 4-in-1 pays off where it is C++ without the GIL (hardware); the
            # simulator's is the same Python calls, so it is used there only on request.
            fused_update = not self.device.is_sim
        self._fused = self.device.fused_fia_update if fused_update else None
        self._stream: Any = None
        # dropped with the entry: a plan holds task-group handles, which must not
        # outlive the graph the manager released
        self._plans: weakref.WeakKeyDictionary[GraphEntry, UpdatePlan] = weakref.WeakKeyDictionary()
        self._steps: dict[str, _NamespaceSteps] = {}
        self._on_error = on_error

    @property
    def stream(self) -> Any:
        """The update stream shared by every namespace."""
        if self._stream is None:
            self._stream = self.device.npu.Stream()
        return self._stream

    def _ns(self, namespace: str) -> _NamespaceSteps:
        st = self._steps.get(namespace)
        if st is None:
            npu = self.device.npu
            st = self._steps[namespace] = _NamespaceSteps(done=(npu.Event(), npu.Event()))
        return st

    def plan(self, entry: GraphEntry) -> UpdatePlan:
        """The update plan of ``entry`` (built on first use)."""
        plan = self._plans.get(entry)
        if plan is None:
            plan = self._plans[entry] = self._build_plan(entry)
        return plan

    def _build_plan(self, entry: GraphEntry) -> UpdatePlan:
        fused, geometry, tables = [], [], []
        statics, trefs, lrefs = [], [], []
        for t in entry.tasks:
            st, tr, lr = {}, [], []
            for name, v in t.args.items():
                if name in t.spec.host_args:
                    continue  # written every step from the metadata
                if isinstance(v, weakref.ref):
                    tr.append((name, v))
                elif isinstance(v, list) and v and isinstance(v[0], weakref.ref):
                    lr.append((name, tuple(v)))
                else:
                    st[name] = v
            statics.append(st)
            trefs.append(tuple(tr))
            lrefs.append(tuple(lr))
            (table_arg,) = t.spec.refreshed_buffers  # the block table, refreshed by copy
            bt = t.tensor(table_arg)
            kc = t.tensor(t.spec.cache_arg)
            if bt is None or kc is None:
                raise NpuGraphError(
                    f"{entry.namespace}/{entry.key!r} layer {t.layer!r}: a captured tensor was "
                    "freed; the graph cannot be updated"
                )
            q = t.tensor("query")
            tokens = int(q.shape[0]) if q is not None else entry.tokens
            geometry.append((int(kc.shape[1]), int(kc.shape[0]), int(bt.shape[1]), int(bt.shape[0]), tokens))
            tables.append(weakref.ref(bt))
            fused.append(bool(t.spec.fused_update and self._fused is not None))
        return UpdatePlan(
            layers=tuple(t.layer for t in entry.tasks),
            groups=tuple(t.group for t in entry.tasks),
            ubatches=tuple(t.ubatch for t in entry.tasks),
            slots=tuple(t.slot for t in entry.tasks),
            handles=tuple(t.handle for t in entry.tasks),
            events=tuple(t.event for t in entry.tasks),
            spec_set=tuple({t.spec.name: t.spec for t in entry.tasks}.values()),
            spec_names=tuple(t.spec.name for t in entry.tasks),
            kernels=tuple(t.spec.kernel_fn(self.device) for t in entry.tasks),
            fused=tuple(fused),
            block_tables=tuple(tables),
            geometry=tuple(geometry),
            statics=tuple(statics),
            tensor_refs=tuple(trefs),
            list_refs=tuple(lrefs),
        )

    # --- update ----------------------------------------------------------------------
    def update(
        self,
        namespace: str,
        key: Hashable,
        metadata: StepMetadata,
    ) -> None:
        """Write this step's metadata into the graph of ``(namespace, key)``.

        ``metadata`` maps attention layer names, or KV-cache group names shared by
        many layers, to :class:`AttentionMetadata` — or is a list of such mappings,
        one per micro-batch.  Each task is resolved by its own layer name first, then
        by its group; never by iteration order.
        """
        entry = self.manager.entry(namespace, key)
        plan = self.plan(entry)
        entry.replayable = False
        try:
            host, copies = self._prepare(entry, plan, metadata)
        except NpuGraphError as exc:
            self._report(exc, entry)
            raise
        try:
            entry.last_reissued = self._issue(entry, plan, host, copies)
        except NpuGraphError as exc:
            self._report(exc, entry)
            raise
        except self.device.race_errors as exc:
            err: NpuGraphError = GraphRace(describe_device_error(self.manager, exc, entry))
            self._report(err, entry)
            raise err from exc
        except Exception as exc:
            err = UpdateFailed(
                f"update of {namespace}/{key!r} failed: {type(exc).__name__}: {exc}. The graph "
                "will not replay until a complete update succeeds."
            )
            self._report(err, entry)
            raise err from exc
        entry.replayable = True
        entry.steps += 1
        steps = self._ns(namespace)
        steps.updated = True
        steps.advance_if_complete()

    def _prepare(
        self, entry: GraphEntry, plan: UpdatePlan, metadata: StepMetadata
    ) -> tuple[list[dict[str, Any]], dict[tuple[int, int], tuple[Any, AttentionMetadata]]]:
        """Resolve, validate and convert metadata; no device call happens here."""
        metas = _resolve(entry, plan, metadata)
        copies: dict[tuple[int, int], tuple[Any, AttentionMetadata]] = {}
        host_by: dict[tuple[int, str], dict[str, Any]] = {}
        distinct: dict[int, AttentionMetadata] = {id(m): m for m in metas if m is not None}
        for meta in distinct.values():  # each distinct object once
            i = metas.index(meta)
            group = plan.slots[i]
            bs, nblocks, cols, batch, tokens = plan.geometry[i]
            lens = convert(
                meta,
                batch=batch,
                tokens=tokens,
                max_model_len=self.manager.max_model_len,
                block_size=bs,
                num_blocks=nblocks,
                capacity_blocks=cols,
                where=f"{entry.namespace}/{entry.key!r} layer {plan.layers[i]!r}",
                validate=self.validate,
            )
            prev = entry.last_lens.get(group)
            if prev is not None and prev.kv_lens == lens.kv_lens and prev.q_ends == lens.q_ends:
                lens = prev  # unchanged: identity lets tasks skip the re-issue
            else:
                entry.last_lens[group] = lens
            copies[(id(plan.block_tables[i]), id(meta))] = (plan.block_tables[i], meta)
            for spec in plan.spec_set:
                cached = entry.last_host.get((group, spec.name))
                if cached is not None and cached[0] is lens:
                    hv = cached[1]
                else:
                    hv = spec.host_values(lens)
                    entry.last_host[(group, spec.name)] = (lens, hv)
                host_by[(id(meta), spec.name)] = hv
        names = plan.spec_names
        return [host_by[(id(m), n)] for m, n in zip(metas, names)], copies

    def _issue(
        self,
        entry: GraphEntry,
        plan: UpdatePlan,
        host: list[dict[str, Any]],
        copies: dict[tuple[int, int], tuple[Any, AttentionMetadata]],
    ) -> int:
        """Issue the step's device work; return how many tasks were re-issued."""
        npu = self.device.npu
        us = self.stream
        skipped = 0
        steps = self._ns(entry.namespace)
        if steps.step > 0:
            # Order after the previous replay: it must consume the previous step's
            # lengths and events before this step's land (no host synchronize).
            us.wait_event(steps.done[(steps.step - 1) % 2])
        with npu.stream(us):
            for ref, meta in copies.values():
                buf = ref()
                src = meta.block_table
                if buf.data_ptr() != src.data_ptr():
                    rows = min(int(src.shape[0]), int(buf.shape[0]))
                    cols = min(int(src.shape[1]), int(buf.shape[1]))
                    buf[:rows, :cols].copy_(src[:rows, :cols], non_blocking=True)
            begin = npu.graph_task_update_begin
            end = npu.graph_task_update_end
            fused_fn = self._fused
            applied = entry.applied
            pending = entry.event_pending
            skip = self.skip_unchanged
            handles, events, kernels, fused = plan.handles, plan.events, plan.kernels, plan.fused
            statics, trefs, lrefs = plan.statics, plan.tensor_refs, plan.list_refs
            for i in range(len(handles)):
                hv = host[i]
                if skip and applied[i] is hv:
                    skipped += 1
                    if not pending[i]:
                        events[i].record(us)
                        pending[i] = True
                    continue
                kw = statics[i].copy()
                for name, ref in trefs[i]:
                    kw[name] = ref()
                for name, refs in lrefs[i]:
                    kw[name] = [r() for r in refs]
                kw.update(hv)
                if fused[i] and not pending[i]:
                    fused_fn(
                        us,
                        handles[i],
                        events[i],
                        kw.pop("query"),
                        kw.pop("key"),
                        kw.pop("value"),
                        **kw,
                    )  # type: ignore[misc]
                    applied[i] = hv
                    pending[i] = True
                    continue
                begin(us, handles[i])
                try:
                    kernels[i](**kw)
                except BaseException:
                    with contextlib.suppress(Exception):
                        end(us)  # close the update; the kernel's error is the one to report
                    raise
                end(us)
                applied[i] = hv
                if not pending[i]:
                    events[i].record(us)
                    pending[i] = True
        if entry.replay_waiting:
            # The replay already queued consumes these events.
            entry.replay_waiting = False
            pending[:] = [False] * len(pending)
        return len(host) - skipped

    # --- replay ----------------------------------------------------------------------
    def replay(self, namespace: str, key: Hashable) -> None:
        """Enqueue the graph of ``(namespace, key)`` on the current stream.

        Called after :meth:`update` it runs this step's lengths; called before, it
        waits on the device for the update that follows.
        """
        entry = self.manager.entry(namespace, key)
        if not entry.replayable:
            err = NotReplayableError(
                f"{namespace}/{key!r} is not replayable: its last update failed part-way, so "
                "some layers hold new lengths and some old. Call update() with complete, "
                "valid metadata first."
            )
            self._report(err, entry)
            raise err
        if entry.replay_waiting:
            raise NpuGraphError(
                f"{namespace}/{key!r} already has a replay waiting for its update; update it before replaying again"
            )
        pending = entry.event_pending
        if pending and pending[0] and pending[-1]:
            pending[:] = [False] * len(pending)
        else:
            entry.replay_waiting = True
        npu = self.device.npu
        steps = self._ns(namespace)
        entry.graph.replay()
        steps.done[steps.step % 2].record(npu.current_stream())
        entry.replays += 1
        steps.replayed = True
        steps.advance_if_complete()

    # --- errors ----------------------------------------------------------------------
    def _report(self, err: NpuGraphError, entry: GraphEntry | None) -> None:
        if self._on_error is not None:
            self._on_error(err, entry)


def describe_device_error(manager: CaptureManager, exc: BaseException, entry: GraphEntry | None = None) -> str:
    """Name the namespace, key and layer behind a device deadlock or race error."""
    events = []
    blocked = getattr(exc, "blocked", None)
    if blocked:
        events = [b.get("event") for b in blocked]
    elif getattr(exc, "event", None) is not None:
        events = [exc.event]  # type: ignore[attr-defined]
    lines = []
    for ev in events:
        found = manager.task_for_event(ev) if ev is not None else None
        if found is not None:
            e, t = found
            lines.append(f"namespace {e.namespace!r}, key {e.key!r}, layer {t.layer!r} (task {t.index}, {t.spec.name})")
    group = getattr(exc, "task_group", None)
    if not lines and group is not None and entry is not None:
        for t in entry.tasks:
            if getattr(t.handle, "_group", None) is group:
                lines.append(f"namespace {entry.namespace!r}, key {entry.key!r}, layer {t.layer!r}")
    where = "; ".join(lines) if lines else "no captured task matched"
    return f"{where}: {exc}"


def _resolve(entry: GraphEntry, plan: UpdatePlan, metadata: StepMetadata) -> list[AttentionMetadata]:
    """The metadata of every task: by layer name, then by KV-cache group, per micro-batch."""
    if isinstance(metadata, Mapping):
        get = metadata.get
        metas = [get(layer) for layer in plan.layers]
        if None in metas:  # fall back to the KV-cache group name
            metas = [m if m is not None else get(g) for m, g in zip(metas, plan.groups)]
    else:
        per = list(metadata)
        if max(plan.ubatches, default=0) >= len(per):
            raise MetadataError(
                f"{entry.namespace}/{entry.key!r}: the graph has {max(plan.ubatches) + 1} micro-batches "
                f"but the step's metadata lists {len(per)}"
            )
        metas = [per[u].get(layer) or per[u].get(g) for u, layer, g in zip(plan.ubatches, plan.layers, plan.groups)]
    if None in metas:
        i = metas.index(None)
        where = f" of micro-batch {plan.ubatches[i]}" if not isinstance(metadata, Mapping) else ""
        keys = sorted(metadata if isinstance(metadata, Mapping) else metadata[plan.ubatches[i]])
        raise MetadataError(
            f"{entry.namespace}/{entry.key!r}: the step's metadata{where} has no entry for layer "
            f"{plan.layers[i]!r} nor for its KV-cache group {plan.groups[i]!r} (it has {keys[:6]}...); "
            "pass metadata for every captured layer"
        )
    return metas  # type: ignore[return-value]
