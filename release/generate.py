"""A real generation on vllm-ascend's platform, on npugraph's simulator (release/run.sh).

    generate.py MODEL_DIR MODE OUT_JSON        MODE: eager | aclgraph | npugraph
    generate.py OUT_DIR [RUNS]                 each mode in its own process, into OUT_DIR;
                                               the graph modes RUNS times (default 1), in turn

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

Writes the tokens per request, how many engine steps ran, the host seconds of each
per-step graph update by vllm-ascend (``update_full_graph_params``) and by npugraph
(``ReplayUpdater._write``) less the simulated device's time, the device calls those
updates made, and npugraph's capture report.  The comparison (tokens identical across
modes and runs, and Hugging Face's float32 choices within float16's noise) is
release/test_generate.py's; the update-cost row is release/update_cost.py's.  The graph
modes run more than once, alternating, because the update cost's noise between runs is
wider than within one (docs/vllm-ascend-release.md).

vllm-ascend's graph-fusion passes and its ``npugraph_ex`` backend are turned off in the
graph modes: they compile with torchair, Ascend's graph compiler, which is not simulated.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import tiny_model  # this folder's
from runs import clear_results, run_logged  # this folder's
from timing import timed  # this folder's

MODES = ("eager", "aclgraph", "npugraph")
CAPTURE_SIZES = [1, 2, 4, 8]
PA_SIZES = [1, 2]
MAX_TOKENS = 48
# (arrives at engine step, prompt length, new tokens): arrivals while others decode, and
# different lengths, so requests finish at different steps and the batch grows and shrinks
REQUESTS = [(0, 5, 40), (0, 12, 24), (0, 19, 44), (3, 7, 36), (6, 26, 30), (9, 9, 40), (9, 33, 20), (14, 4, 34)]
VOCAB = 1024
_FUSION = ("enable_npugraph_ex", "fuse_norm_quant", "fuse_qknorm_rope", "fuse_allreduce_rms", "fuse_muls_add")


def write_model(path: Path) -> None:
    """A tiny Llama (release/tiny_model.py), float16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny_model.write(path, LlamaConfig, LlamaForCausalLM, torch.float16, VOCAB)


def prompts() -> list[list[int]]:
    return [
        [(7 * i + 13 * j + 3) % (VOCAB - 3) + 3 for j in range(length)] for i, (_, length, _) in enumerate(REQUESTS)
    ]


def _time_vllm_ascend_updates(samples: list[float], calls: collections.Counter[str]) -> None:
    """Time vllm-ascend's per-step graph update, ``update_full_graph_params``, wherever it
    was imported (under npugraph's plugin it is replaced, and never called)."""
    import vllm_ascend.compilation.acl_graph as acl

    original = acl.update_full_graph_params
    wrapped = timed(acl, "update_full_graph_params", samples, calls)
    for module in list(sys.modules.values()):
        if (
            getattr(module, "__name__", "").startswith("vllm_ascend")
            and vars(module).get("update_full_graph_params") is original
        ):
            module.update_full_graph_params = wrapped


def _time_npugraph(update_samples: list[float], calls: collections.Counter[str], runtimes: list[Any]) -> None:
    """Time npugraph's per-step update (``ReplayUpdater._write``: the lengths and block
    tables into the graph, events included) and note the runtimes that stepped."""
    from npugraph.replay.updater import ReplayUpdater
    from npugraph.runtime import Runtime

    ReplayUpdater._write = timed(ReplayUpdater, "_write", update_samples, calls)  # type: ignore[method-assign]
    step = Runtime.step

    def noted(self: Runtime, *args: Any, **kwargs: Any) -> Any:
        if self not in runtimes:
            runtimes.append(self)
        return step(self, *args, **kwargs)

    Runtime.step = noted  # type: ignore[method-assign]


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
    ascend_updates: list[float] = []
    npugraph_updates: list[float] = []
    runtimes: list[Any] = []
    ascend_calls: collections.Counter[str] = collections.Counter()
    npugraph_calls: collections.Counter[str] = collections.Counter()
    _time_vllm_ascend_updates(ascend_updates, ascend_calls)
    _time_npugraph(npugraph_updates, npugraph_calls, runtimes)
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
    return {
        "mode": mode,
        "tokens": [tokens[str(i)] for i in range(len(REQUESTS))],
        "prompts": prompts(),
        "engine_steps": steps,
        "seconds": seconds,
        "vllm_ascend_update_seconds": ascend_updates,
        "npugraph_update_seconds": npugraph_updates,
        "vllm_ascend_update_device_calls": dict(ascend_calls),
        "npugraph_update_device_calls": dict(npugraph_calls),
        "npugraph_capture_report": [rt.capture_report() for rt in runtimes],
    }


def result_path(out_dir: Path, mode: str, run: int = 1) -> Path:
    """Where run ``run`` (from 1) of ``mode`` writes its result: ``aclgraph.json``,
    ``aclgraph.run2.json``, ..."""
    return out_dir / (f"{mode}.json" if run == 1 else f"{mode}.run{run}.json")


def results(out_dir: Path, mode: str) -> list[Path]:
    """Every run's result of ``mode`` in ``out_dir``, in run order."""
    found = []
    while (path := result_path(out_dir, mode, len(found) + 1)).is_file():
        found.append(path)
    return found


def generate(out_dir: Path, runs: int = 1) -> None:
    """Run release/generate.py for each mode, each in its own process, into ``out_dir``:
    eager once, then the two graph modes ``runs`` times, in turn (so that a drift of the
    machine over the minutes falls on both alike)."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, not {runs}")
    env = {
        **os.environ,
        "NPUGRAPH_SIM_TORCH_NPU": "1",
        "NPUGRAPH_SIM_MEMORY_GB": "4",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # torch 2.14's AOT-autograd cache expects inductor's output; vllm-ascend's backend
        # (written for torch 2.10) returns an FX module: off, as torch 2.10 has it for it
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        "VLLM_CACHE_ROOT": str(out_dir / "vllm-cache"),
    }
    # torch reads CI as "torch's own CI" and turns its deprecation warnings into errors there:
    # vllm-ascend 0.23.0.post1's maybe_pad_and_reduce returns its input at TP 1, which torch
    # 2.14 warns about on a user's host and refuses under CI=1.  Run as users run.
    env.pop("CI", None)
    clear_results(out_dir)
    order = [("eager", 1)] + [(mode, run) for run in range(1, runs + 1) for mode in MODES[1:]]
    for mode, run in order:
        out = result_path(out_dir, mode, run)
        run_logged([sys.executable, __file__, str(out_dir / "model"), mode, str(out)], out, env, f"{mode} (run {run})")


def main(argv: list[str]) -> int:
    if len(argv) == 2 or (len(argv) == 3 and argv[2].isdigit() and int(argv[2]) >= 1):
        generate(Path(argv[1]), int(argv[2]) if len(argv) == 3 else 1)
        return 0
    if len(argv) != 4 or argv[2] not in MODES:
        print("usage:\n" + "\n".join(__doc__.splitlines()[2:5]), file=sys.stderr)
        return 2
    model = Path(argv[1])
    write_model(model)
    result = run(model, argv[2])
    Path(argv[3]).write_text(json.dumps(result, indent=1))
    print(f"{argv[2]}: {result['engine_steps']} engine steps in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
