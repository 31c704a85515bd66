"""vLLM's server as users start it, with npugraph's plugin: ``vllm serve M --dtype bfloat16``
on 127.0.0.1 (vLLM's default engine and compilation config, vllm-ascend's defaults), driven by
the ``openai`` client (release/run.sh runs this in the release environment; elsewhere it
skips).  release/serving.py starts and drives it.

Greedy completions are Hugging Face's float32 choices.  Eight at once (every other one
streamed) are each within 0.1 of its best logit and 95% exactly it; the same eight one at a time
give the same texts and tokens as the same release's server in eager mode and in vllm-ascend's own
graph mode (each started before npugraph's, alone, and stopped).  Bad requests (a prompt past the
context, max_tokens past it, malformed JSON, bad sampling parameters, an empty prompt, an id
outside the vocabulary) each get vLLM's own 400 with its reason; 200 concurrent connections
are all answered, graphs replayed at batch sizes far past the release check's others; a client
walks away mid-stream; 16 streams for two minutes (release/soak.py) keep the tokens right and
the engine's memory, graphs, events and streams flat.  After each, the same greedy request
gives the same tokens.  SIGINT ends
the server within 90 s.  npugraph's INFO line is in the log, and no traceback in it was raised in
npugraph's code: vLLM 0.23 prints its own for two of the refusals ("Exception in ASGI
application", then the 400) and one at shutdown (``EngineDeadError`` from its output handler),
with or without npugraph.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
import soak
from hf_reference import check_greedy_choices, greedy_choices
from runs import check_scope, engine_env
from serving import Answer, Served, bad_requests, npugraph_raised, started

pytest.importorskip("openai")

MODEL = "llama"
LOGIT_TOLERANCE = 0.15  # as release/test_generate.py: bfloat16 kernels against float32
NEW_TOKENS = 12
# vllm serve on the simulator: its profile run of 2,048 tokens runs vllm-ascend's rope in
# Triton's interpreter, then vLLM captures 70 sizes in two modes; about five minutes here
START_S = 1200
STOP_S = 90
CONTEXT = 1024  # the tiny Llama's max_position_embeddings: vLLM's max_model_len (test_the_context_is_the_models)
MESSAGES = {
    "a prompt longer than the context": "maximum context length is",
    "max_tokens past the context": "cannot be greater than max_model_len",
    "malformed JSON": "JSON decode error",
    "a negative temperature": "temperature must be non-negative",
    "a non-numeric top_p": "valid number",
    "a negative max_tokens": "max_tokens must be at least 1",
    "an empty prompt": "Either prompt or prompt_embeds must be provided and non-empty",
    "an empty list of token ids": "You must pass at least one prompt",
    # npugraph's guard: vLLM's own check lets an id equal to the vocabulary's size through, and
    # its engine core then dies (docs/vllm-ascend-release.md; npugraph/integrations/vllm/plugin.py)
    "an out-of-vocabulary token id": "token id 1024 at position 2, outside the model's vocabulary",
    "a negative token id": "Input should be greater than or equal to 0",  # vLLM's request model
}


REFUSED = bad_requests(CONTEXT, generate.MODELS[MODEL].vocab, MESSAGES)

# The same eight requests to eager's server, vllm-ascend's own graphs' and npugraph's: of 1 to
# near the context's tokens (the soak's pool: crossing pages), greedy, 16 tokens each
TOGETHER = [soak.pooled_prompt(i, CONTEXT, generate.MODELS[MODEL].vocab)[0] for i in range(8)]
TOGETHER_NEW = 16
# Served concurrently, their batches differ from run to run and bfloat16 may break a near tie
# either way: each text is then judged by Hugging Face's float32 forward (the soak's bar)
TOGETHER_TOLERANCE, TOGETHER_EXACT = soak.TOLERANCE, soak.EXACT
# The reference servers (eager's about a minute and a half to start here, vllm-ascend's own
# graphs' about four: vLLM's profile and capture of 70 sizes in two modes): make
# release-check runs both on both releases; CI, inside its time limit, eager's on the newer
# release (CI's generations compare vllm-ascend's graphs with npugraph's on both)
RELEASE = importlib.metadata.version("vllm_ascend")
REFERENCE_MODES = {"eager": ["--enforce-eager"], "vllm-ascend": []}
if check_scope() == "ci":
    REFERENCE_MODES = {} if RELEASE == "0.23.0.post1" else {"eager": ["--enforce-eager"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/run.sh's generation folder
    out = Path(given) if given else tmp_path_factory.mktemp("server")
    generate.write_model(out / MODEL)
    return out / MODEL


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's log, compile cache and engine samples (release/soak_probe.py)."""
    return tmp_path_factory.mktemp("vllm-serve")


