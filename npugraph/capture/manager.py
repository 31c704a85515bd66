"""Capture one device graph per (namespace, key), recording every updatable attention task."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree
from tqdm import tqdm

from npugraph.capture.advice import advice_for, raised_at
from npugraph.capture.events import EventSchedule, group_size
from npugraph.capture.records import CapturedGraph, TaskRecord
from npugraph.capture.report import capture_report
from npugraph.device import Device
from npugraph.errors import CaptureFailed, ConfigError, UnknownKeyError
from npugraph.metadata import StepLens
from npugraph.ops import FIA_SINK, SPECS, AttentionCall, LensArena, LensGroup, OpSpec
from npugraph.policy import KernelChoice, KernelPolicy, StaticPolicy

__all__ = ["CaptureManager", "SINK_MIN_LAYERS"]

# Below this many attention layers a graph keeps FIA's per-layer update: one FIA layer's
# update costs ~184 us of host time (begin + re-issue + end + record, vllm-ascend #13058),
# the tiling-sink step ~150-190 us of launches for the metadata op and the length copy
# (#15336) plus one event record, so the sink path saves host time from the second layer.
SINK_MIN_LAYERS = 2

logger = logging.getLogger("npugraph")


@attrs.frozen
class _How:
    """How a capture tries: its event schedule, why the tiling-sink path is refused (empty:
    it is not), and the room its device lengths get (None: the namespace's default)."""

    schedule: EventSchedule | None
    sink_refusal: str = ""
    lens_room: tuple[int, int] | None = None


# A bound, not a count: each reason to try again (_try_capture's list) is settled by the
# next try, and only the lengths' room can come back, once, after the task count's.
_MOST_TRIES = 8


@attrs.define
class _Capture:
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
    device_lengths: bool = True  # whether FIA may take the tiling-sink path in this capture
    sink_refusal: str = ""  # why not, when it may not
    lens_groups: dict[tuple[Any, ...], LensGroup] = attrs.field(factory=dict)
    lens_event: Any = None  # the one ExternalEvent of the graph's tiling-sink tasks
    lens_arena: LensArena | None = None  # their device memory, allocated before the capture
    lens_short: tuple[int, int] | None = None  # (groups, rows) the arena lacked: capture again

    @property
    def choice(self) -> KernelChoice | None:
        return next(iter(self.choices.values()))[1] if self.choices else None


def _shape(call: AttentionCall) -> tuple[Any, ...]:
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
        self._ctx: _Capture | None = None
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
        if spec.lens_on_device:
            self._attention_on_device(ctx, spec, layer, group, call, lens, ubatch)
            ctx.layer = None
            return
        kwargs = spec.arguments(call, lens, ctx.workspace)
        npu = self.device.npu
        stream = npu.current_stream()
        index = len(ctx.tasks)
        schedule = ctx.schedule
        waits = schedule is None or schedule.waits(index)
        records = schedule is None or schedule.records(index)
        if waits:
            event = ctx.group_event = npu.ExternalEvent()
            event.wait(stream)  # no reset(): a no-op on every CANN with task groups, which npugraph needs
            self.device.name_in_reports(event, f"{ctx.namespace}/{ctx.key!r}/{layer}")
        else:
            event = ctx.group_event
        npu.graph_task_group_begin(stream)
        spec.launch(self.device, kwargs)
        handle = npu.graph_task_group_end(stream)
        self.device.name_in_reports(handle, f"layer {layer!r}")
        ctx.tasks.append(
            TaskRecord(
                index=len(ctx.tasks),
                layer=layer,
                ubatch=ubatch,
                group=group,
                spec=spec,
                handle=handle,
                event=event,
                args={k: self._alias(v) for k, v in kwargs.items()},
                host_at_capture={k: _host_tuple(kwargs[k]) for k in spec.host_args},
                workspace_bytes=need,
                waits=waits,
                records=records,
            )
        )
        ctx.layer = None

    def _attention_on_device(
        self, ctx: _Capture, spec: OpSpec, layer: str, group: str, call: AttentionCall, lens: StepLens, ubatch: int
    ) -> None:
        """Record a tiling-sink task: the kernel alone, reading the lengths and plan of its
        KV-cache group's :class:`LensGroup`; the graph waits for one event before the first."""
        slot = group if ubatch == 0 else f"{group}#ubatch{ubatch}"
        assert spec.plan_args is not None  # a lens_on_device declaration names its plan arguments
        plan_args = spec.plan_args(call)
        batch = int(call.block_table.shape[0])
        gkey = (slot, batch, tuple(sorted(plan_args.items())))
        buffers = ctx.lens_groups.get(gkey)
        if buffers is None:
            # from the arena made before the capture (never the graph's pool), held by the record
            found = ctx.lens_arena.take(batch, plan_args, slot) if ctx.lens_arena is not None else None
            if found is None:  # the arena is too small: this capture is discarded and run again
                groups, rows = ctx.lens_short or (0, 0)
                ctx.lens_short = (max(groups, len(ctx.lens_groups) + 1), max(rows, batch))
                found = LensGroup.make(call.query.device, batch, plan_args, slot)
            buffers = ctx.lens_groups[gkey] = found
        npu = self.device.npu
        first = ctx.lens_event is None
        if first:
            ctx.lens_event = npu.ExternalEvent()
            ctx.lens_event.wait(npu.current_stream())
            self.device.name_in_reports(ctx.lens_event, f"{ctx.namespace}/{ctx.key!r}/device lengths")
        kwargs = spec.arguments(call, lens, None, buffers=buffers)
        spec.launch(self.device, kwargs)
        ctx.tasks.append(
            TaskRecord(
                index=len(ctx.tasks),
                layer=layer,
                ubatch=ubatch,
                group=group,
                spec=spec,
                handle=None,
                event=ctx.lens_event,
                args={k: self._alias(v) for k, v in kwargs.items()},
                host_at_capture={},
                workspace_bytes=0,
                waits=first,
                records=False,  # the graph's last tiling-sink task records (set when the capture ends)
                lens=buffers,
            )
        )

    def _upgrade(self, ctx: _Capture, choice: KernelChoice, call: AttentionCall) -> KernelChoice:
        """FIA with host lengths becomes the tiling-sink kernel where that is possible; a
        tiling-sink kernel chosen as it is must be possible."""
        if choice.kernel != "fia_sink" and (choice.fixed or choice.kernel not in ("fia", "fia_v2")):
            return choice
        why: str | None
        if self.device.device_length_ops is None:
            why = "the device has no tiling-sink FIA (torch.ops._C_ascend without PRs #15215/#15336)"
        else:
            why = FIA_SINK.unsupported(call)
        if choice.kernel == "fia_sink":
            if why is not None:
                raise CaptureFailed(
                    f"capture of {ctx.namespace}/{ctx.key!r}: the kernel policy chose fia_sink, but {why}; "
                    "choose fia (lengths updated per layer) for this graph"
                )
            return choice
        if not self.device_lengths:
            return choice
        if why is None and not ctx.device_lengths:
            why = ctx.sink_refusal
        if why is None:
            return KernelChoice(
                kernel="fia_sink", reason=f"{choice.reason}; lengths on the device, no per-layer update"
            )
        return KernelChoice(kernel=choice.kernel, reason=f"{choice.reason}; per-layer update: {why}")

    def _prepare(self, ctx: _Capture, call: AttentionCall, lens: StepLens) -> tuple[OpSpec, int]:
        """The kernel for this call's shape, and a workspace that covers it (grown if needed)."""
        shape = _shape(call)
        found = ctx.choices.get(shape)
        if found is None:
            choice = self._upgrade(ctx, self.policy.choose(ctx.namespace, ctx.key, ctx.tokens, [call]), call)
            if choice.kernel not in SPECS:
                raise CaptureFailed(f"kernel policy chose {choice.kernel!r}; expected one of {sorted(SPECS)}")
            found = ctx.choices[shape] = (SPECS[choice.kernel], choice)
        spec = found[0]
        if spec.lens_on_device:
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

    def _alias(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return self.device.weak_ref_tensor(v)
        if isinstance(v, list) and v and all(isinstance(x, torch.Tensor) for x in v):
            return [self.device.weak_ref_tensor(x) for x in v]
        return v

    def _alias_tree(self, v: Any) -> Any:
        """``v`` with every tensor a non-owning alias, its structure kept: any pytree
        (tuples, namedtuples, lists, dicts) and dataclasses."""

        def leaf(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return self.device.weak_ref_tensor(x)
            if dataclasses.is_dataclass(x) and not isinstance(x, type):
                y = copy.copy(x)
                for f in dataclasses.fields(x):
                    object.__setattr__(y, f.name, self._alias_tree(getattr(x, f.name)))
                return y
            return x

        return pytree.tree_map(leaf, v)

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
        **kwargs: Any,
    ) -> Any:
        """Capture ``fn(*args, **kwargs)`` as the graph of ``(namespace, key)``; return its outputs.

        ``tokens`` is the graph's padded token count (default: ``key`` if it is an
        int).  ``static_inputs`` names the buffers a step copies new inputs into.
        ``require_attention=False`` allows graphs without attention (vLLM's
        PIECEWISE pieces), which then need no update.
        """
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
        if tokens is None:
            if isinstance(key, bool) or not isinstance(key, int):
                raise CaptureFailed(f"capture of {namespace}/{key!r}: the key is not a token count; pass tokens=")
            tokens = key
        # The schedule needs the namespace's task count: its first capture counts them.  A try
        # whose graph turns out to need another way of capturing is dropped (nothing was
        # registered) and the callable is captured again that way: see _try_capture.
        how = _How(schedule=self._schedule(namespace))
        for spec in SPECS.values():
            spec.prepare(self.device.memory)  # outside the graph: not from its pool
        free_before = self._free_memory()  # a capture done again counts from before its first try
        for _ in range(_MOST_TRIES):
            done = self._try_capture(
                fn, args, kwargs, namespace, key, int(tokens), static_inputs, require_attention, how, free_before
            )
            if isinstance(done, _How):
                how = done
                continue
            entry, outputs = done
            break
        else:
            raise CaptureFailed(
                f"capture of {namespace}/{key!r}: still asked to capture again after {_MOST_TRIES} tries "
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

    def group_size(self, namespace: str) -> int:
        """Tasks per ExternalEvent in ``namespace``'s graphs updated per layer: ``event_group``,
        or (``None``) AUTO_EVENT_GROUP once the namespace has AUTO_EVENT_GROUP_MIN tasks, else 1."""
        return group_size(self._task_counts.get(namespace, 0), self.event_group)

    def _schedule(self, namespace: str) -> EventSchedule | None:
        return EventSchedule.of(self._task_counts.get(namespace), self.group_size(namespace))

    def _try_capture(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        namespace: str,
        key: Hashable,
        tokens: int,
        static_inputs: Mapping[str, torch.Tensor] | None,
        require_attention: bool,
        how: _How,
        free_before: int,
    ) -> tuple[CapturedGraph, Any] | _How:
        """Capture the callable once, ``how`` says; return its graph (not registered yet) and
        outputs, or, where the graph shows it must be captured another way, that way (this
        graph reset).  The reasons to capture again, each settled by the next try:

        * the namespace's first graph counted its tasks, and they are grouped per event;
        * the tiling-sink lengths need more room than the try gave them;
        * the tiling-sink path is refused (too few layers, or mixed with per-layer tasks
          under event grouping): the kernels read their lengths from the host instead;
        * the graph has another task count than its namespace's first: one event per task.
        """
        schedule, sink_refusal, lens_room = how.schedule, how.sink_refusal, how.lens_room
        npu = self.device.npu
        ctx = _Capture(
            namespace=namespace,
            key=key,
            tokens=tokens,
            schedule=schedule,
            device_lengths=not sink_refusal,
            sink_refusal=sink_refusal,
        )
        if self.device_lengths and self.device.device_length_ops is not None and not sink_refusal:
            # outside the graph's pool: a step writes it from outside the graph
            groups, rows = lens_room or (self._lens_groups.get(namespace, 1), tokens)
            ctx.lens_arena = LensArena.make(self.device.memory, groups, max(rows, tokens))
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
                    outputs = fn(*args, **kwargs)
                except BaseException as exc:
                    failure = exc  # the graph context still ends the capture (as torch_npu's does)
            if failure is not None:
                raise failure
            if not ctx.tasks and require_attention:
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
                batch=_batch_of(ctx.tasks),
                workspace_bytes=max(ctx.needs.values(), default=0),
                outputs=self._alias_tree(outputs),
                static_inputs=dict(static_inputs or {}),
                capture_seconds=time.perf_counter() - t0,
                pool=self.pool,
                lens_groups=tuple(ctx.lens_groups.values()),
                memory_bytes=max(0, free_before - self._free_memory()),
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
            raise self._failed(ctx, cause) from cause
        finally:
            self._ctx = None
        return entry, outputs

    def _another_way(self, ctx: _Capture, how: _How) -> _How | None:
        """The way a just-captured graph must be captured again (see :meth:`_try_capture`), or
        None where it stands as captured (its tiling-sink event marked)."""
        namespace, key, schedule = ctx.namespace, ctx.key, how.schedule
        if namespace not in self._task_counts and ctx.tasks:
            self._task_counts[namespace] = len(ctx.tasks)  # the namespace's first graph counts
            learned = self._schedule(namespace)
            if schedule is None and learned is not None and any(t.lens is None for t in ctx.tasks):
                return attrs.evolve(how, schedule=learned)
        if ctx.lens_short is not None:
            self._lens_groups[namespace] = max(self._lens_groups.get(namespace, 1), ctx.lens_short[0])
            return attrs.evolve(how, lens_room=ctx.lens_short)
        on_device = [t for t in ctx.tasks if t.lens is not None]
        forced = any(c.fixed and c.kernel == "fia_sink" for _, c in ctx.choices.values())
        mixed = on_device and schedule is not None and len(on_device) < len(ctx.tasks)
        if forced and mixed:
            raise CaptureFailed(
                f"capture of {namespace}/{key!r}: the kernel policy chose fia_sink for some layers and "
                "another kernel, updated per layer, for others, with event grouping on; capture with "
                "event_group=1 or one kernel for every layer"
            )
        refused = ""
        if forced:
            pass  # the policy's choice, taken as it is
        elif on_device and len(on_device) < SINK_MIN_LAYERS:
            refused = (
                f"{len(on_device)} attention layer(s): below the {SINK_MIN_LAYERS} from which the "
                "tiling-sink path saves host time"
            )
        elif mixed:
            refused = "the graph mixes tiling-sink and per-layer tasks, and event grouping is on"
        if refused:
            sched = schedule if schedule is not None else self._schedule(namespace)
            return attrs.evolve(how, schedule=sched, sink_refusal=refused)
        if on_device:  # the graph's last tiling-sink task records the shared event
            last = on_device[-1].index
            ctx.tasks[last] = attrs.evolve(ctx.tasks[last], records=True)
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

    def _failed(self, ctx: _Capture, cause: BaseException) -> CaptureFailed:
        """The error of a capture the callable (or the device) failed: where, and what to do."""
        layer = ctx.layer or (ctx.tasks[-1].layer if ctx.tasks else None)
        where = (
            f" in layer {ctx.layer!r}"
            if ctx.layer
            else (f" after layer {layer!r} (the last attention call recorded)" if layer else "")
        )
        return CaptureFailed(
            f"capture of {ctx.namespace}/{ctx.key!r} failed{where} at {raised_at(cause, self._library_code)}: "
            f"{type(cause).__name__}: {str(cause).rstrip('.')}. Nothing was registered for this key."
            + advice_for(str(cause))
        )

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
        with _collector_walks_only_new():
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
        try:
            entry = self._entries.get((namespace, key))
        except TypeError:
            entry = None  # an unhashable key was never captured
        if entry is None:
            have = sorted(repr(k) for (ns, k) in self._entries if ns == namespace)
            raise UnknownKeyError(
                f"no graph captured for key {key!r} in namespace {namespace!r}; captured keys: "
                f"[{', '.join(have)}]. Pad the batch to a captured size or capture this key."
            )
        return entry

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


def _host_tuple(v: Any) -> tuple[int, ...]:
    if isinstance(v, torch.Tensor):
        return tuple(int(x) for x in v.tolist())
    return tuple(int(x) for x in v)


def _batch_of(tasks: Sequence[TaskRecord]) -> int:
    """The graph's request slots: rows of its first task's block table (0 without attention)."""
    return int(tasks[0].args[tasks[0].spec.refreshed_buffers[0]].shape[0]) if tasks else 0


@contextlib.contextmanager
def _collector_walks_only_new() -> Iterator[None]:
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
