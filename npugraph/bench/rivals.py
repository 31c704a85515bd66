"""The implementations the modeled timeline compares, each recording its device-API calls
and own Python on a :class:`~npugraph.bench.timeline.RecordingDevice`: npugraph (default and
grouped), vllm-ascend's ``UpdatableGraph`` as merged in #16798 under the MRV1 (synchronize
before each FULL replay, #15125) and MRV2 runners, the runner's older loop (#4233, #15579),
and torch_npu's own ``NPUGraph.update`` (its op-handler registry, SGLang's path).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch

import npusim as sim
from npugraph.bench.measured import _legacy_loop
from npugraph.bench.timeline import RecordingDevice, ShadowGraph
from npugraph.metadata import AttentionMetadata
from npugraph.replay import ReplayUpdater
from npugraph.runtime import Runtime
from npusim.surfaces.graphs import _GraphDispatchRecord, update_records


class _ShadowManager:
    """What a ReplayUpdater needs of a manager, for a shadow entry on the recording device."""

    def __init__(self, device: Any, entry: Any, max_model_len: int) -> None:
        self.device, self._entry, self.max_model_len = device, entry, max_model_len

    def entry(self, namespace: str, key: Any) -> Any:
        return self._entry

    def task_for_event(self, event: Any) -> None:
        return None

    def task_for_group(self, group: Any) -> None:
        return None


# npugraph updated per layer with event grouping (the lever that remains legal under one
# updater): its device-API calls are the API floor, and the background-thread model runs it.
HEADLINE = "npugraph_grouped"
# The row the summary's headline ratios are of: what a user who sets nothing gets. FIA
# takes the tiling-sink path (lengths on the device); PA is updated per layer, one event per
# AUTO_EVENT_GROUP layers at 20 layers and more (as npugraph_grouped).
DEFAULT = "npugraph_default"
# torch_npu's own NPUGraph.update as SGLang drives it: a real worker thread, modeled with
# the background-thread model's hand-off and GIL wake
TORCH_NPU = "torch_npu_update"


def _shadow(rt: Runtime, size: Hashable, dev: RecordingDevice) -> Any:
    entry = rt.entry(size)
    tasks = tuple(attrs.evolve(t, handle=dev.handle(t.index), event=dev.event(t.index)) for t in entry.tasks)
    return attrs.evolve(entry, tasks=tasks, graph=ShadowGraph(dev))


def _implementations(
    rt: Runtime, size: int, kernel: str, grouped: Runtime | None = None
) -> dict[str, tuple[RecordingDevice, Callable[[Any], None]]]:
    """Each implementation's step, on its own calibrated recording device (metadata built
    outside); ``grouped``: the same graph captured with event grouping (``npugraph_grouped``)."""
    out: dict[str, tuple[RecordingDevice, Callable[[Any], None]]] = {}
    variants = [("npugraph", "replay-first", rt), ("npugraph_update_first", "update-first", rt)]
    if grouped is not None:
        variants.append(("npugraph_grouped", "replay-first", grouped))
    for name, order, source in variants:
        dev = RecordingDevice(kernel, rt.device.memory)
        shadow = _shadow(source, size, dev)
        upd = ReplayUpdater(_ShadowManager(dev, shadow, rt.max_model_len), order=order, fused_update=True)  # type: ignore[arg-type]

        def npugraph_step(meta: Any, upd: ReplayUpdater = upd) -> None:
            upd.step("main", size, {"default": meta.meta})

        out[name] = (dev, npugraph_step)
    out["updatable_mrv2"] = _updatable(rt, size, kernel, synchronize=False)
    out["updatable_mrv1"] = _updatable(rt, size, kernel, synchronize=True)
    out["legacy"] = _legacy(rt, size, kernel)
    out[TORCH_NPU] = _torch_npu_update(rt, size, kernel)
    for dev, _ in out.values():
        dev.calibrate()
    return out


@dataclasses.dataclass(slots=True)
class _UpdateTask:
    """UpdatableGraph's ``GraphUpdateTask`` (vllm-ascend ``compilation/updatable_graph.py``
    as merged in #16798): ``bind`` builds a new task with the step's parameters merged in."""

    operation: Callable[..., Any]
    kwargs: dict[str, Any]
    provider: Any
    handle: Any
    event: Any

    def bind(self, params: dict[str, Any]) -> _UpdateTask:
        return dataclasses.replace(self, kwargs={**self.kwargs, **params})

    def apply(self, npu: Any, update_stream: Any) -> None:
        npu.graph_task_update_begin(update_stream, self.handle)
        self.operation(**self.kwargs)
        npu.graph_task_update_end(update_stream)
        self.event.record(update_stream)


