"""A real generation with SGLang 0.5.23 on the simulator: eager, SGLang's own NPU graphs and
npugraph's plugin give the same greedy tokens on a Llama and a Qwen3, which Hugging Face's
float32 forward of the same checkpoints confirms; npugraph did every update and SGLang's
own update none (release/sglang/run.sh runs this in the SGLang environment; elsewhere it
skips).  Each model and mode runs release/sglang/generate.py in its own process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs the SGLang environment (release/sglang/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # release/: hf_reference.py, runs.py
from generate import MODELS, MODES, REQUESTS, UPDATE_FREE, generate, update_free_models
from hf_reference import check_forks_are_near_ties, check_greedy_choices
from runs import results

# Hugging Face in float32 against the simulator's bfloat16 kernels: a token counts as the
# reference's choice when its logit is within this of the best one (the checkpoints' logits
# spread over about 10; bfloat16's 8-bit mantissa through two layers moves them by < 0.1)
LOGIT_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/sglang/run.sh generated them already
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("generate")
    generate(out)
    return out


def _run(out_dir: Path, model: str, mode: str) -> dict[str, Any]:
    return json.loads(results(out_dir, model, mode)[0].read_text())


@pytest.mark.parametrize("model", MODELS)
def test_the_three_modes_give_identical_greedy_tokens(out_dir: Path, model: str) -> None:
    eager = _run(out_dir, model, "eager")["tokens"]
    assert [len(t) for t in eager] == [new for *_, new in REQUESTS], "every request got all its tokens"
    for mode in MODES[1:]:
        for path in results(out_dir, model, mode):
            assert json.loads(path.read_text())["tokens"] == eager, f"{path.name} differs from eager"


@pytest.mark.parametrize("model", MODELS)
def test_the_tokens_are_hugging_faces_greedy_choices(out_dir: Path, model: str) -> None:
    run = _run(out_dir, model, "eager")
    check_greedy_choices(out_dir / model, run["prompts"], run["tokens"], LOGIT_TOLERANCE)


@pytest.mark.parametrize("model", MODELS)
def test_sglang_updates_its_own_graphs_and_npugraph_does_every_update_with_its_plugin(
    out_dir: Path, model: str
) -> None:
    eager, own, npg = (_run(out_dir, model, mode) for mode in MODES)
    assert not eager["torch_npu_update_seconds"] and not eager["npugraph_steps"], "eager replays no graph"
    assert own["torch_npu_update_seconds"] and not own["npugraph_steps"]
    assert not npg["torch_npu_update_seconds"], "torch_npu's NPUGraph.update ran under npugraph's plugin"
    # each of npugraph's steps updated the graph it replayed; as many as SGLang's own
    # decode replays, give or take the steps at which streamed requests arrived
    assert npg["npugraph_steps"] == len(npg["npugraph_update_seconds"]) >= 30
    assert abs(npg["npugraph_steps"] - len(own["torch_npu_update_seconds"])) <= 6
    per_step = {k: v / npg["npugraph_steps"] for k, v in npg["npugraph_update_device_calls"].items()}
    assert per_step["update_begin"] == per_step["event_record"] == 2.0, "one update and one event per layer"


# where eager's and the update-free graph's greedy tokens first differ, both tokens must be
# within this of Hugging Face's float32 best (release/test_update_free.py says why they may)
NEAR_TIE = 0.05


@pytest.mark.parametrize("model", update_free_models())
def test_update_free_graphs_give_eagers_tokens_but_at_near_ties_and_make_no_task_update(
    out_dir: Path, model: str
) -> None:
    """``NPUGRAPH_UPDATE_FREE=1``: each decode size also captured update-free; every step the
    narrowest width that holds it replays, else the updated graph."""
    eager, free = _run(out_dir, model, "eager"), _run(out_dir, model, UPDATE_FREE)
    check_greedy_choices(out_dir / model, free["prompts"], free["tokens"], LOGIT_TOLERANCE)
    forks = check_forks_are_near_ties(out_dir / model, free["prompts"], free["tokens"], eager["tokens"], NEAR_TIE)
    print(f"{model}: {forks} of {len(free['tokens'])} requests left eager's text at a near-tie")
    assert not free["torch_npu_update_seconds"], "torch_npu's NPUGraph.update ran under npugraph's plugin"
    steps, uf = free["npugraph_steps"], free["npugraph_update_free_steps"]
    assert steps >= 30 and uf > 0, (steps, uf)
    # the update-free steps made no task update: the updated graph's steps made all of them
    calls = free["npugraph_update_device_calls"]
    assert calls.get("update_begin", 0) == 2 * (steps - uf), (calls, steps, uf)
