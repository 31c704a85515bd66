"""A real generation on vllm-ascend's platform, on npugraph's simulator (release/run.sh).

    generate.py MODEL_DIR MODE OUT_JSON        MODE: eager | aclgraph | npugraph | vllm-default |
                                               vllm-default-npugraph | aclgraph-v2 | npugraph-v2 |
                                               npugraph-update-free
    generate.py OUT_DIR [RUNS]                 each model and mode in its own process, into
                                               OUT_DIR; the side-by-side's graph modes RUNS
                                               times, in turn (default: 5 for the 32-layer
                                               benchmark, where it runs, else the Llama's once)

``vllm.LLM`` as vllm-ascend's docs start it, with vLLM's default engine (the model in its
own EngineCore process) and vllm-ascend 0.23.0.post1's default configuration (its fusion
passes and its ``npugraph_ex`` backend on), nothing set in the environment but the
simulator as torch_npu.  Tiny checkpoints written by Hugging Face transformers, seeded,
bfloat16, with a word-level tokenizer (release/tiny_model.py): a Llama (head 64), a
Qwen3 (q/k norms, head 128: vllm-ascend fuses its q/k norm and rope into one Triton kernel,
``split_qkv_rmsnorm_rope``) and a DeepSeek-V2 (below).  Prompts as token ids, greedy, requests arriving while others
decode and finishing at different steps: decode batches of 1 to 8 requests, which
vllm-ascend pads to its captured sizes 1, 2, 4 and 8, with PA at sizes 1 and 2
(``pa_shape_list``, vllm-ascend's documented choice) and FIA at 4 and 8.

``ngram`` is the Llama's architecture with speculative decoding in graph mode: vLLM's
n-gram proposer, two draft tokens.  A step runs as a graph only when every request has two
drafts (a uniform batch of 3-token queries: captured at 3, 6, 9, 18 and 24 tokens, FIA); a
random model's greedy text rarely repeats itself, so this checkpoint has a vocabulary of 32
words, where it does: about half its steps are speculative graph steps.

``tp2`` is the Llama at ``tensor_parallel_size=2``: vLLM's engine process and a worker
process per rank, ``hccl`` (the simulator's, over gloo) between them, a collective inside
every captured graph; each rank's worker counts its own updates.

``mla`` is a DeepSeek-V2 (Hugging Face's ``DeepseekV2ForCausalLM``) with multi-head latent
attention at DeepSeek's own sizes (a latent KV of 512, a rope part of 64), every layer dense:
vllm-ascend serves it with its MLA backend (``mla_v1``: the latent cache written by
``npu_kv_rmsnorm_rope_cache``, decode by FIA v2 with rope arguments, captured and updated by
vllm-ascend, or by npugraph's plugin as its ``mla`` declaration).  No PA sizes are set for it:
an MLA layer has no PA.  ``mla-ngram`` is that architecture with the n-gram model's
speculative decoding (its 32-word vocabulary and requests): MLA's speculative decode
(FIA v2 ``TND_NTD``, causal within each request's three query tokens).  ``mla-tp2`` is it
at tensor parallel 2 (each rank 2 of the 4 heads and the whole latent cache).

``mla-mtp`` is a DeepSeek-V3 of that shape with one multi-token-prediction layer (written
beside Hugging Face's file: release/tiny_model.py), served with vLLM's MTP speculative
decoding, one draft token: each decode step replays the target's graph (2-token queries)
and then the draft model's own graph (vllm-ascend's proposer), both updated by vllm-ascend
or both by npugraph (the draft's in its ``draft`` namespace).  A vocabulary of 32 words, so
that the random draft is right often enough for some drafts to be accepted.  ``mla-mtp2``
drafts two tokens (the MTP layer twice, as vLLM does): the draft's graph runs the layer once
per draft token, and vllm-ascend serves the second as one query token per row (3-token
queries at capture), re-tiling its attention at every update.

* ``eager``: ``enforce_eager=True``;
* ``aclgraph``: vllm-ascend's own ACL graph mode (``FULL_DECODE_ONLY``: its
  ``ACLGraphWrapper`` captures, its ``update_full_graph_params`` updates every step);
* ``npugraph``: the same with npugraph's plugin (``NPUGRAPH_ENABLE=1``): npugraph captures,
  updates and replays.

The engine process (release/ascend_site.py, with ``NPUGRAPH_VLLM_COUNTS``) times each
per-step graph update, vllm-ascend's (``update_full_graph_params``) and npugraph's
(``ReplayUpdater._write``), less the simulated device's time, counts the device calls they
made and npugraph's steps, and keeps npugraph's capture report.  The comparison (tokens
identical across modes and runs, and Hugging Face's float32 choices) is
release/test_generate.py's; the update-cost row is release/update_cost.py's, from the
Llama's runs, which run more than once, alternating, because the update cost's noise
between runs is wider than within one (docs/vllm-ascend-release.md).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import engine_counts  # this folder's
import tiny_model  # this folder's
from runs import (  # this folder's
    ascend_source,
    check_scope,
    clear_results,
    counts_folder,
    engine_env,
    order,
    result_path,
    run_logged,
    side_by_side,
    timed,
    two_at_a_time,
)

MODES = ("eager", "aclgraph", "npugraph")
# vLLM's default compilation config (no compilation_config: FULL_AND_PIECEWISE), without and
# with npugraph's plugin: what a user who types nothing more gets (release/test_default_mode.py)
DEFAULT_MODES = ("vllm-default", "vllm-default-npugraph")
# vLLM's model runner v2 (VLLM_USE_V2_MODEL_RUNNER=1; not vllm-ascend 0.30's default): its
# graph manager captures FULL graphs itself, vllm-ascend's ModelAclGraphManager updates them,
# and under the plugin npugraph's (npugraph/integrations/vllm/runner_v2.py) (release/test_runner_v2.py)
V2_MODES = ("aclgraph-v2", "npugraph-v2")
# npugraph's plugin with NPUGRAPH_UPDATE_FREE=1: each FULL size also captured update-free (its
# lengths frozen to widths 128 and 256, masked on the device) (release/test_update_free.py)
UPDATE_FREE_MODES = ("npugraph-update-free",)


def graph_mode(mode: str) -> bool:
    """Whether ``mode`` captures FULL_DECODE_ONLY graphs (vllm-ascend's or npugraph's, either runner)."""
    return mode in MODES[1:] + V2_MODES + UPDATE_FREE_MODES


@attrs.frozen(kw_only=True)
class Model:
    """One checkpoint the generation serves, and how vLLM serves it."""

    arch: str  # tiny_model.checkpoint's
    head_dim: int
    vocab: int = 1024
    speculative: dict[str, Any] | None = None  # vLLM's speculative_config
    tensor_parallel: int = 1  # vLLM's tensor_parallel_size: one worker process per rank
    pipeline_parallel: int = 1  # vLLM's pipeline_parallel_size: the layers split into stages
    # vLLM's distributed_executor_backend: its default ("mp": worker processes of the engine's),
    # or "ray": one Ray actor per rank, on a Ray cluster's nodes (release/ray_cluster.py)
    executor: str = "mp"
    # PA at the smallest captured sizes (vllm-ascend's pa_shape_list); an MLA model has no
    # PA (its decode is FIA with rope arguments), and its user sets no PA sizes
    paged_attention: bool = True
    max_num_seqs: int = 8
    # the most tokens a step schedules (vLLM's max_num_batched_tokens; see engine_args)
    max_num_batched_tokens: int = 256
    layers: int = 2  # decoder layers (release/tiny_model.py): one attention task each per graph
    # Hugging Face's float32 forward against the bfloat16 kernels: a token is its choice when
    # within this of its best logit (release/test_generate.py); bfloat16's error grows with depth
    hf_tolerance: float = 0.15
    hf_exact_share: float = 0.9  # and at least this share exactly its argmax (the rest near-ties)


MODELS = {
    "llama": Model(arch="llama", head_dim=64),
    "qwen3": Model(arch="qwen3", head_dim=128),
    "ngram": Model(
        arch="llama",
        head_dim=64,
        vocab=32,
        speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    ),
    "tp2": Model(arch="llama", head_dim=64, tensor_parallel=2),
    "mla": Model(arch="deepseek_v2", head_dim=64, paged_attention=False),
    "mla-tp2": Model(arch="deepseek_v2", head_dim=64, paged_attention=False, tensor_parallel=2),
    "mla-ngram": Model(
        arch="deepseek_v2",
        head_dim=64,
        vocab=32,
        speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        paged_attention=False,
    ),
    # DeepSeek-V3's MLA with its multi-token-prediction layer as the draft: vLLM's MTP
    # speculative decoding, one draft token a step (the one MTP layer)
    "mla-mtp": Model(
        arch="deepseek_v3_mtp",
        head_dim=64,
        vocab=32,  # a random draft's guess is then right often enough that some drafts are accepted
        speculative={"method": "mtp", "num_speculative_tokens": 1},
        paged_attention=False,
    ),
}
# the side-by-side update benchmark (release/update_cost.py): the Llama's architecture 32
# layers deep at its tiny width, so that the per-layer update dominates a decode step, served
# at decode batches of 1 (PA), then 4 and 16 (FIA) for about twenty steps each
# Its random logits are less decisive after 32 bfloat16 layers than after two: in every mode
# alike (their tokens identical), a token came 0.16 below float32's best and 89% were its
# argmax (2026-12-05); with bfloat16 casts in Triton kernels rounded to nearest even, as a
# device rounds them (they were truncated), 0.283 and 90.5% (2026-12-06, CI's scope, 0.30.0rc2).
# Hugging Face's own bfloat16 forward, teacher-forced on those tokens, chose up to 0.267 below
# float32's best and 87.6% exactly: so within 0.35, and 85% exactly, for it
MODELS["deep"] = Model(
    arch="llama_deep",
    head_dim=64,
    max_num_seqs=16,
    # its most in one step is the twelve prompts of step 40 (114 tokens) beside four decodes;
    # 128, not 256, halves its profile run (32 layers of rope in Triton's interpreter: 2 minutes)
    max_num_batched_tokens=128,
    layers=tiny_model.DEEP_LAYERS,
    hf_tolerance=0.35,
    hf_exact_share=0.85,
)
# MTP with two draft tokens (the one MTP layer run twice, as vLLM does): the draft's graph
# runs its layer once per draft token, the later step re-tiled by vllm-ascend to one query
# token per row at every update
MODELS["mla-mtp2"] = attrs.evolve(MODELS["mla-mtp"], speculative={"method": "mtp", "num_speculative_tokens": 2})
# the tensor-parallel Llama on vLLM's Ray executor, one rank per node of a two-node Ray cluster
# (release/test_ray.py starts it on 127.0.0.1), and at pipeline parallel 2 there
MODELS["tp2-ray"] = attrs.evolve(MODELS["tp2"], executor="ray")
MODELS["pp2-ray"] = attrs.evolve(MODELS["tp2"], tensor_parallel=1, pipeline_parallel=2, executor="ray")
# CI's check (CHECK_SCOPE=ci) runs each kind once: PA and FIA, n-gram speculation, tensor
# parallel 2, MLA, MTP, and where the release ships vllm-ascend's UpdatableGraph (0.30 on) the
# 32-layer side-by-side against it, one run of each graph mode; the full check adds the Qwen3
# (head 128, vllm-ascend's fused q/k-norm and rope Triton kernel: its engines are the slowest,
# and SGLang's check serves a Qwen3 in CI), MLA's combinations (n-gram, tensor parallel 2, two
# MTP drafts), the 32-layer benchmark on every release, and its repeats
CI_MODELS = ("llama", "ngram", "tp2", "mla", "mla-mtp")
# make compat's, on every release: PA's and FIA's head sizes, each a dense decoder users serve
COMPAT_MODELS = ("llama", "qwen3")


def ships_updatable_graph() -> bool:
    """Whether this environment's vllm-ascend ships ``compilation/updatable_graph.py`` (0.29 on)."""
    return ascend_source("compilation/updatable_graph.py") is not None


