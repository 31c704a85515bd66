"""vllm-ascend's KV-cache budget, made to leave out the graphs' memory: a profiling capture
before the KV cache exists measures it (:func:`estimate_graph_memory`, into a
:class:`GraphMemoryEstimate`), and the worker's ``determine_available_memory`` subtracts it."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from npugraph.integrations.common import unwrap_method
from npugraph.integrations.vllm.runner_v2 import CUDAGRAPH_UTILS, PROFILED_FULL_TOKENS
from npugraph.integrations.vllm.wrapper import runtime_for

__all__ = ["GraphMemoryEstimate", "estimate_graph_memory", "kv_budget_missing", "patch_kv_budget", "unpatch_kv_budget"]

logger = logging.getLogger("vllm.npugraph")

# vLLM's model runner, whose capture_model() captures every size (vllm-ascend's calls it too)
RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
# vllm-ascend's worker, whose determine_available_memory() sizes the KV cache, and its runner
_WORKER = ("vllm_ascend.worker.worker", "NPUWorker")
_ASCEND_RUNNER = "vllm_ascend.worker.model_runner_v1"
_ACL_GRAPH = "vllm_ascend.compilation.acl_graph"
_GRAPH_PARAMS = ("_graph_params", "_draft_graph_params", "_draft_graph_prefill_params")
ESTIMATE_ATTR = "_npugraph_graph_memory_estimate"
MIB = float(1 << 20)


@attrs.frozen(kw_only=True)
class GraphMemoryEstimate:
    """What a profiling capture measured, before the KV cache, of the graphs' device memory.

    vLLM's formula (``GPUModelRunner.profile_cudagraph_memory``) with npugraph's measure:
    the largest size's capture (``first``: the shared pool's memory, workspace included)
    plus, for each further size, what the second-largest took (``per_graph``, at least
    1 MiB: per-graph memory the device keeps).  npugraph measures each capture alone;
    vLLM's own figure (``vllm``) also counts the warm-up's eager memory, which the KV
    budget already reserves as the profile run's peak.
    """

    bytes: int
    first: int
    per_graph: int
    sizes: int
    vllm: int

    @classmethod
    def of(cls, sizes: list[list[int]], took: Mapping[int, int], vllm: int) -> GraphMemoryEstimate:
        """The estimate for ``sizes`` (per graph mode, largest first, as vLLM captures them),
        from ``took``: per token count, what the profiling captures of that size took."""
        first = per_graph = count = 0
        for mode in sizes:
            if not mode:
                continue
            sample = [took.get(t, 0) for t in mode[:2]]
            first = max(first, sample[0])  # the modes share one pool: the largest capture takes it
            per_graph = max(per_graph, sample[1] if len(sample) > 1 else 0, 1 << 20)
            count += len(mode)
        total = first + per_graph * max(0, count - 1)
        return cls(bytes=total, first=first, per_graph=per_graph, sizes=count, vllm=vllm)

    def say(self) -> str:
        return (
            f"{self.bytes / MIB:.2f} MiB for {self.sizes} sizes (the largest size's capture took "
            f"{self.first / MIB:.2f} MiB, each further size {self.per_graph / MIB:.2f} MiB; vLLM's figure, "
            f"warm-up included: {self.vllm / MIB:.2f} MiB)"
        )


def _take_capture_context(module: Any) -> None:
    """vLLM 0.30's profiler calls ``graph_capture(device=, graph_capture_context=)``, the
    context ``None`` off ROCm; the ``graph_capture`` vllm-ascend 0.30 puts in its place takes
    the device only.  The same capture, taking (and needing) no context of its caller's."""
    capture = module.graph_capture
    if "graph_capture_context" in inspect.signature(capture).parameters:
        return  # vllm-ascend 0.23's vLLM passes none; a later vllm-ascend may take it

    def graph_capture(device: Any, graph_capture_context: Any = None) -> Any:
        if graph_capture_context is not None:
            raise RuntimeError("npugraph: vllm-ascend's graph_capture takes no capture context (ROCm's)")
        return capture(device)

    module.graph_capture = graph_capture