def _serve_args(model_dir: Path) -> list[str]:
    return [str(Path(sys.executable).parent / "vllm"), "serve", str(model_dir), "--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def references(model_dir: Path, folder: Path) -> dict[str, list[Answer]]:
    """``TOGETHER``'s prompts one at a time to the same release's server in eager mode
    (``--enforce-eager``) and in its own graph mode (vllm-ascend's defaults, no npugraph):
    each mode's answers, its server stopped before the next starts (none shares the machine
    with another); those this scope runs (``REFERENCE_MODES``)."""
    out = {}
    for mode, extra in REFERENCE_MODES.items():
        env = engine_env(folder / f"vllm-cache-{mode}")
        with started(_serve_args(model_dir) + extra, folder / f"server-{mode}.log", env, START_S) as served:
            out[mode] = served.one_at_a_time(TOGETHER, TOGETHER_NEW)
            log = served.log.read_text()
        assert "npugraph: active" not in log, f"{mode}'s server: npugraph's plugin must be off there"
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path, folder: Path, references: dict[str, list[Answer]]) -> Iterator[Served]:
    """npugraph's server, started once the reference servers (``references``) have stopped."""
    env = engine_env(folder / "vllm-cache", NPUGRAPH_ENABLE="1", NPUGRAPH_SOAK_SAMPLES=str(folder))
    with started(_serve_args(model_dir), folder / "server.log", env, START_S) as served:
        yield served


@pytest.fixture(scope="module")
def first(server: Served) -> list[int]:
    """The first prompt's greedy tokens: every later repeat must give them again."""
    return server.complete(generate.prompts(MODEL)[0], NEW_TOKENS)


def test_the_context_is_the_models(model_dir: Path):
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == CONTEXT


def test_greedy_completions_are_hugging_faces(server: Served, first: list[int], model_dir: Path):
    good = generate.prompts(MODEL)[:2]
    answers = [first, server.complete(good[1], NEW_TOKENS)]
    assert [len(a) for a in answers] == [NEW_TOKENS] * 2
    check_greedy_choices(model_dir, good, answers, LOGIT_TOLERANCE)