# The side-by-side's runs (release/update_cost.py's verdict takes every one): the 32-layer
# benchmark's graph modes, in turn, this many times at the full scope (once at CI's, where it
# runs: an engine of it takes about two and a half minutes); the Llama's once where it does not
SIDE_BY_SIDE_RUNS = 5
# ... and then once more each with FIA slowed on the simulated device by this much per execution
# (32 a step at batches 4 and 16: 640 ms, about the replay's own device time on the simulator,
# whose rope runs in Triton's interpreter, and some 50 times the update's host time): the
# update's host figure (wall less device) must stay within the unslowed runs' range while its
# wall grows (release/update_cost.py); at the full scope only
SLOWED = "slow-kernel=npu_fused_infer_attention_score:20"


def checked() -> dict[str, Model]:
    """The models this check generates: every one, or at ``CHECK_SCOPE=ci`` CI_MODELS and the
    32-layer benchmark where the release ships the UpdatableGraph it is measured against, or at
    ``CHECK_SCOPE=compat`` COMPAT_MODELS."""
    # the Ray executor's models need the cluster release/test_ray.py starts: that check runs them
    scope = check_scope()
    chosen = COMPAT_MODELS if scope == "compat" else CI_MODELS + (("deep",) if ships_updatable_graph() else ())
    return {name: m for name, m in MODELS.items() if m.executor == "mp" and (scope == "full" or name in chosen)}


