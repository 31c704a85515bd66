"""``npugraph bench``'s report: runs the modeled and measured benchmarks, prints each table
as it comes, and returns the JSON document ``--json`` writes."""

from __future__ import annotations

import json
import platform
from typing import Any

from npugraph.bench.measured import bench_capture, bench_replay_vs_eager, bench_validation, python_loop_ns, run_bench
from npugraph.bench.modeled import modeled_summary
from npugraph.bench.sink import bench_sink
from npugraph.bench.sweep import update_free_sweep
from npugraph.bench.timeline import chrome_trace
from npugraph.errors import NpuGraphError
from npugraph.files import write_text

__all__ = ["run"]


def run(
    *,
    seeds: int,
    host_costs: dict[str, Any] | None,
    costs_path: str | None,
    timeline: str | None,
    cost_models: list[bool],
    layers: list[int],
    sizes: list[int],
    repeats: int,
    extra: bool,
) -> dict[str, Any]:
    """The modeled timeline (npugraph vs UpdatableGraph vs torch_npu's update vs the older
    loop, and the tiling sink), then the measured host cost of the update path against the
    floor, and validation's share; ``extra``: capture time and replay against eager too."""
    loop_ns = python_loop_ns()
    modeled = _modeled(seeds, host_costs, costs_path, timeline, loop_ns)
    result = _measured(layers, sizes, cost_models, repeats)
    measured = result["summary"]
    result["summary"] = {
        "modeled": modeled,
        "measured_off": {
            "npugraph_vs_floor": measured["off"]["overhead_vs_floor_median"],
            "unchecked_vs_floor": measured["off"]["unchecked_vs_floor_median"],
            "minimal_vs_floor": measured["off"]["minimal_vs_floor_median"],
            "npugraph_vs_minimal": measured["off"]["npugraph_vs_minimal_median"],
            "npugraph_vs_minimal_worst": measured["off"]["npugraph_vs_minimal_worst"],
            "npugraph_vs_minimal_paired": measured["off"]["npugraph_vs_minimal_paired_median"],
        }
        if "off" in measured
        else {},
        "measured": measured,
    }
    result["validation"] = bench_validation()
    for r in result["validation"]:
        print(
            f"validation at {r['requests']} requests, {r['table_columns']} table columns, {r['layers']} layers: "
            f"{r['validation_us']:.0f} us of a {r['update_us']:.0f} us update ({r['validation_share']:.1%}); "
            f"a device-resident table's check on the device: {r['device_table_check_us']:.0f} us "
            f"({r['device_table_check_decode_us']:.0f} us as requests decode)"
        )
    if extra:
        result["capture"] = bench_capture()
        for r in result["capture"]:
            print(
                f"capture {r['sizes']:>3} sizes x {r['layers']:>2} layers: {r['seconds']:.2f}s, "
                f"pool {r['pool_bytes'] / 2**20:.1f} MiB, workspaces {r['workspace_bytes'] / 2**20:.1f} MiB"
            )
        result["replay_vs_eager"] = bench_replay_vs_eager()
        print(f"decoder step, replay / eager on the simulator: {result['replay_vs_eager']['replay_over_eager']:.2f}")
    result["machine"] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "python_loop_ns": loop_ns,  # the modeled ratios depend on it (python_loop_ns)
    }
    return result


def _modeled(
    seeds: int, host_costs: dict[str, Any] | None, costs_path: str | None, timeline: str | None, loop_ns: float
) -> dict[str, Any]:
    source = f"host costs from {costs_path}" if costs_path else "A2 host costs"
    print(
        f"modeled on the device timeline ({source}; steps/s over {seeds} seeds, higher is better; each "
        f"implementation's Python as this machine runs it: {loop_ns:.0f} ns a loop iteration):",
        flush=True,
    )

    def show_model(label: str, res: dict[str, Any]) -> None:
        cells = "  ".join(f"{k} {r.steps_per_s:7.1f}" for k, r in res.items())
        print(f"  {label:<12} {cells}", flush=True)

    try:
        modeled, traces = modeled_summary(seeds=seeds, progress=show_model, host_costs=host_costs)
    except ValueError as exc:
        raise NpuGraphError(f"{costs_path}: {exc}") from exc
    for label in ("host_bound", "small_batch", "device_bound"):
        row = modeled[label]
        r, lat = row["npugraph_vs_updatable"], row["latency_vs_updatable"]
        print(
            f"  {label}: npugraph (default) / UpdatableGraph (MRV2) {r['median']:.3f} "
            f"[{r['min']:.3f}, {r['max']:.3f}]{'' if r['claim'] else ' (within the noise: no claim)'}, "
            f"/ MRV1 {row['npugraph_vs_updatable_mrv1']['median']:.3f}; latency {lat['median']:.3f}; "
            f"per layer, grouped {row['npugraph_grouped_vs_updatable']['median']:.3f}, one event a layer "
            f"{row['npugraph_per_layer_vs_updatable']['median']:.3f}; grouped / API floor "
            f"{row['npugraph_vs_api_floor']['median']:.3f}; device limit "
            f"{row['npugraph_vs_device_limit']['median']:.3f}",
            flush=True,
        )
        for config in ("default", "grouped"):
            cells = ", ".join(
                f"{e} us {g['steps_per_s']['median']:.3f} (latency {g['latency']['median']:.3f})"
                for e, g in row["background_thread"][config].items()
            )
            print(f"    background update thread / in line, {config}, by engine host work: {cells}", flush=True)
        t = row["npugraph_vs_torch_npu_update"]
        verdict = "" if "goal" not in t else f"; goal {t['goal']:g}x: " + ("met" if t["meets_goal"] else "NOT met")
        print(
            f"    npugraph (default) / torch_npu's NPUGraph.update as SGLang drives it {t['median']:.3f} "
            f"[{t['min']:.3f}, {t['max']:.3f}]{'' if t['claim'] else ' (within the noise: no claim)'}{verdict}; "
            f"latency {row['latency_vs_torch_npu_update']['median']:.3f}; per layer, grouped "
            f"{row['npugraph_grouped_vs_torch_npu_update']['median']:.3f}",
            flush=True,
        )
        print(_update_free_line(row), flush=True)
    modeled["tiling_sink"] = _sink(host_costs)
    modeled["update_free_sweep"] = _sweep()
    if timeline:
        write_text(timeline, json.dumps(chrome_trace(traces)))
        print(f"  timelines of every modeled shape: {timeline} (open in https://ui.perfetto.dev)")
    return modeled