@dataclasses.dataclass(frozen=True, slots=True)
class _FIAProvider:
    """vllm-ascend's ``FIAParamProvider``: the layer's FIA host lengths from the metadata."""

    layer_name: str

    def resolve(self, attn_metadata: Any) -> dict[str, Any]:
        m = attn_metadata[self.layer_name]
        return {"actual_seq_lengths": m.q_list, "actual_seq_lengths_kv": m.seq_lens_list}


@dataclasses.dataclass(frozen=True, slots=True)
class _PAProvider:
    """The PA provider: ``context_lens`` as the CPU tensor the metadata carries."""

    layer_name: str

    def resolve(self, attn_metadata: Any) -> dict[str, Any]:
        return {"context_lens": attn_metadata[self.layer_name].context_lens}


@dataclasses.dataclass(frozen=True, slots=True)
class _ContextSource:
    context: Any

    def get(self, provider: Any, _index: int) -> dict[str, Any]:
        return provider.resolve(self.context)  # type: ignore[no-any-return]


def _updatable(
    rt: Runtime, size: int, kernel: str, *, synchronize: bool
) -> tuple[RecordingDevice, Callable[[Any], None]]:
    """vllm-ascend's UpdatableGraph step, ported call for call from ``updatable_graph.py`` as
    merged in #16798 (commit 3c708ca): ``resolve_tasks`` binds every task to its provider's
    parameters (a dict merge and a new dataclass each), ``update`` runs begin / op / end /
    record per task and queries the PA workspace once per distinct PA task signature.

    ``synchronize``: the MRV1 wrapper's host ``synchronize()`` before each FULL replay
    (#15125); without it, the V2 runner's ordering: the update stream waits for the replay
    stream (``wait_stream``: an event record and a wait, #12944).
    """
    dev = RecordingDevice(kernel, rt.device.memory)
    shadow = _shadow(rt, size, dev)
    npu, ops = dev.npu, dev.ops
    operation = shadow.tasks[0].spec.kernel_fn(dev)
    provider_cls = _PAProvider if kernel == "pa" else _FIAProvider
    tasks = [_UpdateTask(operation, dict(t.args), provider_cls(t.layer), t.handle, t.event) for t in shadow.tasks]
    update_stream, main = npu.Stream(), npu.current_stream()

    def ws_key(kw: dict[str, Any]) -> tuple[Any, ...]:
        def sig(t: Any) -> tuple[Any, Any]:
            return (None, None) if t is None else (tuple(t.shape), t.dtype)

        return (
            kw["context_lens"].data_ptr(),
            tuple(kw["context_lens"].shape),
            sig(kw["query"]),
            sig(kw["key_cache"]),
            sig(kw["value_cache"]),
            sig(kw["block_table"]),
            sig(kw["out"]),
            kw["num_kv_heads"],
            kw["num_heads"],
            kw["scale_value"],
        )

    def step(meta: Any) -> None:
        if synchronize:
            npu.synchronize()
        shadow.graph.replay()
        if not synchronize:
            update_stream.wait_stream(main)
        source = _ContextSource(meta.context)
        resolved = tuple(task.bind(source.get(task.provider, i)) for i, task in enumerate(tasks))
        with npu.stream(update_stream):
            ws_buffer: dict[Any, Any] = {}
            for task in resolved:
                if kernel == "pa":
                    key = ws_key(task.kwargs)
                    if ws_buffer.get(key) is None:
                        ws_kwargs = task.kwargs.copy()
                        ws_kwargs.pop("workspace")
                        ws_buffer[key] = ops._npu_paged_attention_get_workspace(**ws_kwargs)
                    task.kwargs["workspace"] = ws_buffer[key]
                task.apply(npu, update_stream)

    return dev, step


