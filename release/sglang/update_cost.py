"""The per-step graph cost in a real SGLang generation, SGLang's own path against npugraph's,
from the Llama runs of release/sglang/generate.py in the two graph modes (release/sglang/run.sh).

    update_cost.py RESULTS_DIR     (reads each run's sglang and npugraph results, writes update-cost.json)

Two measures, each as release/update_cost.py computes them (whose rows and verdict these
are: simulator host time, each call's wall time less the simulated device's; per run the
ratio of medians with a bootstrap 95% interval; a side is faster only where every run's
interval clears 1):

* **the step**: ``replay_with_input_update``, the call SGLang makes each decode step (its own:
  fence wait, the update on its worker thread beside the replay, the join; npugraph's hook:
  one validated update and the replay), in whole wall time: the same device work runs
  inside it in both modes (in steady state about one step's: SGLang's fence waits for the
  previous replay, npugraph's update unblocks the replay it follows), so the difference is
  the two paths' host work; the measure an engine feels;
* **the update alone**: torch_npu's ``NPUGraph.update`` against npugraph's ``_write``.  Not
  like for like on the simulator, which runs a graph's device work inside whichever host
  call unblocks it: npugraph's update (replay first, then the update) unblocks the waiting
  graph, torch_npu's runs beside a replay that does; each has the simulator's bookkeeping
  of that work in it or not accordingly.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import generate  # noqa: F401 - this folder's: puts release/ on the path
from runs import results as run_results  # release/'s: the results' names

_spec = importlib.util.spec_from_file_location("release_update_cost", Path(__file__).parent.parent / "update_cost.py")
assert _spec is not None and _spec.loader is not None
_cost: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cost)

BASELINE, CALL = "torch_npu", "NPUGraph_update"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[4].strip(), file=sys.stderr)
        return 2
    results = Path(argv[1])
    pairs = list(zip(run_results(results, "llama", "sglang"), run_results(results, "llama", "npugraph")))
    if not pairs:
        print(f"update_cost.py: no llama.sglang.json and llama.npugraph.json in {results}", file=sys.stderr)
        return 2
    runs = [(json.loads(a.read_text()), json.loads(b.read_text())) for a, b in pairs]
    out: dict[str, Any] = {}
    measures = (
        (
            "step",
            "SGLang's replay_with_input_update, wall time",
            "graph_step_wall_seconds",
            "graph_step_device_calls",
            "step",
        ),
        ("update", "the update alone", "torch_npu_update_seconds", "torch_npu_update_device_calls", CALL),
    )
    for name, what, own_key, own_calls, call in measures:
        npg_key = own_key if name == "step" else "npugraph_update_seconds"
        npg_calls = "graph_step_device_calls" if name == "step" else "npugraph_update_device_calls"
        rows = [
            _cost.row(
                own[own_key],
                npg[npg_key],
                {BASELINE: own[own_calls], "npugraph": npg[npg_calls]},
                baseline=BASELINE,
                baseline_call=call,
            )
            for own, npg in runs
        ]
        ratios = [r["speedup_median"] for r in rows]
        out[name] = {
            "what": f"{what} on the simulator" + ("" if name == "step" else " (wall less simulated device time)"),
            "runs": rows,
            "speedup_median_range": [min(ratios), max(ratios)],
            "verdict": _cost.verdict(rows, "SGLang's own (torch_npu's)"),
        }
        print(f"{what} (on the simulator, median over the decode steps; SGLang's own / npugraph's):")
        for i, r in enumerate(rows, 1):
            a, n = r[f"{BASELINE}_{call}"], r["npugraph_update"]
            low, high = r["speedup_95"]
            print(
                f"  run {i}: SGLang's {a['median_us']:.0f} us, npugraph's {n['median_us']:.0f} us over "
                f"{r['steps']['npugraph']} steps: {r['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]"
            )
        print(f"  device calls per step (run 1): {rows[0]['device_calls_per_step']}")
        print(f"  {len(rows)} run(s), ratios {min(ratios):.2f}x to {max(ratios):.2f}x: {out[name]['verdict']}")
    (results / "update-cost.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
