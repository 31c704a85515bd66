"""A real generation on vllm-ascend 0.23.0.post1, on the simulator, as users start it (vLLM's
default engine, vllm-ascend's default configuration): eager, vllm-ascend's own ACL graph mode
and npugraph's plugin give the same greedy tokens on a Llama and a Qwen3, which Hugging
Face's float32 forward of the same checkpoints confirms (release/run.sh runs this in the
release environment; elsewhere it skips).

Each model and mode runs release/generate.py in its own process (a fresh engine, as a user
runs it); the engine's own process counted the updates (release/ascend_site.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
from generate import MODELS, MODES, REQUESTS, generate
from hf_reference import greedy_choices
from runs import results

# Hugging Face in float32 against the simulator's bfloat16 kernels: a token counts as the
# reference's choice when its logit is within this of the best one (the checkpoints' logits
# spread over about 10; bfloat16's 8-bit mantissa through two layers moves them by < 0.1)
LOGIT_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/run.sh generated them already
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("generate")
    generate(out)
    return out


def _run(out_dir: Path, model: str, mode: str) -> dict[str, Any]:
    return json.loads(results(out_dir, model, mode)[0].read_text())


@pytest.mark.parametrize("model", MODELS)
def test_the_three_modes_give_identical_greedy_tokens_in_every_run(out_dir: Path, model: str) -> None:
    eager = _run(out_dir, model, "eager")
    assert [len(t) for t in eager["tokens"]] == [new for *_, new in REQUESTS[model]], "every request got its tokens"
    assert eager["engine_steps"] > max(at + new for at, _, new in REQUESTS[model])  # every one served to its end
    for mode in MODES[1:]:
        found = results(out_dir, model, mode)
        assert found, f"no {model} {mode} run"
        for path in found:  # each run a fresh engine, captured anew
            assert json.loads(path.read_text())["tokens"] == eager["tokens"], f"{path.name} differs from eager"


@pytest.mark.parametrize("model", MODELS)
def test_the_tokens_are_hugging_faces_greedy_choices(out_dir: Path, model: str) -> None:
    eager = _run(out_dir, model, "eager")
    choices = greedy_choices(out_dir / model, eager["prompts"], eager["tokens"])
    for prompt, (gap, _) in zip(eager["prompts"], choices):
        assert gap <= LOGIT_TOLERANCE, f"prompt {prompt[:4]}...: a token {gap:.3f} below the best"
    exact, total = sum(n for _, n in choices), sum(len(t) for t in eager["tokens"])
    assert exact >= 0.9 * total  # the rest are near-ties bfloat16 may break either way


@pytest.mark.parametrize("model", MODELS)
def test_vllm_ascend_updates_its_graphs_and_npugraph_does_every_update_with_the_plugin(
    out_dir: Path, model: str
) -> None:
    eager = _run(out_dir, model, "eager")
    assert not eager["vllm_ascend_update_seconds"] and not eager["npugraph_steps"], "eager replays no graph"
    for acl_path, npg_path in zip(results(out_dir, model, "aclgraph"), results(out_dir, model, "npugraph")):
        acl, npg = json.loads(acl_path.read_text()), json.loads(npg_path.read_text())
        assert acl["vllm_ascend_update_seconds"] and not acl["npugraph_steps"], acl_path.name
        assert not npg["vllm_ascend_update_seconds"], f"{npg_path.name}: vllm-ascend's own update ran"
        # every graph step vllm-ascend updated itself, npugraph updates with the plugin
        assert npg["npugraph_steps"] == len(npg["npugraph_update_seconds"]), npg_path.name
        # a graph step for each decode step but those with a prefill in them (vLLM runs them eagerly)
        assert len(npg["npugraph_update_seconds"]) == len(acl["vllm_ascend_update_seconds"]), npg_path.name
        assert len(npg["npugraph_update_seconds"]) >= eager["engine_steps"] // 2, npg_path.name
        per_step = {k: v / npg["npugraph_steps"] for k, v in npg["npugraph_update_device_calls"].items()}
        assert per_step["update_begin"] == per_step["event_record"] == 2.0, "one update and one event per layer"
        (report,) = npg["npugraph_capture_report"]  # one runtime, in the engine process
        assert report.startswith("4 graphs captured"), report