def _legacy(rt: Runtime, size: int, kernel: str) -> tuple[RecordingDevice, Callable[[Any], None]]:
    """vllm-ascend's model runner before UpdatableGraph, in its real order: a host
    synchronize (#4233), the replay, then :func:`_legacy_loop` (PA workspace once per pass)."""
    dev = RecordingDevice(kernel, rt.device.memory)
    shadow = _shadow(rt, size, dev)
    update = _legacy_loop(dev, shadow, dev.npu.Stream())

    def step(meta: Any) -> None:
        dev.npu.synchronize()  # before every replay (PR #4233)
        shadow.graph.replay()
        update(meta.context)

    return dev, step


class _RecordedOverload:
    """An OpOverload as a record holds it: called with the record's arguments, named as
    torch_npu's registry looks it up."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.__name__, self._fn = name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


# the positional parameters of each op's schema, in order (op-plugin); the rest are keyword-only
_POSITIONAL = {
    "pa": (
        "query",
        "key_cache",
        "value_cache",
        "num_kv_heads",
        "num_heads",
        "scale_value",
        "block_table",
        "context_lens",
        "out",
    ),
    "fia": ("query", "key", "value"),
}
_OP_NAME = {"pa": "_npu_paged_attention.default", "fia": "npu_fused_infer_attention_score.out"}
# the key each kernel's step is given under: FIA's kv lengths as SGLang 0.5.23 sends them
# (a list), PA's context_lens as a CPU int32 tensor (SGLang's MHA entry, torch_npu's PA test)
_UPDATE_KEY = {"pa": "context_lens", "fia": "actual_seq_lengths_kv"}


def _dispatch_records(shadow: Any, dev: RecordingDevice, kernel: str) -> list[_GraphDispatchRecord]:
    """What torch_npu's capture with ``auto_dispatch_capture=True`` left: one record per
    attention op of the shadow graph (its positional and keyword arguments, its event and task
    group), on the recording device."""
    op = _RecordedOverload(_OP_NAME[kernel], shadow.tasks[0].spec.kernel_fn(dev))
    positional = _POSITIONAL[kernel]
    records: list[_GraphDispatchRecord] = []
    for t in shadow.tasks:
        args = [
            dev.weak_ref_tensor(t.args[n]) if isinstance(t.args[n], torch.Tensor) else t.args[n] for n in positional
        ]
        kwargs = {k: v for k, v in t.args.items() if k not in positional and v is not None}
        records.append(
            _GraphDispatchRecord(event=t.event, handle=t.handle, kwargs=kwargs, args=args, op_cache_entry=op)
        )
    return records


def _torch_npu_update(rt: Runtime, size: int, kernel: str) -> tuple[RecordingDevice, Callable[[Any], None]]:
    """torch_npu's ``NPUGraph.update`` as SGLang 0.5.23 drives it, line for line in host cost.

    Capture (``auto_dispatch_capture=True``) left one :class:`_GraphDispatchRecord` per
    attention op (the simulator's record, its handler registry and its port of the update
    loop, :func:`npusim.surfaces.graphs.update_records`, on the recording device).
    Each step is SGLang's ``NPUCudaGraphBackend.replay_with_input_update``:
    wait on the host for the previous replay's fence event, submit ``graph.update`` to the
    backend's one-thread executor, replay on the calling thread while the worker updates
    (the graph's ExternalEvents hold each layer until its update lands), wait for the
    worker, record a new fence.  The update is torch_npu's ``update_capture_record``: the
    one input dict copied per record, the length check, then per record on the shared update
    stream: begin, the generic keyword rewrite, the handler's spec rewrite, the op re-issued
    with the record's arguments, end, the event record.
    """
    import concurrent.futures
    import logging

    dev = RecordingDevice(kernel, rt.device.memory)
    shadow = _shadow(rt, size, dev)
    npu = dev.npu
    npu.Stream()  # SGLang's capture stream, made before the first NPUGraph ...
    update_stream = npu.Stream()  # ... makes _GraphDispatchMode's one update stream
    records = _dispatch_records(shadow, dev, kernel)
    log = logging.getLogger("torch_npu.npu.graphs")
    attr_name = _UPDATE_KEY[kernel]
    as_tensor = kernel == "pa"
    np: Any
    try:
        import numpy as np
    except ImportError:  # numpy comes with every engine; without it, torch's own conversion
        np = None

    def update_capture_record(cpu_update_input: list[dict[str, Any]]) -> None:
        dev.log("resume", stream=update_stream)  # marker: the worker has the task
        # the simulator's port of torch_npu's loop and handler registry, on the recording device
        update_records(
            records,
            cpu_update_input,
            update_stream,
            begin=npu.graph_task_update_begin,
            end=npu.graph_task_update_end,
            on_stream=npu.stream,
        )

    def update(cpu_update_input: list[dict[str, Any]]) -> None:  # NPUGraph.update
        log.debug("NPUGraph.update, cpu_update_input length %d", len(cpu_update_input))
        update_capture_record(cpu_update_input)

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-graph-update")
    fence: list[Any] = [None]

    def step(meta: Any) -> None:
        # the engine's list, built before the backend is called: seq_lens_cpu[:bs].tolist() + padding
        seq_lens: Any = meta.context[next(iter(meta.context))].seq_lens_list
        if as_tensor:
            seq_lens = (
                torch.from_numpy(np.array(seq_lens).astype(np.int32))
                if np is not None
                else torch.tensor(seq_lens, dtype=torch.int32)
            )
        cpu_update_input = [{attr_name: seq_lens}]
        if fence[0] is not None:
            fence[0].synchronize()
        dev.log("submit")  # marker: the worker starts from here
        future = executor.submit(update, cpu_update_input=cpu_update_input)
        shadow.graph.replay()
        future.result()
        dev.log("join")  # marker: the calling thread waited for the worker
        f = npu.Event()
        f.record()
        fence[0] = f

    return dev, step


@attrs.frozen
class _StepInput:
    """One step's metadata, built outside the timed region for every implementation."""

    meta: AttentionMetadata
    context: dict[str, Any]


def _step_input(rt: Runtime, size: int, lens: list[int], table: torch.Tensor) -> _StepInput:
    # the step's table is the graphs' buffer, read in place as an engine's CPU table is (no
    # copy; the host checks its block ids): on the simulator's npu device, a CPU view of it
    host_table = sim.host_view(table) if table.device.type == "npu" else table
    meta = AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32, device="cpu"), block_table=host_table)
    entry = rt.entry(size)
    per_layer = types.SimpleNamespace(
        seq_lens=meta.seq_lens,
        seq_lens_list=list(lens),
        q_list=list(range(1, size + 1)),
        context_lens=meta.seq_lens,
    )
    return _StepInput(meta=meta, context=dict.fromkeys(entry.layers, per_layer))


