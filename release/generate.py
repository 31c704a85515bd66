"""A real generation on vllm-ascend's platform, on npugraph's simulator (release/run.sh).

    generate.py MODEL_DIR MODE OUT_JSON        MODE: eager | aclgraph | npugraph

``vllm.LLM`` on a tiny Llama checkpoint (written by :func:`write_model` with Hugging Face
transformers, seeded) with token-id prompts, greedy, requests arriving while others decode
and finishing at different steps: decode batches of 1 to 8 requests, which vllm-ascend
pads to the captured sizes 1, 2, 4 and 8, with PA at sizes 1 and 2 (``pa_shape_list``) and
FIA at 4 and 8.

* ``eager``: ``enforce_eager=True``;
* ``aclgraph``: vllm-ascend's own ACL graph mode (``FULL_DECODE_ONLY``: its
  ``ACLGraphWrapper`` captures, its ``update_full_graph_params`` updates every step);
* ``npugraph``: the same with npugraph's plugin (``NPUGRAPH_ENABLE=1``): npugraph captures,
  updates and replays.

Writes the tokens per request, how many decode steps ran, how many times vllm-ascend's
own per-step update ran, how many steps npugraph's runtime ran (with the host seconds
they took), and npugraph's capture report.  The comparison (tokens identical across
modes, and equal to Hugging Face's float32 forward within float16's noise) is
tests/test_release_generate.py's.

vllm-ascend's graph-fusion passes and its ``npugraph_ex`` backend are turned off in the
graph modes: they compile with torchair, Ascend's graph compiler, which is not simulated.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CAPTURE_SIZES = [1, 2, 4, 8]
PA_SIZES = [1, 2]
MAX_TOKENS = 48
# (arrives at engine step, prompt length, new tokens): arrivals while others decode, and
# different lengths, so requests finish at different steps and the batch grows and shrinks
REQUESTS = [(0, 5, 40), (0, 12, 24), (0, 19, 44), (3, 7, 36), (6, 26, 30), (9, 9, 40), (9, 33, 20), (14, 4, 34)]
VOCAB = 1024
_FUSION = ("enable_npugraph_ex", "fuse_norm_quant", "fuse_qknorm_rope", "fuse_allreduce_rms", "fuse_muls_add")


def write_model(path: Path) -> None:
    """A tiny Llama (2 layers, GQA 4:2, head 64), seeded weights, float16 safetensors."""
    if (path / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.08,  # decisive logits: greedy choices are not near-ties
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(path, safe_serialization=True)


def prompts() -> list[list[int]]:
    return [
        [(7 * i + 13 * j + 3) % (VOCAB - 3) + 3 for j in range(length)] for i, (_, length, _) in enumerate(REQUESTS)
    ]


def _count_vllm_ascend_updates() -> dict[str, int]:
    """Count calls of vllm-ascend's per-step graph update (every module's copy of it)."""
    import vllm_ascend.compilation.acl_graph as acl

    counts = {"calls": 0}
    original = acl.update_full_graph_params

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts["calls"] += 1
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if (
            getattr(module, "__name__", "").startswith("vllm_ascend")
            and vars(module).get("update_full_graph_params") is original
        ):
            module.update_full_graph_params = counted
    return counts


def _time_npugraph_steps() -> dict[str, Any]:
    """Count npugraph's steps and their host time (``Runtime.step``: update, replay, events)."""
    from npugraph.runtime import Runtime

    stats: dict[str, Any] = {"steps": 0, "seconds": 0.0, "runtimes": []}
    original = Runtime.step

    def step(self: Runtime, *args: Any, **kwargs: Any) -> Any:
        if self not in stats["runtimes"]:
            stats["runtimes"].append(self)
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            stats["seconds"] += time.perf_counter() - t0
            stats["steps"] += 1

    Runtime.step = step  # type: ignore[method-assign]
    return stats


def run(model: Path, mode: str) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the counters see the worker
    if mode == "npugraph":
        os.environ["NPUGRAPH_ENABLE"] = "1"
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "dtype": "float16",
        "max_model_len": 256,
        "block_size": 128,
        "max_num_seqs": 8,
        "num_gpu_blocks_override": 32,
        "gpu_memory_utilization": 0.5,
        "seed": 0,
    }
    if mode == "eager":
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": CAPTURE_SIZES}
        kwargs["additional_config"] = {
            "pa_shape_list": PA_SIZES,
            "ascend_compilation_config": dict.fromkeys(_FUSION, False),
        }
    updates = _count_vllm_ascend_updates()
    npugraph_steps = _time_npugraph_steps()
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(zip(REQUESTS, prompts())))
    steps = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0][0] <= steps:
            i, ((_, _, new), ids) = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    seconds = time.perf_counter() - t0
    report = [rt.capture_report() for rt in npugraph_steps["runtimes"]]
    return {
        "mode": mode,
        "tokens": [tokens[str(i)] for i in range(len(REQUESTS))],
        "prompts": prompts(),
        "engine_steps": steps,
        "seconds": seconds,
        "vllm_ascend_update_calls": updates["calls"],
        "npugraph_steps": npugraph_steps["steps"],
        "npugraph_step_seconds": npugraph_steps["seconds"],
        "npugraph_capture_report": report,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[2] not in ("eager", "aclgraph", "npugraph"):
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    model = Path(argv[1])
    write_model(model)
    result = run(model, argv[2])
    Path(argv[3]).write_text(json.dumps(result, indent=1))
    print(f"{argv[2]}: {result['engine_steps']} engine steps in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
