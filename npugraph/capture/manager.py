"""Capture one device graph per (namespace, key), recording every updatable attention task."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import attrs
import torch
from tqdm import tqdm

from npugraph.capture.advice import capture_failed
from npugraph.capture.attempt import (
    MOST_TRIES,
    Capture,
    How,
    Request,
    alias,
    alias_tree,
    batch_of,
    call_shape,
    collector_walks_only_new,
    host_tuple,
)
from npugraph.capture.events import EventSchedule, group_size
from npugraph.capture.records import CapturedGraph, TaskRecord
from npugraph.capture.report import capture_report
from npugraph.capture.sink import (
    SINK_MIN_LAYERS,
    SinkCapture,
    check_width,
    frozen,
    mark_recorder,
    refusal,
    upgrade,
)
from npugraph.device import Device
from npugraph.errors import CaptureFailed, ConfigError, UnknownKeyError
from npugraph.metadata import StepLens
from npugraph.ops import SPECS, AttentionCall, OpSpec
from npugraph.policy import KernelChoice, KernelPolicy, StaticPolicy

__all__ = ["CaptureManager", "SINK_MIN_LAYERS"]


logger = logging.getLogger("npugraph")


class CaptureManager:
    """Capture callables into one device graph per key, per namespace, in one memory pool.

    Workflow of :meth:`capture` — the callable runs under ``torch.npu.graph``, once, or again
    when its first graph shows it must be captured another way (a namespace's first graph
    counts the tasks that event groups divide; the tiling-sink path refused or short of room:
    :meth:`_try_capture`).  Nothing it computes runs eagerly, so running it again is safe;
    warm it up yourself if it needs it (vLLM already has, with eager runs):

    1. at each attention call the kernel policy picks PA or FIA for that call's shape
       (once per shape), and one workspace, sized for every length up to
       ``max_model_len``, is allocated inside the capture (from the graph's pool) and
       shared by the graph's layers;
    2. each attention call becomes ``ExternalEvent`` wait + task group + kernel, recorded
       as a frozen :class:`TaskRecord` holding non-owning aliases of its arguments;
    3. only if all of that succeeded is a :class:`CapturedGraph` registered; otherwise
       the graph is reset and :class:`~npugraph.errors.CaptureFailed` says where it failed.

    Nothing runs eagerly, so a capture in the middle of serving writes nothing (not
    the KV cache either). The manager does not update or replay graphs (see
    :class:`npugraph.replay.ReplayUpdater`) and keeps none of the callable's tensors alive.
    """

    def __init__(
        self,
        device: Device,
        *,
        max_model_len: int,
        policy: KernelPolicy | None = None,
        progress: bool = False,
        on_captured: Callable[[CapturedGraph], None] | None = None,
        event_group: int | None = None,
        device_lengths: bool = True,
    ) -> None:
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ConfigError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        self.device = device
        if event_group is not None and (
            isinstance(event_group, bool) or not isinstance(event_group, int) or event_group < 1
        ):
            raise ConfigError(
                f"event_group must be an int >= 1 (tasks per ExternalEvent) or None (chosen per namespace), "
                f"got {event_group!r}"
            )
        self.max_model_len = max_model_len
        # tasks per ExternalEvent (1: one per task); the schedule needs a namespace's task
        # count, learned from its first capture (captured twice: to count, then grouped)
        self.event_group = event_group
        # FIA graphs take the tiling-sink kernel where the device has it and the call is eligible
        self.device_lengths = device_lengths
        self._task_counts: dict[str, int] = {}
        self._lens_groups: dict[str, int] = {}  # tiling-sink groups a namespace's graphs had
        self.policy: KernelPolicy = policy if policy is not None else StaticPolicy()
        self.progress = progress
        # told of each graph before it is registered (the updater builds its plan there);
        # if it raises, the capture fails and nothing is registered
        self.on_captured = on_captured
        self._entries: dict[tuple[str, Hashable], CapturedGraph] = {}
        self._pool: Any = None
        self._ctx: Capture | None = None
        self._by_event: dict[int, tuple[CapturedGraph, TaskRecord]] = {}
        self.configured: dict[str, list[Hashable]] = {}
        self._warned_order: set[str] = set()  # namespaces warned about a smaller-first capture
        # where a capture error is not the callable's fault: torch's and the device's own code
        self._library_code = tuple(
            os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, device.ops) if m.__file__
        )

    # --- what clients see ------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        """Whether a capture is in progress (attention calls are then recorded, not run)."""
        return self._ctx is not None

    @property
    def pool(self) -> Any:
        """The memory pool every namespace's graphs share."""
        if self._pool is None:
            self._pool = self.device.npu.graph_pool_handle()
        return self._pool

    def kernel_for(self, namespace: str, key: Hashable) -> KernelChoice | None:
        """The kernel captured for ``(namespace, key)``, or None if it is not captured.

        Eager steps of a captured size run this kernel, whatever the policy says now,
        so that they stay comparable with the graph's replays.
        """
        entry = self._entries.get((namespace, key))
        return entry.choice if entry is not None else None

    def eager_kernel(self, namespace: str, tokens: int, call: AttentionCall) -> OpSpec:
        """The kernel an eager call of ``tokens`` query tokens runs: the one captured for
        that size where it can run ``call`` (so eager steps stay comparable with the
        graph's replays), else the policy's choice."""
        choice = self.kernel_for(namespace, tokens)
        if choice is None or choice.kernel not in SPECS or SPECS[choice.kernel].unsupported(call):
            choice = self.policy.choose(namespace, tokens, tokens, [call])
        return SPECS[choice.kernel]

    def attention(self, layer: str, group: str, call: AttentionCall, lens: StepLens, ubatch: int) -> None:
        """Record one attention call of the capture in progress as an updatable task.

        ``ubatch`` tells apart the calls of one layer in the micro-batches of one
        forward (vLLM's dual-batch overlap); their metadata then comes as a list.
        """
        ctx = self._ctx
        if ctx is None:
            raise RuntimeError("CaptureManager.attention called outside a capture")
        if (ubatch, layer) in ctx.seen:
            raise CaptureFailed(
                f"capture of {ctx.namespace}/{ctx.key!r}: layer {layer!r} was called twice "
                f"in micro-batch {ubatch} of one forward; give every attention layer a unique "
                "name, and each micro-batch its own ubatch index"
            )
        ctx.seen.add((ubatch, layer))
        ctx.layer = layer
        spec, need = self._prepare(ctx, call, lens)
        npu = self.device.npu
        stream = npu.current_stream()
        name = f"{ctx.where}/{layer}"
        lens_group = None
        if spec.sink is None:  # a task group the update re-issues, waiting on its group's event
            kwargs = spec.arguments(call, lens, ctx.workspace)
            index, schedule = len(ctx.tasks), ctx.schedule
            waits = schedule is None or schedule.waits(index)
            records = schedule is None or schedule.records(index)
            if waits:
                event = ctx.group_event = npu.ExternalEvent()
                event.wait(stream)  # no reset(): a no-op on every CANN with task groups, which npugraph needs
                self.device.name_in_reports(event, name)
            else:
                event = ctx.group_event
            npu.graph_task_group_begin(stream)
            spec.launch(self.device, kwargs)
            handle = npu.graph_task_group_end(stream)
            self.device.name_in_reports(handle, f"layer {layer!r}")
        else:  # the kernel alone, reading its group's lengths and plan; the graph waits once, first
            lens_group = ctx.sink.buffers(spec, call, group, ubatch)
            event, waits = ctx.sink.wait_event(self.device, stream, ctx.where)
            records = False  # the graph's last tiling-sink task records (mark_recorder, once captured)
            kwargs = spec.arguments(call, lens, None, buffers=lens_group)
            spec.launch(self.device, kwargs)
            handle = None
        ctx.tasks.append(
            TaskRecord(
                index=len(ctx.tasks),
                layer=layer,
                ubatch=ubatch,
                group=group,
                spec=spec,
                handle=handle,
                event=event,
                args={k: alias(self.device, v) for k, v in kwargs.items()},
                host_at_capture={k: host_tuple(kwargs[k]) for k in spec.host_args},
                workspace_bytes=need,
                waits=waits,
                records=records,
                lens=lens_group,
            )
        )
        ctx.layer = None

    def _prepare(self, ctx: Capture, call: AttentionCall, lens: StepLens) -> tuple[OpSpec, int]:
        """The kernel for this call's shape, and a workspace that covers it (grown if needed)."""
        shape = call_shape(call)
        found = ctx.choices.get(shape)
        if found is None:
            if ctx.width is not None:
                choice = frozen(ctx.where, ctx.layer, call, ctx.width)
            else:
                chosen = self.policy.choose(ctx.namespace, ctx.key, ctx.tokens, [call])
                choice = upgrade(self.device, self.device_lengths, ctx.sink, ctx.where, chosen, call)
            if choice.kernel not in SPECS:
                raise CaptureFailed(f"kernel policy chose {choice.kernel!r}; expected one of {sorted(SPECS)}")
            found = ctx.choices[shape] = (SPECS[choice.kernel], choice)
        spec = found[0]
        if spec.sink is not None:
            return spec, 0  # no workspace: its plan is its tiling
        need = ctx.needs.get(shape)
        if need is None:
            need = ctx.needs[shape] = spec.workspace_bytes(
                self.device, spec.arguments(call, lens, None), self.max_model_len
            )
        have = 0 if ctx.workspace is None else ctx.workspace.numel()
        if need > have:
            # Allocated inside the capture, so from the graph's pool (as vllm-ascend does);
            # earlier layers keep the smaller one, which covers them.
            ctx.workspace = torch.empty(need, dtype=torch.uint8, device=call.query.device)
        return spec, need

    # --- capture ---------------------------------------------------------------------
    def capture(
        self,
        fn: Callable[..., Any],
        *args: Any,
        key: Hashable,
        namespace: str = "main",
        tokens: int | None = None,
        static_inputs: Mapping[str, torch.Tensor] | None = None,
        require_attention: bool = True,
        width: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Capture ``fn(*args, **kwargs)`` as the graph of ``(namespace, key)``; return its outputs.

        ``tokens`` is the graph's padded token count (default: ``key`` if it is an
        int).  ``static_inputs`` names the buffers a step copies new inputs into.
        ``require_attention=False`` allows graphs without attention (vLLM's
        PIECEWISE pieces), which then need no update.  ``width``: update-free, every
        attention call FIA with its lengths frozen to ``width`` keys (``fia_frozen``).
        """
        self._check_capturable(namespace, key, width)
        if tokens is None:
            if isinstance(key, bool) or not isinstance(key, int):
                raise CaptureFailed(f"capture of {namespace}/{key!r}: the key is not a token count; pass tokens=")
            tokens = key
        # The schedule needs the namespace's task count: its first capture counts them.  A try
        # whose graph turns out to need another way of capturing is dropped (nothing was
        # registered) and the callable is captured again that way: see _try_capture.
        how = How(schedule=self._schedule(namespace))
        for spec in SPECS.values():
            spec.prepare(self.device.memory)  # outside the graph: not from its pool
        request = Request(
            fn=fn,
            args=args,
            kwargs=kwargs,
            namespace=namespace,
            key=key,
            tokens=int(tokens),
            static_inputs=static_inputs,
            require_attention=require_attention,
            free_before=self._free_memory(),
            width=width,
        )
        for _ in range(MOST_TRIES):
            done = self._try_capture(request, how)
            if isinstance(done, How):
                how = done
                continue
            entry, outputs = done
            break
        else:
            raise CaptureFailed(
                f"capture of {namespace}/{key!r}: still asked to capture again after {MOST_TRIES} tries "
                f"(last: {how}); this is a bug in npugraph: please report it with the capture report"
            )
        smaller = [e.key for e in self.entries(namespace) if e.tokens < entry.tokens]
        if smaller and namespace not in self._warned_order:
            self._warned_order.add(namespace)
            warnings.warn(
                f"captured {namespace}/{key!r} ({entry.tokens} tokens) after smaller graphs ({smaller[:4]}): "
                "capture the largest first, so that smaller graphs reuse its pool blocks instead of growing "
                "the pool (Runtime.capture_all orders the keys for you)",
                stacklevel=2,
            )
        self._entries[(namespace, key)] = entry
        for t in entry.tasks:
            self._by_event.setdefault(id(t.event), (entry, t))  # a shared event names its group's first task
        return outputs

    def _check_capturable(self, namespace: str, key: Hashable, width: int | None) -> None:
        """Refuse, before any device call, a key that cannot be captured now."""
        check_width(f"{namespace}/{key!r}", width, self.max_model_len)
        try:
            hash(key)
        except TypeError as exc:
            raise CaptureFailed(f"graph key {key!r} is not hashable: {exc}") from exc
        if (namespace, key) in self._entries:
            raise CaptureFailed(
                f"{namespace}/{key!r} is already captured; call Runtime.reset({namespace!r}, {key!r}) "
                "(or CaptureManager.reset) first to capture it again"
            )
        if self._ctx is not None:
            raise CaptureFailed(
                f"capture of {namespace}/{key!r}: {self._ctx.namespace}/{self._ctx.key!r} is being captured; "
                "captures do not nest"
            )

    def group_size(self, namespace: str) -> int:
        """Tasks per ExternalEvent in ``namespace``'s graphs updated per layer: ``event_group``,
        or (``None``) AUTO_EVENT_GROUP once the namespace has AUTO_EVENT_GROUP_MIN tasks, else 1."""
        return group_size(self._task_counts.get(namespace, 0), self.event_group)

    def _schedule(self, namespace: str) -> EventSchedule | None:
        return EventSchedule.of(self._task_counts.get(namespace), self.group_size(namespace))

    def _try_capture(self, request: Request, how: How) -> tuple[CapturedGraph, Any] | How:
        """Capture the callable once, ``how`` says; return its graph (not registered yet) and
        outputs, or, where the graph shows it must be captured another way, that way (this
        graph reset).  The reasons to capture again, each settled by the next try:

        * the namespace's first graph counted its tasks, and they are grouped per event;
        * the tiling-sink lengths need more room than the try gave them;
        * the tiling-sink path is refused (too few layers, or mixed with per-layer tasks
          under event grouping): the kernels read their lengths from the host instead;
        * the graph has another task count than its namespace's first: one event per task.
        """
        namespace, key, tokens = request.namespace, request.key, request.tokens
        npu = self.device.npu
        room = how.lens_room or (self._lens_groups.get(namespace, 1), tokens)
        ctx = Capture(
            namespace=namespace,
            key=key,
            tokens=tokens,
            schedule=how.schedule,
            sink=SinkCapture.start(self.device, self.device_lengths, how.sink_refusal, room, tokens, request.width),
            width=request.width,
        )
        graph = npu.NPUGraph()
        self.device.name_in_reports(graph, f"{namespace}/{key!r}")

        t0 = time.perf_counter()
        self._ctx = ctx
        failure: BaseException | None = None
        try:
            # on the device's one side stream for captures (torch_npu's default), as graphs
            # sharing a pool must be
            with npu.graph(graph, pool=self.pool):
                try:
                    outputs = request.fn(*request.args, **request.kwargs)
                except BaseException as exc:
                    failure = exc  # the graph context still ends the capture (as torch_npu's does)
            if failure is not None:
                raise failure
            if not ctx.tasks and request.require_attention:
                raise CaptureFailed(
                    f"capture of {namespace}/{key!r}: the callable made no attention call "
                    "through the runtime; nothing would be updated"
                )
            another = self._another_way(ctx, how)
            if another is not None:
                graph.reset()  # nothing was registered
                return another
            entry = CapturedGraph(
                namespace=namespace,
                key=key,
                graph=graph,
                choice=ctx.choice or KernelChoice(kernel="none", reason="no attention in this graph"),
                tasks=tuple(ctx.tasks),
                tokens=ctx.tokens,
                batch=batch_of(ctx.tasks),
                workspace_bytes=max(ctx.needs.values(), default=0),
                outputs=alias_tree(self.device, outputs),
                static_inputs=dict(request.static_inputs or {}),
                capture_seconds=time.perf_counter() - t0,
                pool=self.pool,
                lens_groups=tuple(ctx.sink.groups.values()),
                memory_bytes=max(0, request.free_before - self._free_memory()),
            )
            if self.on_captured is not None:
                self.on_captured(entry)
        except BaseException as exc:
            graph.reset()  # nothing registered: the same key captures again at once
            # the callable's own error, even if ending the capture raised another
            cause = failure if failure is not None else exc
            if not isinstance(cause, Exception) or isinstance(cause, CaptureFailed):
                if cause is exc:
                    raise  # Ctrl-C stays itself; our own errors already say where
                raise cause from None
            raise capture_failed(ctx.where, ctx.layer, ctx.tasks, cause, self._library_code) from cause
        finally:
            self._ctx = None
        return entry, outputs

    def _another_way(self, ctx: Capture, how: How) -> How | None:
        """The way a just-captured graph must be captured again (see :meth:`_try_capture`), or
        None where it stands as captured (its tiling-sink event marked)."""
        namespace, key, schedule = ctx.namespace, ctx.key, how.schedule
        if namespace not in self._task_counts and ctx.tasks:
            self._task_counts[namespace] = len(ctx.tasks)  # the namespace's first graph counts
            learned = self._schedule(namespace)
            if schedule is None and learned is not None and any(t.lens is None for t in ctx.tasks):
                return attrs.evolve(how, schedule=learned)
        room = ctx.sink.room()
        if room is not None:
            self._lens_groups[namespace] = max(self._lens_groups.get(namespace, 1), room[0])
            return attrs.evolve(how, lens_room=room)
        refused = refusal(ctx.tasks, (c for _, c in ctx.choices.values()), schedule, ctx.where)
        if refused:
            sched = schedule if schedule is not None else self._schedule(namespace)
            return attrs.evolve(how, schedule=sched, sink_refusal=refused)
        mark_recorder(ctx.tasks)
        if schedule is not None and len(ctx.tasks) != schedule.tasks:
            # this graph has another task count than its namespace's first: its last group
            # would never record; capture it again with one event per task
            warnings.warn(
                f"capture of {namespace}/{key!r}: {len(ctx.tasks)} attention calls, but the first graph "
                f"of namespace {namespace!r} had {schedule.tasks}; this graph records one ExternalEvent "
                f"per layer (event_group={schedule.size} does not apply to it)",
                stacklevel=4,
            )
            return attrs.evolve(how, schedule=None, lens_room=None)
        return None

    def capture_all(
        self,
        keys: Iterable[Hashable],
        make: Callable[[Hashable], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
        *,
        namespace: str = "main",
        size: Callable[[Hashable], int] | None = None,
    ) -> None:
        """Capture every key, largest first (so that smaller graphs reuse the pool).

        ``make(key)`` returns ``(fn, args, kwargs)`` for :meth:`capture`; a progress
        bar is shown when the manager was created with ``progress=True``.
        """
        order = sorted(keys, key=size or (lambda k: k), reverse=True)  # type: ignore[arg-type,return-value]
        known = set(self.configured.get(namespace, [])) | set(order)
        self.configured[namespace] = sorted(known, key=size or (lambda k: k))  # type: ignore[arg-type,return-value]
        it: Iterable[Hashable] = order
        if self.progress:
            it = tqdm(order, desc=f"capturing {namespace}", unit="graph", leave=False)
        t0 = time.perf_counter()
        with collector_walks_only_new():
            for k in it:
                fn, args, kwargs = make(k)
                self.capture(fn, *args, key=k, namespace=namespace, **kwargs)
        logger.info("npugraph: %s", self.capture_report(namespace, time.perf_counter() - t0))

    def _free_memory(self) -> int:
        """The device's free memory now (``mem_get_info``: the driver's count on a device,
        the card's on the simulator; no synchronize): capture measures what it took."""
        return int(self.device.npu.mem_get_info()[0])

    def capture_report(self, namespace: str | None = None, seconds: float | None = None) -> str:
        """One line on what is captured: graphs, attention tasks, kernels, time, device memory
        (per size, what each capture took), pool memory, and what capture chose and why."""
        entries = self.entries(namespace)
        events = {
            ns: (self.group_size(ns), self._task_counts.get(ns, 0)) for ns in sorted({e.namespace for e in entries})
        }
        return capture_report(
            entries,
            namespace=namespace,
            seconds=seconds,
            pool_bytes=self.device.pool_bytes(self._pool),
            events=events,
            event_group_set=self.event_group is not None,
        )

    # --- lookup ----------------------------------------------------------------------
    def entry(self, namespace: str, key: Hashable) -> CapturedGraph:
        """The captured graph of ``(namespace, key)``; raises listing the captured keys."""
        entry = self.find(namespace, key)
        if entry is None:
            have = sorted(repr(k) for (ns, k) in self._entries if ns == namespace)
            raise UnknownKeyError(
                f"no graph captured for key {key!r} in namespace {namespace!r}; captured keys: "
                f"[{', '.join(have)}]. Pad the batch to a captured size or capture this key."
            )
        return entry

    def find(self, namespace: str, key: Hashable) -> CapturedGraph | None:
        """The captured graph of ``(namespace, key)``, or None."""
        try:
            return self._entries.get((namespace, key))
        except TypeError:
            return None  # an unhashable key was never captured

    def has(self, namespace: str, key: Hashable) -> bool:
        """Whether ``(namespace, key)`` has a captured graph."""
        try:
            return (namespace, key) in self._entries
        except TypeError:
            return False

    def entries(self, namespace: str | None = None) -> list[CapturedGraph]:
        return [e for (ns, _), e in self._entries.items() if namespace in (None, ns)]

    def namespaces(self) -> list[str]:
        return sorted({ns for ns, _ in self._entries})

    def keys(self, namespace: str = "main") -> list[Hashable]:
        return [k for (ns, k) in self._entries if ns == namespace]

    def task_for_event(self, event: Any) -> tuple[CapturedGraph, TaskRecord] | None:
        """Map a device event back to its graph and task (for error messages)."""
        return self._by_event.get(id(event))

    def task_for_group(self, group: Any) -> tuple[CapturedGraph, TaskRecord] | None:
        """Map a device task group (as a device error carries it) back to its graph and task."""
        for entry in self._entries.values():
            for t in entry.tasks:
                if self.device.task_group(t.handle) is group:
                    return entry, t
        return None

    def reset(self, namespace: str | None = None, key: Hashable | None = None) -> None:
        """Free captured graphs: one key, one namespace, or all."""
        for (ns, k), entry in list(self._entries.items()):
            if namespace not in (None, ns) or (key is not None and k != key):
                continue
            for t in entry.tasks:
                self._by_event.pop(id(t.event), None)
            entry.graph.reset()
            del self._entries[(ns, k)]