def _sink_step(rt: Runtime, size: int) -> tuple[RecordingDevice, Callable[[Any], None], list[int]]:
    """npugraph's step of a tiling-sink graph on a recording device, and which task's event
    lets each layer run (all of them: the one event the update records)."""
    dev = RecordingDevice("fia", rt.device.memory)
    shadow = _shadow(rt, size, dev)
    upd = ReplayUpdater(_ShadowManager(dev, shadow, rt.max_model_len), order="replay-first")  # type: ignore[arg-type]
    rec = next(t.index for t in shadow.tasks if t.records)

    def step(meta: Any) -> None:
        upd.step("main", size, {"default": meta.meta})

    dev.calibrate()
    return dev, step, [rec] * len(shadow.tasks)


def _frozen_step(rt: Runtime, size: int) -> tuple[RecordingDevice, Callable[[Any], None], list[int]]:
    """npugraph's step of an update-free graph on a recording device: the pick of the
    narrowest width (``Runtime.step``'s), then the step of that graph (one length copy, one
    mask comparison, one event, the replay: the same calls at every width, so the widest
    graph's shadow stands for all), and which task's event lets each layer run."""
    dev = RecordingDevice("fia", rt.device.memory)
    widest = max((e for e in rt.entries() if e.width is not None), key=lambda e: e.width or 0)
    shadow = _shadow(rt, widest.key, dev)
    upd = ReplayUpdater(_ShadowManager(dev, shadow, rt.max_model_len), order="replay-first")  # type: ignore[arg-type]
    rec = next(t.index for t in shadow.tasks if t.records)

    def step(meta: Any) -> None:
        metadata = {"default": meta.meta}
        rt.graph_for(size, metadata)  # the runtime's own pick, as Runtime.step makes it
        upd.step("main", size, metadata)

    dev.calibrate()
    return dev, step, [rec] * len(shadow.tasks)
