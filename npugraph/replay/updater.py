"""Sequence every step of captured graphs: the step table, recovery, and synchronize.

:meth:`ReplayUpdater.step` is the one place that orders a step's update and replay;
:meth:`~ReplayUpdater.update` and :meth:`~ReplayUpdater.replay` are its halves, for
engines that call them apart, and follow the same table (:mod:`.phases`).  A step's
metadata is made ready with no device call (:mod:`.prepare`), then its tasks are
re-issued on the one update stream (:mod:`.tasks`); block ids of device tables are
checked on the device (:mod:`.blockcheck`).  After any error the graph is left in a
phase from which the next good step succeeds, in either order (see
docs/step-protocol.md); device errors name their graph and layer (:mod:`.diagnose`).
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs

from npugraph.capture import CapturedGraph, CaptureManager
from npugraph.errors import (
    ConfigError,
    GraphDeadlock,
    GraphRace,
    MetadataError,
    NotReplayableError,
    NpuGraphError,
    ReplayFailed,
    StepOrderWarning,
    UpdateFailed,
)
from npugraph.metadata import batch_refusal, real_batch
from npugraph.replay.blockcheck import DeferredBlockChecks
from npugraph.replay.diagnose import caller_level, describe_device_error, failed_task
from npugraph.replay.phases import ORDERS, GraphState, StepMetadata, StepPhase
from npugraph.replay.plan import Geometry, UpdatePlan, build_plan
from npugraph.replay.prepare import PreparedStep, StepPreparer, resolve
from npugraph.replay.tasks import TaskFailed, issue_tasks, null_tasks

__all__ = ["ORDERS", "ReplayUpdater", "StepMetadata", "StepPhase", "GraphState", "describe_device_error"]


class ReplayUpdater:
    """Apply each step's lengths and block tables to captured graphs, and sequence each step.

    Workflow per step:

    1. the engine builds per-layer (or per-KV-cache-group) :class:`AttentionMetadata`;
    2. :meth:`step` validates and pads every distinct metadata object once (a bad one
       raises :class:`~npugraph.errors.MetadataError` before any device call), checks
       the block ids of device-resident tables and copies block tables into the captured
       buffers once per buffer on the engine's stream (after the engine's own writes of
       its tables, before the replay that reads them), then in the runtime's ``order``
       replays the graph and updates it — on the one update stream, ordered after the
       previous replay by an event (never a host synchronize), re-issuing
       each task whose host arguments changed inside ``graph_task_update_begin/end`` and
       recording each task's ``ExternalEvent``;
    3. :meth:`synchronize` before reading outputs on the host.

    The phases of a graph (``order`` decides the two calls a step makes):

    =================  =======================  ==================================
    phase              call                     next phase
    =================  =======================  ==================================
    IDLE               update                   UPDATED
    IDLE               replay (replay-first)    REPLAY_QUEUED
    IDLE               replay (update-first)    refused: update first
    UPDATED            replay (update-first)    IDLE (the replay runs the update)
    UPDATED            replay (replay-first)    REPLAY_QUEUED (the stale update's
                                                events are consumed first)
    UPDATED            update                   UPDATED (the earlier update's
                                                events are consumed first)
    UPDATED            another graph's update   BROKEN (it rewrote a block-table
                       into a shared buffer     buffer this update's lengths read)
    REPLAY_QUEUED      update (replay-first)    IDLE (the waiting replay runs it)
    REPLAY_QUEUED      update (update-first)    UPDATED (the waiting replay of an
                                                earlier step is released first)
    REPLAY_QUEUED      replay                   REPLAY_QUEUED (the waiting one is
                                                released first)
    BROKEN             update                   UPDATED (stale events consumed,
                                                every task re-issued)
    BROKEN             replay (replay-first)    REPLAY_QUEUED (likewise)
    BROKEN             replay (update-first)    refused: update first
    =================  =======================  ==================================

    A *released* replay runs with no request (every key length 0: it reads no block
    and its attention writes zeros), so nothing waits forever.  Errors: bad metadata
    changes nothing on the device, except that a replay waiting for it is released;
    a device error part-way through an update releases a waiting replay, else leaves
    the graph BROKEN; a replay fault (reported by :meth:`synchronize`, as the device
    reports asynchronous work) leaves it BROKEN; :meth:`synchronize` with a replay still
    waiting raises :class:`~npugraph.errors.GraphDeadlock` at once instead of hanging.

    FIA tasks are updated through the device's 4-in-1
    ``_npu_fused_infer_attention_score_out_graph`` where it has one (``fused_update``;
    default: on hardware).  One updater, one update stream, one thread: CANN does not
    allow concurrent task updates.  The updater never captures.
    """

    def __init__(
        self,
        manager: CaptureManager,
        *,
        order: str = "replay-first",
        validate: bool = True,
        skip_unchanged: bool = True,
        fused_update: bool | None = None,
        on_error: Callable[[NpuGraphError, CapturedGraph | None], None] | None = None,
        on_update: Callable[[CapturedGraph, GraphState], None] | None = None,
        defer_block_check: bool | None = None,
    ) -> None:
        self.manager = manager
        self.order = order
        self.device = manager.device
        # None: block ids of device-resident tables are checked on the device (a host read
        # would synchronize) and reported by check_deferred(); host tables on the host.
        # True treats every table as device memory (the simulator's live on the CPU).
        self._preparer = StepPreparer(
            manager=manager, device=self.device, validate=validate, defer_block_check=defer_block_check
        )
        self._block_checks = DeferredBlockChecks()
        self.skip_unchanged = skip_unchanged
        if fused_update is None:
            fused_update = self.device.fused_update_pays
        self._fused = self.device.fused_fia_update if fused_update else None
        self._stream: Any = None  # made on first use
        # The done event of the latest replay that waits for no update: every update is
        # ordered after it, so it lands after the replays that read what it rewrites.
        self._after: Any = None
        # The one graph whose replay waits for its update, if any.  A waiting replay blocks
        # its stream, so the updater keeps it the last replay enqueued: any other graph's
        # step releases it first (it was abandoned).  Then ``_after`` always precedes it.
        self._waiting: CapturedGraph | None = None
        # graphs whose update no replay ran yet (a superset: pruned as they are looked at)
        self._updated: weakref.WeakSet[CapturedGraph] = weakref.WeakSet()
        # dropped with the graph: a plan holds task-group handles, which must not
        # outlive the graph the manager released
        self._registered: weakref.WeakKeyDictionary[CapturedGraph, _Registered] = weakref.WeakKeyDictionary()
        self._on_error = on_error
        self._on_update = on_update
        # misordered halves found by the current call, warned of when it returns
        self._order_notes: list[tuple[CapturedGraph, str, str]] = []

    @property
    def order(self) -> str:
        """The order of a step's two halves: ``"replay-first"`` or ``"update-first"``."""
        return self._order

    @order.setter
    def order(self, order: str) -> None:
        if order not in ORDERS:
            raise ConfigError(f"order must be 'replay-first' or 'update-first', got {order!r}")
        self._order = order

    @property
    def validate(self) -> bool:
        """Whether each step's lengths and block ids are checked (off: benchmarks of the bare update)."""
        return self._preparer.validate

    @validate.setter
    def validate(self, validate: bool) -> None:
        self._preparer.validate = validate

    @property
    def defer_block_check(self) -> bool | None:
        """``None``: device tables' block ids checked on the device, host tables' on the host;
        ``True``: every table is treated as device memory."""
        return self._preparer.defer_block_check

    @property
    def stream(self) -> Any:
        """The one update stream, shared by every graph and namespace."""
        if self._stream is None:
            self._stream = self.device.npu.Stream()
        return self._stream

    def register(self, entry: CapturedGraph) -> None:
        """Build ``entry``'s update plan and step state (when its capture ends)."""
        npu = self.device.npu
        n = len(entry.tasks)
        plan = build_plan(entry, self.device, self._fused)
        state = GraphState(
            pending=[False] * n,
            applied=[None] * n,
            lens_of=[None] * n,
            host_of=[None] * n,
            done=(npu.Event(), npu.Event()),
            ready=npu.Event(),
        )
        self._registered[entry] = _Registered(plan=plan, state=state)

    def _lookup(self, entry: CapturedGraph) -> _Registered:
        found = self._registered.get(entry)
        if found is None:
            self.register(entry)  # a graph captured by a bare CaptureManager
            found = self._registered[entry]
        return found

    def state(self, entry: CapturedGraph) -> GraphState:
        """The per-step state of ``entry``."""
        return self._lookup(entry).state

    def plan(self, entry: CapturedGraph) -> UpdatePlan:
        """The update plan of ``entry`` (built when its capture ended)."""
        return self._lookup(entry).plan

    def _graph(self, namespace: str, key: Hashable) -> tuple[CapturedGraph, UpdatePlan, GraphState]:
        entry = self.manager.entry(namespace, key)
        found = self._lookup(entry)
        return entry, found.plan, found.state

    # --- the step --------------------------------------------------------------------
    def step(self, namespace: str, key: Hashable, metadata: StepMetadata) -> Any:
        """Run one step of the graph of ``(namespace, key)`` in this updater's order.

        Bad metadata is refused before any device call.  Returns the graph's outputs
        (non-owning aliases: valid until another graph of the pool replays).
        """
        return self.step_entry(self.manager.entry(namespace, key), metadata)

    def step_entry(self, entry: CapturedGraph, metadata: StepMetadata) -> Any:
        """:meth:`step` of a graph its caller has looked up already (``Runtime.step``)."""
        self._order_notes.clear()
        found = self._lookup(entry)
        plan, state = found.plan, found.state
        if not plan.tasks:  # nothing to update (a PIECEWISE piece)
            self._replay(entry, plan, state)
            self._warn_noted_misorders()
            return entry.outputs
        prepared = self._prepare_checked(entry, plan, state, metadata)
        self._stage_checked(entry, plan, state, prepared)
        if self.order == "update-first":
            self._write(entry, plan, state, prepared, staged=True)
            self._replay(entry, plan, state)
        else:
            self._replay(entry, plan, state)
            self._write(entry, plan, state, prepared, staged=True)
        self._warn_noted_misorders()
        return entry.outputs

    def update(self, namespace: str, key: Hashable, metadata: StepMetadata) -> None:
        """Write this step's metadata into the graph of ``(namespace, key)``: half a step.

        ``metadata`` maps attention layer names, or KV-cache group names shared by
        many layers, to :class:`AttentionMetadata` — or is a list of such mappings,
        one per micro-batch.  Each task is resolved by its own layer name first, then
        by its group; never by iteration order.  Bad metadata raises
        :class:`~npugraph.errors.MetadataError` before any device call.
        """
        self._order_notes.clear()
        entry, plan, state = self._graph(namespace, key)
        if plan.tasks:
            prepared = self._prepare_checked(entry, plan, state, metadata)
            # the replay this update completes is queued already: what it reads must be in
            # place before it, so the update stream checks and copies (after state.ready)
            staged = not (state.phase is StepPhase.REPLAY_QUEUED and self.order == "replay-first")
            if staged:
                self._stage_checked(entry, plan, state, prepared)
            self._write(entry, plan, state, prepared, staged=staged)
        self._warn_noted_misorders()

    def replay(self, namespace: str, key: Hashable) -> None:
        """Enqueue the graph of ``(namespace, key)`` on the current stream: half a step.

        After :meth:`update` it runs that update's lengths; in replay-first order it
        waits on the device for the update that follows.
        """
        self._order_notes.clear()
        entry, plan, state = self._graph(namespace, key)
        self._replay(entry, plan, state, ready=True)
        self._warn_noted_misorders()

    def refusal(self, namespace: str, key: Hashable, metadata: StepMetadata) -> str | None:
        """Why the graph of ``(namespace, key)`` cannot run the batch ``metadata`` holds
        (:func:`~npugraph.metadata.batch_refusal`: too many requests or tokens, spare tokens with
        no padding row, or several query tokens per request for PA), or ``None``: what an
        engine asks before it replays rather than runs a batch eagerly.  Nothing else is
        checked: malformed metadata gives ``None``, and :meth:`step` refuses it with the
        reason.  Plain decode metadata (no ``query_start_loc``) on a graph of one token per
        row always fits, and is not read."""
        entry, plan, _ = self._graph(namespace, key)
        if not plan.tasks:
            return None
        try:
            metas = resolve(entry, plan, metadata)
        except MetadataError:
            return None
        seen: set[tuple[int, Geometry, bool]] = set()
        for t, meta in zip(plan.tasks, metas):
            geometry, one_token = t.geometry, t.one_query_token
            if (id(meta), geometry, one_token) in seen:
                continue
            seen.add((id(meta), geometry, one_token))
            if geometry.batch >= geometry.tokens and getattr(meta, "query_start_loc", None) is None:
                continue  # one token per request, as many rows as tokens: it always fits
            found = real_batch(meta, max(1, geometry.tokens // max(1, geometry.batch)))
            refused = (
                None
                if found is None
                else batch_refusal(geometry.batch, geometry.tokens, *found, one_query_token=one_token)
            )
            if refused is not None:
                return f"{t.where}: {refused}"
        return None

    def _prepare_checked(
        self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, metadata: StepMetadata
    ) -> PreparedStep:
        try:
            return self._preparer.prepare(entry, plan, state, metadata)
        except NpuGraphError as bad:
            if state.phase is StepPhase.REPLAY_QUEUED and self.order == "replay-first":
                # this step's replay is already queued: let it run empty rather than wait forever
                self._release(plan, state)
            self._report(bad, entry)
            raise

    def _write(
        self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, step: PreparedStep, *, staged: bool
    ) -> None:
        """Issue a prepared update and move the graph to its next phase (``staged``: its
        block tables were checked and copied already, on the engine's stream)."""
        t0, d0 = time.perf_counter(), self.device.device_seconds()
        misordered = _DISCARDED_UPDATE if state.phase is StepPhase.UPDATED else None
        self._release_other(entry)
        if state.phase is StepPhase.REPLAY_QUEUED and self.order == "update-first":
            self._release(plan, state)  # a replay of an earlier step: it must not take this update
        if state.phase in (StepPhase.BROKEN, StepPhase.UPDATED):
            # events an earlier update recorded: a replay would pass their waits before this
            # update's re-issues land (and run the earlier lengths), so consume them first
            self._settle(plan, state)
        waiting = state.phase is StepPhase.REPLAY_QUEUED
        try:
            reissued = self._issue(entry, plan, state, step, staged=staged)
        except TaskFailed as failed:
            err = self._update_error(entry, plan, failed)
            if waiting:
                self._release(plan, state, keep=step.host)
            else:
                state.phase = StepPhase.BROKEN
            self._report(err, entry)
            raise err from failed.error
        state.last_reissued = reissued
        state.steps += 1
        if waiting:
            self._waiting_ran(state)
        else:
            state.phase = StepPhase.UPDATED
            self._updated.add(entry)  # its update waits for a replay: another graph's copy may void it
        busy = self.device.device_seconds() - d0
        state.last_update_s = time.perf_counter() - t0 - busy
        if self._on_update is not None:
            self._on_update(entry, state)
        if misordered is not None:
            self._note_misorder(entry, state, misordered, "update")

    def _replay(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, *, ready: bool = False) -> None:
        """Enqueue a replay and move the graph to its next phase (see the class table);
        ``ready``: a replay that waits for its update records ``state.ready`` first."""
        t0, d0 = time.perf_counter(), self.device.device_seconds()
        try:
            self._enqueue(entry, plan, state, ready)
        finally:
            busy = self.device.device_seconds() - d0
            state.last_replay_s = time.perf_counter() - t0 - busy

    def _enqueue(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, ready: bool) -> None:
        where = f"{entry.namespace}/{entry.key!r}"
        self._release_other(entry)
        if not plan.tasks:  # nothing to update: no events to wait for
            self._launch(entry, state, waits=False)
            return
        misordered = None
        if state.phase is StepPhase.REPLAY_QUEUED:
            misordered = _SECOND_REPLAY
            self._release(plan, state)  # abandoned by the caller: let it run empty
        update_first = self.order == "update-first"
        if state.phase is StepPhase.UPDATED and not update_first:
            misordered = _DISCARDED_UPDATE
        if state.phase is StepPhase.UPDATED and update_first:
            self._launch(entry, state, waits=False)
            return
        if update_first:
            why = (
                "its last update or replay failed part-way, so its layers may hold several steps' lengths"
                if state.phase is StepPhase.BROKEN
                else "it has no update since its last replay"
            )
            err = NotReplayableError(
                f"{where} is not replayable: {why}. In update-first order call update() with complete, "
                "valid metadata before each replay() (or use step())."
            )
            self._report(err, entry)
            raise err
        if state.phase is not StepPhase.IDLE:
            # UPDATED: that update belongs to an earlier step (in this order a step's update
            # follows its replay); BROKEN: events left recorded by a failure.
            self._settle(plan, state)
        if ready:
            state.ready.record()  # on the engine's stream, after the tables it wrote for this step
        self._launch(entry, state, waits=True)
        if misordered is not None:
            self._note_misorder(entry, state, misordered, "replay")

    def _launch(self, entry: CapturedGraph, state: GraphState, *, waits: bool) -> None:
        """Enqueue the graph; ``waits``: it waits on the device for the update that follows."""
        try:
            entry.graph.replay()
        except Exception as exc:
            state.phase = StepPhase.BROKEN
            if isinstance(exc, self.device.race_errors):
                err: NpuGraphError = GraphRace(describe_device_error(self.manager, exc, entry))
            else:
                err = ReplayFailed(
                    f"replay of {entry.namespace}/{entry.key!r} failed: {type(exc).__name__}: "
                    f"{str(exc).rstrip('.')}. The next complete step replays it again."
                )
            self._report(err, entry)
            raise err from exc
        state.replays += 1
        self._updated.discard(entry)  # its update is consumed: no copy can void it now
        if not entry.tasks:
            return
        done = state.done[(state.replays - 1) % 2]
        done.record()  # on the current stream, where the replay went
        if waits:
            state.phase = StepPhase.REPLAY_QUEUED
            state.waiting_done = done
            self._waiting = entry
        else:
            state.phase = StepPhase.IDLE
            state.pending[:] = [False] * len(state.pending)
            self._after = done

    # --- recovery --------------------------------------------------------------------
    def _waiting_ran(self, state: GraphState) -> None:
        """The waiting replay got every event: it consumes them and can finish."""
        state.pending[:] = [False] * len(state.pending)
        state.phase = StepPhase.IDLE
        self._after = state.waiting_done
        state.waiting_done = None
        self._waiting = None

    def _invalidate_sharers(self, entry: CapturedGraph, plan: UpdatePlan) -> None:
        """Another graph's update that no replay ran yet read a block-table buffer this
        update rewrites: replayed now it would run its lengths over this step's table."""
        for other in list(self._updated):
            st = self.state(other)
            if st.phase is not StepPhase.UPDATED:
                self._updated.discard(other)
            elif other is not entry and self.plan(other).shares_buffer_with(plan):
                st.phase = StepPhase.BROKEN
                self._updated.discard(other)

    def _release_other(self, entry: CapturedGraph) -> None:
        """Another graph's replay still waits: its step was abandoned; let it run empty."""
        other = self._waiting
        if other is not None and other is not entry:
            state = self.state(other)
            self._release(self.plan(other), state)
            self._note_misorder(other, state, _ABANDONED_REPLAY, f"call on {entry.namespace}/{entry.key!r}")

    def _note_misorder(self, entry: CapturedGraph, state: GraphState, kind: str, call: str) -> None:
        """Note, once per graph and kind, that a half step discarded work nobody ran; the
        public call that found it warns at the caller's line when it returns."""
        if kind in state.warned:
            return
        state.warned.add(kind)
        self._order_notes.append((entry, kind, call))

    def _warn_noted_misorders(self) -> None:
        """Warn of the misordered halves this call found, once it has done all it does (a
        warning turned into an error then interrupts nothing)."""
        notes, self._order_notes = self._order_notes, []
        for entry, kind, call in notes:
            self._warn_misorder(entry, kind, call)

    def _warn_misorder(self, entry: CapturedGraph, kind: str, call: str) -> None:
        what = {
            _DISCARDED_UPDATE: "discarded the update made before it, which no replay ran",
            _SECOND_REPLAY: "came while its previous replay still waited for an update; that replay was "
            "released and ran with no request (zeros)",
            _ABANDONED_REPLAY: "released this graph's replay, which waited for an update that never came; "
            "it ran with no request (zeros)",
        }[kind]
        order = (
            "replay() then update() (the replay waits on the device for its update)"
            if self.order == "replay-first"
            else "update() then replay()"
        )
        warnings.warn(
            f"{entry.namespace}/{entry.key!r}: this {call} {what}. In {self.order} order a step is {order}; "
            "call the two halves in that order for one graph at a time, or use step(). (Said once per graph.)",
            StepOrderWarning,
            stacklevel=caller_level(),
        )

    def _release(self, plan: UpdatePlan, state: GraphState, keep: list[dict[str, Any]] | None = None) -> None:
        """Let the replay that waits for this graph's update run with no request (zeros).

        Every task is re-issued with key lengths 0 (it then reads no block, whatever the
        block-table buffer holds now), except those ``keep`` says this step already
        wrote; then every event not yet recorded is.  A task the device refuses even
        that is left unknown (the graph is BROKEN, but nothing waits forever).
        """
        update_stream = self.stream
        with self.device.npu.stream(update_stream):
            self._order_update(update_stream)
            ok = null_tasks(self.device.npu, update_stream, plan, state, keep)
        self._waiting_ran(state)
        if not ok:
            state.phase = StepPhase.BROKEN

    def _settle(self, plan: UpdatePlan, state: GraphState) -> None:
        """Consume the events a failure or an earlier step left recorded, and forget
        what the tasks hold, so that the next update re-issues every task."""
        update_stream = self.stream
        npu = self.device.npu
        if any(state.pending):
            with npu.stream(update_stream):
                for t in plan.tasks:
                    if state.pending[t.index]:
                        t.event.wait(update_stream)
                        state.pending[t.index] = False
            # a replay enqueued next must not race these waits for a record
            npu.current_stream().wait_stream(update_stream)
        if state.phase is StepPhase.BROKEN:
            state.applied[:] = [None] * len(state.applied)
        state.phase = StepPhase.IDLE

    def _entries_by_graph(self) -> dict[int, CapturedGraph]:
        """npugraph's captured graphs by the id of their device graph (what a device error names)."""
        return {id(e.graph): e for e in self.manager.entries()}

    def _release_stuck(self, hang: BaseException) -> bool:
        """After a hang the device reported (an event record that never landed: a device
        fault, as npugraph records every event it waits on), record each ExternalEvent one
        of npugraph's replays is stuck on, so that the device drains; the graph is BROKEN
        until its next complete step.  Whether the device then drained."""
        by_graph = self._entries_by_graph()
        stuck = []
        for blocked in getattr(hang, "blocked", ()):
            entry = by_graph.get(id(blocked.get("graph")))
            event = blocked.get("event")
            if entry is not None and any(t.event is event for t in entry.tasks):
                stuck.append((entry, event))
        if not stuck:
            return False
        # on a stream of their own: the update stream may itself wait behind the stuck replay
        # (the next step's update is ordered after it); made only here, after a device fault
        side = self.device.npu.Stream()
        with self.device.npu.stream(side):
            for entry, event in stuck:
                event.record(side)
                self.state(entry).phase = StepPhase.BROKEN
        try:
            self.device.npu.synchronize()
        except Exception:  # still stuck elsewhere: the error already says where
            return False
        return True

    def replay_faulted(self, entry: CapturedGraph, waits_skipped: Sequence[Any]) -> None:
        """A replay of ``entry`` was cancelled by a device fault: the events whose waits
        it skipped stay recorded; the graph is BROKEN until its next complete step."""
        state = self.state(entry)
        skipped = {id(e) for e in waits_skipped}
        state.pending[:] = [t.records and id(t.event) in skipped for t in entry.tasks]
        state.phase = StepPhase.BROKEN

    def waiting(self) -> list[CapturedGraph]:
        """The graph whose replay waits for an update, if any (a synchronize would hang)."""
        return [] if self._waiting is None else [self._waiting]

    # --- update internals ------------------------------------------------------------
    def _order_update(self, update_stream: Any) -> None:
        """Order the update stream after the latest replay that waits for no update: it
        must consume the previous step's lengths and events before this step's land."""
        if self._after is not None:
            update_stream.wait_event(self._after)

    def _issue(
        self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, step: PreparedStep, *, staged: bool
    ) -> int:
        """Issue the step's update on the update stream; return how many tasks were re-issued.

        A failure is raised as :class:`TaskFailed` naming the task it happened at
        (``-1``: before any task, while checking or copying block tables).
        """
        update_stream = self.stream
        with self.device.npu.stream(update_stream):
            self._order_update(update_stream)
            if not staged:
                update_stream.wait_event(state.ready)  # after the tables the engine wrote before the replay
                self._stage(entry, plan, step)
            return issue_tasks(
                self.device.npu,
                update_stream,
                plan,
                state,
                step.host,
                skip_unchanged=self.skip_unchanged,
                fused=self._fused,
            )

    def _stage_checked(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, step: PreparedStep) -> None:
        """Check and copy the step's block tables on the engine's (current) stream, before
        this step's replay and update: stream order puts them after the engine's own writes
        of its tables, and before the replay that reads the captured buffers."""
        if not (step.copies or step.deferred):
            return
        try:
            self._stage(entry, plan, step)
        except TaskFailed as failed:
            if state.phase is StepPhase.REPLAY_QUEUED:
                self._release(plan, state)  # a replay abandoned earlier: let it run empty rather than wait
            state.phase = StepPhase.BROKEN  # a buffer may hold part of this step's table
            err = self._update_error(entry, plan, failed)
            self._report(err, entry)
            raise err from failed.error

    def _stage(self, entry: CapturedGraph, plan: UpdatePlan, step: PreparedStep) -> None:
        """Queue the step's block-id checks and block-table copies on the current stream."""
        if step.copies and self._updated:
            self._invalidate_sharers(entry, plan)
        try:
            for check in step.deferred:
                self._block_checks.flag(check)
            for buf, meta in step.copies:
                src = meta.block_table
                if buf.data_ptr() != src.data_ptr():
                    rows = min(int(src.shape[0]), int(buf.shape[0]))
                    cols = min(int(src.shape[1]), int(buf.shape[1]))
                    buf[:rows, :cols].copy_(self.device.staged(src[:rows, :cols]), non_blocking=True)
        except Exception as exc:
            raise TaskFailed(-1, exc) from exc

    def _update_error(self, entry: CapturedGraph, plan: UpdatePlan, failed: TaskFailed) -> NpuGraphError:
        cause, i = failed.error, failed.index
        where = "checking or copying block tables" if i < 0 else f"layer {plan.tasks[i].layer!r} (task {i})"
        name = f"{entry.namespace}/{entry.key!r}"
        if isinstance(cause, self.device.race_errors):
            return GraphRace(f"update of {name} at {where}: " + describe_device_error(self.manager, cause, entry))
        return UpdateFailed(
            f"update of {name} failed at {where}: {type(cause).__name__}: {str(cause).rstrip('.')}. "
            "The next complete update re-issues every layer."
        )

    # --- synchronize -----------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the device; turn a hang, a race or a replay fault into a typed error.

        A replay still waiting for its update would block the device until its
        event-wait timeout: it is released first (it runs with no request; its attention
        writes zeros), the device is synchronized, and then
        :class:`~npugraph.errors.GraphDeadlock` names it.  A replay fault raises
        :class:`~npugraph.errors.ReplayFailed` and leaves its graph BROKEN until its next
        complete step.  Then a bad block id found by a deferred device-side check is
        reported.  Whatever it raises, the device is drained: nothing is left waiting.
        """
        dev = self.device
        released = self.waiting()
        for e in released:
            self._release(self.plan(e), self.state(e))
        try:
            dev.npu.synchronize()
        except dev.fault_errors as exc:
            by_graph = self._entries_by_graph()
            for fault in (exc, *getattr(exc, "others", ())):
                faulted = by_graph.get(id(getattr(fault, "graph", None)))
                if faulted is not None:
                    self.replay_faulted(faulted, getattr(fault, "waits_skipped", ()))
            entry = by_graph.get(id(getattr(exc, "graph", None)))
            failed = failed_task(self.manager, exc, entry) if entry is not None else None
            after = " The rest of that replay was cancelled; the graph's next complete step runs it again."
            if entry is not None:
                where = f"replay of {entry.namespace}/{entry.key!r} failed" + (
                    "" if failed is None else f" in layer {failed.layer!r} (task {failed.index}, {failed.spec.name})"
                )
            elif getattr(exc, "graph", None) is not None:
                where = "a replay of a graph npugraph did not capture failed"
            else:  # no replay: the engine's own eager work on a stream
                where, after = "device work outside npugraph's graphs (an eager op or kernel on a stream) failed", ""
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            flagged = self._block_checks.take_flagged()
            also = f" A device-side block-id check also failed: {flagged}." if flagged else ""
            err: NpuGraphError = ReplayFailed(
                f"{where}: {type(cause).__name__}: {str(cause).rstrip('.')}.{after}{also}"
            )
            self._report(err, entry)
            raise err from exc
        except dev.deadlock_errors as exc:
            err = GraphDeadlock(describe_device_error(self.manager, exc))
            if self._release_stuck(exc):
                err = GraphDeadlock(
                    f"{str(err).rstrip()}\nnpugraph recorded the events its replays waited on (their step's "
                    "output is lost), so the device drained; those graphs' next steps update every layer."
                )
            self._report(err, None)
            raise err from exc
        except dev.race_errors as exc:
            err = GraphRace(describe_device_error(self.manager, exc))
            self._report(err, None)
            raise err from exc
        if released:
            names = ", ".join(f"{e.namespace}/{e.key!r} (first layer {e.tasks[0].layer!r})" for e in released)
            flagged = self._block_checks.take_flagged()
            err = GraphDeadlock(
                f"the replay of {names} waited on the device for its update, which was never issued: "
                "synchronize would have blocked forever (on hardware: event-wait timeout 507011 after "
                f"~30 min). It was released and ran with no request (its outputs are zeros). In {self.order} "
                "order a replay that no update preceded waits for the update after it: call update() after "
                "replay(), or use step(), which orders both."
                + (f" A device-side block-id check also failed: {flagged}." if flagged else "")
            )
            self._report(err, None)
            raise err
        self.check_deferred()

    def check_deferred(self) -> None:
        """Raise :class:`~npugraph.errors.MetadataError` for a bad block id found on the device.

        Call it when the device is idle (``Runtime.synchronize`` does): reading the flags
        then costs no synchronize.  The step that carried the bad id has already run, so
        its output is wrong; the graph stays replayable and later steps are unaffected.
        Each check is reported once; the last 64 checks are remembered (the oldest is named).
        """
        flagged = self._block_checks.take_flagged()
        if not flagged:
            return
        err = MetadataError(
            f"{flagged}. That step has already run and read a wrong block, so its output is wrong; "
            "fix the block table the engine passes (the graph stays replayable)."
        )
        self._report(err, None)
        raise err

    # --- errors ----------------------------------------------------------------------
    def _report(self, err: NpuGraphError, entry: CapturedGraph | None) -> None:
        if self._on_error is not None:
            self._on_error(err, entry)


@attrs.frozen(kw_only=True)
class _Registered:
    """A registered graph's plan and step state (one lookup per step)."""

    plan: UpdatePlan
    state: GraphState


# the kinds of misordered half steps StepOrderWarning names
_DISCARDED_UPDATE = "discarded update"
_SECOND_REPLAY = "second replay"
_ABANDONED_REPLAY = "abandoned replay"