def eager_models() -> tuple[str, ...]:
    """The models this check also runs eagerly: every one, but at CI's scope the 32-layer
    benchmark (its eager engine takes about four minutes beside another; its graph modes'
    tokens are compared with each other and with Hugging Face's float32 forward)."""
    return tuple(m for m in checked() if not (m == "deep" and check_scope() == "ci"))


PA_SIZES = [1, 2]
# per model, (arrives at engine step, prompt length, new tokens): arrivals while others
# decode, and different lengths, so requests finish at different steps and the batch grows
# and shrinks (1 to 8 for the Llama, 1 to 6 for the Qwen3: padded to 8, FIA).  The Qwen3's
# graph steps run vllm-ascend's fused q/k-norm + rope Triton kernel in Triton's interpreter,
# about a second a layer: it serves fewer tokens.
REQUESTS = {
    "llama": [(0, 5, 40), (0, 12, 24), (0, 19, 44), (3, 7, 36), (6, 26, 30), (9, 9, 40), (9, 33, 20), (14, 4, 34)],
    "qwen3": [(0, 5, 20), (0, 12, 16), (0, 19, 22), (3, 7, 16), (6, 26, 14), (9, 9, 12)],
    # four requests decoding together, so that most steps have two drafts for every one
    "ngram": [(0, 20, 30), (0, 23, 30), (1, 21, 30), (2, 26, 30)],
    # the Llama's weights over two ranks (2 of its 4 query heads and 1 of its 2 KV heads
    # each), fewer tokens: batches of 1 to 6, padded to 1, 2, 4 and 8 as the Llama's
    "tp2": [(0, 5, 16), (0, 12, 12), (0, 19, 20), (3, 7, 14), (6, 26, 12), (9, 9, 10)],
    # DeepSeek-V2's MLA: batches of 1 to 6, padded to 1, 2, 4 and 8, all MLA graphs
    "mla": [(0, 5, 16), (0, 12, 12), (0, 19, 20), (3, 7, 14), (6, 26, 12), (9, 9, 10)],
    # MLA at tensor parallel 2: 2 of the 4 heads on each rank, the latent cache whole on both
    "mla-tp2": [(0, 5, 16), (0, 12, 12), (0, 19, 20), (3, 7, 14), (6, 26, 12), (9, 9, 10)],
    # MLA with the n-gram model's speculative decoding and requests (its vocabulary of 32)
    "mla-ngram": [(0, 20, 30), (0, 23, 30), (1, 21, 30), (2, 26, 30)],
    # MLA with MTP: the draft model's graph after the target's at every decode step
    "mla-mtp": [(0, 5, 16), (0, 12, 12), (0, 19, 20), (3, 7, 14), (6, 26, 12), (9, 9, 10)],
}
REQUESTS["mla-mtp2"] = REQUESTS["mla-mtp"]
REQUESTS["tp2-ray"] = REQUESTS["pp2-ray"] = REQUESTS["tp2"]
# one request alone, three more from step 20, twelve more from step 40: decode batches of 1,
# 4 and 16 (each a captured size), about twenty steps each, all ending together
REQUESTS["deep"] = [(0, 6, 62), *[(20, 5 + i, 42) for i in range(3)], *[(40, 4 + i, 22) for i in range(12)]]
if check_scope() == "ci":
    # CI's one run of each graph mode: about ten decode steps at each batch (update_cost.py's
    # breakdown takes five), half the full scope's (an engine of it: about 75 s less)
    REQUESTS["deep"] = [(0, 6, 32), *[(10, 5 + i, 22) for i in range(3)], *[(20, 4 + i, 12) for i in range(12)]]


