"""vLLM's model runner v2 (``VLLM_USE_V2_MODEL_RUNNER=1``), vllm-ascend 0.30's second runner,
with vllm-ascend's own graphs and with npugraph's plugin (release/run.sh runs this in the
0.30.0rc2 environment; elsewhere it skips).

The v2 runner captures FULL graphs in its own graph manager (vllm-ascend's
``ModelAclGraphManager``), not in a static wrapper: npugraph's plugin serves it there
(npugraph/integrations/vllm/runner_v2.py).  ``vllm.LLM(model, dtype="bfloat16",
compilation_config FULL_DECODE_ONLY)`` as in release/generate.py, on the Llama and its
requests: both v2 runs give eager's tokens (the v1 runner's eager run), Hugging Face's float32
forward agrees, under the plugin npugraph updated every graph step and vllm-ascend none, and
neither run printed a traceback; under the plugin vLLM's own v2 profile of the graphs' memory
(captured through npugraph) is taken out of vllm-ascend's KV-cache budget.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
from hf_reference import check_greedy_choices
from runs import result_path

from npugraph.integrations.vllm import runner_v2

# vllm-ascend 0.23's v2 runner: npugraph's plugin refuses it (tests/test_vllm.py); skipped test
# by test, not the module (a module skipped whole collects nothing, and pytest exits 5)
pytestmark = pytest.mark.skipif(
    not runner_v2.available(), reason="a vllm-ascend whose v2 runner npugraph does not serve"
)

MODEL = "llama"


@pytest.fixture(scope="module")
def results(generated_dir: Path) -> dict[str, dict]:
    return generate.run_modes(generated_dir, MODEL, ("eager", *generate.V2_MODES))


@pytest.mark.parametrize("mode", generate.V2_MODES)
def test_the_v2_runner_gives_eagers_tokens_and_hugging_faces(
    results: dict[str, dict], generated_dir: Path, mode: str
) -> None:
    got, eager = results[mode], results["eager"]
    assert got["tokens"] == eager["tokens"]
    check_greedy_choices(generated_dir / MODEL, got["prompts"], got["tokens"], 0.15)
    log = result_path(generated_dir, MODEL, mode).with_suffix(".log").read_text()
    assert "Traceback" not in log, log[-4000:]
    assert got["graph_steps"] > 0, "the v2 runner replayed graphs"


def test_npugraph_does_every_update_of_the_v2_runners_graphs(results: dict[str, dict], generated_dir: Path) -> None:
    acl = results["aclgraph-v2"]
    assert len(acl["vllm_ascend_update_seconds"]) == acl["graph_steps"] > 0, "vllm-ascend's own: one update a step"
    npg = results["npugraph-v2"]
    log = result_path(generated_dir, MODEL, "npugraph-v2").with_suffix(".log").read_text()
    assert "npugraph: vLLM's model runner v2: replaced" in log
    assert not npg["vllm_ascend_update_seconds"], "vllm-ascend's own update ran under the plugin"
    assert npg["npugraph_steps"] == npg["graph_steps"] > 0
    calls = npg["npugraph_update_device_calls"]
    assert calls["update_begin"] == calls["event_record"] == 2 * npg["graph_steps"], calls  # 2 layers a step


def test_the_kv_cache_budget_under_v2_leaves_out_the_graphs_memory(
    results: dict[str, dict], generated_dir: Path
) -> None:
    """vLLM's own v2 profile of its graph memory runs, its two largest FULL graphs captured
    by npugraph, and npugraph's measure of them, extrapolated to every FULL size, is taken out
    of vllm-ascend's KV-cache budget (npugraph/integrations/vllm/kv_budget.py): as many sizes
    as the real capture then captured."""
    log = result_path(generated_dir, MODEL, "npugraph-v2").with_suffix(".log").read_text()
    said = re.search(
        r"npugraph: graph memory estimated before the KV cache at ([\d.]+) MiB for (\d+) sizes "
        r".*the KV-cache budget is ([\d.]+) GiB instead of ([\d.]+) GiB",
        log,
    )
    assert said is not None, log[-4000:]
    estimate_gib, budget, available = float(said[1]) / 1024, float(said[3]), float(said[4])
    assert estimate_gib > 0 and available - budget == pytest.approx(estimate_gib, abs=0.011)  # (said to 0.01 GiB)
    captured = re.search(
        r"(\d+) graphs captured in all namespaces", " ".join(results["npugraph-v2"]["npugraph_capture_report"])
    )
    assert captured is not None and int(said[2]) == int(captured[1])
