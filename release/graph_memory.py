"""Graph memory and the KV-cache budget, side by side, on the simulator (release/test_graph_memory.py
runs each engine).

    graph_memory.py MODEL_DIR RUN OUT_JSON        RUN: one of RUNS

The model is MLA with DeepSeek-V3's attention width and context (release/tiny_model.py,
``deepseek_v2_wide``: 128 heads over the 512-wide latent cache, 32K tokens).  Each run is
what a user types, vLLM's default engine and vllm-ascend's defaults, at
``gpu_memory_utilization=0.9``:

* ``eager``: no graphs (the tokens to compare);
* ``aclgraph``: vllm-ascend's own ``FULL_DECODE_ONLY`` graphs, whose KV-cache budget does
  not count graph memory;
* ``npugraph``: npugraph's plugin, whose KV-cache budget leaves out the graph memory a
  profiling capture measured;
* ``npugraph-uncounted``: npugraph's plugin with the KV cache vllm-ascend's own budget
  gives (``kv_cache_memory_bytes``, from ``NPUGRAPH_RELEASE_KV_BYTES``): npugraph's graphs
  where nothing counted them.

Writes whether the engine started, the error its caller got, and each request's tokens.
It exits 0 once it has written them, whatever the engine did; a hang is the caller's timeout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import tiny_model  # this folder's

RUNS = ("eager", "aclgraph", "npugraph", "npugraph-uncounted")
PROMPTS = [[5 + i, 9, 12 + i, 7] for i in range(4)]
NEW_TOKENS = 8


def engine_args(model: Path, run: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"model": str(model), "dtype": "bfloat16", "gpu_memory_utilization": 0.9, "seed": 0}
    if run == "eager":
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    if run == "npugraph-uncounted":
        kwargs["kv_cache_memory_bytes"] = int(os.environ["NPUGRAPH_RELEASE_KV_BYTES"])
    return kwargs


def run(model: Path, name: str) -> dict[str, Any]:
    if name.startswith("npugraph"):
        os.environ["NPUGRAPH_ENABLE"] = "1"
    from vllm import LLM, SamplingParams

    result: dict[str, Any] = {"run": name, "started": False, "error": None, "tokens": None}
    try:
        llm = LLM(**engine_args(model, name))
        result["started"] = True
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    except Exception as exc:  # what the caller of vLLM gets
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[2] not in RUNS:
        print(f"usage: {__doc__.splitlines()[2].strip()}\nRUN: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    model = Path(argv[1])
    tiny_model.checkpoint(model, "deepseek_v2_wide", 1024)
    Path(argv[3]).write_text(json.dumps(run(model, argv[2]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
