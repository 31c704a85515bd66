"""vLLM's default compilation config, as a user who types nothing more starts it, with and
without npugraph's plugin (release/run.sh runs this in the release environment; elsewhere it
skips).

``vllm.LLM(model, dtype="bfloat16", ...)`` with no ``compilation_config``: vLLM's
``FULL_AND_PIECEWISE`` mode (full graphs for uniform decode, piecewise graphs around
attention for the rest), on the release check's Llama and requests.  Both runs give eager's
tokens; under the plugin npugraph updated every full-graph step and vllm-ascend none, and
neither run printed a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
from runs import result_path

MODEL = "llama"


@pytest.fixture(scope="module")
def results(generated_dir: Path) -> dict[str, dict]:
    return generate.run_modes(generated_dir, MODEL, ("eager", *generate.DEFAULT_MODES))


@pytest.mark.parametrize("mode", generate.DEFAULT_MODES)
def test_vllms_default_mode_gives_eagers_tokens(results: dict[str, dict], generated_dir: Path, mode: str) -> None:
    assert results[mode]["tokens"] == results["eager"]["tokens"]
    log = result_path(generated_dir, MODEL, mode).with_suffix(".log").read_text()
    assert "Traceback" not in log and "FULL_AND_PIECEWISE" in log


def test_npugraph_does_every_full_graph_update_in_vllms_default_mode(results: dict[str, dict]) -> None:
    acl, npg = results["vllm-default"], results["vllm-default-npugraph"]
    assert acl["graph_steps"] > 0 and len(acl["vllm_ascend_update_seconds"]) == acl["graph_steps"]
    assert not npg["vllm_ascend_update_seconds"], "vllm-ascend's own update ran under the plugin"
    # npugraph's steps include the piecewise pieces' replays (no attention: nothing to
    # update) of steps that are not uniform decode: at least one per full-graph step
    assert npg["graph_steps"] > 0 and npg["npugraph_steps"] >= npg["graph_steps"]
    calls = npg["npugraph_update_device_calls"]
    # every full-graph step updated once per layer (2), by npugraph
    assert calls["update_begin"] == calls["event_record"] == 2 * npg["graph_steps"], calls
    (report,) = npg["npugraph_capture_report"]
    # each size's full graph, and its piecewise pieces (one namespace per piecewise wrapper)
    assert " graphs captured in all namespaces" in report
