"""Measured (:func:`bench_update`): host time of five implementations updating the same
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
(``HostCostModel.atlas_a2``: the cost structure measured on Atlas A2).  Also: capture
time, replay against eager, validation's share, the Python loop's speed.
"""

from __future__ import annotations

import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

import npusim as sim
from npugraph.errors import StepOrderWarning
from npugraph.metadata import AttentionMetadata, convert, pad_lens, real_requests
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.models.stack import AttentionStack
from npugraph.policy import FixedPolicy
from npugraph.replay.blockcheck import BlockIdCheck
from npugraph.runtime import Runtime

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
    widths: tuple[int, ...] = (),
) -> tuple[Runtime, Any, torch.Tensor, torch.Tensor]:
    """A captured attention stack; returns the runtime, the stack, and the graph's block-table
    and query buffers (the caller keeps them alive: the graph reads them).  ``table``: capture
    with this block-table buffer (another graph's), as an engine's graphs share its one buffer.
    ``widths``: capture update-free graphs at these widths instead (``WidthKey(size, w)``)."""
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
    ws: list[int | None] = [*sorted(widths, reverse=True)] or [None]
    for w in ws:
        rt.capture(stack, q, meta, key=size, width=w)
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
        row[f"{name}_spread_us"] = _quartiles(ts)
    # paired: each round timed both in one shuffled pass, so the machine's drift between
    # rounds cancels in their ratio (a narrower spread than the ratio of the two medians)
    paired = sorted(a / b for a, b in zip(times["npugraph"], times["minimal"]))
    row["npugraph_vs_minimal_paired"] = statistics.median(paired)
    row["npugraph_vs_minimal_paired_spread"] = _quartiles(paired)
    row["calls"] = {name: sum(calls[name].values()) for name in methods}
    row["calls_detail"] = calls
    sim.configure()
    return row


def _quartiles(sorted_values: Sequence[float]) -> list[float]:
    n = len(sorted_values)
    return [sorted_values[n // 4], sorted_values[(3 * n) // 4]]


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
            "npugraph_vs_minimal_worst": max(r["npugraph_us"] / r["minimal_us"] for r in sel),
            "npugraph_vs_minimal_paired_median": statistics.median(r["npugraph_vs_minimal_paired"] for r in sel),
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


def _validation_runtime(r: int, layers: int, max_len: int, block: int) -> tuple[Runtime, torch.Tensor]:
    """A FIA stack of ``layers`` captured for ``r`` requests (update-first: its updates are
    never replayed), and its device block table."""
    sim.configure()
    rt = Runtime("sim", max_model_len=max_len, policy=FixedPolicy("fia"), order="update-first")
    stack = AttentionStack(rt, layers=layers, block_size=block, num_blocks=64)
    dev = rt.device.memory
    table = torch.zeros(r, max_len // block, dtype=torch.int32, device=dev)
    q = torch.randn(r, stack.heads, stack.head_size, device="cpu").to(dtype=stack.dtype, device=dev)
    rt.capture(
        stack,
        q,
        AttentionMetadata(seq_lens=torch.ones(r, dtype=torch.int32, device="cpu"), block_table=table),
        key=r,
    )
    return rt, table


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
        rt, table = _validation_runtime(r, layers, max_len, block)
        cols, dev, entry = int(table.shape[1]), rt.device.memory, rt.entry(r)
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
