"""Graph memory counted in the KV-cache budget: a case where it would have run out, side by
side (release/run.sh runs this in the release environment; elsewhere it skips).

The same model and settings (release/graph_memory.py: MLA with DeepSeek-V3's 128 heads and
32K context, ``gpu_memory_utilization=0.9``, each run in its own process):

* vllm-ascend's own graph mode sizes the KV cache before capturing and never counts the
  graphs: its capture runs out of device memory and the engine does not start;
* npugraph's plugin with that same KV cache (``kv_cache_memory_bytes``) runs out too, at
  the same graph: npugraph's graphs need the memory as well;
* npugraph's plugin as a user starts it leaves the graph memory its profiling capture
  measured out of the budget: it serves, with eager's tokens.

All four run on one card: the simulator's default size, taken once here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
from graph_memory import RUNS
from runs import check_scope, engine_env, run_to_the_end

from npusim.device.backend import card_size

# three engines of DeepSeek-V3's heads: the full check's (make release-check), not CI's
pytestmark = pytest.mark.skipif(check_scope() == "ci", reason="CHECK_SCOPE=ci: make release-check runs it")

LIMIT_S = 900
GIB = 1 << 30
MIB = 1 << 20
OUT_OF_MEMORY = r"OutOfMemoryError: NPU out of memory\. Tried to allocate [\d.]+ GiB on npu:0"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")
    out = Path(given) / "graph-memory" if given else tmp_path_factory.mktemp("graph-memory")
    out.mkdir(parents=True, exist_ok=True)
    # one card for the four runs: the simulator's default is half of what the host has
    # available as each process starts, which drifts between processes by tens of MiB
    card = os.environ.get("NPUGRAPH_SIM_MEMORY_GB") or f"{card_size()[0] / GIB:.2f}"
    done: dict[str, tuple[dict[str, Any], str]] = {}
    for name in RUNS:
        extra = {"NPUGRAPH_SIM_MEMORY_GB": card}
        if name == "npugraph-uncounted":
            extra["NPUGRAPH_RELEASE_KV_BYTES"] = str(_kv_budget(done["aclgraph"][1]))
        done[name] = _run(out, name, extra)
    return done


def _run(out: Path, name: str, extra: dict[str, str]) -> tuple[dict[str, Any], str]:
    path = out / f"{name}.json"
    args = [sys.executable, str(Path(__file__).parent / "graph_memory.py"), str(out / "mla-wide"), name, str(path)]
    return run_to_the_end(args, path, engine_env(out / "vllm-cache", **extra), name, LIMIT_S)


def _kv_budget(log: str) -> int:
    """vllm-ascend's KV-cache budget, from its own log line (GiB, two decimals)."""
    found = re.search(r"Available KV cache memory: ([\d.]+) GiB", log)
    assert found, "vllm-ascend did not say its KV-cache budget"
    return int(float(found.group(1)) * GIB)


def test_vllm_ascends_own_graph_mode_runs_out_at_capture(runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    result, log = runs["aclgraph"]
    assert not result["started"], "vllm-ascend's own graph mode started: this case no longer shows what it should"
    assert "Engine core initialization failed" in result["error"]["message"]
    assert re.search(OUT_OF_MEMORY, log), log[-6000:]
    assert "capture_model" in log  # at capture, after the KV cache took its budget


def test_npugraph_with_that_kv_cache_runs_out_too(runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    result, log = runs["npugraph-uncounted"]
    assert not result["started"], "npugraph's graphs fitted beside vllm-ascend's KV budget: no case"
    assert re.search(r"CaptureFailed: capture of main/BatchDescriptor\(num_tokens=\d+.*\) failed in layer ", log)
    assert re.search(OUT_OF_MEMORY, log), log[-6000:]


def test_npugraph_counts_its_graphs_and_serves_eagers_tokens(runs: dict[str, tuple[dict[str, Any], str]]) -> None:
    result, log = runs["npugraph"]
    assert result["started"] and result["error"] is None, result["error"]
    assert result["tokens"] == runs["eager"][0]["tokens"]
    said = re.search(
        r"npugraph: graph memory estimated before the KV cache at ([\d.]+) MiB for (\d+) sizes \(the largest "
        r"size's capture took ([\d.]+) MiB.*\): the KV-cache budget is ([\d.]+) GiB instead of ([\d.]+) GiB",
        log,
    )
    assert said, log[-6000:]
    estimate, largest, budget, instead = (float(said.group(i)) for i in (1, 3, 4, 5))
    # the budget it would have had is vllm-ascend's; the estimate comes off it
    assert abs(instead * GIB - _kv_budget(runs["aclgraph"][1])) < 0.02 * GIB
    assert abs((instead - budget) * GIB - estimate * MIB) < 0.02 * GIB
    # what the graphs must hold at once: the largest graph's workspace (npugraph's report)
    report = re.search(r"capture report: (\S+\.json)", log)
    assert report, "npugraph did not say where its capture report is"
    keys = json.loads(Path(report.group(1)).read_text())["namespaces"]["main"]["keys"]
    workspace = max(k["workspace"]["bytes"] for k in keys)
    assert workspace > 512 * MIB  # a case where graph memory matters at all
    assert workspace <= largest * MIB <= estimate * MIB
    assert "Traceback" not in log
