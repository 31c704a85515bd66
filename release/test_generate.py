"""A real generation on vllm-ascend 0.23.0.post1, on the simulator, as users start it (vLLM's
default engine, vllm-ascend's default configuration), on a Llama, a Qwen3, a Llama with
n-gram speculative decoding (two draft tokens, in graph mode), the Llama at tensor
parallel 2 (a worker process per rank, hccl between them) and a DeepSeek-V2 with
multi-head latent attention (vllm-ascend's MLA backend), alone, with the n-gram
speculative decoding and at tensor parallel 2: npugraph's
plugin gives vllm-ascend's own ACL graph mode's greedy tokens, eager gives the same (up to
near-ties where vllm-ascend fuses kernels in graph mode only), and Hugging Face's float32
forward of the same checkpoints confirms each mode's (release/run.sh runs this in the
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
from generate import MODELS, MODES, REQUESTS, checked, eager_models, generate
from hf_reference import check_greedy_choices
from runs import results

# Hugging Face in float32 against the simulator's bfloat16 kernels: a token counts as the
# reference's choice when its logit is within the model's tolerance of the best one (the
# checkpoints' logits spread over about 10; bfloat16's 8-bit mantissa through two layers moves
# them by < 0.1: 0.15; the 32-layer benchmark's: 0.25, generate.py's Model.hf_tolerance)


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


# vllm-ascend fuses the Qwen3's q/k norm and rope into one Triton kernel in its compiled
# (graph) modes only: its rounding differs from eager's separate kernels, so a near-tie may
# break the other way in eager (both sides are then Hugging Face's choices, within the
# tolerance).  The Llama's graph modes run eager's kernels: its tokens must be eager's.
FUSED_IN_GRAPH_MODES = {"qwen3"}


@pytest.mark.parametrize("model", checked())
def test_npugraph_gives_vllm_ascends_own_graph_tokens_in_every_run(out_dir: Path, model: str) -> None:
    """The same compiled model and kernels, captured and updated by vllm-ascend or by
    npugraph: identical tokens, in every run (each a fresh engine, captured anew)."""
    own = _run(out_dir, model, "aclgraph")
    assert [len(t) for t in own["tokens"]] == [new for *_, new in REQUESTS[model]], "every request got its tokens"
    for mode in MODES[1:]:
        found = results(out_dir, model, mode)
        assert found, f"no {model} {mode} run"
        for path in found:
            assert json.loads(path.read_text())["tokens"] == own["tokens"], f"{path.name} differs from aclgraph"


@pytest.mark.parametrize("model", eager_models())
def test_eager_gives_the_graph_modes_tokens(out_dir: Path, model: str) -> None:
    eager, graph = _run(out_dir, model, "eager"), _run(out_dir, model, "aclgraph")
    assert [len(t) for t in eager["tokens"]] == [new for *_, new in REQUESTS[model]], "every request got its tokens"
    if MODELS[model].speculative is None:  # (a step may give a request more than one token)
        assert eager["engine_steps"] > max(at + new for at, _, new in REQUESTS[model])  # every one served to its end
    if model not in FUSED_IN_GRAPH_MODES:
        assert eager["tokens"] == graph["tokens"]
        return
    same = sum(e == g for e, g in zip(eager["tokens"], graph["tokens"]))
    assert same >= len(eager["tokens"]) - 2, f"{same} of {len(eager['tokens'])} requests as the graph modes"


@pytest.mark.parametrize("model", checked())
@pytest.mark.parametrize("mode", ["eager", "aclgraph"])  # npugraph's are aclgraph's (above)
def test_the_tokens_are_hugging_faces_greedy_choices(out_dir: Path, model: str, mode: str) -> None:
    if mode == "eager" and model not in eager_models():
        pytest.skip(f"{model} runs no eager engine at this scope (generate.eager_models)")
    run = _run(out_dir, model, mode)
    served = MODELS[model]
    check_greedy_choices(out_dir / model, run["prompts"], run["tokens"], served.hf_tolerance, served.hf_exact_share)


# How many graphs npugraph captures per model: decode sizes 1, 2, 4 and 8 (PA at 1 and 2,
# FIA at 4 and 8); with two draft tokens, uniform batches of 3-token queries at 3, 6, 9, 18
# and 24 tokens, all FIA
CAPTURED = {"llama": "4 graphs captured", "qwen3": "4 graphs captured", "ngram": "5 graphs captured"}
CAPTURED["tp2"] = CAPTURED["llama"]  # on each rank
CAPTURED["mla"] = CAPTURED["llama"]  # the same sizes, all of them npugraph's MLA declaration (FIA with rope)
CAPTURED["mla-ngram"] = CAPTURED["ngram"]
CAPTURED["mla-tp2"] = CAPTURED["mla"]  # on each rank
# MTP: the target's 2-token queries of 1 to 8 requests padded to 2, 4, 8 and 16 tokens, and
# the draft's graph at the same batch descriptors (namespace "draft")
CAPTURED["mla-mtp"] = "8 graphs captured in all namespaces"
# two draft tokens: the target's 3-token queries at 3, 6, 9, 18, 24 tokens, and the draft's
CAPTURED["mla-mtp2"] = "10 graphs captured in all namespaces"
# the 32-layer benchmark: decode sizes 1, 2, 4, 8 and 16 (max_num_seqs 16)
CAPTURED["deep"] = "5 graphs captured"
# At least this share (1/n) of a run's steps ran as a graph: with n-gram speculative
# decoding a step is a graph only when every request has both drafts (about half of them)
GRAPH_STEP_SHARE = {"llama": 2, "qwen3": 2, "ngram": 4, "tp2": 2, "mla": 2, "mla-ngram": 4, "mla-tp2": 2}
GRAPH_STEP_SHARE |= {"mla-mtp": 2, "mla-mtp2": 2, "deep": 2}


@pytest.mark.parametrize("model", checked())
def test_vllm_ascend_updates_its_graphs_and_npugraph_does_every_update_with_the_plugin(
    out_dir: Path, model: str
) -> None:
    """In each run, every step vllm-ascend ran as a full graph was updated once, by
    vllm-ascend in its own mode and by npugraph alone under the plugin.  (The runs need not
    have the same number of graph steps: the engine is its own process, and which client
    step a request arrives at can move by one between runs.)"""
    ranks = MODELS[model].tensor_parallel  # model processes: each rank's worker counts its own
    if model in eager_models():
        eager = _run(out_dir, model, "eager")
        assert not eager["vllm_ascend_update_seconds"] and not eager["npugraph_steps"], "eager replays no graph"
        assert not eager["graph_steps"]
        steps = eager["engine_steps"]
    else:  # no eager run at this scope (generate.eager_models): vllm-ascend's own graphs' first run
        steps = _run(out_dir, model, "aclgraph")["engine_steps"]
    least = steps // GRAPH_STEP_SHARE[model]
    drafting = MODELS[model].speculative is not None and MODELS[model].speculative["method"] == "mtp"
    for path in results(out_dir, model, "aclgraph"):
        acl = json.loads(path.read_text())
        graphs = acl["graph_steps"] + acl["draft_graph_steps"]  # the target's, and the draft's apart
        assert len(acl["vllm_ascend_update_seconds"]) == graphs and not acl["npugraph_steps"], path.name
        assert acl["graph_steps"] >= least, path.name
        assert bool(acl["draft_graph_steps"]) == drafting, path.name
        assert len(acl["ranks"]) == ranks and all(r["graph_steps"] == acl["graph_steps"] for r in acl["ranks"])
    for path in results(out_dir, model, "npugraph"):
        npg = json.loads(path.read_text())
        assert not npg["vllm_ascend_update_seconds"], f"{path.name}: vllm-ascend's own update ran"
        graphs = npg["graph_steps"] + npg["draft_graph_steps"]
        assert npg["npugraph_steps"] == len(npg["npugraph_update_seconds"]) == graphs, path.name
        assert npg["graph_steps"] >= least, path.name
        assert bool(npg["draft_graph_steps"]) == drafting, path.name
        # every rank ran the same graph steps, and npugraph updated each of them there
        assert len(npg["ranks"]) == ranks, npg["ranks"]
        assert all(r["npugraph_steps"] == graphs for r in npg["ranks"]), npg["ranks"]
        assert all(r["graph_steps"] == npg["graph_steps"] for r in npg["ranks"]), npg["ranks"]
        # one update per layer of each graph that ran: the target's layers; an MTP draft's
        # graph runs its one layer once per draft token; one event per layer, or per group
        # of ten from twenty layers (npugraph's default event grouping)
        draft_tasks = MODELS[model].speculative["num_speculative_tokens"] if drafting else 0
        depth = MODELS[model].layers
        layers = depth * npg["graph_steps"] + draft_tasks * npg["draft_graph_steps"]
        events = _records(depth) * npg["graph_steps"] + draft_tasks * npg["draft_graph_steps"]
        calls = npg["npugraph_update_device_calls"]
        assert calls["update_begin"] == layers and calls["event_record"] == events, (calls, layers, events)
        (report,) = npg["npugraph_capture_report"]  # one runtime, in the engine process
        assert report.startswith(CAPTURED[model]), report


def _records(tasks: int) -> int:
    """The ExternalEvents npugraph records per step for a graph of ``tasks`` layers (its default grouping)."""
    from npugraph.capture.events import EventSchedule, group_size

    schedule = EventSchedule(tasks=tasks, size=group_size(tasks, None))
    return sum(schedule.records(i) for i in range(tasks))


def test_no_run_printed_a_traceback_or_an_error(out_dir: Path) -> None:
    """As a user runs it, start-up, serving and shutdown (vLLM's engine process included)
    say no error: each run's whole output is kept beside its result.  No process crashed
    either: vLLM 0.30's engine core segfaulted at exit in torch.accelerator.empty_host_cache()
    (the simulator had no host allocator) while its results and this test's words were fine."""
    logs = sorted(p.with_suffix(".log") for model in checked() for mode in MODES for p in results(out_dir, model, mode))
    assert logs and all(log.is_file() for log in logs), logs
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text and " ERROR " not in text, f"{log.name} printed an error"
        assert "Segfault encountered" not in text and "Fatal Python error" not in text, f"{log.name}: a process crashed"
