"""Rewrite captured graphs' host-side kernel arguments before each replay."""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import attrs
import torch

from npugraph.capture import CapturedGraph, CaptureManager, TaskRecord
from npugraph.errors import (
    ConfigError,
    GraphRace,
    MetadataError,
    NotReplayableError,
    NpuGraphError,
    ReplayFailed,
    UpdateFailed,
)
from npugraph.ops import OpSpec, StepLens
from npugraph.replay.lens import AttentionMetadata, bad_block_ids, convert

__all__ = ["ReplayUpdater", "StepMetadata", "UpdatePlan", "GraphState", "describe_device_error"]

# Layer or KV-cache-group name -> metadata; a list of those with micro-batching.
StepMetadata = Mapping[str, AttentionMetadata] | Sequence[Mapping[str, AttentionMetadata]]


@attrs.frozen(kw_only=True)
class UpdatePlan:
    """What an update of one graph touches, worked out once after capture.

    Per task (in layer order): its layer, KV-cache group, micro-batch and length slot,
    task-group handle, event, resolved kernel entry point, whether the fused 4-in-1
    update applies, its captured arguments less the host ones (positional query, key,
    value for the 4-in-1), its block-table buffer, and the cache geometry its lengths
    are validated against: (block_size, num_blocks, table columns, batch rows, tokens).
    """

    layers: tuple[str, ...]
    groups: tuple[str, ...]
    ubatches: tuple[int, ...]
    slots: tuple[str, ...]
    handles: tuple[Any, ...]
    events: tuple[Any, ...]
    kernels: tuple[Callable[..., Any], ...]
    fused: tuple[bool, ...]
    kwargs: tuple[dict[str, Any], ...]
    qkv: tuple[tuple[Any, Any, Any] | None, ...]
    block_tables: tuple[Any, ...]
    buffers: tuple[Any, ...]  # the distinct block-table buffers
    slot_set: tuple[str, ...]  # the distinct length slots
    geometry: tuple[tuple[int, int, int, int, int], ...]
    spec_set: tuple[OpSpec, ...]  # the distinct specs of the graph
    spec_names: tuple[str, ...]
    uniform: bool  # one spec and one cache geometry for every task: one metadata converts once for all


@attrs.define(kw_only=True, eq=False)
class GraphState:
    """The updater's per-step state of one captured graph (capture's records stay frozen).

    ``applied[i]``: the host values last written into task ``i`` (identity tells an
    unchanged task); ``lens_of[i]`` / ``host_of[i]``: the lengths task ``i`` was last
    given and their host values (a step with equal lengths reuses both objects, so its
    tasks skip the re-issue); ``event_pending[i]``: its event is recorded and not yet
    consumed by a replay; ``replay_waiting``: a replay is queued ahead of its update;
    ``last_lens``: each length slot's latest lengths (for dumps).
    """

    replayable: bool = True
    replay_waiting: bool = False
    applied: list[Any]
    event_pending: list[bool]
    lens_of: list[StepLens | None]
    host_of: list[tuple[StepLens, dict[str, Any]] | None]
    last_lens: dict[str, StepLens] = attrs.field(factory=dict)
    steps: int = 0
    replays: int = 0
    last_reissued: int = 0


@attrs.define
class _NamespaceSteps:
    """Step bookkeeping of one namespace: which replay the next update must follow.

    Two events take turns: this step's replay records :attr:`done`; this step's update
    waits for :attr:`previous`, recorded by the previous step's replay.
    """

    events: tuple[Any, Any]
    step: int = 0
    updated: bool = False
    replayed: bool = False

    @property
    def done(self) -> Any:
        return self.events[self.step % 2]

    @property
    def previous(self) -> Any:
        """The previous step's replay-done event (None before the first step completes)."""
        return self.events[1 - self.step % 2] if self.step else None

    def advance_if_complete(self) -> None:
        if self.updated and self.replayed:
            self.step += 1
            self.updated = self.replayed = False


