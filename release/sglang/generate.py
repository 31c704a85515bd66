"""A real generation with SGLang 0.5.23 on npugraph's simulator (release/sglang/run.sh).

    generate.py MODEL_DIR MODE OUT_JSON        MODE: eager | sglang | npugraph | npugraph-update-free
    generate.py OUT_DIR [RUNS]                 each model and mode in its own process, into
                                               OUT_DIR; the Llama's graph modes RUNS times
                                               (default 3, or 1 at CHECK_SCOPE=ci), in turn

``sglang.Engine(model_path=..., device="npu")`` with SGLang's NPU defaults and nothing else
(its own engine: the scheduler in its own process), on tiny Llama and Qwen3 checkpoints
written by Hugging Face with seeded weights in bfloat16 and a word-level tokenizer, prompts
given as token ids, greedy:

* ``eager``: ``disable_cuda_graph=True``;
* ``sglang``: SGLang's own NPU decode graphs (torch_npu's ``NPUGraph.update`` each step);
* ``npugraph``: the same with npugraph's plugin (``NPUGRAPH_ENABLE=1``);
* ``npugraph-update-free``: the plugin with ``NPUGRAPH_UPDATE_FREE=1``: each decode size also
  captured update-free (lengths frozen to widths, masked on the device), each step replaying
  the narrowest that holds it.

Requests arrive while others decode (streamed: a group is sent once an earlier request has
produced some tokens), have prompts of different lengths, finish at different steps, and
one crosses SGLang's 128-token page.  The scheduler process (release/sglang/site.py) times
each per-step update, torch_npu's and npugraph's, and counts npugraph's steps.
release/sglang/test_generate.py compares the modes and Hugging Face's float32 forward.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # release/: tiny_model.py, runs.py, engine_counts.py
import engine_counts
import tiny_model
from runs import check_scope, clear_results, counts_folder, order, result_path, run_logged

MODES = ("eager", "sglang", "npugraph")
# npugraph's plugin with NPUGRAPH_UPDATE_FREE=1 (its update-free graphs beside the updated
# ones): the Llama at CHECK_SCOPE=ci, both models at the full scope (release/sglang/test_generate.py)
UPDATE_FREE = "npugraph-update-free"
MODELS = ("llama", "qwen3")
VOCAB = 1024
# (sent when request `after` has produced `tokens` tokens (None: at once), prompt length, new tokens)
REQUESTS = [
    (None, 0, 5, 40),
    (None, 0, 12, 24),
    (None, 0, 19, 44),
    (0, 3, 7, 36),
    (0, 3, 26, 30),
    (1, 10, 9, 40),
    (1, 10, 118, 30),  # 118 + 30 tokens: crosses the 128-token page while decoding
    (3, 6, 4, 34),
]


def write_model(path: Path, arch: str) -> None:
    """A tiny Llama or Qwen3 (release/tiny_model.py), bfloat16, with its tokenizer."""
    tiny_model.checkpoint(path, arch, VOCAB)


def prompts() -> list[list[int]]:
    return [
        [(7 * i + 13 * j + 3) % (VOCAB - 3) + 3 for j in range(length)] for i, (_, _, length, _) in enumerate(REQUESTS)
    ]


async def _serve(engine: Any) -> list[list[int]]:
    produced = [0] * len(REQUESTS)
    tokens: list[list[int]] = [[] for _ in REQUESTS]
    sent = [False] * len(REQUESTS)
    ids = prompts()

    async def one(i: int) -> None:
        params = {"temperature": 0.0, "max_new_tokens": REQUESTS[i][3], "ignore_eos": True}
        stream = await engine.async_generate(input_ids=ids[i], sampling_params=params, stream=True)
        async for chunk in stream:
            tokens[i] = list(chunk["output_ids"])
            produced[i] = len(tokens[i])

    tasks = []
    while not all(sent):
        for i, (after, at, _, _) in enumerate(REQUESTS):
            if not sent[i] and (after is None or produced[after] >= at):
                sent[i] = True
                tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    return tokens


def run(model: Path, mode: str) -> dict[str, Any]:
    if mode.startswith("npugraph"):
        os.environ["NPUGRAPH_ENABLE"] = "1"
    if mode == UPDATE_FREE:
        os.environ["NPUGRAPH_UPDATE_FREE"] = "1"
    import sglang

    kwargs: dict[str, Any] = {"model_path": str(model), "device": "npu"}
    if mode == "eager":
        kwargs["disable_cuda_graph"] = True
    counts_dir = Path(os.environ["NPUGRAPH_SGLANG_COUNTS"])
    engine = sglang.Engine(**kwargs)
    t0 = time.perf_counter()
    try:
        tokens = asyncio.run(_serve(engine))
    finally:
        seconds = time.perf_counter() - t0
        engine.shutdown()
    (counts,) = engine_counts.read(counts_dir) or [{}]  # the scheduler's (the only process that updates)
    return {
        "mode": mode,
        "model": model.name,
        "tokens": tokens,
        "prompts": prompts(),
        "seconds": seconds,
        "graph_step_seconds": counts.get("graph_step_seconds", []),
        "graph_step_wall_seconds": counts.get("graph_step_wall_seconds", []),
        "graph_step_device_calls": counts.get("graph_step_device_calls", {}),
        "torch_npu_update_seconds": counts.get("torch_npu_update_seconds", []),
        "npugraph_update_seconds": counts.get("npugraph_update_seconds", []),
        "npugraph_steps": counts.get("npugraph_steps", 0),
        "npugraph_update_free_steps": counts.get("npugraph_update_free_steps", 0),
        "torch_npu_update_device_calls": counts.get("torch_npu_update_device_calls", {}),
        "npugraph_update_device_calls": counts.get("npugraph_update_device_calls", {}),
    }


# the Llama's graph modes run three times in turn (the update cost's verdict takes every
# run); CI's check (CHECK_SCOPE=ci) and make compat run them once: their tokens are checked all the same
RUNS = {"full": 3, "ci": 1, "compat": 1}


def update_free_models() -> tuple[str, ...]:
    """The models the update-free mode runs: the Llama at CI's scope and make compat's, both else."""
    return MODELS if check_scope() == "full" else ("llama",)


def generate(out_dir: Path, runs: int = 1) -> None:
    """Each model and mode in its own process, into ``out_dir``: eager once, SGLang's graphs
    and npugraph's once each for Qwen3 and ``runs`` times, in turn, for the Llama (the update
    cost's verdict takes every run)."""
    plan = order(MODELS, MODES[1:], runs, "llama")
    plan += [(arch, UPDATE_FREE, 1) for arch in update_free_models()]
    # One at a time, unlike vLLM's untimed runs: an SGLang engine keeps both cores busy (its
    # scheduler, tokenizer and detokenizer processes), and two side by side took about 100 s
    # each where one alone takes about 45 (2026-12-06)
    clear_results(out_dir)
    for arch in MODELS:
        write_model(out_dir / arch, arch)
    for arch, mode, run in plan:
        out = result_path(out_dir, arch, mode, run)
        counts = counts_folder(out)
        env = {**os.environ, "NPUGRAPH_SIM_TORCH_NPU": "1", "NPUGRAPH_SGLANG_COUNTS": str(counts)}
        args = [sys.executable, __file__, str(out_dir / arch), mode, str(out)]
        run_logged(args, out, env, f"{arch} {mode} (run {run})")


def main(argv: list[str]) -> int:
    if len(argv) == 4:
        model, mode, out = Path(argv[1]), argv[2], Path(argv[3])
        if mode not in (*MODES, UPDATE_FREE):
            print(f"generate.py: MODE must be one of {', '.join(MODES)}, {UPDATE_FREE}, not {mode!r}", file=sys.stderr)
            return 2
        out.write_text(json.dumps(run(model, mode)))
        return 0
    if len(argv) in (2, 3):
        generate(Path(argv[1]), int(argv[2]) if len(argv) == 3 else RUNS[check_scope()])
        return 0
    print(__doc__.splitlines()[2].strip() + "\n" + __doc__.splitlines()[3].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