def write_model(path: Path) -> None:
    """The tiny checkpoint named by ``path``'s folder name (release/tiny_model.py)."""
    model = MODELS[path.name]
    tiny_model.checkpoint(path, model.arch, model.vocab, head_dim=model.head_dim)


def prompts(model: str) -> list[list[int]]:
    vocab = MODELS[model].vocab
    return [
        [(7 * i + 13 * j + 3) % (vocab - 3) + 3 for j in range(length)]
        for i, (_, length, _) in enumerate(REQUESTS[model])
    ]


def engine_args(model: Path, mode: str) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for ``model`` in ``mode``: what a user passes, nothing else."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 256,
        "block_size": 128,
        "max_num_seqs": MODELS[model.name].max_num_seqs,
        # the most tokens a step schedules: vLLM's default (2,048) sizes the profile run at
        # start-up, whose rope runs as vllm-ascend's Triton kernel in Triton's interpreter
        # here (a minute and more per engine); these requests never schedule 100 in one step
        # (the 32-layer benchmark's 118: its own figure)
        "max_num_batched_tokens": MODELS[model.name].max_num_batched_tokens,
        "seed": 0,
    }
    if mode == "eager":
        kwargs["enforce_eager"] = True
    elif mode not in DEFAULT_MODES:
        kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    served = MODELS[model.name]
    if graph_mode(mode) and served.paged_attention:
        kwargs["additional_config"] = {"pa_shape_list": PA_SIZES}
    if served.speculative is not None:
        kwargs["speculative_config"] = dict(served.speculative)
    if served.tensor_parallel > 1:
        kwargs["tensor_parallel_size"] = served.tensor_parallel
    if served.pipeline_parallel > 1:
        kwargs["pipeline_parallel_size"] = served.pipeline_parallel
    if served.executor != "mp":
        kwargs["distributed_executor_backend"] = served.executor
    return kwargs


