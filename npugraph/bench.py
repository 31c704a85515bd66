"""Benchmarks of the per-step update path.

Modeled (:func:`modeled_summary`): each implementation's device-API calls and own Python,
recorded and replayed on a model of the host and the device (``npugraph.timeline``):
npugraph in its default and grouped configurations, vllm-ascend's ``UpdatableGraph`` as
merged in #16798 under the MRV1 (synchronize before each FULL replay, #15125) and MRV2
runners, and the runner's older loop (#4233, #15579).

Measured (:func:`bench_update`): host time of five implementations updating the same
captured graph, interleaved step by step so that machine drift cancels.  Each is timed
from its input as an engine hands it over: the metadata objects are built untimed,
because building them is the engine's work, whichever update then reads them.

* **npugraph** — :meth:`ReplayUpdater.update`;
* **unchecked** — the same with validation off (``Runtime(validate=False)``): what the
  framework costs without the checks of lengths and block ids;
* **baseline** — the older loop of vllm-ascend's runner (``update_*_params``):
  host-synchronize before every replay; walk the metadata dict in capture order; per
  layer unpack a positional argument tuple, convert its lengths to a Python list; the
  PA workspace once per pass (#15579); update begin, re-issue the op, update end,
  record the event;
* **floor** — only the device calls an update needs (begin, op, end, record per
  layer), with every argument precomputed;
* **minimal** — the floor plus the least a validated step must do on the host: the
  lengths read, bounded, padded and turned into the kernel's host values, and the
  device-side check of the block ids in use (:class:`BlockIdCheck`, as npugraph uses
  it).  No resolve, no state, no ordering, no trace: what any validated update costs,
  so ``npugraph / minimal`` is the framework's own share.

Each runs with the simulator's host-cost model off (pure framework overhead) or on
(``HostCostModel.atlas_a2``: the cost structure measured on Atlas A2).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from npusim.surfaces.graphs import _GraphDispatchRecord, update_records

import npusim as sim
from npugraph.errors import StepOrderWarning
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.models.stack import AttentionStack
from npugraph.ops import pad_lens
from npugraph.policy import FixedPolicy
from npugraph.replay import AttentionMetadata, ReplayUpdater, convert
from npugraph.replay.lens import BlockIdCheck, real_requests
from npugraph.runtime import Runtime
from npugraph.timeline import Call, Costs, RecordingDevice, ShadowGraph, StepLog, TimelineResult, min_log, model_steps

__all__ = [
    "bench_update",
    "run_bench",
    "bench_capture",
    "bench_replay_vs_eager",
    "bench_validation",
    "bench_timeline",
    "modeled_summary",
    "python_loop_ns",
]

_MAX_MODEL_LEN = 2048


def _setup(
    layers: int,
    size: int,
    kernel: str,
    cost: bool,
    *,
    event_group: int = 1,
    configure: bool = True,
    table: torch.Tensor | None = None,
) -> tuple[Runtime, Any, torch.Tensor, torch.Tensor]:
    """A captured attention stack; returns the runtime, the stack, and the graph's block-table
    and query buffers (the caller keeps them alive: the graph reads them).  ``table``: capture
    with this block-table buffer (another graph's), as an engine's graphs share its one buffer."""
    if configure:
        sim.configure(cost_model=sim.HostCostModel.atlas_a2() if cost else None)
    rt = Runtime(
        "sim",
        max_model_len=_MAX_MODEL_LEN,
        policy=FixedPolicy(kernel),
        order="update-first",
        event_group=event_group,
    )
    stack = AttentionStack(rt, layers=layers)
    cols = _MAX_MODEL_LEN // stack.block_size
    dev = rt.device.memory
    if table is None:
        table = torch.randint(0, stack.num_blocks, (size, cols), dtype=torch.int32, device="cpu").to(dev)
    q = torch.randn(size, stack.heads, stack.head_size, device="cpu").to(dtype=stack.dtype, device=dev)
    meta = AttentionMetadata(seq_lens=torch.ones(size, dtype=torch.int32, device="cpu"), block_table=table)
    rt.capture(stack, q, meta, key=size)
    return rt, stack, table, q


def _legacy_loop(device: Any, entry: Any, update_stream: Any) -> Callable[[Any], None]:
    """vllm-ascend's per-layer update before September 2026, for the graph ``entry`` on ``device``.

    The step's metadata (``{layer: metadata}``) is walked in capture order with a positional
    tuple per layer; lengths are converted per layer; the PA workspace is queried once per
    pass (PR #15579, which replaced a query before every layer, #3986); then begin / op /
    end / record.  The caller adds the host synchronize before the replay (PR #4233).
    """
    npu, ops = device.npu, device.ops
    spec = entry.tasks[0].spec
    kernel = spec.kernel_fn(device)
    is_pa = spec.name == "pa"
    names = list(entry.tasks[0].args)
    attn_params = [tuple(t.args.values()) for t in entry.tasks]
    handles = [t.handle for t in entry.tasks]
    events = [t.event for t in entry.tasks]

    def update(metadata: Any) -> None:
        workspace = None
        with npu.stream(update_stream):
            for (_name, meta), params, handle, event in zip(metadata.items(), attn_params, handles, events):
                kw = dict(zip(names, params))
                seq = meta.seq_lens.tolist()
                if is_pa:
                    kw["context_lens"] = torch.tensor(seq, dtype=torch.int32, device="cpu")
                    if workspace is None:  # once per pass (#15579)
                        workspace = ops._npu_paged_attention_get_workspace(
                            **{k: v for k, v in kw.items() if k != "workspace"}
                        )
                    kw["workspace"] = workspace
                else:
                    kw["actual_seq_lengths"] = list(range(1, len(seq) + 1))
                    kw["actual_seq_lengths_kv"] = seq
                npu.graph_task_update_begin(update_stream, handle)
                kernel(**kw)
                npu.graph_task_update_end(update_stream)
                event.record(update_stream)

    return update


@attrs.frozen(kw_only=True)
class _Method:
    """One measured update: ``prepare`` makes its input from the step's lengths (untimed:
    the engine's work, such as building the metadata objects), ``run`` is the timed update."""

    prepare: Callable[[torch.Tensor], Any]
    run: Callable[[Any], None]


def _methods(rt: Runtime, size: int, table: torch.Tensor) -> dict[str, _Method]:
    """The update implementations, each from this step's seq_lens."""
    entry = rt.entry(size)
    dev = rt.device
    npu = dev.npu
    update_stream = rt.updater.stream
    layers = list(entry.layers)
    spec = entry.tasks[0].spec
    handles = [t.handle for t in entry.tasks]
    events = [t.event for t in entry.tasks]
    kernel = spec.kernel_fn(dev)

    def step_metadata(lens: torch.Tensor) -> dict[str, AttentionMetadata]:
        return {"default": AttentionMetadata(seq_lens=lens, block_table=table)}

    def npugraph(metadata: dict[str, AttentionMetadata]) -> None:
        rt.updater.update("main", size, metadata)

    def unchecked(metadata: dict[str, AttentionMetadata]) -> None:
        # the same update with validation off (Runtime(validate=False)): the framework alone
        updater = rt.updater
        updater.validate = False
        try:
            updater.update("main", size, metadata)
        finally:
            updater.validate = True

    legacy = _legacy_loop(dev, entry, update_stream)

    def per_layer(lens: torch.Tensor) -> dict[str, AttentionMetadata]:
        return {name: AttentionMetadata(seq_lens=lens, block_table=table) for name in layers}

    def baseline(metadata: dict[str, AttentionMetadata]) -> None:
        npu.synchronize()  # before every replay (vllm-ascend PR #4233)
        legacy(metadata)

    def prepare_floor(lens: torch.Tensor) -> list[dict[str, Any]]:
        host = spec.host_values(_lens(lens, size))
        args = []
        for t in entry.tasks:
            kw = t.kwargs()
            kw.update(host)
            args.append(kw)
        return args

    def floor(args: list[dict[str, Any]]) -> None:
        begin, end = npu.graph_task_update_begin, npu.graph_task_update_end
        with npu.stream(update_stream):
            for i in range(len(args)):
                begin(update_stream, handles[i])
                kernel(**args[i])
                end(update_stream)
                events[i].record(update_stream)

    geometry = rt.updater.plan(entry).tasks[0].geometry
    check = BlockIdCheck.on(dev.memory, int(table.shape[1]))
    minimal_args = [t.kwargs() for t in entry.tasks]

    def minimal(lens: torch.Tensor) -> None:
        kv = lens.tolist()
        kv = kv[: real_requests(kv)]
        if kv and (min(kv) < 1 or max(kv) > _MAX_MODEL_LEN):
            raise ValueError("the bench drew lengths outside [1, max_model_len]")
        host = spec.host_values(pad_lens(kv, None, size, size))
        if kv:
            check.flag(table, kv, geometry.block_size, geometry.num_blocks)
        for kw in minimal_args:
            kw.update(host)
        floor(minimal_args)  # then the floor's device calls, the same code

    return {
        "npugraph": _Method(prepare=step_metadata, run=npugraph),
        "unchecked": _Method(prepare=step_metadata, run=unchecked),
        "baseline": _Method(prepare=per_layer, run=baseline),
        "floor": _Method(prepare=prepare_floor, run=floor),
        "minimal": _Method(prepare=lambda lens: lens, run=minimal),
    }


def _lens(lens: torch.Tensor, size: int) -> Any:
    return pad_lens(lens.tolist(), None, size, size)


def bench_update(
    layers: int, size: int, kernel: str, cost: bool, *, repeats: int = 15, warmup: int = 3, seed: int = 0
) -> dict[str, Any]:
    """Median per-step update cost (us) of each implementation for one configuration."""
    rt, _, table, _query = _setup(layers, size, kernel, cost)
    methods = _methods(rt, size, table)
    rng = random.Random(seed)
    times: dict[str, list[float]] = {m: [] for m in methods}
    calls: dict[str, dict[str, int]] = {}
    counters = sim.counters()
    order = list(methods)
    for i in range(warmup + repeats):
        rng.shuffle(order)  # interleaved, in a fresh order each round
        for name in order:
            lens = torch.tensor([rng.randint(1, _MAX_MODEL_LEN) for _ in range(size)], dtype=torch.int32, device="cpu")
            method = methods[name]
            step_input = method.prepare(lens)  # the engine's part: untimed for every method
            before = dict(counters)
            t0 = time.perf_counter()
            method.run(step_input)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt * 1e6)
                calls[name] = {k: counters[k] - before.get(k, 0) for k in counters if counters[k] - before.get(k, 0)}
            # untimed: replay so that the graph consumes this update's events
            if name in ("npugraph", "unchecked"):
                rt.updater.replay("main", size)
            else:
                rt.entry(size).graph.replay()
            rt.device.npu.synchronize()
    row: dict[str, Any] = {
        "layers": layers,
        "size": size,
        "kernel": kernel,
        "cost_model": "a2" if cost else "off",
    }
    for name in methods:
        ts = sorted(times[name])
        row[f"{name}_us"] = statistics.median(ts)
        row[f"{name}_spread_us"] = [ts[len(ts) // 4], ts[(3 * len(ts)) // 4]]
    row["calls"] = {name: sum(calls[name].values()) for name in methods}
    row["calls_detail"] = calls
    sim.configure()
    return row


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cm in ("off", "a2"):
        sel = [r for r in rows if r["cost_model"] == cm and r["layers"] >= 32]
        if not sel:
            continue
        out[cm] = {
            "ratio_vs_baseline_median": statistics.median(r["npugraph_us"] / r["baseline_us"] for r in sel),
            "overhead_vs_floor_median": statistics.median(r["npugraph_us"] / r["floor_us"] for r in sel),
            "unchecked_vs_floor_median": statistics.median(r["unchecked_us"] / r["floor_us"] for r in sel),
            "minimal_vs_floor_median": statistics.median(r["minimal_us"] / r["floor_us"] for r in sel),
            "npugraph_vs_minimal_median": statistics.median(r["npugraph_us"] / r["minimal_us"] for r in sel),
        }
        for k in ("pa", "fia"):
            ks = [r for r in sel if r["kernel"] == k]
            if ks:
                out[cm][f"ratio_vs_baseline_median_{k}"] = statistics.median(
                    r["npugraph_us"] / r["baseline_us"] for r in ks
                )
    return out


def run_bench(
    *,
    layers: Sequence[int] = (8, 32, 64),
    sizes: Sequence[int] = (1, 8, 32),
    kernels: Sequence[str] = ("pa", "fia"),
    cost_models: Sequence[bool] = (False, True),
    repeats: int = 15,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every configuration of :func:`bench_update`; rows plus the summary ratios."""
    rows = []
    for cost in cost_models:
        for n in layers:
            for s in sizes:
                for k in kernels:
                    row = bench_update(n, s, k, cost, repeats=repeats)
                    rows.append(row)
                    if progress is not None:
                        progress(row)
    return {"rows": rows, "summary": _summary(rows)}


def bench_capture(sizes_counts: Sequence[int] = (8, 32, 67), layers: Sequence[int] = (8, 32)) -> list[dict[str, Any]]:
    """Wall time and pool memory to capture S sizes x L attention layers."""
    rows = []
    for n in layers:
        for s in sizes_counts:
            sim.configure()
            rt = Runtime("sim", max_model_len=_MAX_MODEL_LEN)
            stack = AttentionStack(rt, layers=n)
            keys = list(range(1, s + 1))
            cols = _MAX_MODEL_LEN // stack.block_size
            dev = rt.device.memory
            table = torch.zeros(max(keys), cols, dtype=torch.int32, device=dev)
            q = torch.randn(max(keys), stack.heads, stack.head_size, device="cpu").to(dtype=stack.dtype, device=dev)

            def make(k: Any, q: torch.Tensor = q, table: torch.Tensor = table, stack: Any = stack) -> tuple:
                meta = AttentionMetadata(seq_lens=torch.ones(k, dtype=torch.int32, device="cpu"), block_table=table[:k])
                return stack, (q[:k], meta), {}

            t0 = time.perf_counter()
            rt.capture_all(keys, make)
            dt = time.perf_counter() - t0
            rows.append(
                {
                    "sizes": s,
                    "layers": n,
                    "seconds": dt,
                    "pool_bytes": sim.pool_bytes(rt.manager.pool),
                    "workspace_bytes": sum(e.workspace_bytes for e in rt.entries()),
                }
            )
    sim.configure()
    return rows


def bench_replay_vs_eager(steps: int = 40, layers: int = 8) -> dict[str, Any]:
    """Decoder step time, replayed vs eager, on the simulator (a sanity line, not a claim)."""
    sim.configure()
    cfg = DecoderConfig(layers=layers)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    eng = DecodeEngine(rt, Decoder(cfg, rt), [1, 2, 4, 8, 16, 32])
    eng.capture()
    eager, replay = [], []
    for b in Workload(cfg, eng.sizes, seed=0).steps(steps):
        t0 = time.perf_counter()
        eng.eager(b)
        t1 = time.perf_counter()
        eng.step(b)
        t2 = time.perf_counter()
        eager.append(t1 - t0)
        replay.append(t2 - t1)
    sim.configure()
    e, r = statistics.median(eager) * 1e6, statistics.median(replay) * 1e6
    return {"eager_us_median": e, "replay_us_median": r, "replay_over_eager": r / e}


def bench_validation(
    requests: Sequence[int] = (64, 256), layers: int = 32, repeats: int = 10, seed: int = 0
) -> list[dict[str, Any]]:
    """Validation's share of a step's update at real shapes (max_model_len 32768, block 128).

    The block table has 256 columns; validation reads only the columns in use, so its
    cost follows the blocks the step uses, not the table's width.  ``device_table_check_us``:
    the same block-id check for a device-resident table, issued as eager device ops, with
    new random lengths each step; ``device_table_check_decode_us``: the same as requests
    decode (each one token longer a step).  The check keeps nothing between steps, so the
    two differ only by the columns the longest request reaches.
    """
    rows = []
    max_len, block = 32768, 128
    for r in requests:
        sim.configure()
        rt = Runtime("sim", max_model_len=max_len, policy=FixedPolicy("fia"), order="update-first")
        stack = AttentionStack(rt, layers=layers, block_size=block, num_blocks=64)
        cols = max_len // block
        dev = rt.device.memory
        table = torch.zeros(r, cols, dtype=torch.int32, device=dev)
        q = torch.randn(r, stack.heads, stack.head_size, device="cpu").to(dtype=stack.dtype, device=dev)
        rt.capture(
            stack,
            q,
            AttentionMetadata(seq_lens=torch.ones(r, dtype=torch.int32, device="cpu"), block_table=table),
            key=r,
        )
        entry = rt.entry(r)
        rng = random.Random(seed)
        conv, upd, dev_check, decode_check = [], [], [], []
        check = BlockIdCheck.on(dev, cols)  # keeps nothing between steps: one serves both draws
        decode_lens = [rng.randint(1, max_len - repeats - 2) for _ in range(r)]
        with warnings.catch_warnings():  # each update discards the last, on purpose
            warnings.simplefilter("ignore", StepOrderWarning)
            for i in range(repeats + 2):
                lens = [rng.randint(1, max_len) for _ in range(r)]
                host = torch.randint(0, 64, (r, cols), dtype=torch.int32, device="cpu")
                meta = AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32, device="cpu"), block_table=host)
                t0 = time.perf_counter()
                convert(
                    meta,
                    batch=r,
                    tokens=r,
                    max_model_len=max_len,
                    block_size=block,
                    num_blocks=64,
                    capacity_blocks=cols,
                    where="bench",
                    validate=True,
                    tokens_per_request=1,
                )
                t1 = time.perf_counter()
                rt.update(r, {"default": meta})  # never replayed: the kernels' math would dominate the run
                t2 = time.perf_counter()
                # a device-resident table (vLLM's) is checked on the device instead: eager ops per step
                check.flag(table, lens, block, 64)
                t3 = time.perf_counter()
                decode_lens = [n + 1 for n in decode_lens]
                t4 = time.perf_counter()
                check.flag(table, decode_lens, block, 64)
                t5 = time.perf_counter()
                if i >= 2:
                    conv.append(t1 - t0)
                    upd.append(t2 - t1)
                    dev_check.append(t3 - t2)
                    decode_check.append(t5 - t4)
        c, u = statistics.median(conv) * 1e6, statistics.median(upd) * 1e6
        rows.append(
            {
                "requests": r,
                "layers": layers,
                "max_model_len": max_len,
                "block_size": block,
                "table_columns": cols,
                "validation_us": c,
                "update_us": u,
                "validation_share": c / u,
                "device_table_check_us": statistics.median(dev_check) * 1e6,
                "device_table_check_decode_us": statistics.median(decode_check) * 1e6,
                "tasks": len(entry.tasks),
            }
        )
    sim.configure()
    return rows


def python_loop_ns(iterations: int = 200_000, repeats: int = 5) -> float:
    """How fast this machine runs Python: ns per iteration of a plain summing loop (best of
    ``repeats``).  The modeled timeline takes each implementation's Python from the machine
    it runs on, so its ratios move with this figure: a slower host leaves a lever that
    saves device-API calls a smaller share of the step."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(iterations):
            total += i
        best = min(best, time.perf_counter() - t0)
    return best * 1e9 / iterations


# --- the modeled timeline: npugraph vs UpdatableGraph vs the older loop ---------------------


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


def _shadow(rt: Runtime, size: int, dev: RecordingDevice) -> Any:
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


@attrs.frozen(kw_only=True)
class ModeledShape:
    """One modeled serving shape: the graph, and the device time of each layer (with where
    that figure comes from: only a device can confirm it)."""

    label: str
    layers: int
    size: int
    kernel: str
    attention_us: float
    other_us: float  # the layer's non-attention work (matmuls, norms)
    source: str
    event_group: int = 10  # tasks per ExternalEvent in the npugraph_grouped row

    @property
    def device_limit(self) -> float:
        """Steps/s of the device alone: every layer back to back, nothing waiting."""
        return 1e6 / (self.layers * (self.attention_us + self.other_us))


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
# what npugraph's default must reach over torch_npu's update (steps/s, every seed), per shape
TORCH_NPU_GOALS = {"host_bound": 2.0, "small_batch": 1.2}

SHAPES = (
    ModeledShape(
        label="host_bound",
        layers=20,
        size=16,
        kernel="fia",
        attention_us=20.0,
        other_us=40.0,
        source="vllm-ascend #13058: 1.21 ms of replay for 20 layers, 60 us a layer (split 20 attention / 40 other: assumed)",
    ),
    ModeledShape(
        label="small_batch",
        layers=20,
        size=4,
        kernel="pa",
        attention_us=10.0,
        other_us=20.0,
        source="a small model at batch 4: 30 us a layer (10 attention / 20 other: assumed)",
    ),
    ModeledShape(
        label="device_bound",
        layers=32,
        size=16,
        kernel="fia",
        attention_us=50.0,
        other_us=270.0,
        source="a Llama-3-8B-sized layer on Atlas A2: 218M bf16 weights (436 MB) read at ~1.6 TB/s = 270 us; attention "
        "at batch 16 over 2K tokens = 50 us (estimates)",
    ),
)


# The background update thread (not built; modeled): the engine's own host work for a step
# (input preparation, sampling bookkeeping) as Python under the GIL in chunks of
# ENGINE_CHUNK_US between GIL-releasing calls (torch ops), swept over ENGINE_US (no source:
# a parameter); HANDOFF_US is the wake of a Python thread blocked on a queue or on the GIL
# (measured on the development machine: 21 us one way).
ENGINE_US = (0.0, 250.0, 500.0, 1000.0)
ENGINE_CHUNK_US = 50.0
HANDOFF_US = 21.0


def engine_step(log: StepLog, engine_us: float, *, background: bool) -> StepLog:
    """npugraph's recorded step (replay first) plus the engine's host work for the step.

    In line: the replay, the update, then the engine's work, on one thread.  With a
    background update thread: the main thread replays, hands the update to the thread
    (which wakes ``HANDOFF_US`` later) and does the engine's work; the step ends when both
    are done, the main thread woken by the thread's last call.  Every Python segment holds
    the GIL, so the two overlap only while the thread is in a GIL-free call.
    """
    calls = list(log.calls)
    after_replay = next(i for i, c in enumerate(calls) if c.kind == "replay") + 1
    chunks = int(engine_us // ENGINE_CHUNK_US)
    engine = [Call(kind="engine", thread=0, python_us=ENGINE_CHUNK_US) for _ in range(chunks)]
    if engine_us > chunks * ENGINE_CHUNK_US:
        engine.append(Call(kind="engine", thread=0, python_us=engine_us - chunks * ENGINE_CHUNK_US))
    if not background:
        return StepLog(calls=(*calls, *engine), fork=log.fork)
    update = [attrs.evolve(c, thread=1) for c in calls[after_replay:]]
    if not update:
        return StepLog(calls=(*calls, *engine), fork=log.fork)
    update[0] = attrs.evolve(update[0], python_us=update[0].python_us + HANDOFF_US)
    update[-1] = attrs.evolve(update[-1], python_us=update[-1].python_us + HANDOFF_US)
    return StepLog(calls=(*calls[:after_replay], *engine, *update), fork=after_replay)


def _modeled_runtimes(shape: ModeledShape) -> tuple[Runtime, Runtime, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The shape captured by default and with event grouping, both reading one block-table
    buffer, as an engine's graphs read its one buffer (each step's table is that buffer, so
    neither copies it in: with a buffer each, the grouped graph alone would copy every step).
    Returns both runtimes, the table and the query buffers (keep them alive)."""
    rt, _, table, query = _setup(shape.layers, shape.size, shape.kernel, cost=False)
    grouped, _, _, g_query = _setup(
        shape.layers, shape.size, shape.kernel, cost=False, event_group=shape.event_group, configure=False, table=table
    )
    return rt, grouped, table, (query, g_query)


def bench_timeline(
    shape: ModeledShape, *, repeats: int = 7, seed: int = 0, host_costs: dict[str, Any] | None = None
) -> dict[str, TimelineResult]:
    """Modeled step latency and steps/s of every implementation for one shape and seed,
    plus ``api_floor``: the headline's device-API calls with none of its Python.
    ``host_costs``: measured host µs per call (``npugraph selftest --calibrate``) instead of A2's."""
    sim.configure()
    rt, grouped, table, _queries = _modeled_runtimes(shape)
    sink = None
    if shape.kernel == "fia":  # the default FIA graph: the tiling-sink kernel
        sink, _, _, _sq = _setup(shape.layers, shape.size, "fia_sink", cost=False, configure=False, table=table)
    rng = random.Random(seed)
    device_us = {"attention_us": shape.attention_us, "other_us": shape.other_us}
    costs = Costs.host_costs(host_costs, **device_us) if host_costs else Costs(**device_us)
    results: dict[str, TimelineResult] = {}
    tasks = grouped.entry(shape.size).tasks
    recorded_by = [next(j for j in range(i, len(tasks)) if tasks[j].records) for i in range(len(tasks))]
    impls = _implementations(rt, shape.size, shape.kernel, grouped)
    sink_by: list[int] | None = None
    if sink is not None:
        sdev, sstep, sink_by = _sink_step(sink, shape.size)
        impls["npugraph_sink"] = (sdev, sstep)
    for name, (dev, step) in impls.items():
        logs: list[StepLog] = []
        for _ in range(repeats + 2):
            inp = _step_input(rt, shape.size, [rng.randint(1, _MAX_MODEL_LEN) for _ in range(shape.size)], table)
            with dev.recording() as log:
                step(inp)
            logs += log
        best = min_log(logs[2:])
        by = recorded_by if name == "npugraph_grouped" else sink_by if name == "npugraph_sink" else None
        own = attrs.evolve(costs, gil_handoff=HANDOFF_US, thread_wake=HANDOFF_US) if name == TORCH_NPU else costs
        results[name] = model_steps(best, own, kernel=shape.kernel, layers=shape.layers, recorded_by=by)
        if name == HEADLINE:  # its device-API calls alone: the floor for one updater
            bare = StepLog(calls=tuple(attrs.evolve(c, python_us=0.0) for c in best.calls), fork=best.fork)
            results["api_floor"] = model_steps(bare, costs, kernel=shape.kernel, layers=shape.layers, recorded_by=by)
        if name in ("npugraph", HEADLINE):  # in line vs a background update thread ("name@engine_us[+thread]")
            threaded = attrs.evolve(costs, gil_handoff=HANDOFF_US)
            for e in ENGINE_US:
                for background, c in ((False, costs), (True, threaded)):
                    results[f"{name}@{e:g}" + ("+thread" if background else "")] = model_steps(
                        engine_step(best, e, background=background),
                        c,
                        kernel=shape.kernel,
                        layers=shape.layers,
                        recorded_by=by,
                    )
    # the default configuration (what Runtime() chooses for this shape)
    results[DEFAULT] = results["npugraph_sink" if sink is not None else "npugraph_grouped"]
    sim.configure()
    return results


def _implementation_rows(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` less the background-thread variants (``"name@engine_us[+thread]"``),
    which the summary reports apart."""
    return {k: r for k, r in results.items() if "@" not in k}


def _spread(xs: Sequence[float]) -> dict[str, Any]:
    med = statistics.median(xs)
    return {"median": round(med, 4), "min": round(min(xs), 4), "max": round(max(xs), 4), "n": len(xs)}


def modeled_summary(
    seeds: int = 5,
    progress: Callable[[str, dict[str, TimelineResult]], None] | None = None,
    host_costs: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, TimelineResult]]]:
    """The modeled rows of ``npugraph bench``, each ratio over ``seeds`` runs with its spread,
    and the first seed's timelines per shape (for the Chrome trace).

    A ratio is a claim only where its whole spread lies on one side of 1 (``claim``).
    """
    out: dict[str, Any] = {}
    traces: dict[str, dict[str, TimelineResult]] = {}
    noise = 0.0
    for shape in SHAPES:
        runs = [bench_timeline(shape, seed=seed, host_costs=host_costs) for seed in range(seeds)]
        traces[shape.label] = _implementation_rows(runs[0])
        sps = {k: [r[k].steps_per_s for r in runs] for k in runs[0]}
        lat = {k: [r[k].step_latency_us for r in runs] for k in runs[0]}

        def ratio(
            a: str, b: str, lat: dict[str, list[float]] = lat, sps: dict[str, list[float]] = sps
        ) -> dict[str, Any]:
            return _spread([x / y for x, y in zip(sps[a], sps[b])])

        default_is = (
            "FIA with lengths on the device (tiling sink), replay-first"
            if shape.kernel == "fia"
            else f"updated per layer, one ExternalEvent per {shape.event_group} layers (auto), replay-first"
        )
        row: dict[str, Any] = {
            "headline": f"{DEFAULT}: Runtime() as a user who sets nothing gets it: {default_is}, one update thread",
            "layers": shape.layers,
            "size": shape.size,
            "kernel": shape.kernel,
            "attention_us": shape.attention_us,
            "other_us": shape.other_us,
            "device_time_source": shape.source,
            "steps_per_s": {k: round(statistics.median(v), 1) for k, v in _implementation_rows(sps).items()},
            "step_latency_us": {k: round(statistics.median(v), 1) for k, v in _implementation_rows(lat).items()},
            "npugraph_vs_updatable": ratio(DEFAULT, "updatable_mrv2"),
            "npugraph_vs_updatable_mrv1": ratio(DEFAULT, "updatable_mrv1"),
            "npugraph_grouped_vs_updatable": ratio(HEADLINE, "updatable_mrv2"),
            "npugraph_per_layer_vs_updatable": ratio("npugraph", "updatable_mrv2"),
            "legacy_vs_updatable": ratio("legacy", "updatable_mrv2"),
            "npugraph_vs_torch_npu_update": ratio(DEFAULT, TORCH_NPU),
            # per layer, lengths on the host as torch_npu's: what is left without the tiling sink
            "npugraph_grouped_vs_torch_npu_update": ratio(HEADLINE, TORCH_NPU),
            "latency_vs_torch_npu_update": _spread([x / y for x, y in zip(lat[DEFAULT], lat[TORCH_NPU])]),
            "latency_vs_updatable": _spread([x / y for x, y in zip(lat[DEFAULT], lat["updatable_mrv2"])]),
            "grouped_latency_vs_updatable": _spread([x / y for x, y in zip(lat[HEADLINE], lat["updatable_mrv2"])]),
            "npugraph_vs_api_floor": ratio(HEADLINE, "api_floor"),
            "npugraph_vs_device_limit": _spread([x / shape.device_limit for x in sps[DEFAULT]]),
            "device_limit_steps_per_s": round(shape.device_limit, 1),
        }

        def threaded(name: str, lat: dict[str, list[float]] = lat) -> dict[str, Any]:
            """Per engine_us: steps/s and step latency with a background update thread over in line."""
            out: dict[str, Any] = {}
            for e in ENGINE_US:
                a, b = f"{name}@{e:g}+thread", f"{name}@{e:g}"
                out[f"{e:g}"] = {
                    "steps_per_s": ratio(a, b),
                    "latency": _spread([x / y for x, y in zip(lat[a], lat[b])]),
                }
            return out

        row["background_thread"] = {
            "engine_us": list(ENGINE_US),
            "engine_chunk_us": ENGINE_CHUNK_US,
            "handoff_us": HANDOFF_US,
            "default": threaded("npugraph"),
            "grouped": threaded(HEADLINE),
        }
        for key in (
            "npugraph_vs_updatable",
            "npugraph_vs_updatable_mrv1",
            "npugraph_grouped_vs_updatable",
            "npugraph_per_layer_vs_updatable",
            "npugraph_vs_torch_npu_update",
            "npugraph_grouped_vs_torch_npu_update",
        ):
            r = row[key]
            r["claim"] = r["min"] > 1.0 or r["max"] < 1.0  # the whole spread on one side of 1
            noise = max(noise, (r["max"] - r["min"]) / r["median"])
        if shape.label in TORCH_NPU_GOALS:
            r = row["npugraph_vs_torch_npu_update"]
            r["goal"] = TORCH_NPU_GOALS[shape.label]
            r["meets_goal"] = r["min"] >= r["goal"]  # every seed, not the median
        out[shape.label] = row
        if progress is not None:
            progress(shape.label, traces[shape.label])
    out["noise"] = round(noise, 4)
    out["seeds"] = seeds
    out["host_costs"] = dict(host_costs) if host_costs else "atlas_a2 (vllm-ascend #13058, #15579, #4233)"
    return out, traces


# --- the tiling-sink path (modeled) ------------------------------------------------------

SINK_LAYERS = (20, 32, 61)
# the metadata op's AI-CPU time per step, as vllm-ascend #15336 measured it (130-320 us)
SINK_METADATA_US = (130.0, 220.0, 320.0)


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


def bench_sink(
    layers: Sequence[int] = SINK_LAYERS,
    metadata_us: Sequence[float] = SINK_METADATA_US,
    *,
    seeds: int = 3,
    repeats: int = 7,
    host_costs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Modeled host-bound FIA decode (batch 16; 20 us attention and 40 us other work a layer,
    as the host_bound shape): npugraph's tiling-sink step against vllm-ascend's
    UpdatableGraph (MRV2) and against npugraph's per-layer update with event grouping
    (``npugraph_grouped``), per layer count and metadata-op device time; each ratio over
    ``seeds`` runs with its spread.  ``break_even_metadata_us``: the metadata op's device
    time above which the sink step's steps/s falls below UpdatableGraph's."""
    out: dict[str, Any] = {
        "size": 16,
        "attention_us": 20.0,
        "other_us": 40.0,
        "metadata_launch_us": Costs().metadata_launch,
        "source": "metadata op: vllm-ascend #15336 (130-320 us AI CPU, 150-190 us of launches); layers as host_bound",
        "rows": [],
    }
    for n in layers:
        sim.configure()
        shape = ModeledShape(
            label=f"sink_{n}", layers=n, size=16, kernel="fia", attention_us=20.0, other_us=40.0, source=""
        )
        rt, grouped, table, _q = _modeled_runtimes(shape)
        sink, _, _, _q2 = _setup(n, 16, "fia_sink", cost=False, configure=False, table=table)
        if sink.entry(16).choice.kernel != "fia_sink":
            raise RuntimeError(f"the sink runtime captured {sink.entry(16).choice}")
        tasks = grouped.entry(16).tasks
        grouped_by = [next(j for j in range(i, len(tasks)) if tasks[j].records) for i in range(len(tasks))]
        impls = _implementations(rt, 16, "fia", grouped)
        sdev, sstep, sink_by = _sink_step(sink, 16)
        chosen = {
            "updatable_mrv2": (*impls["updatable_mrv2"], None),
            "npugraph_grouped": (*impls["npugraph_grouped"], grouped_by),
            "npugraph_sink": (sdev, sstep, sink_by),
        }
        per_cost: dict[float, dict[str, list[TimelineResult]]] = {m: {k: [] for k in chosen} for m in metadata_us}
        logs_by_seed = []
        for seed in range(seeds):
            rng = random.Random(seed)
            best: dict[str, StepLog] = {}
            for name, (dev, step, _) in chosen.items():
                logs: list[StepLog] = []
                for _ in range(repeats + 2):
                    inp = _step_input(rt, 16, [rng.randint(1, _MAX_MODEL_LEN) for _ in range(16)], table)
                    with dev.recording() as log:
                        step(inp)
                    logs += log
                best[name] = min_log(logs[2:])
            logs_by_seed.append(best)
            for m in metadata_us:
                costs = _sink_costs(host_costs, m)
                for name, (_, _, by) in chosen.items():
                    per_cost[m][name].append(model_steps(best[name], costs, kernel="fia", layers=n, recorded_by=by))
        rows = []
        for m in metadata_us:
            r = per_cost[m]

            def ratio(a: str, b: str, r: dict[str, list[TimelineResult]] = r) -> dict[str, Any]:
                return _spread([x.steps_per_s / y.steps_per_s for x, y in zip(r[a], r[b])])

            lat = _spread(
                [x.step_latency_us / y.step_latency_us for x, y in zip(r["npugraph_sink"], r["updatable_mrv2"])]
            )
            rows.append(
                {
                    "metadata_us": m,
                    "steps_per_s": {k: round(statistics.median(x.steps_per_s for x in v), 1) for k, v in r.items()},
                    "step_latency_us": {
                        k: round(statistics.median(x.step_latency_us for x in v), 1) for k, v in r.items()
                    },
                    "sink_vs_updatable": ratio("npugraph_sink", "updatable_mrv2"),
                    "sink_vs_npugraph_grouped": ratio("npugraph_sink", "npugraph_grouped"),
                    "sink_latency_vs_updatable": lat,
                }
            )
        out["rows"].append(
            {
                "layers": n,
                "by_metadata_us": rows,
                "break_even_metadata_us": _break_even(logs_by_seed[0], chosen, n, host_costs),
            }
        )
    sim.configure()
    return out


def _sink_costs(host_costs: dict[str, Any] | None, metadata_us: float) -> Costs:
    device = {"attention_us": 20.0, "other_us": 40.0, "metadata_device_us": metadata_us}
    return Costs.host_costs(host_costs, **device) if host_costs else Costs(**device)


def _break_even(best: dict[str, StepLog], chosen: dict[str, Any], layers: int, host_costs: Any) -> float | None:
    """The smallest metadata-op device time (25 us steps, up to 20 ms) at which the sink
    step's steps/s is below UpdatableGraph's, or None if it never is."""
    m = 0.0
    base = model_steps(best["updatable_mrv2"], _sink_costs(host_costs, 0.0), kernel="fia", layers=layers)
    while m <= 20_000.0:
        r = model_steps(
            best["npugraph_sink"],
            _sink_costs(host_costs, m),
            kernel="fia",
            layers=layers,
            recorded_by=chosen["npugraph_sink"][2],
        )
        if r.steps_per_s < base.steps_per_s:
            return m
        m += 25.0
    return None
