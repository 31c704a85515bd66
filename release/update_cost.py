"""The per-step graph update on the real engine: vllm-ascend's own (``update_full_graph_params``)
against npugraph's, from one run of release/generate.py in each mode (release/run.sh).

    update_cost.py RESULTS_DIR        (reads aclgraph.json and npugraph.json, writes update-cost.json)

Simulator host time: each update call's wall time less the simulated device's, on this
machine's CPU; the simulator's own Python costs are in it, an NPU host's driver costs are
not.  The ratio is of medians over the decode steps of one run, with a bootstrap 95%
interval over those steps.  That interval is not the whole noise: runs on the same machine
have spread wider than it (docs/vllm-ascend-release.md), so a claim needs several runs
whose intervals all clear 1.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path


def _quantiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4)
    return {"median_us": statistics.median(xs) * 1e6, "p25_us": q[0] * 1e6, "p75_us": q[2] * 1e6}


def row(
    ascend: list[float],
    npugraph: list[float],
    calls: dict[str, dict[str, int]] | None = None,
    *,
    seed: int = 0,
    draws: int = 2000,
) -> dict[str, object]:
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(ascend, k=len(ascend)))
        / statistics.median(rng.choices(npugraph, k=len(npugraph)))
        for _ in range(draws)
    )
    return {
        "what": "per-step graph update, host time on the simulator (wall less simulated device time)",
        "steps": {"vllm_ascend": len(ascend), "npugraph": len(npugraph)},
        "vllm_ascend_update_full_graph_params": _quantiles(ascend),
        "npugraph_update": _quantiles(npugraph),
        "speedup_median": statistics.median(ascend) / statistics.median(npugraph),
        "speedup_95": [ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]],
        # device calls per step (update sessions, launches, records, workspace queries)
        "device_calls_per_step": {
            who: {k: round(v / max(1, n), 2) for k, v in (calls or {}).get(who, {}).items()}
            for who, n in (("vllm_ascend", len(ascend)), ("npugraph", len(npugraph)))
        },
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    results = Path(argv[1])
    acl = json.loads((results / "aclgraph.json").read_text())
    npg = json.loads((results / "npugraph.json").read_text())
    calls = {
        "vllm_ascend": acl.get("vllm_ascend_update_device_calls", {}),
        "npugraph": npg.get("npugraph_update_device_calls", {}),
    }
    out = row(acl["vllm_ascend_update_seconds"], npg["npugraph_update_seconds"], calls)
    (results / "update-cost.json").write_text(json.dumps(out, indent=1))
    a, n = out["vllm_ascend_update_full_graph_params"], out["npugraph_update"]
    low, high = out["speedup_95"]  # type: ignore[misc]
    print(
        f"per-step update (simulator host time, median over {len(npg['npugraph_update_seconds'])} steps): "
        f"vllm-ascend {a['median_us']:.0f} us, npugraph {n['median_us']:.0f} us: "  # type: ignore[index]
        f"{out['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]; device calls per step: {out['device_calls_per_step']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