@contextlib.contextmanager
def _profiling(runner: Any) -> Iterator[Any]:
    """vLLM's profiling capture, made to run on vllm-ascend's runner; yields npugraph's runtime.

    vllm-ascend's runner takes no ``is_profiling`` (its PR #14293 adds it) and builds the
    minimal cache as any other; it sets its graph parameters once per process, at the KV
    cache's initialisation, so the real one must find them unset again.  After it the
    profiling graphs are freed (vLLM frees only its own), so the real capture captures every
    size again, into the same pool."""
    config = runner.vllm_config
    runtime = runtime_for(config)
    initialize = runner.initialize_kv_cache

    def initialize_kv_cache(kv_cache_config: Any, is_profiling: bool = False) -> None:
        initialize(kv_cache_config)

    params = sys.modules.get(_ACL_GRAPH)
    saved = {name: getattr(params, name) for name in _GRAPH_PARAMS if hasattr(params, name)}
    runner.initialize_kv_cache = initialize_kv_cache
    try:
        yield runtime
    finally:
        del runner.initialize_kv_cache
        for name, value in saved.items():
            setattr(params, name, value)
        for layer in config.compilation_config.static_forward_context.values():
            # vllm-ascend's attention keeps the KV cache its first forward saw (set to None in
            # its __init__): the minimal profiling cache, which vLLM's clean-up does not reach
            impl = getattr(layer, "impl", None)
            for name in ("key_cache", "value_cache"):
                if getattr(impl, name, None) is not None:
                    setattr(impl, name, None)
        runtime.reset()  # the profiling graphs: each size is captured again
        gc.collect()
        torch.npu.empty_cache()  # type: ignore[attr-defined]


def _took(runtime: Any) -> dict[int, int]:
    """Per token count, what the profiling captures of that size took (every namespace)."""
    took: dict[int, int] = {}
    for entry in runtime.entries():
        took[entry.tokens] = took.get(entry.tokens, 0) + entry.memory_bytes
    return took


