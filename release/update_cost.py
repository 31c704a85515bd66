"""The per-step graph update on the real engine: vllm-ascend's own (``update_full_graph_params``)
against npugraph's, from the runs of release/generate.py in the two graph modes (release/run.sh):
the Llama's (one token a request a step) and the n-gram speculative Llama's (three).

    update_cost.py RESULTS_DIR     (reads each run's llama and ngram aclgraph and npugraph results, writes update-cost.json)

Simulator host time: each update call's wall time less the simulated device's, on this
machine's CPU; the simulator's own Python costs are in it, an NPU host's driver costs are
not.  Per run, the ratio is of medians over the decode steps, with a bootstrap 95%
interval over those steps.  That interval is not the whole noise: runs on the same machine
have spread wider than it (docs/vllm-ascend-release.md).  So the verdict takes every run:
a side is faster only where every run's interval is clear of 1 on that side.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import runs  # this folder's: the results' names, and the models whose graph steps are timed


def _quantiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4)
    return {"median_us": statistics.median(xs) * 1e6, "p25_us": q[0] * 1e6, "p75_us": q[2] * 1e6}


def device_ms_per_step(device_at: list[float]) -> float | None:
    """A graph step's device work on the simulator, median over the run, from the simulated
    device's seconds at each graph step (release/ascend_site.py): None where under two."""
    steps = [b - a for a, b in itertools.pairwise(device_at)]
    return statistics.median(steps) * 1e3 if steps else None