def serve(engine: Any, model: str, tokens: dict[str, list[int]]) -> int:
    """Serve ``model``'s :data:`REQUESTS` on vLLM's ``engine``, greedy, each arriving at its engine step;
    ``tokens`` gets each request's tokens so far, by request id, after every step (so a
    caller still has them if a step raises).  Returns the engine steps taken."""
    from vllm import SamplingParams

    pending = list(enumerate(zip(REQUESTS[model], prompts(model))))
    steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0][0] <= steps:
            i, ((_, _, new), ids) = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return steps


def run(model: Path, mode: str) -> dict[str, Any]:
    if "npugraph" in mode:
        os.environ["NPUGRAPH_ENABLE"] = "1"
    if mode in V2_MODES:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if mode in UPDATE_FREE_MODES:
        os.environ["NPUGRAPH_UPDATE_FREE"] = "1"
    from vllm import LLM

    kwargs = engine_args(model, mode)
    counts_dir = Path(os.environ["NPUGRAPH_VLLM_COUNTS"])
    llm = LLM(**kwargs)
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    steps = serve(llm.llm_engine, model.name, tokens)
    seconds = time.perf_counter() - t0
    # each model process's: the engine's, or each rank's worker under tensor parallelism
    served = MODELS[model.name]
    ranks = engine_counts.read(counts_dir, served.tensor_parallel * served.pipeline_parallel)
    counts = ranks[0] if ranks else {}
    return {
        "mode": mode,
        "model": model.name,
        "tokens": [tokens[str(i)] for i in range(len(REQUESTS[model.name]))],
        "prompts": prompts(model.name),
        "engine_steps": steps,
        "seconds": seconds,
        "vllm_ascend_update_seconds": counts.get("vllm_ascend_update_seconds", []),
        "npugraph_update_seconds": counts.get("npugraph_update_seconds", []),
        # the same calls' whole wall times, the simulated device's time in them (update_cost.py: the slowed kernel)
        "vllm_ascend_update_walls": counts.get("vllm_ascend_update_walls", []),
        "npugraph_update_walls": counts.get("npugraph_update_walls", []),
        # the simulator's own host seconds in each (npusim.own_seconds): update_cost.py's framework-only ratio
        "vllm_ascend_update_own": counts.get("vllm_ascend_update_own", []),
        "npugraph_update_own": counts.get("npugraph_update_own", []),
        # each update's step size (padded tokens), beside its seconds: the per-batch breakdown
        "vllm_ascend_update_tokens": counts.get("vllm_ascend_update_tokens", []),
        "npugraph_update_tokens": counts.get("npugraph_update_tokens", []),
        "vllm_ascend_update_device_calls": counts.get("vllm_ascend_update_device_calls", {}),
        "npugraph_update_device_calls": counts.get("npugraph_update_device_calls", {}),
        "npugraph_steps": counts.get("npugraph_steps", 0),
        "npugraph_update_free_steps": counts.get("npugraph_update_free_steps", 0),
        "graph_steps": counts.get("graph_steps", 0),
        "graph_steps_device_at": counts.get("graph_steps_device_at", []),
        # a draft model's (MTP) graph steps: its own graph, after the target's
        "draft_graph_steps": counts.get("draft_graph_steps", 0),
        "npugraph_capture_report": counts.get("npugraph_capture_report", []),
        # per model process (rank): its graph steps, and the steps npugraph updated there
        "ranks": [
            {k: r.get(k, 0) for k in ("graph_steps", "draft_graph_steps", "npugraph_steps")}
            | {"ray_node": r.get("ray_node", "")}
            for r in ranks
        ],
    }