def estimate_graph_memory(runner: Any) -> GraphMemoryEstimate:
    """Measure the device memory the runner's graphs will hold, before the KV cache exists.

    vLLM's own profiling capture (``GPUModelRunner.profile_cudagraph_memory``: the two
    largest sizes of each mode against a minimal KV cache) runs as vllm-ascend runs vLLM's
    capture (its torch.cuda → torch.npu names); npugraph's measure of each capture makes
    the estimate (:class:`GraphMemoryEstimate`).
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    ascend = sys.modules[_ASCEND_RUNNER]
    dispatcher = runner.cudagraph_dispatcher
    get_descs = dispatcher.get_capture_descs
    modes: list[Any] = []

    def get_capture_descs() -> Any:
        modes[:] = get_descs()  # the sizes vLLM will capture, per mode
        return modes

    dispatcher.get_capture_descs = get_capture_descs
    try:
        with _profiling(runner) as runtime:
            module = ascend._get_gpu_model_runner_module_name(runner)
            with ascend._torch_cuda_wrapper(), ascend._replace_gpu_model_runner_function_wrapper(module):
                _take_capture_context(sys.modules[module])
                vllm_bytes = int(GPUModelRunner.profile_cudagraph_memory(runner))
            took = _took(runtime)
        return GraphMemoryEstimate.of([[int(d.num_tokens) for d in descs] for _, descs in modes], took, vllm_bytes)
    finally:
        del dispatcher.get_capture_descs


def estimate_graph_memory_v2(runner: Any) -> GraphMemoryEstimate:
    """:func:`estimate_graph_memory` for vLLM's model runner v2: vLLM's own profile of its graph
    memory (``vllm.v1.worker.gpu.cudagraph_utils.profile_cudagraph_memory``: a minimal KV cache,
    the two largest FULL descriptors captured, here by npugraph's capture) runs, and npugraph's
    measure of those captures, extrapolated to every FULL size by the same formula, makes the
    estimate (vLLM's figure, which also counts the warm-ups' eager memory, is reported)."""
    profile = __import__(CUDAGRAPH_UTILS, fromlist=["_"]).profile_cudagraph_memory
    config = runner.vllm_config
    with _profiling(runner) as runtime:
        vllm_bytes = int(profile(runner))
        took = _took(runtime)
    sizes = list(getattr(config, PROFILED_FULL_TOKENS, None) or sorted(took, reverse=True))
    if hasattr(config, PROFILED_FULL_TOKENS):
        delattr(config, PROFILED_FULL_TOKENS)
    return GraphMemoryEstimate.of([sizes], took, vllm_bytes)


# what estimate_graph_memory() uses of vllm-ascend and vLLM, by module: checked before patching
_KV_BUDGET_NAMES = (
    (_WORKER[0], (_WORKER[1],)),
    (
        _ASCEND_RUNNER,
        ("_torch_cuda_wrapper", "_replace_gpu_model_runner_function_wrapper", "_get_gpu_model_runner_module_name"),
    ),
    (_ACL_GRAPH, ("_graph_params",)),
    (RUNNER[0], (RUNNER[1],)),
)


def kv_budget_missing() -> list[str]:
    """The names the KV-cache budget's estimate needs and this vllm-ascend/vLLM lacks."""
    missing = []
    for module_name, names in _KV_BUDGET_NAMES:
        module = sys.modules.get(module_name)
        missing += [f"{module_name}.{n}" for n in names if module is None or not hasattr(module, n)]
    runner = getattr(sys.modules.get(RUNNER[0]), RUNNER[1], None)
    if runner is not None and not hasattr(runner, "profile_cudagraph_memory"):
        missing.append(f"{RUNNER[0]}.{RUNNER[1]}.profile_cudagraph_memory")
    return missing


def patch_kv_budget() -> None:
    """Make vllm-ascend's KV-cache budget leave out the graphs' memory (it sizes the cache
    before the capture and never counts them: its issues #8260, #8289, PR #14293)."""
    try:
        module = __import__(_WORKER[0], fromlist=["_"])
        for module_name, _ in _KV_BUDGET_NAMES:
            __import__(module_name, fromlist=["_"])
    except Exception:  # vllm-ascend absent (or broken): vLLM's own worker counts them on CUDA
        return
    cls = getattr(module, _WORKER[1], None)
    if cls is None or hasattr(cls, "_npugraph_original_determine_available_memory"):
        return
    missing = kv_budget_missing()
    if missing:
        logger.warning(
            "npugraph: vllm-ascend's KV-cache budget will not count graph memory: this release has no %s",
            ", ".join(missing),
        )
        return
    original = cls.determine_available_memory

    @functools.wraps(original)
    def determine_available_memory(self: Any) -> int:
        available = int(original(self))
        config = self.vllm_config
        from vllm.config import CUDAGraphMode

        if (
            self.cache_config.kv_cache_memory_bytes  # the user sized the cache: vllm-ascend respects it as is
            or self.model_config.enforce_eager
            or config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
        ):
            return available
        if hasattr(self.model_runner, "cudagraph_dispatcher"):
            estimate = estimate_graph_memory(self.model_runner)
        else:  # vLLM's model runner v2: its profiling capture is its graph manager's (npugraph's: runner_v2)
            estimate = estimate_graph_memory_v2(self.model_runner)
        setattr(config, ESTIMATE_ATTR, estimate)
        budget = available - estimate.bytes
        logger.info(
            "npugraph: graph memory estimated before the KV cache at %s: the KV-cache budget is %.2f GiB "
            "instead of %.2f GiB",
            estimate.say(),
            budget / (1 << 30),
            available / (1 << 30),
        )
        self.available_kv_cache_memory_bytes = budget
        return budget

    cls._npugraph_original_determine_available_memory = original
    cls.determine_available_memory = determine_available_memory


def unpatch_kv_budget() -> None:
    unwrap_method(_WORKER, "determine_available_memory")