def row(
    ascend: list[float],
    npugraph: list[float],
    calls: dict[str, dict[str, int]] | None = None,
    *,
    seed: int = 0,
    draws: int = 2000,
    baseline: str = "vllm_ascend",
    baseline_call: str = "update_full_graph_params",
) -> dict[str, Any]:
    """One run's row: ``ascend`` (the baseline's per-step update, ``baseline`` calling
    ``baseline_call``: vllm-ascend's by default) against ``npugraph``'s."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(ascend, k=len(ascend)))
        / statistics.median(rng.choices(npugraph, k=len(npugraph)))
        for _ in range(draws)
    )
    return {
        "what": "per-step graph update, host time on the simulator (wall less simulated device time)",
        "steps": {baseline: len(ascend), "npugraph": len(npugraph)},
        f"{baseline}_{baseline_call}": _quantiles(ascend),
        "npugraph_update": _quantiles(npugraph),
        "speedup_median": statistics.median(ascend) / statistics.median(npugraph),
        "speedup_95": [ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]],
        # device calls per step (update sessions, launches, records, workspace queries)
        "device_calls_per_step": {
            who: {k: round(v / max(1, n), 2) for k, v in (calls or {}).get(who, {}).items()}
            for who, n in ((baseline, len(ascend)), ("npugraph", len(npugraph)))
        },
    }


def by_size(
    ascend: list[float], ascend_tokens: list[int], npugraph: list[float], npugraph_tokens: list[int], least: int = 5
) -> dict[int, dict[str, Any]]:
    """One row per step size (padded tokens) that both sides updated at least ``least`` times:
    where a model is served at several decode batches (the 32-layer benchmark's 1, 4 and 16).
    Empty where a side's sizes were not recorded beside its seconds."""
    if len(ascend) != len(ascend_tokens) or len(npugraph) != len(npugraph_tokens):
        return {}
    out = {}
    for size in sorted(set(ascend_tokens) & set(npugraph_tokens)):
        a = [s for s, n in zip(ascend, ascend_tokens) if n == size]
        g = [s for s, n in zip(npugraph, npugraph_tokens) if n == size]
        if len(a) >= least and len(g) >= least:
            out[size] = row(a, g)
    return out


def verdict(rows: list[dict[str, Any]], baseline: str = "vllm-ascend's") -> str:
    """What the runs support: a side faster only where every run's interval clears 1."""
    if all(row["speedup_95"][0] > 1 for row in rows):
        return "npugraph's update is faster in every run"
    if all(row["speedup_95"][1] < 1 for row in rows):
        return f"{baseline} update is faster in every run"
    return "no claim: the runs' intervals do not all clear 1 on one side"


def _medians_by_size(result: dict[str, Any], side: str) -> dict[int, dict[str, float]] | None:
    """Per step size (at least 5 steps): the update's median host time and median wall, in
    microseconds; ``None`` where the result has no walls or sizes beside its seconds."""
    host, walls = result[f"{side}_update_seconds"], result.get(f"{side}_update_walls", [])
    tokens = result.get(f"{side}_update_tokens", [])
    if len(walls) != len(host) or len(tokens) != len(host):
        return None
    out = {}
    for size in sorted(set(tokens)):
        h = [x for x, n in zip(host, tokens) if n == size]
        w = [x for x, n in zip(walls, tokens) if n == size]
        if len(h) >= 5:
            out[size] = {"host_median_us": statistics.median(h) * 1e6, "wall_median_us": statistics.median(w) * 1e6}
    return out


def slowed(results: Path, model: str = "deep") -> dict[str, Any]:
    """Whether the host figure leaves the device's time out: per side and step size, the
    update's medians (host time, and whole wall time) in run 1 and in the run with the FIA
    kernel slowed on the simulated device (release/generate.py's SLOWED), beside the range of
    the host medians over every unslowed run; empty without the slowed runs.  The slowed
    kernel adds its delay to whatever device work the update call unblocks: the wall grows
    with it, the host figure should stay within the unslowed runs' range (their noise)."""
    out: dict[str, Any] = {}
    for mode, side in (("aclgraph", "vllm_ascend"), ("npugraph", "npugraph")):
        slow_path = results / f"{model}.{mode}.slowed.json"
        normal = [_medians_by_size(json.loads(p.read_text()), side) for p in runs.results(results, model, mode)]
        slow = _medians_by_size(json.loads(slow_path.read_text()), side) if slow_path.is_file() else None
        if slow is None or not normal or any(n is None for n in normal):
            return {}
        out[side] = {}
        for size, got in slow.items():
            first = normal[0].get(size) if normal[0] else None
            hosts = [n[size]["host_median_us"] for n in normal if n and size in n]
            if first is None:
                continue
            out[side][size] = {
                "normal": first,
                "slowed": got,
                "host_slowed_over_normal": got["host_median_us"] / first["host_median_us"],
                "wall_slowed_over_normal": got["wall_median_us"] / first["wall_median_us"],
                "unslowed_runs_host_median_us": [min(hosts), max(hosts)],
                "host_within_unslowed_runs": min(hosts) <= got["host_median_us"] <= max(hosts),
            }
    return {"slowed_kernel": "release/generate.py SLOWED", **out}


def run_row(model: str, acl: dict[str, Any], npg: dict[str, Any]) -> dict[str, Any]:
    """One run's row of ``model`` from its two graph modes' results (release/generate.py's JSON):
    the update's ratio, by decode batch where it ran several, and a graph step's device work."""
    calls = {
        "vllm_ascend": acl.get("vllm_ascend_update_device_calls", {}),
        "npugraph": npg.get("npugraph_update_device_calls", {}),
    }
    out = {"model": model, **row(acl["vllm_ascend_update_seconds"], npg["npugraph_update_seconds"], calls)}
    out["device_ms_per_graph_step"] = {
        side: device_ms_per_step(run.get("graph_steps_device_at", []))
        for side, run in (("vllm_ascend", acl), ("npugraph", npg))
    }
    sizes = by_size(
        acl["vllm_ascend_update_seconds"],
        acl.get("vllm_ascend_update_tokens", []),
        npg["npugraph_update_seconds"],
        npg.get("npugraph_update_tokens", []),
    )
    if len(sizes) > 1:
        out["by_size"] = sizes
    framework = {side: _framework(run, side) for side, run in (("vllm_ascend", acl), ("npugraph", npg))}
    if framework["vllm_ascend"] is not None and framework["npugraph"] is not None:
        # the frameworks' own host time: each step's less the simulator's own in it (its entry
        # points' Python: the launch's checks, the re-issue's comparison), which an NPU host's
        # driver replaces with its own costs (npugraph bench --costs models those)
        fw_ascend, fw_npugraph = framework["vllm_ascend"], framework["npugraph"]
        fw = row(fw_ascend, fw_npugraph)
        fw["what"] = "per-step graph update, the framework's own host time (less the device's and the simulator's own)"
        fw["simulator_own_median_us"] = {
            "vllm_ascend": statistics.median(acl["vllm_ascend_update_own"]) * 1e6,
            "npugraph": statistics.median(npg["npugraph_update_own"]) * 1e6,
        }
        fw_sizes = by_size(
            fw_ascend, acl.get("vllm_ascend_update_tokens", []), fw_npugraph, npg.get("npugraph_update_tokens", [])
        )
        if len(fw_sizes) > 1:
            fw["by_size"] = fw_sizes
        out["framework_only"] = fw
        out["a2_modeled"] = a2_modeled(fw, out["device_calls_per_step"])
    return out


def a2_modeled(fw: dict[str, Any], calls: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The frameworks' own host time with Atlas A2's modelled API costs in place of the
    simulator's own (``HostCostModel.atlas_a2``: the cost of each update session's begin and
    end, launch, record and workspace query on an A2 host): each side's framework-only
    median plus its device calls per step (the run's mean, every batch alike) at A2's costs."""
    from npusim import HostCostModel  # the release environment's simulator: one table of costs

    model = HostCostModel.atlas_a2()

    def api_us(side: str) -> float:
        return sum(n * getattr(model, f"{kind}_us", 0.0) for kind, n in calls.get(side, {}).items())

    sides = {"vllm_ascend": fw["vllm_ascend_update_full_graph_params"], "npugraph": fw["npugraph_update"]}
    per = {side: {"api_us": api_us(side), "median_us": q["median_us"] + api_us(side)} for side, q in sides.items()}
    result: dict[str, Any] = {
        "what": "per-step graph update on an A2 host, modelled: the framework's own host time plus its "
        "device calls at HostCostModel.atlas_a2's costs",
        **per,
        "speedup_median": per["vllm_ascend"]["median_us"] / per["npugraph"]["median_us"],
    }
    sizes = {}
    for size, row_ in fw.get("by_size", {}).items():
        a = row_["vllm_ascend_update_full_graph_params"]["median_us"] + per["vllm_ascend"]["api_us"]
        n = row_["npugraph_update"]["median_us"] + per["npugraph"]["api_us"]
        sizes[size] = {"vllm_ascend_median_us": a, "npugraph_median_us": n, "speedup_median": a / n}
    if sizes:
        result["by_size"] = sizes
    return result


def _framework(run: dict[str, Any], side: str) -> list[float] | None:
    """Each step's update host seconds less the simulator's own in it; ``None`` where the run
    did not record the simulator's own (a result from before npusim.own_seconds)."""
    host, own = run[f"{side}_update_seconds"], run.get(f"{side}_update_own", [])
    if not host or len(own) != len(host):
        return None
    return [h - o for h, o in zip(host, own)]


def print_shares(rows: list[dict[str, Any]]) -> None:
    """Each run's frameworks-only share, by batch, and on A2's modelled API costs."""
    for i, r in enumerate(rows, 1):
        fw = r.get("framework_only")
        if fw is None:
            continue
        low, high = fw["speedup_95"]
        own = fw["simulator_own_median_us"]
        print(
            f"run {i} ({r['model']}): the frameworks' own share (less the simulator's own: vllm-ascend "
            f"{own['vllm_ascend']:.0f} us, npugraph {own['npugraph']:.0f} us a step): vllm-ascend "
            f"{fw['vllm_ascend_update_full_graph_params']['median_us']:.0f} us, npugraph "
            f"{fw['npugraph_update']['median_us']:.0f} us: {fw['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]"
        )
        for size, s in fw.get("by_size", {}).items():
            low, high = s["speedup_95"]
            print(f"    {size} tokens a step: {s['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]")
    for i, r in enumerate(rows, 1):
        a2 = r.get("a2_modeled")
        if a2 is None:
            continue
        sizes = ", ".join(f"{size} tokens {v['speedup_median']:.2f}x" for size, v in a2.get("by_size", {}).items())
        print(
            f"run {i} ({r['model']}): on A2's modelled API costs (vllm-ascend {a2['vllm_ascend']['api_us']:.0f} us, "
            f"npugraph {a2['npugraph']['api_us']:.0f} us of calls a step): vllm-ascend "
            f"{a2['vllm_ascend']['median_us']:.0f} us, npugraph {a2['npugraph']['median_us']:.0f} us: "
            f"{a2['speedup_median']:.2f}x" + (f" ({sizes})" if sizes else "")
        )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    results = Path(argv[1])
    pairs = [
        (model, acl, npg)
        for model in runs.timed(m for m in runs.TIMED if runs.results(results, m, "npugraph"))
        for acl, npg in zip(runs.results(results, model, "aclgraph"), runs.results(results, model, "npugraph"))
    ]
    if not pairs:
        print(f"update_cost.py: no llama.aclgraph.json and llama.npugraph.json in {results}", file=sys.stderr)
        return 2
    rows = [run_row(model, json.loads(a.read_text()), json.loads(n.read_text())) for model, a, n in pairs]
    ratios = [r["speedup_median"] for r in rows]
    models = list(dict.fromkeys(r["model"] for r in rows))
    out = {
        "what": rows[0]["what"],
        "runs": rows,
        "speedup_median_range": [min(ratios), max(ratios)],
        "verdict": verdict(rows),
        "framework_only_verdict": verdict([r["framework_only"] for r in rows if "framework_only" in r])
        if all("framework_only" in r for r in rows)
        else None,
        "a2_modeled_range": [
            min(r["a2_modeled"]["speedup_median"] for r in rows if "a2_modeled" in r),
            max(r["a2_modeled"]["speedup_median"] for r in rows if "a2_modeled" in r),
        ]
        if any("a2_modeled" in r for r in rows)
        else None,
        # per model: a verdict over its own runs (the two-layer models' and the 32-layer benchmark's apart)
        "verdict_by_model": {m: verdict([r for r in rows if r["model"] == m]) for m in models},
    }
    if check := slowed(results):
        out["slowed"] = check
    (results / "update-cost.json").write_text(json.dumps(out, indent=1))
    for i, r in enumerate(rows, 1):
        a, n = r["vllm_ascend_update_full_graph_params"], r["npugraph_update"]
        low, high = r["speedup_95"]
        print(
            f"run {i} ({r['model']}): per-step update (simulator host time, median over {r['steps']['npugraph']} steps): "
            f"vllm-ascend {a['median_us']:.0f} us, npugraph {n['median_us']:.0f} us: "
            f"{r['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]"
        )
        for size, s in r.get("by_size", {}).items():
            low, high = s["speedup_95"]
            print(
                f"    {size} tokens a step: vllm-ascend {s['vllm_ascend_update_full_graph_params']['median_us']:.0f} us, "
                f"npugraph {s['npugraph_update']['median_us']:.0f} us over {s['steps']['npugraph']} steps: "
                f"{s['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]"
            )
    print_shares(rows)
    print(f"device calls per step (run 1): {rows[0]['device_calls_per_step']}")
    for i, r in enumerate(rows, 1):
        work = {side: f"{ms:.1f} ms" for side, ms in r["device_ms_per_graph_step"].items() if ms is not None}
        if work:
            print(f"run {i} ({r['model']}): a graph step's device work on the simulator (median): {work}")
    print(f"{len(rows)} run(s), ratios {min(ratios):.2f}x to {max(ratios):.2f}x: {out['verdict']}")
    if len(models) > 1:
        for model, said in out["verdict_by_model"].items():
            print(f"  {model}: {said}")
    for side, sizes in check.items() if check else ():
        for size, v in sizes.items() if isinstance(sizes, dict) else ():
            low, high = v["unslowed_runs_host_median_us"]
            print(
                f"FIA slowed ({side}, {size} tokens a step): the update's host figure "
                f"{v['normal']['host_median_us']:.0f} -> {v['slowed']['host_median_us']:.0f} us "
                f"({v['host_slowed_over_normal']:.2f}x; the unslowed runs {low:.0f} to {high:.0f}), its wall "
                f"{v['normal']['wall_median_us']:.0f} -> {v['slowed']['wall_median_us']:.0f} us "
                f"({v['wall_slowed_over_normal']:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
