"""SGLang's server as users start it, with npugraph's plugin: ``python -m sglang.launch_server
--model-path M --device npu`` on 127.0.0.1, driven by the ``openai`` client (release/sglang/run.sh
runs this in the SGLang environment; elsewhere it skips).  release/serving.py starts and drives it.

Greedy completions are Hugging Face's float32 choices and the eager engine's tokens for the
same prompts.  Bad requests (a prompt past the context, max_tokens past it, malformed JSON,
bad sampling parameters, an empty prompt, an id outside the vocabulary) each get SGLang's own
400 with its reason; the last is the plugin's: SGLang 0.5.23 checks no prompt id against the
vocabulary, and its scheduler then takes the whole server down, so the plugin's request guard
refuses it at SGLang's intake.  200 concurrent connections are all answered; a client walks
away mid-stream.  After each, the same greedy request gives the same tokens.  SIGINT ends the
server within 90 s; its log has npugraph's INFO line, no traceback while serving, and none raised in
npugraph's code at shutdown.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs the SGLang environment (release/sglang/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # release/: hf_reference.py, runs.py, serving.py
import soak
from generate import VOCAB, prompts
from hf_reference import check_greedy_choices
from launch import check_model, launch
from runs import check_scope, result_path
from serving import Served, bad_requests, npugraph_raised

pytest.importorskip("openai")

LOGIT_TOLERANCE = 0.15  # as release/sglang/test_generate.py: bfloat16 kernels against float32
NEW_TOKENS = 12
STOP_S = 90
CONTEXT = 1024  # the tiny Llama's max_position_embeddings: SGLang's context length
REFUSED = bad_requests(
    CONTEXT,
    VOCAB,
    {
        "a prompt longer than the context": "longer than the model's context length",
        "max_tokens past the context": "exceeds the model's maximum context length",
        "malformed JSON": "JSON decode error",
        "a negative temperature": "temperature must be a non-negative",
        "a non-numeric top_p": "valid number",
        "a negative max_tokens": "max_tokens must be positive",
        "an empty prompt": "Prompt cannot be empty",
        "an empty list of token ids": "Prompt cannot be empty",
        "an out-of-vocabulary token id": f"token id {VOCAB} at position 2, outside the model's vocabulary",
        "a negative token id": "token id -1 at position 0, outside the model's vocabulary",
    },
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return check_model(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launch(model_dir, tmp_path_factory.mktemp("server-log") / "server.log") as served:
        yield served


@pytest.fixture(scope="module")
def first(server: Served) -> list[int]:
    """The first prompt's greedy tokens: every later repeat must give them again."""
    return server.complete(prompts()[0], NEW_TOKENS)


def _eager_tokens(model_dir: Path, prompt: list[int]) -> list[int] | None:
    """The eager engine's tokens for ``prompt`` in release/sglang/generate.py's run, if it ran."""
    path = result_path(model_dir.parent, "llama", "eager")
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    return run["tokens"][run["prompts"].index(prompt)]


def test_greedy_completions_are_hugging_faces_and_the_eager_engines(server: Served, first: list[int], model_dir: Path):
    good = prompts()[:2]
    answers = [first, server.complete(good[1], NEW_TOKENS)]
    assert [len(a) for a in answers] == [NEW_TOKENS] * 2
    check_greedy_choices(model_dir, good, answers, LOGIT_TOLERANCE)
    for prompt, tokens in zip(good, answers):
        eager = _eager_tokens(model_dir, prompt)
        if eager is not None:
            assert tokens == eager[:NEW_TOKENS], "the eager engine's tokens for the same prompt"


@pytest.mark.parametrize("what,body,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_request_gets_sglangs_400_and_the_next_good_one_is_right(
    server: Served, first: list[int], what: str, body: Any, message: str
):
    status, text = server.post(body)
    assert status == 400, f"{what}: HTTP {status} {text[:500]}"
    assert message in text, f"{what}: {text[:500]}"
    assert server.complete(prompts()[0], NEW_TOKENS) == first, f"after {what}: the same request, the same tokens"


def test_a_burst_of_200_connections_is_served_and_the_server_serves_on(server: Served, first: list[int]):
    finished = server.burst(prompts(), 200, 4)
    assert finished == ["length"] * 200, "every one of 200 concurrent completions answered in full"
    assert server.complete(prompts()[0], NEW_TOKENS) == first


def test_a_client_that_walks_away_mid_stream_leaves_the_server_serving(server: Served, first: list[int]):
    assert server.walk_away(prompts()[1], 3, 600) == 3
    assert server.complete(prompts()[0], NEW_TOKENS) == first