def _update_free_line(row: dict[str, Any]) -> str:
    """One shape's update-free figures, with their goals (issue #77) where the shape has them."""

    def cell(key: str) -> str:
        r = row[key]
        goal = "" if "goal" not in r else f", goal {r['goal']:g}: " + ("met" if r["meets_goal"] else "NOT met")
        return f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]{goal}"

    return (
        f"    update-free (widths {row['width_ladder']}, no update) / UpdatableGraph {cell('update_free_vs_updatable')}; "
        f"/ npugraph per layer, grouped {row['update_free_vs_npugraph_per_layer']['median']:.3f}; of its own "
        f"device limit (the whole width read) {cell('update_free_vs_own_device_limit')}; of the device limit "
        f"{row['update_free_vs_device_limit']['median']:.3f}"
    )


def _sweep() -> dict[str, Any]:
    """The update-free sweep over context and batch (A2's host costs), one line per batch."""
    sweep = update_free_sweep()
    print(
        f"  update-free or updated per layer, by the longest request's context ({sweep['layers']} layers, "
        f"{sweep['other_us']:g} us of other device work a layer; the others' drawn below it):",
        flush=True,
    )
    for row in sweep["rows"]:
        cells = ", ".join(f"{p['context']}: {p['update_free_vs_updated']:.2f}x" for p in row["points"])
        cross = row["crossover_context"]
        print(
            f"    batch {row['batch']} (updated: {row['updated_kernel']}): update-free / updated {cells}; "
            + (f"the updated graph faster from {cross}" if cross else "update-free faster throughout"),
            flush=True,
        )
    verdict = "met" if sweep["meets_goal"] else "NOT met"
    print(
        f"    the per-step choice (UpdateFreeCosts) / the better path: at least {sweep['choice_vs_better_min']:.3f} "
        f"(goal {sweep['goal']:g}: {verdict})",
        flush=True,
    )
    return sweep


def _sink(host_costs: dict[str, Any] | None) -> dict[str, Any]:
    sink = bench_sink(host_costs=host_costs)
    print(
        "  tiling sink (FIA's lengths on the device), host-bound FIA at batch 16, by layers and the metadata op's "
        "device time:",
        flush=True,
    )
    for row in sink["rows"]:
        cells = "; ".join(
            f"{r['metadata_us']:g} us: {r['sink_vs_updatable']['median']:.2f}x UpdatableGraph, "
            f"{r['sink_vs_npugraph_grouped']['median']:.2f}x per-layer grouped, latency "
            f"{r['sink_latency_vs_updatable']['median']:.2f}"
            for r in row["by_metadata_us"]
        )
        even = row["break_even_metadata_us"]
        print(
            f"    {row['layers']} layers: {cells}; below UpdatableGraph from "
            + (f"{even:g} us" if even is not None else "never (up to 20 ms)"),
            flush=True,
        )
    return sink


def _measured(layers: list[int], sizes: list[int], cost_models: list[bool], repeats: int) -> dict[str, Any]:
    print(
        f"{'cost':>4} {'layers':>6} {'size':>4} {'kernel':>6} {'npugraph us':>12} {'unchecked':>10} {'baseline us':>12} "
        f"{'floor us':>10} {'vs base':>8} {'vs floor':>8} {'unchecked':>9} {'minimal':>8}  calls n/b/f"
    )

    def show(r: dict[str, Any]) -> None:
        c = r["calls"]
        print(
            f"{r['cost_model']:>4} {r['layers']:>6} {r['size']:>4} {r['kernel']:>6} {r['npugraph_us']:>12.0f} "
            f"{r['unchecked_us']:>10.0f} {r['baseline_us']:>12.0f} {r['floor_us']:>10.0f} "
            f"{r['npugraph_us'] / r['baseline_us']:>8.2f} {r['npugraph_us'] / r['floor_us']:>8.2f} "
            f"{r['unchecked_us'] / r['floor_us']:>9.2f} {r['minimal_us'] / r['floor_us']:>8.2f}  "
            f"{c['npugraph']}/{c['baseline']}/{c['floor']}",
            flush=True,
        )

    result = run_bench(layers=layers, sizes=sizes, cost_models=cost_models, repeats=repeats, progress=show)
    for cm, s in result["summary"].items():
        print(
            f"summary [{cm}] (32+ layers): npugraph/baseline {s['ratio_vs_baseline_median']:.2f}, "
            f"npugraph/floor {s['overhead_vs_floor_median']:.3f} "
            f"(validation off: {s['unchecked_vs_floor_median']:.3f}; the minimal validated update: "
            f"{s['minimal_vs_floor_median']:.3f}, npugraph/minimal {s['npugraph_vs_minimal_median']:.3f}, "
            f"worst row {s['npugraph_vs_minimal_worst']:.3f}, paired by round {s['npugraph_vs_minimal_paired_median']:.3f})"
        )
    return result
