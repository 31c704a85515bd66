"""npugraph's update-free graphs in a real engine: ``vllm.LLM`` as release/generate.py starts it
(``FULL_DECODE_ONLY``, vllm-ascend's default configuration), with npugraph's plugin and
``NPUGRAPH_UPDATE_FREE=1`` (release/run.sh runs this in each release environment).

Each FULL size is captured updated per layer and update-free at widths 128 and 256 (its
lengths frozen, each request's own masked on the device); each graph step replays the
narrowest that holds the batch.  On the Llama and the Qwen3 the tokens are eager's (which
npugraph's updated mode gives too: release/test_generate.py) but where a near-tie in Hugging
Face's float32 logits breaks the other way, and Hugging Face's float32 choices; the
update-free graphs ran (their steps counted), those steps made no task update, and the capture
report names them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
from hf_reference import check_forks_are_near_ties, check_greedy_choices
from runs import result_path

MODE = "npugraph-update-free"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def results(request: pytest.FixtureRequest, generated_dir: Path) -> tuple[str, dict[str, dict]]:
    return request.param, generate.run_modes(generated_dir, request.param, ("eager", MODE))


# a step where eager's and the update-free graph's greedy tokens differ must be a near-tie in
# Hugging Face's float32 logits: both within this of the best
NEAR_TIE = 0.05


def test_update_free_graphs_give_eagers_tokens_but_at_near_ties_and_hugging_faces(
    results: tuple[str, dict[str, dict]], generated_dir: Path
) -> None:
    """Reading the whole width (the masked keys' exact zeros included) sums attention in another
    order than reading each request's own keys, on the simulator as a device's tiling does on
    hardware: the bits differ, and a random model's near-tie may break the other way.  Where a
    request's tokens first differ from eager's, both tokens are within NEAR_TIE of Hugging
    Face's best; every token is within the generation check's tolerance of it."""
    model, got, eager = results[0], results[1][MODE], results[1]["eager"]
    check_greedy_choices(generated_dir / model, got["prompts"], got["tokens"], 0.15)
    forks = check_forks_are_near_ties(generated_dir / model, got["prompts"], got["tokens"], eager["tokens"], NEAR_TIE)
    print(f"{model}: {forks} of {len(got['tokens'])} requests left eager's text at a near-tie")
    log = result_path(generated_dir, model, MODE).with_suffix(".log").read_text()
    assert "Traceback" not in log, log[-4000:]
    assert "no update-free graphs" not in log, "the plugin fell back to updated graphs alone"


def test_update_free_steps_ran_and_made_no_task_update(results: tuple[str, dict[str, dict]]) -> None:
    got = results[1][MODE]
    free, steps = got["npugraph_update_free_steps"], got["npugraph_steps"]
    assert steps == got["graph_steps"] > 0 and free > 0, (free, steps)
    # every request here fits a width of 256 (max_model_len): no step runs the updated graph,
    # so no task update at all
    assert free == steps
    assert got["npugraph_update_device_calls"].get("update_begin", 0) == 0, got["npugraph_update_device_calls"]
    report = " ".join(got["npugraph_capture_report"])
    frozen = re.search(r"fia_frozen at \[([^\]]*)\]", report)
    assert frozen is not None and "@w128" in frozen[1] and "@w256" in frozen[1], report