def test_sixteen_streams_for_minutes_keep_tokens_memory_and_graphs_right(
    server: Served, first: list[int], model_dir: Path
):
    """The soak (release/soak.py) on this server, as CI runs it: 16 concurrent streams for
    ``SOAK_S`` seconds (default 120; ``make soak`` runs longer, and every mode), prompts from 1
    token to near the context, crossing pages, some clients walking away: every completed text
    Hugging Face's choice, the device's bytes, graphs, ExternalEvents and streams flat over the
    second half (the scheduler's host memory reported: soak.CHECK_MEMORY)."""
    run = soak.under_load(server, soak.CHECK_SOAK_S, CONTEXT, VOCAB, server.log.parent, warm=False)
    choices = soak.check_choices(model_dir, run["requests"])
    print(f"soak: {run['summary']}, Hugging Face: {choices}, flat: {run['flat']}, forwards: {run['forwards']}")
    why = soak.failures("sglang", run, choices, memory=soak.CHECK_MEMORY)
    assert not why, why
    assert server.complete(prompts()[0], NEW_TOKENS) == first


def test_sigint_ends_the_server_in_time_with_npugraphs_line_and_no_traceback(server: Served):
    """Serving, the log has no traceback.  At SIGINT, SGLang 0.5.23's launch_server prints its
    own: uvicorn re-raises the KeyboardInterrupt through it (with or without npugraph); that
    one is allowed; none may be raised in npugraph's code."""
    serving = server.log.read_text()
    assert "npugraph: active in this engine process" in serving, "npugraph's INFO line (the scheduler's)"
    assert "Traceback" not in serving, serving[-6000:]
    ended, shutdown = server.interrupt(STOP_S)
    assert ended, f"the server did not stop within {STOP_S} s of SIGINT"
    if "Traceback" in shutdown:
        assert _less_sglangs_shutdown_race(shutdown).rstrip().endswith("KeyboardInterrupt"), shutdown[-6000:]
    assert not npugraph_raised(shutdown), shutdown[-6000:]


def _less_sglangs_shutdown_race(shutdown: str) -> str:
    """The shutdown log without SGLang 0.5.23's own race: launch_server's kill_process_tree
    SIGKILLs the scheduler while its SubprocessWatchdog thread still polls, which then reports
    the kill as a crash ("Subprocess scheduler_0 ... crashed with exit code -9", CI 2026-12-05;
    with or without npugraph).  Only that line, and only after kill_process_tree ran: a
    scheduler that died any other way, or before the kill, still fails the check."""
    lines = shutdown.splitlines()
    killed = next((i for i, line in enumerate(lines) if "kill_process_tree called" in line), len(lines))
    race = re.compile(r"Subprocess \w+ \(pid=\d+\) crashed with exit code -9\. Triggering SIGQUIT for cleanup")
    return "\n".join(line for i, line in enumerate(lines) if not (i > killed and race.search(line)))


@pytest.fixture(scope="module")
def server_tp2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with launch(model_dir, tmp_path_factory.mktemp("server-tp2-log") / "server.log", "--tp-size", "2") as served:
        yield served


# a second server of two ranks: the full check's (make sglang-check), not CI's
@pytest.mark.skipif(check_scope() == "ci", reason="CHECK_SCOPE=ci: make sglang-check runs it")
def test_tensor_parallel_2_runs_npugraph_in_each_rank_with_the_same_tokens(
    server_tp2: Served, first: list[int], model_dir: Path
):
    """``--tp-size 2``: a scheduler process per rank, each with npugraph's plugin (its INFO line
    per rank), the simulator's hccl between them; the greedy tokens are the single rank's and
    Hugging Face's."""
    tokens = server_tp2.complete(prompts()[0], NEW_TOKENS)
    assert tokens == first, "tensor parallel 2 gives the single rank's tokens"
    check_greedy_choices(model_dir, [prompts()[0]], [tokens], LOGIT_TOLERANCE)
    log = server_tp2.log.read_text()
    for rank in ("TP0", "TP1"):
        assert any(rank in line and "npugraph: active in this engine process" in line for line in log.splitlines()), (
            rank
        )
    assert "Traceback" not in log, log[-6000:]
    ended, shutdown = server_tp2.interrupt(STOP_S)
    assert ended, f"the tensor-parallel server did not stop within {STOP_S} s of SIGINT"
    assert not npugraph_raised(shutdown), shutdown[-6000:]
