"""Modeled (:func:`modeled_summary`): each implementation's device-API calls and own Python
(:mod:`npugraph.bench.rivals`), recorded and replayed on a model of the host and the device
(``npugraph.bench.timeline``), over the serving shapes of :data:`SHAPES`.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

import npusim as sim
from npugraph.bench.measured import _MAX_MODEL_LEN, _setup
from npugraph.bench.rivals import (
    DEFAULT,
    HEADLINE,
    TORCH_NPU,
    _frozen_step,
    _implementations,
    _sink_step,
    _step_input,
)
from npugraph.bench.timeline import Call, Costs, StepLog, TimelineResult, min_log, model_steps
from npugraph.runtime import Runtime


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


# what npugraph's default must reach over torch_npu's update (steps/s, every seed), per shape
TORCH_NPU_GOALS = {"host_bound": 2.0, "small_batch": 1.2}
# what the update-free graphs must reach (issue #77), every seed: over UpdatableGraph, and of
# the device limit with their own extra attention counted
UPDATE_FREE_GOALS = {
    "host_bound": {"update_free_vs_updatable": 2.0, "update_free_vs_own_device_limit": 0.85},
    "small_batch": {"update_free_vs_updatable": 1.5},
}

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


# update-free graphs: widths in powers of two from the block size (128) to max_model_len
WIDTH_LADDER = (128, 256, 512, 1024, 2048)
UPDATE_FREE = "npugraph_update_free"
# the bench's stack (AttentionStack): a key and a value of 64 fp16 values, one KV head; the
# mask adds a byte a key (bool)
_KV_BYTES_PER_KEY = 2 * 64 * 2
_MASK_BYTES_PER_KEY = 1


def _width_of(longest: int) -> int:
    """The narrowest width of the ladder that holds ``longest`` keys (Runtime.step's pick)."""
    return next(w for w in WIDTH_LADDER if longest <= w)


def frozen_attention_us(shape: ModeledShape, read: float) -> float:
    """An update-free layer's attention: the shape's (its requests' own keys) times the bytes it
    reads instead, ``read`` times the keys and a mask byte each (attention is bound by memory:
    its time is the bytes it reads; npusim's HbmTimeModel charges the same)."""
    return shape.attention_us * read * (_KV_BYTES_PER_KEY + _MASK_BYTES_PER_KEY) / _KV_BYTES_PER_KEY


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
    frozen, _, _, _fq = _setup(
        shape.layers, shape.size, "fia", cost=False, configure=False, table=table, widths=WIDTH_LADDER
    )
    fdev, fstep, frozen_by = _frozen_step(frozen, shape.size)
    impls[UPDATE_FREE] = (fdev, fstep)
    for name, (dev, step) in impls.items():
        logs: list[StepLog] = []
        read: list[float] = []  # update-free: keys read over the requests' own, per step
        for _ in range(repeats + 2):
            lens = [rng.randint(1, _MAX_MODEL_LEN) for _ in range(shape.size)]
            inp = _step_input(rt, shape.size, lens, table)
            with dev.recording() as log:
                step(inp)
            logs += log
            read.append(_width_of(max(lens)) * len(lens) / sum(lens))
        best = min_log(logs[2:])
        by = {"npugraph_grouped": recorded_by, "npugraph_sink": sink_by, UPDATE_FREE: frozen_by}.get(name)
        own = attrs.evolve(costs, gil_handoff=HANDOFF_US, thread_wake=HANDOFF_US) if name == TORCH_NPU else costs
        if name == UPDATE_FREE:  # its attention reads the width for every request, and the mask
            own = attrs.evolve(costs, attention_us=frozen_attention_us(shape, statistics.fmean(read)))
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
        row = _shape_row(shape, runs)
        for key in (
            "npugraph_vs_updatable",
            "npugraph_vs_updatable_mrv1",
            "npugraph_grouped_vs_updatable",
            "npugraph_per_layer_vs_updatable",
            "npugraph_vs_torch_npu_update",
            "npugraph_grouped_vs_torch_npu_update",
            "update_free_vs_updatable",
        ):
            r = row[key]
            r["claim"] = r["min"] > 1.0 or r["max"] < 1.0  # the whole spread on one side of 1
            noise = max(noise, (r["max"] - r["min"]) / r["median"])
        if shape.label in TORCH_NPU_GOALS:
            r = row["npugraph_vs_torch_npu_update"]
            r["goal"] = TORCH_NPU_GOALS[shape.label]
            r["meets_goal"] = r["min"] >= r["goal"]  # every seed, not the median
        for key, goal in UPDATE_FREE_GOALS.get(shape.label, {}).items():
            r = row[key]
            r["goal"] = goal
            r["meets_goal"] = r["min"] >= goal  # every seed
        out[shape.label] = row
        if progress is not None:
            progress(shape.label, traces[shape.label])
    out["noise"] = round(noise, 4)
    out["seeds"] = seeds
    out["host_costs"] = dict(host_costs) if host_costs else "atlas_a2 (vllm-ascend #13058, #15579, #4233)"
    return out, traces


def _shape_row(shape: ModeledShape, runs: Sequence[dict[str, TimelineResult]]) -> dict[str, Any]:
    """One shape's row: each implementation's steps/s and latency (medians, spreads over the
    runs) and the ratios the summary states."""
    sps = {k: [r[k].steps_per_s for r in runs] for k in runs[0]}
    lat = {k: [r[k].step_latency_us for r in runs] for k in runs[0]}

    def ratio(a: str, b: str, of: dict[str, list[float]] = sps) -> dict[str, Any]:
        return _spread([x / y for x, y in zip(of[a], of[b])])

    def threaded(name: str) -> dict[str, Any]:
        """Per engine_us: steps/s and step latency with a background update thread over in line."""
        return {
            f"{e:g}": {
                "steps_per_s": ratio(f"{name}@{e:g}+thread", f"{name}@{e:g}"),
                "latency": ratio(f"{name}@{e:g}+thread", f"{name}@{e:g}", lat),
            }
            for e in ENGINE_US
        }

    default_is = (
        "FIA with lengths on the device (tiling sink), replay-first"
        if shape.kernel == "fia"
        else f"updated per layer, one ExternalEvent per {shape.event_group} layers (auto), replay-first"
    )
    return {
        "headline": f"{DEFAULT}: Runtime() as a user who sets nothing gets it: {default_is}, one update thread",
        "layers": shape.layers,
        "size": shape.size,
        "kernel": shape.kernel,
        "attention_us": shape.attention_us,
        "other_us": shape.other_us,
        "device_time_source": shape.source,
        "steps_per_s": {k: round(statistics.median(v), 1) for k, v in _implementation_rows(sps).items()},
        # each implementation's own spread over the seeds: the chart's error bars (npugraph bench --plot)
        "steps_per_s_spread": {k: _spread(v) for k, v in _implementation_rows(sps).items()},
        "step_latency_us": {k: round(statistics.median(v), 1) for k, v in _implementation_rows(lat).items()},
        "npugraph_vs_updatable": ratio(DEFAULT, "updatable_mrv2"),
        "npugraph_vs_updatable_mrv1": ratio(DEFAULT, "updatable_mrv1"),
        "npugraph_grouped_vs_updatable": ratio(HEADLINE, "updatable_mrv2"),
        "npugraph_per_layer_vs_updatable": ratio("npugraph", "updatable_mrv2"),
        "legacy_vs_updatable": ratio("legacy", "updatable_mrv2"),
        "npugraph_vs_torch_npu_update": ratio(DEFAULT, TORCH_NPU),
        # per layer, lengths on the host as torch_npu's: what is left without the tiling sink
        "npugraph_grouped_vs_torch_npu_update": ratio(HEADLINE, TORCH_NPU),
        "latency_vs_torch_npu_update": ratio(DEFAULT, TORCH_NPU, lat),
        "latency_vs_updatable": ratio(DEFAULT, "updatable_mrv2", lat),
        "grouped_latency_vs_updatable": ratio(HEADLINE, "updatable_mrv2", lat),
        "npugraph_vs_api_floor": ratio(HEADLINE, "api_floor"),
        # no update at all: lengths frozen to the ladder's narrowest width that holds the step,
        # masked on the device; its attention reads the whole width (charged in its device time)
        "update_free_vs_updatable": ratio(UPDATE_FREE, "updatable_mrv2"),
        "update_free_vs_torch_npu_update": ratio(UPDATE_FREE, TORCH_NPU),
        "update_free_vs_npugraph_per_layer": ratio(UPDATE_FREE, HEADLINE),
        "update_free_vs_device_limit": _spread([x / shape.device_limit for x in sps[UPDATE_FREE]]),
        # against the device limit with its own extra attention counted: its device time a step
        "update_free_vs_own_device_limit": _spread(
            [r[UPDATE_FREE].steps_per_s * r[UPDATE_FREE].device_us_per_step / 1e6 for r in runs]
        ),
        "update_free_device_us_per_step": round(statistics.median(r[UPDATE_FREE].device_us_per_step for r in runs), 1),
        "width_ladder": list(WIDTH_LADDER),
        "npugraph_vs_device_limit": _spread([x / shape.device_limit for x in sps[DEFAULT]]),
        "device_limit_steps_per_s": round(shape.device_limit, 1),
        "background_thread": {
            "engine_us": list(ENGINE_US),
            "engine_chunk_us": ENGINE_CHUNK_US,
            "handoff_us": HANDOFF_US,
            "default": threaded("npugraph"),
            "grouped": threaded(HEADLINE),
        },
    }
