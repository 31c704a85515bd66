"""A real generation on vllm-ascend 0.23.0.post1, on the simulator: eager, vllm-ascend's own
ACL graph mode and npugraph's plugin give the same greedy tokens, which Hugging Face's
float32 forward of the same checkpoint confirms (release/run.sh runs this in the release
environment; elsewhere it skips).

Each mode runs release/generate.py in its own process (a fresh engine, as a user runs it).
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
from generate import MODES, generate, results
from hf_reference import greedy_choices

# Hugging Face in float32 against the simulator's float16 kernels: a token counts as the
# reference's choice when its logit is within this of the best one (the checkpoint's
# logits spread over about 10; float16's rounding through two layers moves them by < 0.01)
LOGIT_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/run.sh generated them already
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("generate")
    generate(out)
    return out


@pytest.fixture(scope="module")
def runs(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The first run of each mode."""
    return {
        mode: json.loads((out_dir / f"{mode}.json").read_text()) | {"model": str(out_dir / "model")} for mode in MODES
    }


def test_the_three_modes_give_identical_greedy_tokens(runs: dict[str, dict[str, Any]]) -> None:
    eager = runs["eager"]["tokens"]
    assert len(eager) == 8 and all(eager)
    assert runs["eager"]["engine_steps"] >= 40  # a prefill or two, then 32+ decode steps
    for mode in ("aclgraph", "npugraph"):
        assert runs[mode]["tokens"] == eager, f"{mode} differs from eager"


def test_the_tokens_are_hugging_faces_greedy_choices(runs: dict[str, dict[str, Any]]) -> None:
    eager = runs["eager"]
    choices = greedy_choices(eager["model"], eager["prompts"], eager["tokens"])
    for prompt, (gap, _) in zip(eager["prompts"], choices):
        assert gap <= LOGIT_TOLERANCE, f"prompt {prompt[:4]}...: a token {gap:.3f} below the best"
    exact, total = sum(n for _, n in choices), sum(len(t) for t in eager["tokens"])
    assert exact >= 0.95 * total  # the rest are near-ties float16 may break either way


def test_vllm_ascend_updates_its_graphs_and_npugraph_does_every_update_with_the_plugin(
    runs: dict[str, dict[str, Any]],
) -> None:
    acl, npg = runs["aclgraph"], runs["npugraph"]
    assert acl["vllm_ascend_update_seconds"] and not acl["npugraph_update_seconds"]
    assert not npg["vllm_ascend_update_seconds"], "vllm-ascend's own update ran under npugraph's plugin"
    # every graph step vllm-ascend updated itself, npugraph updates with the plugin
    assert len(npg["npugraph_update_seconds"]) == len(acl["vllm_ascend_update_seconds"]) >= 32
    (report,) = npg["npugraph_capture_report"]
    assert report.startswith("4 graphs captured"), report


def test_every_run_of_a_graph_mode_gives_the_same_tokens_and_updates(
    out_dir: Path, runs: dict[str, dict[str, Any]]
) -> None:
    """release/run.sh runs the graph modes more than once (for the update cost's noise):
    each run is a fresh engine, captured anew, and must serve the same tokens."""
    for mode in ("aclgraph", "npugraph"):
        for path in results(out_dir, mode)[1:]:
            again = json.loads(path.read_text())
            assert again["tokens"] == runs["eager"]["tokens"], f"{path.name} differs from eager"
            who = "vllm_ascend" if mode == "aclgraph" else "npugraph"
            assert len(again[f"{who}_update_seconds"]) == len(runs[mode][f"{who}_update_seconds"]), path.name
