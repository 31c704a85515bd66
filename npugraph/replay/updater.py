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
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import attrs

from npugraph.capture import CapturedGraph, CaptureManager
from npugraph.errors import (
    BatchRefused,
    ConfigError,
    GraphDeadlock,
    GraphRace,
    MetadataError,
    NpuGraphError,
    ReplayFailed,
)
from npugraph.replay.blockcheck import DeferredBlockChecks
from npugraph.replay.diagnose import (
    describe_device_error,
    faulted_replays,
    not_replayable,
    release_stuck,
    replay_error,
    replay_fault_message,
    unissued_update,
    update_error,
)
from npugraph.replay.misorder import ABANDONED_REPLAY, DISCARDED_UPDATE, SECOND_REPLAY, Misorders
from npugraph.replay.phases import ORDERS, GraphState, StepMetadata, StepPhase
from npugraph.replay.plan import UpdatePlan, build_plan
from npugraph.replay.prepare import PreparedStep, StepPreparer, stage
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

    The phases of a graph, and the call that moves each to the next, are
    :class:`~npugraph.replay.phases.StepPhase`'s table.

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
        self._misorders = Misorders()

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

    def step_entry(self, entry: CapturedGraph, metadata: StepMetadata, *, refusable: bool = False) -> Any:
        """:meth:`step` of a graph its caller has looked up already (``Runtime.step``).

        ``refusable``: the caller runs a batch the graph's padding rule refuses some other
        way (eagerly), so :class:`~npugraph.errors.BatchRefused` is raised to it, before any
        device call, as an answer rather than a fault (not reported to the post-mortem)."""
        self._misorders.notes.clear()
        found = self._lookup(entry)
        plan, state = found.plan, found.state
        if not plan.tasks:  # nothing to update (a PIECEWISE piece)
            self._replay(entry, plan, state)
            self._misorders.warn(self.order)
            return entry.outputs
        prepared = self._prepare_checked(entry, plan, state, metadata, refusable=refusable)
        self._stage_checked(entry, plan, state, prepared)
        if self.order == "update-first":
            self._write(entry, plan, state, prepared, staged=True)
            self._replay(entry, plan, state)
        else:
            self._replay(entry, plan, state)
            self._write(entry, plan, state, prepared, staged=True)
        self._misorders.warn(self.order)
        return entry.outputs

    def update(self, namespace: str, key: Hashable, metadata: StepMetadata) -> None:
        """Write this step's metadata into the graph of ``(namespace, key)``: half a step.

        ``metadata`` maps attention layer names, or KV-cache group names shared by
        many layers, to :class:`AttentionMetadata` — or is a list of such mappings,
        one per micro-batch.  Each task is resolved by its own layer name first, then
        by its group; never by iteration order.  Bad metadata raises
        :class:`~npugraph.errors.MetadataError` before any device call.
        """
        self._misorders.notes.clear()
        entry, plan, state = self._graph(namespace, key)
        if plan.tasks:
            prepared = self._prepare_checked(entry, plan, state, metadata)
            # the replay this update completes is queued already: what it reads must be in
            # place before it, so the update stream checks and copies (after state.ready)
            staged = not (state.phase is StepPhase.REPLAY_QUEUED and self.order == "replay-first")
            if staged:
                self._stage_checked(entry, plan, state, prepared)
            self._write(entry, plan, state, prepared, staged=staged)
        self._misorders.warn(self.order)

    def replay(self, namespace: str, key: Hashable) -> None:
        """Enqueue the graph of ``(namespace, key)`` on the current stream: half a step.

        After :meth:`update` it runs that update's lengths; in replay-first order it
        waits on the device for the update that follows.
        """
        self._misorders.notes.clear()
        entry, plan, state = self._graph(namespace, key)
        self._replay(entry, plan, state, ready=True)
        self._misorders.warn(self.order)

    def refusal(self, namespace: str, key: Hashable, metadata: StepMetadata) -> str | None:
        """Why the graph of ``(namespace, key)`` cannot run the batch ``metadata`` holds (the
        step's own :class:`~npugraph.errors.BatchRefused`, by the padding rule), or ``None``:
        a question asked without stepping.  An engine that runs a refused batch eagerly
        steps with ``refusable=True`` instead, which resolves the metadata once.  Nothing
        else is checked: malformed metadata gives ``None``, and :meth:`step` refuses it with
        the reason."""
        entry, plan, _ = self._graph(namespace, key)
        return self._preparer.refusal(entry, plan, metadata)

    def _prepare_checked(
        self,
        entry: CapturedGraph,
        plan: UpdatePlan,
        state: GraphState,
        metadata: StepMetadata,
        *,
        refusable: bool = False,
    ) -> PreparedStep:
        try:
            return self._preparer.prepare(entry, plan, state, metadata)
        except NpuGraphError as bad:
            if state.phase is StepPhase.REPLAY_QUEUED and self.order == "replay-first":
                # this step's replay is already queued: let it run empty rather than wait forever
                self._release(plan, state)
            if not (refusable and isinstance(bad, BatchRefused)):
                self._report(bad, entry)
            raise

    def _write(
        self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, step: PreparedStep, *, staged: bool
    ) -> None:
        """Issue a prepared update and move the graph to its next phase (``staged``: its
        block tables were checked and copied already, on the engine's stream)."""
        t0, d0 = time.perf_counter(), self.device.device_seconds()
        misordered = DISCARDED_UPDATE if state.phase is StepPhase.UPDATED else None
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
            err = update_error(self.manager, entry, plan, failed)
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
            self._misorders.note(entry, state, misordered, "update")

    def _replay(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, *, ready: bool = False) -> None:
        """Enqueue a replay and move the graph to its next phase (the table in :class:`StepPhase`);
        ``ready``: a replay that waits for its update records ``state.ready`` first."""
        t0, d0 = time.perf_counter(), self.device.device_seconds()
        try:
            self._enqueue(entry, plan, state, ready)
        finally:
            busy = self.device.device_seconds() - d0
            state.last_replay_s = time.perf_counter() - t0 - busy

    def _enqueue(self, entry: CapturedGraph, plan: UpdatePlan, state: GraphState, ready: bool) -> None:
        self._release_other(entry)
        if not plan.tasks:  # nothing to update: no events to wait for
            self._launch(entry, state, waits=False)
            return
        misordered = None
        if state.phase is StepPhase.REPLAY_QUEUED:
            misordered = SECOND_REPLAY
            self._release(plan, state)  # abandoned by the caller: let it run empty
        update_first = self.order == "update-first"
        if state.phase is StepPhase.UPDATED and not update_first:
            misordered = DISCARDED_UPDATE
        if state.phase is StepPhase.UPDATED and update_first:
            self._launch(entry, state, waits=False)
            return
        if update_first:
            err = not_replayable(entry, broken=state.phase is StepPhase.BROKEN)
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
            self._misorders.note(entry, state, misordered, "replay")

    def _launch(self, entry: CapturedGraph, state: GraphState, *, waits: bool) -> None:
        """Enqueue the graph; ``waits``: it waits on the device for the update that follows."""
        try:
            entry.graph.replay()
        except Exception as exc:
            state.phase = StepPhase.BROKEN
            err = replay_error(self.manager, entry, exc)
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
            self._misorders.note(other, state, ABANDONED_REPLAY, f"call on {entry.namespace}/{entry.key!r}")

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
            err = update_error(self.manager, entry, plan, failed)
            self._report(err, entry)
            raise err from failed.error

    def _stage(self, entry: CapturedGraph, plan: UpdatePlan, step: PreparedStep) -> None:
        """Queue the step's block-id checks and block-table copies on the current stream."""
        if step.copies and self._updated:
            self._invalidate_sharers(entry, plan)
        try:
            stage(self.device, self._block_checks, step)
        except Exception as exc:
            raise TaskFailed(-1, exc) from exc

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
            for faulted, skipped in faulted_replays(self.manager, exc):
                # the events whose waits its cancelled rest skipped stay recorded; BROKEN until
                # the graph's next complete step
                st, ids = self.state(faulted), {id(e) for e in skipped}
                st.pending[:] = [t.records and id(t.event) in ids for t in faulted.tasks]
                st.phase = StepPhase.BROKEN
            message, entry = replay_fault_message(self.manager, exc)
            flagged = self._block_checks.take_flagged()
            also = f" A device-side block-id check also failed: {flagged}." if flagged else ""
            err: NpuGraphError = ReplayFailed(message + also)
            self._report(err, entry)
            raise err from exc
        except dev.deadlock_errors as exc:
            err = GraphDeadlock(describe_device_error(self.manager, exc))
            stuck, drained = release_stuck(self.manager, exc)
            for entry in stuck:
                self.state(entry).phase = StepPhase.BROKEN
            if drained:
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
            err = GraphDeadlock(unissued_update(released, self.order, self._block_checks.take_flagged()))
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
