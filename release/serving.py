"""An OpenAI-compatible server as users start it, driven by the ``openai`` client: what
release/test_server.py (``vllm serve``) and release/sglang/test_server.py
(``sglang.launch_server``) share.

The server listens on 127.0.0.1 and every request goes there.  :func:`started` starts it with
npugraph's plugin and waits until it answers; :class:`Served` sends greedy completions, the bad
requests of :func:`bad_requests` as raw HTTP, a burst of concurrent completions, a stream its
client walks away from, and SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SGLANG_READY", "Answer", "Served", "bad_requests", "npugraph_raised", "started"]

# What SGLang's server logs once its own warm-up request is done.  A SIGINT before it waits
# on that warm-up thread, whose retries on a closed server take minutes: SGLang's, with or
# without npugraph (its http_server's lifespan joins the thread)
SGLANG_READY = "The server is fired up and ready to roll!"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Answer:
    """A greedy completion as the client got it: its text and its token ids."""

    text: str
    tokens: tuple[int, ...]


@dataclass
class Served:
    """A started server: its process, log, address and the model it serves."""

    proc: subprocess.Popen[bytes]
    log: Path
    base: str
    model: str
    client: Any  # openai.OpenAI

    def _greedy(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        """The ``completions.create`` arguments of a greedy completion of ``new_tokens`` tokens
        (end of sequence ignored), its token ids returned beside its text."""
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True, "return_token_ids": True},
        }

    def _async_client(self) -> Any:
        """An ``openai.AsyncOpenAI`` client of this server: each request on its own connection."""
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="none", timeout=600, max_retries=0)

    def complete(self, prompt: list[int], new_tokens: int) -> list[int]:
        """A greedy completion of ``new_tokens`` tokens (end of sequence ignored): its token ids."""
        (answer,) = self.one_at_a_time([prompt], new_tokens)
        return list(answer.tokens)

    def one_at_a_time(self, prompts: list[list[int]], new_tokens: int) -> list[Answer]:
        """A greedy completion of ``new_tokens`` (end of sequence ignored) for each prompt, each
        sent once the one before has ended: no batch but its own."""
        out = []
        for prompt in prompts:
            (choice,) = self.client.completions.create(**self._greedy(prompt, new_tokens)).choices
            out.append(Answer(choice.text, tuple(choice.model_extra["token_ids"])))
        return out

    def together(self, prompts: list[list[int]], new_tokens: int, streamed: list[bool]) -> list[Answer]:
        """The same completions all at once, each on its own connection, prompt ``i`` streamed
        where ``streamed[i]``: their answers, in the prompts' order."""

        async def together() -> list[Answer]:
            client = self._async_client()

            async def one(prompt: list[int], stream: bool) -> Answer:
                if not stream:
                    c = await client.completions.create(**self._greedy(prompt, new_tokens))
                    return Answer(c.choices[0].text, tuple(c.choices[0].model_extra["token_ids"]))
                text, tokens = [], []
                async for chunk in await client.completions.create(**self._greedy(prompt, new_tokens), stream=True):
                    if chunk.choices:
                        text.append(chunk.choices[0].text or "")
                        tokens.extend((chunk.choices[0].model_extra or {}).get("token_ids") or [])
                return Answer("".join(text), tuple(tokens))

            try:
                return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, streamed, strict=True))))
            finally:
                await client.close()

        return asyncio.run(together())

    def post(self, body: dict[str, Any] | bytes) -> tuple[int, str]:
        """POST ``body`` to /v1/completions as raw HTTP (no client-side validation in the way):
        its status and text.  A dict gets the model's name; bytes go as they are."""
        data = body if isinstance(body, bytes) else json.dumps({"model": self.model, **body}).encode()
        req = urllib.request.Request(
            f"{self.base}/v1/completions", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def burst(self, prompts: list[list[int]], count: int, new_tokens: int) -> list[str]:
        """``count`` concurrent greedy completions, each on its own connection: their finish reasons."""

        async def burst() -> list[str]:
            client = self._async_client()

            async def one(i: int) -> str:
                c = await client.completions.create(**self._greedy(prompts[i % len(prompts)], new_tokens))
                return str(c.choices[0].finish_reason)

            try:
                return list(await asyncio.gather(*(one(i) for i in range(count))))
            finally:
                await client.close()

        return asyncio.run(burst())

    def stream(self, prompt: list[int], new_tokens: int, got: list[int], after_chunks: int | None = None) -> int:
        """Stream a greedy completion of ``new_tokens`` (end of sequence ignored), its token ids
        appended to ``got`` as they come, closing the connection after ``after_chunks`` chunks
        if given: how many chunks came.  What ends the stream early (a server gone) raises."""
        stream = self.client.completions.create(**self._greedy(prompt, new_tokens), stream=True)
        received = 0
        for chunk in stream:
            received += 1
            if chunk.choices:
                got.extend((chunk.choices[0].model_extra or {}).get("token_ids") or [])
            if received == after_chunks:
                break
        stream.close()
        return received

    def walk_away(self, prompt: list[int], after_chunks: int, new_tokens: int) -> int:
        """Stream a completion of ``new_tokens`` and close the connection after ``after_chunks``
        chunks, most of it still to come: how many chunks came."""
        return self.stream(prompt, new_tokens, [], after_chunks)

    def interrupt(self, stop_s: float) -> tuple[bool, str]:
        """SIGINT, as Ctrl-C: whether the server ended within ``stop_s``, and what it logged since."""
        before = len(self.log.read_text())
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            return False, self.log.read_text()[before:]
        return True, self.log.read_text()[before:]


@contextlib.contextmanager
def started(
    args: list[str], log: Path, env: dict[str, str], start_s: float, ready: str | None = None
) -> Iterator[Served]:
    """Start the server ``args`` (``--host``/``--port`` added: 127.0.0.1 and a free port), its
    output into ``log``, and wait until it answers /v1/models and, if given, its log holds the
    line ``ready`` (SGLang's: its own warm-up request is done); on leaving, every process of
    its group is killed (its children may outlive it).
    A server that exits or stays silent for ``start_s`` raises ``RuntimeError`` with its log's end."""
    import openai

    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: every process of it is stopped below
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited {proc.returncode} while starting:\n{log.read_text()[-6000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                if r.status == 200 and (ready is None or ready in log.read_text()):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer within {start_s} s:\n{log.read_text()[-6000:]}")
            time.sleep(2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
        yield Served(proc=proc, log=log, base=base, model=client.models.list().data[0].id, client=client)
    finally:
        # the whole process group: a server's children (schedulers, engine cores, ranks) may
        # outlive its main process, and must not linger into the next server's start
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bad_requests(context: int, vocab: int, messages: dict[str, str]) -> list[tuple[str, dict[str, Any] | bytes, str]]:
    """The requests a server must refuse, as ``(what, body, a fragment of its message)``, for a
    model of ``context`` tokens and ``vocab`` ids; ``messages`` gives the server's own message
    per ``what``."""
    bodies: dict[str, dict[str, Any] | bytes] = {
        "a prompt longer than the context": {"prompt": [5] * (context + 50), "max_tokens": 4},
        "max_tokens past the context": {"prompt": [5, 6, 7], "max_tokens": 5 * context},
        "malformed JSON": b'{"prompt": [5, 6',
        "a negative temperature": {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": -1},
        "a non-numeric top_p": {"prompt": [5, 6, 7], "max_tokens": 4, "top_p": "abc"},
        "a negative max_tokens": {"prompt": [5, 6, 7], "max_tokens": -3},
        "an empty prompt": {"prompt": "", "max_tokens": 4},
        "an empty list of token ids": {"prompt": [], "max_tokens": 4},
        "an out-of-vocabulary token id": {"prompt": [5, 6, vocab], "max_tokens": 4},
        "a negative token id": {"prompt": [-1, 5, 6], "max_tokens": 4},
    }
    if set(messages) != set(bodies):
        raise ValueError(f"messages for exactly these requests: {sorted(bodies)}")
    return [(what, body, messages[what]) for what, body in bodies.items()]


# What an engine's log puts before a line: its process ("(APIServer pid=12)") and a logger's
# level, time and place ("ERROR 12-04 16:27:51 [core.py:1197]")
_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\] )?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Fault|Warning)\b")


def npugraph_raised(text: str) -> list[str]:
    """The tracebacks in ``text`` raised in npugraph's code (their innermost frame in its
    package), each as its exception line.  A traceback that only passes through one of
    npugraph's wrappers is the engine's own, printed with or without npugraph."""
    import npugraph

    package = str(Path(npugraph.__file__).parent) + os.sep
    raised, innermost, inside = [], "", False
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw, count=1)
        if line.startswith("Traceback (most recent call last):"):
            inside, innermost = True, ""
        elif inside and line.lstrip().startswith('File "'):
            innermost = line
        elif inside and _EXCEPTION.match(line):
            if package in innermost:
                raised.append(line)
            inside = False
    return raised