def generate(out_dir: Path, runs: int | None = None) -> None:
    """Each model and mode in its own process, into ``out_dir``: eager once (each model of
    :func:`eager_models`), vllm-ascend's
    graphs and npugraph's once each for the other models and ``runs`` times, in turn, for
    the side-by-side's model (so that a drift of the machine over the minutes falls on both
    alike): the 32-layer benchmark's, ``SIDE_BY_SIDE_RUNS`` times by default at the full
    scope and once at CI's, where it runs, else the Llama's, once.  The untimed runs go two
    at a time; the timed ones (release/runs.py's ``timed``) alone, last; at the full scope the
    32-layer benchmark's graph modes then once more each with the ``SLOWED`` kernel
    (``deep.MODE.slowed.json``)."""
    repeated = "deep" if "deep" in checked() else "llama"
    full = check_scope() == "full"
    if runs is None:
        runs = SIDE_BY_SIDE_RUNS if repeated == "deep" and full else 1
    plan = order(tuple(checked()), MODES[1:], runs, repeated, eager=eager_models())
    shared, alone = side_by_side(plan, timed(checked()))
    clear_results(out_dir)
    for arch in checked():
        write_model(out_dir / arch)

    def one(arch: str, mode: str, run: int, slowed: bool = False) -> None:
        if slowed:
            run_one(out_dir, arch, mode, slowed_path(out_dir, arch, mode), "slowed", NPUGRAPH_SIM_FAULT=SLOWED)
        else:
            run_one(out_dir, arch, mode, result_path(out_dir, arch, mode, run), f"run {run}")

    # the untimed runs two at a time; the timed ones then alone (release/runs.py)
    two_at_a_time(functools.partial(one, *r) for r in shared)
    for r in alone:
        one(*r)
    if repeated == "deep" and full:
        for mode in MODES[1:]:
            one("deep", mode, 1, slowed=True)


