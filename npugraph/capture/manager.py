"""Capture one device graph per (namespace, key), recording every updatable attention task."""

from __future__ import annotations

import enum
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from npugraph.device import Device
from npugraph.errors import CaptureFailed, UnknownKeyError
from npugraph.ops import SPECS, AttentionCall, OpSpec, StepLens

__all__ = ["Phase", "KernelChoice", "TaskRecord", "GraphEntry", "CaptureManager"]


class Phase(enum.Enum):
    """What the manager is doing with the callable right now."""

    IDLE = "idle"
    WARMUP = "warmup"
    CAPTURE = "capture"


@attrs.frozen(kw_only=True)
class KernelChoice:
    """The attention kernel of one graph, and why it was chosen."""

    kernel: str
    reason: str


def _weak(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return weakref.ref(v)
    if isinstance(v, list) and v and all(isinstance(x, torch.Tensor) for x in v):
        return [weakref.ref(x) for x in v]
    return v


def _strong(v: Any) -> Any:
    if isinstance(v, weakref.ref):
        return v()
    if isinstance(v, list) and v and isinstance(v[0], weakref.ref):
        return [r() for r in v]
    return v


@attrs.frozen(kw_only=True)
class TaskRecord:
    """One captured updatable attention task.

    ``args`` holds the kernel's arguments with every tensor as a weak reference: the
    graph owns its buffers, the manager never keeps a model tensor alive.
    ``host_at_capture`` are the host-side arguments the task was captured with.
    """

    index: int
    layer: str
    group: str
    spec: OpSpec
    handle: Any
    event: Any
    args: Mapping[str, Any]
    host_at_capture: Mapping[str, Any]
    workspace_bytes: int
    ubatch: int = 0  # micro-batch index (0 unless one forward runs several)

    @property
    def slot(self) -> str:
        """The name this task's step lengths are tracked under: its KV-cache group,
        qualified by the micro-batch when there are several."""
        return self.group if self.ubatch == 0 else f"{self.group}#ubatch{self.ubatch}"

    def kwargs(self) -> dict[str, Any]:
        """The kernel's arguments with live tensors (raises if one was freed)."""
        out = {k: _strong(v) for k, v in self.args.items()}
        return out

    def tensor(self, name: str) -> torch.Tensor | None:
        return _strong(self.args.get(name))


@attrs.define(kw_only=True, eq=False)  # identity: the updater keys its plans by entry
class GraphEntry:
    """Everything known about one captured graph (mutable per-step state included)."""

    namespace: str
    key: Hashable
    graph: Any
    choice: KernelChoice
    tasks: tuple[TaskRecord, ...]
    tokens: int
    batch: int
    workspace: torch.Tensor | None
    workspace_bytes: int
    outputs: Any
    static_inputs: Mapping[str, Any]
    capture_seconds: float
    pool: Any
    replayable: bool = True
    replay_waiting: bool = False
    applied: list[Any] = attrs.field(factory=list)
    event_pending: list[bool] = attrs.field(factory=list)
    last_lens: dict[Any, StepLens] = attrs.field(factory=dict)
    last_host: dict[Any, tuple[StepLens, dict[str, Any]]] = attrs.field(factory=dict)
    steps: int = 0
    replays: int = 0
    last_reissued: int = 0
    trace: Any = None
    last_update: Any = None

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(t.layer for t in self.tasks)


@attrs.define
class _Context:
    namespace: str
    key: Hashable
    phase: Phase
    tokens: int
    max_model_len: int
    calls: list[tuple[tuple[int, str], str, AttentionCall]] = attrs.field(factory=list)
    choice: KernelChoice | None = None
    workspace: torch.Tensor | None = None
    workspace_bytes: int = 0
    required: dict[tuple[int, str], int] = attrs.field(factory=dict)
    tasks: list[TaskRecord] = attrs.field(factory=list)
    layer: str | None = None
    seen: set[tuple[int, str]] = attrs.field(factory=set)


class CaptureManager:
    """Capture callables into one device graph per key, per namespace, in one memory pool.

    Workflow for :meth:`capture`:

    1. **warm-up** — run the callable eagerly once; attention clients report their
       calls (layer, KV-cache group, shapes);
    2. **choose** — the kernel policy picks PA or FIA for this graph from those calls;
       one workspace is sized for the worst case ``max_model_len`` allows and shared
       by every layer of the graph;
    3. **capture** — run the callable under ``torch.npu.graph`` on the capture
       stream; each attention call becomes ``ExternalEvent`` wait + task group + kernel,
       recorded as a :class:`TaskRecord`;
    4. **register** — only if all of that succeeded; otherwise the graph is reset and
       :class:`~npugraph.errors.CaptureFailed` names the key and layer.

    It does not update or replay graphs (see :class:`npugraph.replay.ReplayUpdater`),
    and it keeps only weak references to the callable's tensors.
    """

    def __init__(
        self,
        device: Device,
        *,
        max_model_len: int,
        policy: Any = None,
        progress: bool = False,
    ) -> None:
        from npugraph.policy import StaticPolicy

        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.device = device
        self.max_model_len = int(max_model_len)
        self.policy = policy if policy is not None else StaticPolicy()
        self.progress = progress
        self._entries: dict[tuple[str, Hashable], GraphEntry] = {}
        self._pool: Any = None
        self._stream: Any = None
        self._ctx: _Context | None = None
        self._event_index: dict[int, TaskRecord] = {}
        self.configured: dict[str, list[Hashable]] = {}
        self._task_entry: dict[int, GraphEntry] = {}

    # --- what clients see ------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._ctx.phase if self._ctx is not None else Phase.IDLE

    @property
    def pool(self) -> Any:
        """The memory pool every namespace's graphs share."""
        if self._pool is None:
            self._pool = self.device.npu.graph_pool_handle()
        return self._pool

    def kernel_for(self, namespace: str, key: Hashable) -> KernelChoice | None:
        """The kernel captured for ``(namespace, key)`` (or the one being captured)."""
        ctx = self._ctx
        if ctx is not None and ctx.namespace == namespace and ctx.key == key and ctx.choice:
            return ctx.choice
        entry = self._entries.get((namespace, key))
        return entry.choice if entry is not None else None

    def attention(self, layer: str, group: str, call: AttentionCall, lens: StepLens, ubatch: int = 0) -> None:
        """Run, note or record one attention call, depending on the phase.

        ``ubatch`` tells apart the calls of one layer in the micro-batches of one
        forward (vLLM's dual-batch overlap); their metadata then comes as a list.
        """
        ctx = self._ctx
        if ctx is None:
            raise RuntimeError("CaptureManager.attention called outside warm-up or capture")
        ctx.layer = layer
        if ctx.phase is Phase.WARMUP:
            if (ubatch, layer) in ctx.seen:
                raise CaptureFailed(
                    f"capture of {ctx.namespace}/{ctx.key!r}: layer {layer!r} was called twice "
                    f"in micro-batch {ubatch} of one forward; give every attention layer a unique "
                    "name, and each micro-batch its own ubatch index"
                )
            ctx.seen.add((ubatch, layer))
            ctx.calls.append(((ubatch, layer), group, call))
            # The kernel is chosen from all the calls after warm-up; FIA runs every shape.
            spec = SPECS["fia"]
            spec.launch(self.device, spec.arguments(call, lens, None))
            return
        assert ctx.choice is not None
        spec = SPECS[ctx.choice.kernel]
        kwargs = spec.arguments(call, lens, ctx.workspace)
        npu = self.device.npu
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        spec.launch(self.device, kwargs)
        handle = npu.graph_task_group_end(stream)
        if hasattr(event, "label"):
            event.label = f"{ctx.namespace}/{ctx.key!r}/{layer}"
        ctx.tasks.append(
            TaskRecord(
                index=len(ctx.tasks),
                layer=layer,
                ubatch=ubatch,
                group=group,
                spec=spec,
                handle=handle,
                event=event,
                args={k: _weak(v) for k, v in kwargs.items()},
                host_at_capture={k: _host_repr(kwargs[k]) for k in spec.host_args},
                workspace_bytes=ctx.required.get((ubatch, layer), ctx.workspace_bytes),
            )
        )

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
        if (namespace, key) in self._entries:
            raise CaptureFailed(
                f"{namespace}/{key!r} is already captured; call reset({namespace!r}, {key!r}) first to capture it again"
            )
        if self._ctx is not None:
            raise CaptureFailed("captures do not nest")
        if tokens is None:
            if not isinstance(key, int):
                raise ValueError(f"key {key!r} is not a token count: pass tokens=")
            tokens = key
        npu = self.device.npu
        if self._stream is None:
            self._stream = npu.Stream()
        ctx = _Context(namespace, key, Phase.WARMUP, int(tokens), self.max_model_len)
        self._ctx = ctx
        graph = npu.NPUGraph()
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)  # warm-up, eager
            npu.synchronize()
            if not ctx.calls and require_attention:
                raise CaptureFailed(
                    f"capture of {namespace}/{key!r}: the callable made no attention call "
                    "through the runtime; nothing would be updated"
                )
            if ctx.calls:
                ctx.choice = self.policy.choose(namespace, key, ctx.tokens, [c for _, _, c in ctx.calls])
                self._size_workspace(ctx)
            else:
                ctx.choice = KernelChoice(kernel="none", reason="no attention in this graph")
            ctx.calls.clear()  # drop the warm-up's tensors
            ctx.phase = Phase.CAPTURE
            ctx.layer = None
            with npu.graph(graph, pool=self.pool, stream=self._stream):
                outputs = fn(*args, **kwargs)
        except CaptureFailed:
            graph.reset()
            raise
        except Exception as exc:
            graph.reset()
            where = f" in layer {ctx.layer!r}" if ctx.layer else ""
            raise CaptureFailed(
                f"capture of {namespace}/{key!r} ({ctx.phase.value}) failed{where}: "
                f"{type(exc).__name__}: {exc}. Nothing was registered for this key."
            ) from exc
        finally:
            self._ctx = None
        batch = _batch_of(ctx.tasks)
        entry = GraphEntry(
            namespace=namespace,
            key=key,
            graph=graph,
            choice=ctx.choice,
            tasks=tuple(ctx.tasks),
            tokens=ctx.tokens,
            batch=batch,
            workspace=ctx.workspace,
            workspace_bytes=ctx.workspace_bytes,
            outputs=_weak_tree(outputs),
            # the engine's own input buffers (not model tensors): held for copy_inputs
            static_inputs=dict(static_inputs or {}),
            capture_seconds=time.perf_counter() - t0,
            pool=self.pool,
            applied=[None] * len(ctx.tasks),
            event_pending=[False] * len(ctx.tasks),
        )
        self._entries[(namespace, key)] = entry
        for t in entry.tasks:
            self._event_index[id(t.event)] = t
            self._task_entry[id(t)] = entry
        return outputs

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
            from tqdm import tqdm

            it = tqdm(order, desc=f"capturing {namespace}", unit="graph", leave=False)
        for k in it:
            fn, args, kwargs = make(k)
            self.capture(fn, *args, key=k, namespace=namespace, **kwargs)

    def _size_workspace(self, ctx: _Context) -> None:
        assert ctx.choice is not None
        spec = SPECS[ctx.choice.kernel]
        seen: dict[tuple[Any, ...], int] = {}
        best = 0
        for layer, _, call in ctx.calls:
            shape = (
                tuple(call.query.shape),
                tuple(call.key_cache.shape),
                tuple(call.value_cache.shape),
                tuple(call.block_table.shape),
                call.query.dtype,
            )
            if shape not in seen:
                lens = _capture_lens(call)
                seen[shape] = spec.workspace_bytes(self.device, spec.arguments(call, lens, None), ctx.max_model_len)
            best = max(best, seen[shape])
            ctx.required[layer] = seen[shape]
        ctx.workspace_bytes = best
        ctx.workspace = torch.empty(best, dtype=torch.uint8) if best else None

    # --- lookup ----------------------------------------------------------------------
    def entry(self, namespace: str, key: Hashable) -> GraphEntry:
        """The captured graph of ``(namespace, key)``; raises listing the captured keys."""
        entry = self._entries.get((namespace, key))
        if entry is None:
            have = sorted(repr(k) for (ns, k) in self._entries if ns == namespace)
            raise UnknownKeyError(
                f"no graph captured for key {key!r} in namespace {namespace!r}; captured keys: "
                f"[{', '.join(have)}]. Pad the batch to a captured size or capture this key."
            )
        return entry

    def has(self, namespace: str, key: Hashable) -> bool:
        """Whether ``(namespace, key)`` has a captured graph."""
        return (namespace, key) in self._entries

    def entries(self, namespace: str | None = None) -> list[GraphEntry]:
        return [e for (ns, _), e in self._entries.items() if namespace in (None, ns)]

    def namespaces(self) -> list[str]:
        return sorted({ns for ns, _ in self._entries})

    def keys(self, namespace: str = "main") -> list[Hashable]:
        return [k for (ns, k) in self._entries if ns == namespace]

    def task_for_event(self, event: Any) -> tuple[GraphEntry, TaskRecord] | None:
        """Map a device event back to its entry and task (for error messages)."""
        task = self._event_index.get(id(event))
        if task is None:
            return None
        return self._task_entry[id(task)], task

    def reset(self, namespace: str | None = None, key: Hashable | None = None) -> None:
        """Free captured graphs: one key, one namespace, or all."""
        for (ns, k), entry in list(self._entries.items()):
            if namespace not in (None, ns) or (key is not None and k != key):
                continue
            for t in entry.tasks:
                self._event_index.pop(id(t.event), None)
                self._task_entry.pop(id(t), None)
            entry.graph.reset()
            del self._entries[(ns, k)]


def _host_repr(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return tuple(int(x) for x in v.tolist())
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return v


def _batch_of(tasks: Sequence[TaskRecord]) -> int:
    if not tasks:
        return 0
    bt = tasks[0].tensor(tasks[0].spec.refreshed_buffers[0])
    return int(bt.shape[0]) if bt is not None else 0


def _weak_tree(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return weakref.ref(v)
    if isinstance(v, (tuple, list)):
        return type(v)(_weak_tree(x) for x in v)
    if isinstance(v, dict):
        return {k: _weak_tree(x) for k, x in v.items()}
    return v


def strong_tree(v: Any) -> Any:
    """Resolve a tree of weak references (captured outputs)."""
    if isinstance(v, weakref.ref):
        return v()
    if isinstance(v, (tuple, list)):
        return type(v)(strong_tree(x) for x in v)
    if isinstance(v, dict):
        return {k: strong_tree(x) for k, x in v.items()}
    return v


def _capture_lens(call: AttentionCall) -> StepLens:
    from npugraph.replay.lens import pad_lens

    batch = int(call.block_table.shape[0])
    return pad_lens((1,) * batch, None, batch, int(call.query.shape[0]))
