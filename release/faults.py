"""Faults in a real engine, on the simulator (release/test_faults.py runs each case).

    faults.py MODEL_DIR CASE OUT_JSON        CASE: one of CASES

vLLM's default engine with npugraph's plugin, as release/generate.py starts it, serving the
same requests, with one fault:

* ``host-copy-in-capture``: each Llama MLP calls a custom op that reads a value to the host
  while a graph is captured (release/ascend_site.py, ``NPUGRAPH_VLLM_FAULT=host-copy``);
* ``kernel-fault-at-replay``: a PA kernel inside a replay fails, as an AI core exception
  does (``NPUGRAPH_SIM_FAULT=kernel=...``: npusim/npusim/runtime/faults.py);
* ``lost-event-record``: an ExternalEvent record that npugraph issued never lands, so the
  replay waiting on it would wait forever (``NPUGRAPH_SIM_FAULT=lost-record@...``);
* ``kernel-fault-at-replay-v2``: the kernel fault under vLLM's model runner v2
  (``VLLM_USE_V2_MODEL_RUNNER=1``), where the release has one npugraph serves.

Writes what the caller saw: whether the engine started, the error it got (type, message)
and how long after serving began, and every request's tokens as delivered so far.  It exits
0 once it has written them, whatever the engine did; a hang is the caller's timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import generate  # this folder's

# each case's settings; the counts are of events in the engine process after its start
CASES: dict[str, dict[str, str]] = {
    "host-copy-in-capture": {"NPUGRAPH_VLLM_FAULT": "host-copy"},
    # the 9th replayed PA kernel: serving has begun (capture replays nothing)
    "kernel-fault-at-replay": {"NPUGRAPH_SIM_FAULT": "kernel=_npu_paged_attention@9"},
    # the 9th ExternalEvent record to land: a few decode steps into serving
    "lost-event-record": {"NPUGRAPH_SIM_FAULT": "lost-record@9"},
    # the kernel fault under vLLM's model runner v2, whose graphs npugraph serves through
    # vllm-ascend's graph manager (npugraph/integrations/vllm/runner_v2.py; 0.30.0rc2 on)
    "kernel-fault-at-replay-v2": {
        "NPUGRAPH_SIM_FAULT": "kernel=_npu_paged_attention@9",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
    },
}


def run(model: Path) -> dict[str, Any]:
    os.environ["NPUGRAPH_ENABLE"] = "1"
    from vllm import LLM

    tokens: dict[str, list[int]] = {}
    result: dict[str, Any] = {"started": False, "error": None, "seconds_to_error": None, "engine_steps": 0}
    t0 = time.perf_counter()
    try:
        v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
        llm = LLM(**generate.engine_args(model, "npugraph-v2" if v2 else "npugraph"))
        result["started"] = True
        t0 = time.perf_counter()
        result["engine_steps"] = generate.serve(llm.llm_engine, model.name, tokens)
    except Exception as exc:  # what the caller of vLLM gets
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        result["seconds_to_error"] = time.perf_counter() - t0
    result["tokens"] = tokens
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[2] not in CASES:
        print(f"usage: {__doc__.splitlines()[2].strip()}\nCASE: {', '.join(CASES)}", file=sys.stderr)
        return 2
    model = Path(argv[1])
    generate.write_model(model)
    Path(argv[3]).write_text(json.dumps({"case": argv[2], **run(model)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
