"""The per-step graph update in a real SGLang generation: torch_npu's ``NPUGraph.update`` (SGLang's
own path, on its update thread) against npugraph's, from the Llama runs of
release/sglang/generate.py in the two graph modes (release/sglang/run.sh).

    update_cost.py RESULTS_DIR     (reads each run's sglang and npugraph results, writes update-cost.json)

As release/update_cost.py (whose rows and verdict these are): simulator host time, each
update call's wall time less the simulated device's; per run the ratio of medians with a
bootstrap 95% interval; a side is faster only where every run's interval clears 1.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import generate  # this folder's: the results' names

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
    pairs = list(zip(generate.results(results, "llama", "sglang"), generate.results(results, "llama", "npugraph")))
    if not pairs:
        print(f"update_cost.py: no llama.sglang.json and llama.npugraph.json in {results}", file=sys.stderr)
        return 2
    rows = []
    for own_path, npg_path in pairs:
        own, npg = json.loads(own_path.read_text()), json.loads(npg_path.read_text())
        calls = {BASELINE: own["torch_npu_update_device_calls"], "npugraph": npg["npugraph_update_device_calls"]}
        rows.append(
            _cost.row(
                own["torch_npu_update_seconds"],
                npg["npugraph_update_seconds"],
                calls,
                baseline=BASELINE,
                baseline_call=CALL,
            )
        )
    ratios = [r["speedup_median"] for r in rows]
    out = {
        "what": rows[0]["what"],
        "runs": rows,
        "speedup_median_range": [min(ratios), max(ratios)],
        "verdict": _cost.verdict(rows, "torch_npu's"),
    }
    (results / "update-cost.json").write_text(json.dumps(out, indent=1))
    for i, r in enumerate(rows, 1):
        a, n = r[f"{BASELINE}_{CALL}"], r["npugraph_update"]
        low, high = r["speedup_95"]
        print(
            f"run {i}: per-step update (simulator host time, median over {r['steps']['npugraph']} steps): "
            f"torch_npu's NPUGraph.update {a['median_us']:.0f} us, npugraph {n['median_us']:.0f} us: "
            f"{r['speedup_median']:.2f}x [{low:.2f}, {high:.2f}]"
        )
    print(f"device calls per step (run 1): {rows[0]['device_calls_per_step']}")
    print(f"{len(rows)} run(s), ratios {min(ratios):.2f}x to {max(ratios):.2f}x: {out['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