def test_eight_together_are_hugging_faces_and_one_at_a_time_eager_vllm_ascend_and_npugraph_say_the_same(
    server: Served, references: dict[str, list[Answer]], model_dir: Path
):
    """Eight greedy completions at once, every other one streamed: each text Hugging Face's
    float32 choice (every token within 0.1 of its best logit, 95% exactly it).  Then the
    same eight one at a time: the same texts and tokens from npugraph's server as from the
    same release's eager server and its own graph mode's."""
    together = server.together(TOGETHER, TOGETHER_NEW, [i % 2 == 0 for i in range(len(TOGETHER))])
    assert [len(a.tokens) for a in together] == [TOGETHER_NEW] * len(TOGETHER)
    assert all(a.text for a in together), "every answer has its text, streamed or not"
    choices = greedy_choices(model_dir, TOGETHER, [list(a.tokens) for a in together])
    far = [(i, round(gap, 3)) for i, (gap, _) in enumerate(choices) if gap > TOGETHER_TOLERANCE]
    assert not far, f"prompts with a token beyond {TOGETHER_TOLERANCE} of Hugging Face's best logit: {far}"
    exact, total = sum(n for _, n in choices), TOGETHER_NEW * len(TOGETHER)
    assert exact >= TOGETHER_EXACT * total, f"{exact} of {total} tokens Hugging Face's argmax"
    alone = server.one_at_a_time(TOGETHER, TOGETHER_NEW)
    print(f"eight together: {sum(a != b for a, b in zip(together, alone))} of 8 texts differ from one at a time")
    if not references:
        pytest.skip(f"the reference servers: make release-check's (CHECK_SCOPE=ci on {RELEASE})")
    assert list(references) == list(REFERENCE_MODES)
    for mode, answers in references.items():
        differ = [i for i, (a, b) in enumerate(zip(alone, answers)) if a != b]
        assert not differ, f"one at a time, npugraph's server and {mode}'s differ at prompts {differ}: " + "; ".join(
            f"{alone[i]} against {answers[i]}" for i in differ[:2]
        )


@pytest.mark.parametrize("what,body,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_request_gets_vllms_400_and_the_next_good_one_is_right(
    server: Served, first: list[int], what: str, body: Any, message: str
):
    status, text = server.post(body)
    assert status == 400, f"{what}: HTTP {status} {text[:500]}"
    assert message in text, f"{what}: {text[:500]}"
    assert server.complete(generate.prompts(MODEL)[0], NEW_TOKENS) == first, f"after {what}: the same tokens"


def test_a_burst_of_200_connections_is_served_and_the_server_serves_on(server: Served, first: list[int]):
    finished = server.burst(generate.prompts(MODEL), 200, 4)
    assert finished == ["length"] * 200, "every one of 200 concurrent completions answered in full"
    assert server.complete(generate.prompts(MODEL)[0], NEW_TOKENS) == first


def test_a_client_that_walks_away_mid_stream_leaves_the_server_serving(server: Served, first: list[int]):
    assert server.walk_away(generate.prompts(MODEL)[1], 3, 600) == 3
    assert server.complete(generate.prompts(MODEL)[0], NEW_TOKENS) == first


def test_sixteen_streams_for_minutes_keep_tokens_memory_and_graphs_right(
    server: Served, first: list[int], model_dir: Path, folder: Path
):
    """The soak (release/soak.py) on this server, as CI runs it: 16 concurrent streams for
    ``SOAK_S`` seconds (default 120; ``make soak`` runs longer, and every mode), prompts from 1
    token to near the context, some clients walking away: every completed text Hugging Face's
    choice, the device's bytes, graphs, ExternalEvents and streams flat over the second half (the
    engine's host memory reported: soak.CHECK_MEMORY)."""
    run = soak.under_load(server, soak.CHECK_SOAK_S, CONTEXT, generate.MODELS[MODEL].vocab, folder, warm=False)
    choices = soak.check_choices(model_dir, run["requests"])
    print(f"soak: {run['summary']}, Hugging Face: {choices}, flat: {run['flat']}, forwards: {run['forwards']}")
    why = soak.failures("vllm", run, choices, memory=soak.CHECK_MEMORY)
    assert not why, why
    assert server.complete(generate.prompts(MODEL)[0], NEW_TOKENS) == first


def test_sigint_ends_the_server_in_time_and_no_traceback_is_npugraphs(server: Served):
    serving = server.log.read_text()
    assert "npugraph: active in this engine process" in serving, "npugraph's INFO line (the engine core's)"
    assert "npugraph: installed as the graph wrapper" in serving
    assert not npugraph_raised(serving), serving[-6000:]
    ended, shutdown = server.interrupt(STOP_S)
    assert ended, f"the server did not stop within {STOP_S} s of SIGINT"
    assert not npugraph_raised(shutdown), shutdown[-6000:]
