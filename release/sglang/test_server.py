"""SGLang's server as users start it, with npugraph's plugin: ``python -m sglang.launch_server
--model-path M --device npu`` on 127.0.0.1, driven by the ``openai`` client (release/sglang/run.sh
runs this in the SGLang environment; elsewhere it skips).

A completion whose prompt holds a token id outside the vocabulary gets a 400 with the reason
(SGLang 0.5.23 checks no prompt id against the vocabulary, and its scheduler then takes the
whole server down: the plugin's request guard refuses it at SGLang's intake).  Good requests
before and after it are answered, Hugging Face's float32 forward agrees with their tokens, and
they equal the eager engine's tokens for the same prompt.  Every other bad request (a prompt
past the context, max_tokens past it, malformed JSON, bad sampling parameters, an empty
prompt) gets SGLang's own 400; 200 concurrent connections are all answered; a client walks
away mid-stream; after each, the same greedy request gives the same tokens.  SIGINT ends the server within 90 s;
its log has npugraph's INFO line, and no traceback but SGLang's own KeyboardInterrupt at shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs the SGLang environment (release/sglang/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # release/: hf_reference.py, runs.py
from generate import VOCAB, prompts, write_model
from hf_reference import check_greedy_choices
from runs import result_path

openai = pytest.importorskip("openai")

LOGIT_TOLERANCE = 0.15  # as release/sglang/test_generate.py: bfloat16 kernels against float32
NEW_TOKENS = 12
START_S = 900  # the simulator starts SGLang's server, and captures its graphs, in a few minutes
STOP_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/sglang/run.sh wrote the models
    if given and (Path(given) / "llama" / "config.json").is_file():
        return Path(given) / "llama"
    path = tmp_path_factory.mktemp("server") / "llama"
    write_model(path, "llama")
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    port = _free_port()
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    env = {**os.environ, "NPUGRAPH_ENABLE": "1", "NPUGRAPH_SIM_TORCH_NPU": "1"}
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "npu"]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {proc.returncode} while starting:\n{log.read_text()[-6000:]}"
                )
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer within {START_S} s:\n{log.read_text()[-6000:]}")
            time.sleep(2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
        served = {"client": client, "proc": proc, "log": log, "base": base, "model": client.models.list().data[0].id}
        served["first"] = _complete(served, prompts()[0])  # what every later repeat must give again
        yield served
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only if the shutdown test did not end it
            proc.wait()


def _npugraph_dir() -> str:
    import npugraph

    return str(Path(npugraph.__file__).parent)


def _complete(server: dict[str, Any], prompt: list[int]) -> list[int]:
    c = server["client"].completions.create(
        model=server["model"],
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    (choice,) = c.choices
    return list(choice.model_extra["token_ids"])


def _eager_tokens(model_dir: Path, prompt: list[int]) -> list[int] | None:
    """The eager engine's tokens for ``prompt`` in release/sglang/generate.py's run, if it ran."""
    path = result_path(model_dir.parent, "llama", "eager")
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    return run["tokens"][run["prompts"].index(prompt)]


def test_an_out_of_vocabulary_prompt_is_a_400_and_the_server_serves_on(server: dict[str, Any], model_dir: Path):
    good = prompts()[:2]
    answers = [server["first"]]
    for bad in ([5, 6, VOCAB + 99999], [-1, 5, 6]):
        with pytest.raises(openai.BadRequestError) as err:
            _complete(server, bad)
        assert err.value.status_code == 400
        assert "outside the model's vocabulary" in str(err.value), str(err.value)
    answers.append(_complete(server, good[1]))
    answers.append(_complete(server, good[0]))
    assert answers[2] == answers[0], "the same greedy request, before and after the refusals"
    assert [len(a) for a in answers] == [NEW_TOKENS] * 3
    check_greedy_choices(model_dir, [good[0], good[1]], answers[:2], LOGIT_TOLERANCE)
    for prompt, tokens in zip(good, answers):
        eager = _eager_tokens(model_dir, prompt)
        if eager is not None:
            assert tokens == eager[:NEW_TOKENS], "the eager engine's tokens for the same prompt"


# Requests SGLang must refuse, each with its own 400 and the reason, as (what, the request's
# JSON body less the model, a fragment of SGLang's message).  The body goes as it is: the
# malformed one as raw bytes.
CONTEXT = 1024  # the tiny Llama's max_position_embeddings: SGLang's context length
REFUSED: list[tuple[str, Any, str]] = [
    (
        "a prompt longer than the context",
        {"prompt": [5] * (CONTEXT + 50), "max_tokens": 4},
        "longer than the model's context length",
    ),
    (
        "max_tokens past the context",
        {"prompt": [5, 6, 7], "max_tokens": 5 * CONTEXT},
        "exceeds the model's maximum context length",
    ),
    ("malformed JSON", b'{"prompt": [5, 6', "JSON decode error"),
    (
        "a negative temperature",
        {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": -1},
        "temperature must be a non-negative",
    ),
    ("a non-numeric top_p", {"prompt": [5, 6, 7], "max_tokens": 4, "top_p": "abc"}, "valid number"),
    ("a negative max_tokens", {"prompt": [5, 6, 7], "max_tokens": -3}, "max_tokens must be positive"),
    ("an empty prompt", {"prompt": "", "max_tokens": 4}, "Prompt cannot be empty"),
    ("an empty list of token ids", {"prompt": [], "max_tokens": 4}, "Prompt cannot be empty"),
    ("an out-of-vocabulary token id", {"prompt": [5, 6, VOCAB], "max_tokens": 4}, "outside the model's vocabulary"),
]


def _post(server: dict[str, Any], body: Any) -> tuple[int, str]:
    """POST ``body`` to /v1/completions as raw HTTP (no client-side validation in the way)."""
    data = body if isinstance(body, bytes) else json.dumps({"model": server["model"], **body}).encode()
    req = urllib.request.Request(
        f"{server['base']}/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.parametrize("what,body,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_request_gets_sglangs_400_and_the_next_good_one_is_right(
    server: dict[str, Any], what: str, body: Any, message: str
):
    status, text = _post(server, body)
    assert status == 400, f"{what}: HTTP {status} {text[:500]}"
    assert message in text, f"{what}: {text[:500]}"
    assert _complete(server, prompts()[0]) == server["first"], f"after {what}: the same greedy request, the same tokens"


def test_a_burst_of_200_connections_is_served_and_the_server_serves_on(server: dict[str, Any]):
    import asyncio

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="none", timeout=600, max_retries=0)
        ids = prompts()

        async def one(i: int) -> str:
            c = await client.completions.create(
                model=server["model"],
                prompt=ids[i % len(ids)],
                max_tokens=4,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            return str(c.choices[0].finish_reason)

        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await client.close()

    assert asyncio.run(burst()) == ["length"] * 200, "every one of 200 concurrent completions answered in full"
    assert _complete(server, prompts()[0]) == server["first"]


def test_a_client_that_walks_away_mid_stream_leaves_the_server_serving(server: dict[str, Any]):
    stream = server["client"].completions.create(
        model=server["model"],
        prompt=prompts()[1],
        max_tokens=600,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for _chunk in stream:
        received += 1
        if received == 3:
            break
    stream.close()  # the connection drops with most of the 600 tokens still to come
    assert received == 3
    assert _complete(server, prompts()[0]) == server["first"]


def test_sigint_ends_the_server_in_time_with_npugraphs_line_and_no_traceback(server: dict[str, Any]):
    """Serving, the log has no traceback.  At SIGINT, SGLang 0.5.23's launch_server prints its
    own: uvicorn re-raises the KeyboardInterrupt through it (with or without npugraph); that
    one is allowed, and nothing of npugraph's may be in it."""
    proc = server["proc"]
    serving = server["log"].read_text()
    assert "npugraph: active in this engine process" in serving, "npugraph's INFO line (the scheduler's)"
    assert "Traceback" not in serving, serving[-6000:]
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within {STOP_S} s of SIGINT")
    shutdown = server["log"].read_text()[len(serving) :]
    if "Traceback" in shutdown:
        assert shutdown.rstrip().endswith("KeyboardInterrupt"), shutdown[-6000:]
        assert _npugraph_dir() not in shutdown, f"a frame of npugraph's in SGLang's shutdown:\n{shutdown[-6000:]}"
