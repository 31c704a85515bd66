"""The tiling-sink path, modeled: FIA with its lengths and tiling plan on the device (no
update per layer) against the per-layer update, at 20 to 61 layers and three metadata-op
device times; where the sink stops paying (:func:`bench_sink`).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

import npusim as sim
from npugraph.bench.measured import _MAX_MODEL_LEN, _setup
from npugraph.bench.modeled import ModeledShape, _modeled_runtimes, _spread
from npugraph.bench.rivals import _implementations, _sink_step, _step_input
from npugraph.bench.timeline import Costs, StepLog, TimelineResult, min_log, model_steps

SINK_LAYERS = (20, 32, 61)
# the metadata op's AI-CPU time per step, as vllm-ascend #15336 measured it (130-320 us)
SINK_METADATA_US = (130.0, 220.0, 320.0)


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
        rows = [_cost_row(m, per_cost[m]) for m in metadata_us]
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


def _cost_row(m: float, r: dict[str, list[TimelineResult]]) -> dict[str, Any]:
    """One metadata-op device time's row: each implementation's medians and the sink's ratios."""

    def ratio(a: str, b: str) -> dict[str, Any]:
        return _spread([x.steps_per_s / y.steps_per_s for x, y in zip(r[a], r[b])])

    return {
        "metadata_us": m,
        "steps_per_s": {k: round(statistics.median(x.steps_per_s for x in v), 1) for k, v in r.items()},
        "step_latency_us": {k: round(statistics.median(x.step_latency_us for x in v), 1) for k, v in r.items()},
        "sink_vs_updatable": ratio("npugraph_sink", "updatable_mrv2"),
        "sink_vs_npugraph_grouped": ratio("npugraph_sink", "npugraph_grouped"),
        "sink_latency_vs_updatable": _spread(
            [x.step_latency_us / y.step_latency_us for x, y in zip(r["npugraph_sink"], r["updatable_mrv2"])]
        ),
    }