class ReplayUpdater:
    """Apply each step's lengths and block tables to captured graphs, then replay them.

    Workflow per step (either order of 2 and 3 works):

    1. the engine builds per-layer (or per-KV-cache-group) :class:`AttentionMetadata`;
    2. :meth:`update` — validates and pads every distinct metadata object once, copies
       block tables into the captured buffers once per buffer, then on its own update
       stream, ordered after the namespace's previous replay by an event (never a host
       synchronize), re-issues each task whose host arguments changed inside
       ``graph_task_update_begin/end`` and records each task's ``ExternalEvent``;
    3. :meth:`replay` — enqueues the graph on the current stream.

    FIA tasks are updated through the device's 4-in-1 ``_npu_fused_infer_attention_score_out_graph``
    where it has one (``fused_update``; default: on hardware).  A graph whose update
    or replay failed refuses to replay until a complete update succeeds.  The updater
    never captures and never synchronizes; it owns every graph's per-step state.
    """

    def __init__(
        self,
        manager: CaptureManager,
        *,
        validate: bool = True,
        skip_unchanged: bool = True,
        fused_update: bool | None = None,
        on_error: Callable[[NpuGraphError, CapturedGraph | None], None] | None = None,
        on_update: Callable[[CapturedGraph, GraphState], None] | None = None,
        defer_block_check: bool | None = None,
        update_workers: int = 1,
    ) -> None:
        if isinstance(update_workers, bool) or not isinstance(update_workers, int) or update_workers < 1:
            raise ConfigError(f"update_workers must be an int >= 1, got {update_workers!r}")
        self.manager = manager
        # K > 1: tasks are updated from K host threads, each on its own update stream
        # (task i by thread i % K, so layers land in order); worth it where the update
        # call releases the GIL (the 4-in-1). Check the device first: npugraph selftest.
        self.update_workers = update_workers
        # threads start on first use: none with K = 1
        self._pool = ThreadPoolExecutor(max(1, update_workers - 1), "npugraph-update")
        self._streams: list[Any] | None = None  # made on first use
        self.device = manager.device
        self.validate = validate
        # None: block ids of device-resident tables are checked on the device (a host read
        # would synchronize) and reported by check_deferred(); host tables on the host.
        # True treats every table as device memory (the simulator's live on the CPU).
        self.defer_block_check = defer_block_check
        # (where, 0-d bool on the device) of the recent deferred checks, oldest first
        self._flags: deque[tuple[str, torch.Tensor]] = deque(maxlen=_FLAG_SLOTS)
        self.skip_unchanged = skip_unchanged
        if fused_update is None:
            # The 4-in-1 pays off where it is C++ without the GIL (hardware); the
            # simulator's is the same Python calls, so it is used there only on request.
            fused_update = not self.device.is_sim
        self._fused = self.device.fused_fia_update if fused_update else None
        # dropped with the graph: a plan holds task-group handles, which must not
        # outlive the graph the manager released
        self._plans: weakref.WeakKeyDictionary[CapturedGraph, UpdatePlan] = weakref.WeakKeyDictionary()
        self._states: weakref.WeakKeyDictionary[CapturedGraph, GraphState] = weakref.WeakKeyDictionary()
        self._steps: dict[str, _NamespaceSteps] = {}
        self._on_error = on_error
        self._on_update = on_update

    @property
    def stream(self) -> Any:
        """The (first) update stream, shared by every namespace."""
        return self.streams[0]

    @property
    def streams(self) -> list[Any]:
        """One update stream per update worker."""
        if self._streams is None:
            self._streams = [self.device.npu.Stream() for _ in range(self.update_workers)]
        return self._streams

    def _ns(self, namespace: str) -> _NamespaceSteps:
        st = self._steps.get(namespace)
        if st is None:
            npu = self.device.npu
            st = self._steps[namespace] = _NamespaceSteps(events=(npu.Event(), npu.Event()))
        return st

    def state(self, entry: CapturedGraph) -> GraphState:
        """The per-step state of ``entry`` (created on first use)."""
        st = self._states.get(entry)
        if st is None:
            n = len(entry.tasks)
            st = self._states[entry] = GraphState(
                applied=[None] * n, event_pending=[False] * n, lens_of=[None] * n, host_of=[None] * n
            )
        return st

    def plan(self, entry: CapturedGraph) -> UpdatePlan:
        """The update plan of ``entry`` (built on first use)."""
        plan = self._plans.get(entry)
        if plan is None:
            plan = self._plans[entry] = self._build_plan(entry)
        return plan

    def _build_plan(self, entry: CapturedGraph) -> UpdatePlan:
        fused, geometry, tables, kwargs, qkv = [], [], [], [], []
        # Aliases are per task; one buffer (by address and layout) is copied into once per step.
        buffers: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Any] = {}
        for t in entry.tasks:
            kw = {k: v for k, v in t.kwargs().items() if k not in t.spec.host_args}
            use_fused = bool(t.spec.fused_update and self._fused is not None)
            fused.append(use_fused)
            qkv.append((kw.pop("query"), kw.pop("key"), kw.pop("value")) if use_fused else None)
            kwargs.append(kw)
            (table_arg,) = t.spec.refreshed_buffers  # the block table, refreshed by copy
            bt, kc, q = t.args[table_arg], t.args[t.spec.cache_arg], t.args["query"]  # every spec has them
            geometry.append((int(kc.shape[1]), int(kc.shape[0]), int(bt.shape[1]), int(bt.shape[0]), int(q.shape[0])))
            tables.append(buffers.setdefault((bt.data_ptr(), tuple(bt.shape), tuple(bt.stride())), bt))
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
            kwargs=tuple(kwargs),
            qkv=tuple(qkv),
            block_tables=tuple(tables),
            buffers=tuple({id(b): b for b in tables}.values()),
            slot_set=tuple(dict.fromkeys(t.slot for t in entry.tasks)),
            geometry=tuple(geometry),
            uniform=len({t.spec.name for t in entry.tasks}) == 1 and len(set(geometry)) == 1,
        )

    # --- update ----------------------------------------------------------------------
    def update(self, namespace: str, key: Hashable, metadata: StepMetadata) -> None:
        """Write this step's metadata into the graph of ``(namespace, key)``.

        ``metadata`` maps attention layer names, or KV-cache group names shared by
        many layers, to :class:`AttentionMetadata` — or is a list of such mappings,
        one per micro-batch.  Each task is resolved by its own layer name first, then
        by its group; never by iteration order.  Bad metadata raises
        :class:`~npugraph.errors.MetadataError` before any device call; the graph then
        refuses to replay until a complete update succeeds.
        """
        entry = self.manager.entry(namespace, key)
        plan = self.plan(entry)
        state = self.state(entry)
        # Until a complete update lands, replaying would run a mix of steps' lengths.
        state.replayable = False
        try:
            step = self._prepare(entry, plan, state, metadata)
        except NpuGraphError as bad:
            self._report(bad, entry)
            raise
        try:
            state.last_reissued = self._issue(entry, plan, state, step)
        except _TaskFailed as failed:
            cause = failed.error
            i = failed.index
            where = "copying block tables" if i < 0 else f"layer {plan.layers[i]!r} (task {i})"
            if isinstance(cause, self.device.race_errors):
                err: NpuGraphError = GraphRace(
                    f"update of {namespace}/{key!r} at {where}: " + describe_device_error(self.manager, cause, entry)
                )
            else:
                err = UpdateFailed(
                    f"update of {namespace}/{key!r} failed at {where}: "
                    f"{type(cause).__name__}: {str(cause).rstrip('.')}. The graph will not replay until a "
                    "complete update succeeds."
                )
            self._report(err, entry)
            raise err from cause
        state.replayable = True
        state.steps += 1
        steps = self._ns(namespace)
        steps.updated = True
        steps.advance_if_complete()
        if self._on_update is not None:
            self._on_update(entry, state)

    def _prepare(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, metadata: StepMetadata) -> _Step:
        """Resolve, validate and convert metadata; no device call here."""
        metas = _resolve(entry, plan, metadata)
        if plan.uniform and metas.count(metas[0]) == len(metas):
            return self._prepare_one(entry, plan, state, metas[0])
        copies: dict[int, tuple[Any, AttentionMetadata]] = {}
        deferred: list[_DeferredCheck] = []
        lens_by: dict[tuple[int, tuple[int, ...]], StepLens] = {}
        host_by: dict[tuple[int, str], dict[str, Any]] = {}
        new_lens: dict[str, StepLens] = {}
        host: list[dict[str, Any]] = []
        for i, meta in enumerate(metas):
            # each distinct metadata once per cache geometry (a layer's own cache bounds its block ids)
            ck = (id(meta), plan.geometry[i])
            lens = lens_by.get(ck)
            if lens is None:
                lens = lens_by[ck] = self._convert(entry, plan, state, i, meta, deferred)
                new_lens[plan.slots[i]] = lens
            buf = plan.block_tables[i]
            seen = copies.get(id(buf))
            if seen is None:
                copies[id(buf)] = (buf, meta)
            elif seen[1] is not meta and not _same_table(seen[1], meta, readable=not self._resident(meta)):
                raise MetadataError(
                    f"{entry.namespace}/{entry.key!r} layer {plan.layers[i]!r}: its metadata has another "
                    f"block table than layer {plan.layers[plan.block_tables.index(buf)]!r}, but both layers "
                    "read one captured block-table buffer; give those layers their own buffers (capture "
                    "them with separate block tables or KV-cache groups) or the same block table"
                )
            name = plan.spec_names[i]
            cached = state.host_of[i]
            if cached is not None and cached[0] is lens:
                hv = cached[1]  # task i's own lengths, unchanged
            else:
                found = host_by.get((id(lens), name))
                hv = found if found is not None else _spec(plan, i).host_values(lens)
                host_by[(id(lens), name)] = hv
                state.host_of[i] = (lens, hv)
            state.lens_of[i] = lens
            host.append(hv)
        state.last_lens.update(new_lens)
        return _Step(host=host, copies=tuple(copies.values()), deferred=tuple(deferred))

    def _convert(
        self,
        entry: CapturedGraph,
        plan: UpdatePlan,
        state: GraphState,
        i: int,
        meta: Any,
        deferred: list[_DeferredCheck],
    ) -> StepLens:
        """Validate and pad the metadata of task ``i`` (and of every task sharing it)."""
        bs, nblocks, cols, batch, tokens = plan.geometry[i]
        where = f"{entry.namespace}/{entry.key!r} layer {plan.layers[i]!r}"
        defer = self.validate and self._resident(meta)
        lens = convert(
            meta,
            batch=batch,
            tokens=tokens,
            max_model_len=self.manager.max_model_len,
            block_size=bs,
            num_blocks=nblocks,
            capacity_blocks=cols,
            where=where,
            validate=self.validate,
            check_block_ids=not defer,
            tokens_per_request=max(1, tokens // max(1, batch)),
        )
        if defer and lens.num_reqs:
            deferred.append(
                _DeferredCheck(
                    table=meta.block_table,
                    kv=lens.kv_lens[: lens.num_reqs],
                    block_size=bs,
                    num_blocks=nblocks,
                    where=f"step {state.steps + 1} of {where}",
                )
            )
        prev = state.lens_of[i]
        if prev is not None and prev.kv_lens == lens.kv_lens and prev.q_ends == lens.q_ends:
            return prev  # unchanged: identity lets tasks skip the re-issue
        return lens

    def _resident(self, meta: Any) -> bool:
        """Whether ``meta``'s block table is device memory, which the host must not read
        (a read would synchronize); ``defer_block_check`` overrides the table's device."""
        if self.defer_block_check is not None:
            return self.defer_block_check
        table = getattr(meta, "block_table", None)
        return isinstance(table, torch.Tensor) and table.device.type != "cpu"

    def _prepare_one(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, meta: Any) -> _Step:
        """The common step: one metadata object for every task of one kernel and one cache geometry."""
        deferred: list[_DeferredCheck] = []
        lens = self._convert(entry, plan, state, 0, meta, deferred)
        cached = state.host_of[0]  # the first task stands for all: the others follow it
        if cached is not None and cached[0] is lens:
            hv = cached[1]
        else:
            hv = plan.spec_set[0].host_values(lens)
            state.host_of[0] = (lens, hv)
        state.lens_of[0] = lens
        for slot in plan.slot_set:
            state.last_lens[slot] = lens
        return _Step(
            host=[hv] * len(plan.handles), copies=tuple((b, meta) for b in plan.buffers), deferred=tuple(deferred)
        )

    def _issue(
        self,
        entry: CapturedGraph,
        plan: UpdatePlan,
        state: GraphState,
        step: _Step,
    ) -> int:
        """Issue the step's device work; return how many tasks were re-issued.

        A failure is raised as :class:`_TaskFailed` naming the task it happened at
        (``-1``: before any task, while copying block tables).
        """
        npu = self.device.npu
        streams = self.streams
        us = streams[0]
        steps = self._ns(entry.namespace)
        previous = steps.previous
        if previous is not None:
            # Order after the previous replay: it must consume the previous step's
            # lengths and events before this step's land (no host synchronize).
            for s in streams:
                s.wait_event(previous)
        with npu.stream(us):
            try:
                for check in step.deferred:
                    self._flag(check)
                for buf, meta in step.copies:
                    src = meta.block_table
                    if buf.data_ptr() != src.data_ptr():
                        rows = min(int(src.shape[0]), int(buf.shape[0]))
                        cols = min(int(src.shape[1]), int(buf.shape[1]))
                        buf[:rows, :cols].copy_(src[:rows, :cols], non_blocking=True)
            except Exception as exc:
                raise _TaskFailed(-1, exc) from exc
            n, k = len(plan.handles), self.update_workers
            futures = [
                self._pool.submit(self._issue_on, streams[w], plan, state, step.host, range(w, n, k))
                for w in range(1, k)
            ]
            try:
                reissued = self._issue_tasks(us, plan, state, step.host, range(0, n, k))
            finally:
                wait(futures)  # every worker is done before the update returns or raises
            reissued += sum(f.result() for f in futures)
        if state.replay_waiting:
            # The replay already queued consumes these events.
            state.replay_waiting = False
            state.event_pending[:] = [False] * len(state.event_pending)
        return reissued

    def _issue_on(
        self, us: Any, plan: UpdatePlan, state: GraphState, host: list[dict[str, Any]], indices: range
    ) -> int:
        """A worker thread's share of the tasks, on its own update stream."""
        with self.device.npu.stream(us):
            return self._issue_tasks(us, plan, state, host, indices)

    def _issue_tasks(
        self, us: Any, plan: UpdatePlan, state: GraphState, host: list[dict[str, Any]], indices: range
    ) -> int:
        """Re-issue every task (of ``indices``) whose host values changed; record every task's event once."""
        npu = self.device.npu
        begin, end, fused_fn = npu.graph_task_update_begin, npu.graph_task_update_end, self._fused
        applied, pending, skip = state.applied, state.event_pending, self.skip_unchanged
        handles, events, kernels, fused = plan.handles, plan.events, plan.kernels, plan.fused
        kwargs, qkv = plan.kwargs, plan.qkv
        reissued = 0
        for i in indices:
            try:
                hv = host[i]
                if skip and applied[i] is hv:
                    if not pending[i]:
                        events[i].record(us)
                        pending[i] = True
                    continue
                kw = kwargs[i]
                kw.update(hv)  # the plan's own dict: host entries are rewritten in place
                reissued += 1
                if fused[i] and not pending[i]:
                    q, k, v = qkv[i]  # type: ignore[misc]
                    fused_fn(us, handles[i], events[i], q, k, v, **kw)  # type: ignore[misc]
                    applied[i] = hv
                    pending[i] = True
                    continue
                begin(us, handles[i])
                try:
                    if qkv[i] is not None:
                        kernels[i](*qkv[i], **kw)  # type: ignore[misc]
                    else:
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
            except Exception as exc:
                raise _TaskFailed(i, exc) from exc
        return reissued

    def _flag(self, check: _DeferredCheck) -> None:
        """Queue the device-side block-id check of one table (no host read)."""
        self._flags.append((check.where, bad_block_ids(check.table, check.kv, check.block_size, check.num_blocks)))

    def check_deferred(self) -> None:
        """Raise :class:`~npugraph.errors.MetadataError` for a bad block id found on the device.

        Call it when the device is idle (``Runtime.synchronize`` does): reading the flags
        then costs no synchronize.  The step that carried the bad id has already run, so
        its output is wrong; the graph stays replayable and later steps are unaffected.
        Each check is reported once; the last 64 checks are remembered (the oldest is named).
        """
        if not self._flags:
            return
        checks = list(self._flags)
        self._flags.clear()
        hits = torch.stack([flag for _, flag in checks]).nonzero().flatten().tolist()  # one host read
        if not hits:
            return
        more = f" (and {len(hits) - 1} later check(s))" if len(hits) > 1 else ""
        err = MetadataError(
            f"{checks[hits[0]][0]}: a block id in use in its device-resident block table is not a block of "
            f"the KV cache{more}. That step has already run and read a wrong block, so its output is wrong; "
            "fix the block table the engine passes (the graph stays replayable)."
        )
        self._report(err, None)
        raise err

    # --- replay ----------------------------------------------------------------------
    def replay(self, namespace: str, key: Hashable) -> None:
        """Enqueue the graph of ``(namespace, key)`` on the current stream.

        Called after :meth:`update` it runs this step's lengths; called before, it
        waits on the device for the update that follows.  A graph without attention
        tasks has nothing to wait for.
        """
        entry = self.manager.entry(namespace, key)
        state = self.state(entry)
        if not state.replayable:
            err: NpuGraphError = NotReplayableError(
                f"{namespace}/{key!r} is not replayable: its last update or replay failed, so "
                "some layers may hold new lengths and some old. Call update() with complete, "
                "valid metadata first."
            )
            self._report(err, entry)
            raise err
        if state.replay_waiting:
            raise NpuGraphError(
                f"{namespace}/{key!r} already has a replay waiting for its update; update it before replaying again"
            )
        pending = state.event_pending
        # an update records every task's event, so the first task's tells for all
        waits = bool(pending) and not pending[0]
        steps = self._ns(namespace)
        try:
            entry.graph.replay()
        except Exception as exc:
            # The device cancels the rest of the graph: the events of the tasks after the
            # one that failed stay recorded (their waits never ran), the others were consumed.
            # The next complete update then recovers.
            failed = _failed_task(self.manager, exc, entry)
            state.replayable = False  # (no replay was waiting: that was refused above)
            pending[:] = [failed is not None and i > failed.index for i in range(len(pending))]
            state.applied[:] = [None] * len(pending)
            if isinstance(exc, self.device.race_errors):
                err = GraphRace(describe_device_error(self.manager, exc, entry))
            else:
                where = (
                    "" if failed is None else f" in layer {failed.layer!r} (task {failed.index}, {failed.spec.name})"
                )
                err = ReplayFailed(
                    f"replay of {namespace}/{key!r} failed{where}: "
                    f"{type(exc).__name__}: {str(exc).rstrip('.')}. Update the graph with complete, valid "
                    "metadata to replay it again."
                )
            self._report(err, entry)
            raise err from exc
        if waits:
            state.replay_waiting = True
        else:
            pending[:] = [False] * len(pending)
        steps.done.record()  # on the current stream, where the replay went
        state.replays += 1
        steps.replayed = True
        steps.advance_if_complete()

    # --- errors ----------------------------------------------------------------------
    def _report(self, err: NpuGraphError, entry: CapturedGraph | None) -> None:
        if self._on_error is not None:
            self._on_error(err, entry)


_FLAG_SLOTS = 64  # deferred block-id checks remembered between two synchronizes


@attrs.frozen(kw_only=True)
class _DeferredCheck:
    """A block-id check of a device-resident table, run on the device."""

    table: Any
    kv: tuple[int, ...]
    block_size: int
    num_blocks: int
    where: str


@attrs.frozen(kw_only=True)
class _Step:
    """One update, prepared: host values per task, block tables to copy, deferred checks."""

    host: list[dict[str, Any]]
    copies: tuple[tuple[Any, AttentionMetadata], ...]  # (captured buffer, metadata whose table it gets)
    deferred: tuple[_DeferredCheck, ...]


@attrs.define
class _TaskFailed(Exception):
    """A device call of an update failed at task ``index`` (-1: before the first task)."""

    index: int
    error: Exception


def _spec(plan: UpdatePlan, i: int) -> OpSpec:
    name = plan.spec_names[i]
    return next(s for s in plan.spec_set if s.name == name)


def _same_table(first: AttentionMetadata, other: AttentionMetadata, *, readable: bool) -> bool:
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


def _named_tasks(
    manager: CaptureManager, exc: BaseException, entries: Sequence[CapturedGraph]
) -> list[tuple[CapturedGraph, TaskRecord]]:
    """The captured tasks a device error names, most specific first.

    By the event, else the task group, of each stream it blocked (a hang) or of the
    error itself (a race); else by the first ``task group #N)`` in its text (the
    simulator's kernel and memory errors), searched in ``entries``.
    """
    sources = getattr(exc, "blocked", None) or [
        {"event": getattr(exc, "event", None), "task_group": getattr(exc, "task_group", None)}
    ]
    found: list[tuple[CapturedGraph, TaskRecord]] = []
    for src in sources:
        hit = manager.task_for_event(src.get("event"))
        if hit is None and src.get("task_group") is not None:
            hit = manager.task_for_group(src["task_group"])
        if hit is not None and all(hit[1] is not t for _, t in found):
            found.append(hit)
    if found:
        return found
    text = str(exc)
    for e in entries:
        for t in e.tasks:
            g = getattr(t.handle, "_group", None)  # the simulator's handles know their group
            if g is not None and f"task group #{g.group_id})" in text:
                return [(e, t)]
    return []


def _failed_task(manager: CaptureManager, exc: BaseException, entry: CapturedGraph) -> TaskRecord | None:
    """The first task of ``entry`` a device error names, if any."""
    return next((t for e, t in _named_tasks(manager, exc, [entry]) if e is entry), None)


def describe_device_error(manager: CaptureManager, exc: BaseException, entry: CapturedGraph | None = None) -> str:
    """Name the namespace, key and layer of each captured task behind a device error."""
    found = _named_tasks(manager, exc, [entry] if entry is not None else manager.entries())
    where = "; ".join(
        f"namespace {e.namespace!r}, key {e.key!r}, layer {t.layer!r} (task {t.index}, {t.spec.name})" for e, t in found
    )
    return f"{where or 'no captured task matched'}: {exc}"


def _resolve(entry: CapturedGraph, plan: UpdatePlan, metadata: StepMetadata) -> list[AttentionMetadata]:
    """The metadata of every task: by layer name, then by KV-cache group, per micro-batch."""
    if isinstance(metadata, Mapping):
        one = plan.uniform and len(metadata) == 1 and plan.layers[0] not in metadata
        if one and metadata.get(plan.groups[0]) is not None:  # the common step: one group's metadata
            return [metadata[plan.groups[0]]] * len(plan.layers)
        get = metadata.get
        metas = [get(layer) for layer in plan.layers]
        if None in metas:  # fall back to the KV-cache group name
            metas = [m if m is not None else get(g) for m, g in zip(metas, plan.groups)]
    elif isinstance(metadata, Sequence) and not isinstance(metadata, (str, bytes)):
        per = list(metadata)
        if max(plan.ubatches, default=0) >= len(per):
            raise MetadataError(
                f"{entry.namespace}/{entry.key!r}: the graph has {max(plan.ubatches) + 1} micro-batches "
                f"but the step's metadata lists {len(per)}"
            )
        for u, m in enumerate(per):
            if not isinstance(m, Mapping):
                raise MetadataError(
                    f"{entry.namespace}/{entry.key!r}: micro-batch {u} of the step's metadata is a "
                    f"{type(m).__name__}; expected a mapping of layer or KV-cache group names to AttentionMetadata"
                )
        metas = []
        for u, layer, g in zip(plan.ubatches, plan.layers, plan.groups):
            found = per[u].get(layer)
            metas.append(found if found is not None else per[u].get(g))
    else:
        raise MetadataError(
            f"{entry.namespace}/{entry.key!r}: step metadata must map layer or KV-cache group names to "
            f"AttentionMetadata (or be a list of such mappings), got {type(metadata).__name__}"
        )
    if None in metas:
        i = metas.index(None)
        where = f" of micro-batch {plan.ubatches[i]}" if not isinstance(metadata, Mapping) else ""
        keys = sorted(map(str, metadata if isinstance(metadata, Mapping) else metadata[plan.ubatches[i]]))
        raise MetadataError(
            f"{entry.namespace}/{entry.key!r}: the step's metadata{where} has no entry for layer "
            f"{plan.layers[i]!r} nor for its KV-cache group {plan.groups[i]!r} (it has {keys[:6]}...); "
            "pass metadata for every captured layer"
        )
    return metas  # type: ignore[return-value]
