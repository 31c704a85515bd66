"""Faults through SGLang's server end in seconds and say where (release/sglang/run.sh runs
this in the SGLang environment; elsewhere it skips).

Each case starts ``python -m sglang.launch_server`` with npugraph's plugin on the check's
tiny Llama, as a user starts it, with one fault injected into its scheduler:

* ``host-copy-in-capture``: each Llama MLP reads a value to the host while a graph is
  captured (release/sglang/site.py, ``NPUGRAPH_SGLANG_FAULT=host-copy``);
* ``kernel-fault-at-replay``: an attention kernel inside a replay fails, as an AI core
  exception does (``NPUGRAPH_SIM_FAULT=kernel=...``: npusim/npusim/runtime/faults.py);
* ``lost-event-record``: an ExternalEvent record that npugraph issued never lands, so the
  replay waiting on it would wait for ever (``NPUGRAPH_SIM_FAULT=lost-record@...``).

SGLang does not carry on after its scheduler raises: the scheduler logs the exception and
sends SIGQUIT to the server, which ends every process of it (``run_scheduler_process``; the
same for any scheduler failure, with or without npugraph).  So each case must end the server
within its limit (never a hang), with:

* the caller getting SGLang's own ending: a server that does not start, or streams that
  end without their tokens and a server that is gone;
* the scheduler's log naming what failed: npugraph's graph (its namespace and key), the
  layer and the op;
* every token streamed before the fault being Hugging Face's choice (never a wrong token).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs the SGLang environment (release/sglang/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # release/: hf_reference.py, serving.py
from generate import prompts
from hf_reference import check_greedy_choices
from launch import START_S, check_model, launch
from serving import Served

pytest.importorskip("openai")

ERROR_WITHIN_S = 60  # from the first stream's end to the server's
LOGIT_TOLERANCE = 0.15  # as release/sglang/test_generate.py
STREAMS, NEW_TOKENS = 4, 64  # every stream still decoding when the fault comes

# npugraph's namespace for SGLang's decode graphs, and its key (SGLang's own ShapeKey)
GRAPH = r"sglang\.decode\.\d+/ShapeKey\(size=\d+[^\]]*\)"
LAYER = r"layer 'layers\.\d+'"
CASES: dict[str, dict[str, str]] = {
    "host-copy-in-capture": {"NPUGRAPH_SGLANG_FAULT": "host-copy"},
    # the 40th replayed PA kernel, the 40th ExternalEvent record to land: past SGLang's own
    # warm-up request (8 tokens, two layers: about 14 of each), some steps into the streams
    "kernel-fault-at-replay": {"NPUGRAPH_SIM_FAULT": "kernel=_npu_paged_attention@40"},
    "lost-event-record": {"NPUGRAPH_SIM_FAULT": "lost-record@40"},
}
SAYS = {
    "host-copy-in-capture": [
        r"CaptureFailed: capture of " + GRAPH + r" failed (in|after) " + LAYER,
        r"item\(\) reads .* on the host",
        r"Scheduler hit an exception",
    ],
    "kernel-fault-at-replay": [
        r"ReplayFault: replay of graph #\d+ \[" + GRAPH + r"\] failed at node \d+ \(_npu_paged_attention",
        r"\[" + LAYER + r"\]\)\); the rest of the replay was cancelled: InjectedFault: AI core exception",
        r"Scheduler hit an exception",
    ],
    "lost-event-record": [
        r"DeadlockError: .*would block forever",
        r"wait on <sim\.npu\.ExternalEvent #\d+> \[" + GRAPH + r"/layers\.\d+\], which is never recorded",
        r"Scheduler hit an exception",
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return check_model(tmp_path_factory.mktemp("faults"))


def _stream_until_it_ends(served: Served, prompt: list[int], got: list[int], ended: list[str]) -> None:
    """Stream a greedy completion into ``got`` (its token ids, chunk by chunk) until it ends:
    ``ended`` gets ``finished`` or the error that ended it."""
    try:
        served.stream(prompt, NEW_TOKENS, got)
        ended.append("finished")
    except Exception as exc:  # what the caller of SGLang's server gets
        ended.append(type(exc).__name__)


@pytest.mark.parametrize("case", CASES)
def test_a_fault_ends_sglangs_server_in_seconds_and_says_where(model_dir: Path, tmp_path: Path, case: str) -> None:
    log = tmp_path / "server.log"
    if case == "host-copy-in-capture":
        t0 = time.monotonic()
        with (
            pytest.raises(RuntimeError, match=r"the server exited .* while starting"),
            launch(model_dir, log, **CASES[case]),
        ):
            pass
        assert time.monotonic() - t0 < START_S
    else:
        with launch(model_dir, log, **CASES[case]) as served:
            chosen = prompts()[:STREAMS]
            got: list[list[int]] = [[] for _ in chosen]
            ended: list[list[str]] = [[] for _ in chosen]
            threads = [
                threading.Thread(target=_stream_until_it_ends, args=(served, p, g, e), daemon=True)
                for p, g, e in zip(chosen, got, ended)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=START_S)
            assert not any(t.is_alive() for t in threads), f"{case}: a stream still waits (a hang)"
            t_end = time.monotonic()
            assert all(e and e[0] != "finished" for e in ended), f"{case}: a stream finished as if nothing happened"
            served.proc.wait(timeout=ERROR_WITHIN_S)  # SGLang ends its server after a scheduler failure
            assert time.monotonic() - t_end < ERROR_WITHIN_S
            # what was delivered before the fault is Hugging Face's choice
            assert any(got), f"{case}: the fault came before serving began"
            kept = [(p, d) for p, d in zip(chosen, got) if d]
            check_greedy_choices(model_dir, [p for p, _ in kept], [d for _, d in kept], LOGIT_TOLERANCE)
    text = log.read_text()
    for pattern in SAYS[case]:
        assert re.search(pattern, text), f"{case}: the log does not say {pattern!r}\n{text[-6000:]}"