def slowed_path(out_dir: Path, model: str, mode: str) -> Path:
    """Where ``model``'s run in graph ``mode`` with the ``SLOWED`` kernel writes its result."""
    return out_dir / f"{model}.{mode}.slowed.json"


def run_modes(out_dir: Path, model: str, modes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``model`` in each of ``modes``, each in its own process as :func:`generate` runs them,
    two at a time, into ``out_dir`` (eager's result kept where release/run.sh's generation
    made it): each mode's result.

    None of these runs is timed. Each mode compiles into a compile cache of its own: two
    engines compiling one graph into one cache at once could read each other's half-written
    files."""
    write_model(out_dir / model)
    todo = [m for m in modes if m != "eager" or not result_path(out_dir, model, m).is_file()]
    two_at_a_time(
        functools.partial(run_one, out_dir, model, m, result_path(out_dir, model, m), "run 1", f"vllm-cache.{m}")
        for m in todo
    )
    return {mode: json.loads(result_path(out_dir, model, mode).read_text()) for mode in modes}


def run_one(out_dir: Path, model: str, mode: str, out: Path, which: str, cache: str = "vllm-cache", **env: str) -> None:
    """``model`` (its checkpoint in ``out_dir``) in ``mode``, in a process of its own, its result
    into ``out`` and its output beside it, its compile cache ``out_dir / cache``, ``env`` added
    to its environment; logged as ``MODEL MODE (which)``."""
    args = [sys.executable, __file__, str(out_dir / model), mode, str(out)]
    run_logged(args, out, process_env(out_dir, out, cache) | env, f"{model} {mode} ({which})")


def process_env(out_dir: Path, out: Path, cache: str = "vllm-cache") -> dict[str, str]:
    """The environment of one run's process (``generate.py MODEL_DIR MODE OUT``): the
    simulator as torch_npu, offline, its compile cache ``out_dir / cache``, and where its
    engine process writes its counts."""
    return engine_env(out_dir / cache, str(counts_folder(out)))


def main(argv: list[str]) -> int:
    if len(argv) == 2 or (len(argv) == 3 and argv[2].isdigit() and int(argv[2]) >= 1):
        generate(Path(argv[1]), int(argv[2]) if len(argv) == 3 else None)
        return 0
    if (
        len(argv) != 4
        or argv[2] not in MODES + DEFAULT_MODES + V2_MODES + UPDATE_FREE_MODES
        or Path(argv[1]).name not in MODELS
    ):
        print("usage:\n" + "\n".join(__doc__.splitlines()[2:7]), file=sys.stderr)
        return 2
    model = Path(argv[1])
    write_model(model)
    result = run(model, argv[2])
    Path(argv[3]).write_text(json.dumps(result, indent=1))
    print(f"{model.name} {argv[2]}: {result['engine_steps']} engine steps in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
