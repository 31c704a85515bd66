"""vLLM's model runner v2 (``VLLM_USE_V2_MODEL_RUNNER=1``) served by npugraph.

The v2 runner does not build static graph wrappers for its FULL graphs: its graph manager
captures them itself.  vLLM's ``CudaGraphManager.capture`` runs, per batch descriptor, a
warm-up forward and then the forward inside ``torch.cuda.graph(torch.cuda.CUDAGraph())``
(vllm-ascend makes that class its ``UpdatableGraph``), and keeps the graph in
``manager.graphs[desc]``; its ``run_fullgraph`` calls the graph's ``replay()`` and slices the
persistent outputs.  vllm-ascend's ``ModelAclGraphManager`` (``worker/v2/aclgraph_utils.py``)
resolves and re-issues the graph's attention tasks around that replay.

Under npugraph, for a ``ModelAclGraphManager``:

* the capture of each FULL descriptor's forward is npugraph's (:meth:`Runtime.capture
  <npugraph.runtime.Runtime.capture>`: warm-up, kernel choice per size, capture, with
  vllm-ascend's backends recording through npugraph's recorders), and ``graphs[desc]`` is a
  :class:`GraphStep`, whose ``replay()`` is npugraph's one step for the descriptor, from the
  step's attention metadata as vllm-ascend's manager reads it (``model_state.attn_metadata``);
  vLLM's ``run_fullgraph`` then slices the outputs as it does for its own graphs;
* vllm-ascend's per-step update around the replay (``_updatable_graph_replay`` for FIA/PA,
  ``_graph_relay`` for the rest) becomes that replay alone: npugraph's step has updated.

PIECEWISE descriptors stay vLLM's (their graphs are the compiled model's static wrappers,
npugraph's under the plugin).  A speculative decoder's draft managers capture through their
own classes, which npugraph does not serve under v2 yet: their capture is refused by name
(:data:`DRAFT_MANAGERS`).  :func:`install` and :func:`uninstall` are the plugin's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from npugraph.errors import BatchRefused, ConfigError, NpuGraphError
from npugraph.integrations.common import restore, unwrap_method, wrap_method
from npugraph.integrations.vllm import vllm_ascend
from npugraph.integrations.vllm.metadata import step_metadata
from npugraph.integrations.vllm.wrapper import runtime_for
from npugraph.runtime import Runtime

__all__ = [
    "CUDAGRAPH_UTILS",
    "DRAFT_MANAGERS",
    "PROFILED_FULL_TOKENS",
    "GraphStep",
    "available",
    "install",
    "uninstall",
]

logger = logging.getLogger("vllm.npugraph")

# vLLM's v2 graph manager (its capture loop; its profile of the graphs' memory, which
# kv_budget runs) and vllm-ascend's subclass for the target model
CUDAGRAPH_UTILS = "vllm.v1.worker.gpu.cudagraph_utils"
_MANAGER = ("vllm_ascend.worker.v2.aclgraph_utils", "ModelAclGraphManager")
# the draft models' managers under v2 speculative decoding: not served by npugraph yet
DRAFT_MANAGERS = (
    ("vllm_ascend.worker.v2.spec_decode.autoregressive.aclgraph", "AutoRegressiveAclGraphManager"),
    ("vllm_ascend.worker.v2.spec_decode.dflash.aclgraph", "DFlashAclGraphManager"),
)
NAMESPACE = "main"
# where a profiling capture (vLLM's memory profile) leaves the token counts of every FULL
# descriptor the real capture will take, on the engine's config
PROFILED_FULL_TOKENS = "_npugraph_v2_profiled_full_tokens"


class GraphStep:
    """What ``manager.graphs[desc]`` holds under npugraph: ``replay()`` runs npugraph's step for
    ``desc``, its attention updated from the metadata the runner prepared for this step."""

    __slots__ = ("desc", "keep", "manager", "runtime")

    def __init__(self, runtime: Runtime, desc: Any, manager: Any, keep: list[Any]) -> None:
        self.runtime, self.desc, self.manager = runtime, desc, manager
        self.keep = keep  # device memory a recorder made for this graph: alive as long as it is

    def replay(self) -> None:
        metadata = step_metadata(self.manager.model_runner.model_state.attn_metadata)
        try:
            self.runtime.step(self.desc, metadata, namespace=NAMESPACE, refusable=True)
        except BatchRefused as refused:
            # vLLM's v2 runner has decided on this graph, and its inputs are laid out for it:
            # there is no eager fallback here, as the static wrapper has
            raise NpuGraphError(
                f"vLLM's v2 runner chose graph {NAMESPACE}/{self.desc} for a batch it cannot run: {refused}"
            ) from refused


def _is_target_manager(manager: Any) -> bool:
    cls = _class(_MANAGER)
    return cls is not None and isinstance(manager, cls)


def _class(where: tuple[str, str]) -> Any:
    if where[0].startswith("vllm_ascend."):
        vllm_ascend.import_in_order()  # from its worker/v2 modules alone the import fails halfway (0.29)
    try:
        module = __import__(where[0], fromlist=["_"])
    except Exception:  # vllm-ascend without the v2 runner, or vLLM without it
        return None
    return getattr(module, where[1], None)


def _capturing_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def capture(self: Any, create_forward_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        draft = next((f"{m}.{n}" for m, n in DRAFT_MANAGERS if (c := _class((m, n))) and isinstance(self, c)), None)
        if draft is not None:
            raise ConfigError(
                f"npugraph: {draft} (a draft model's graphs under vLLM's model runner v2) is not served by "
                "npugraph yet; serve speculative decoding on the v1 runner (unset VLLM_USE_V2_MODEL_RUNNER), "
                "or set NPUGRAPH_ENABLE=0"
            )
        if not _is_target_manager(self):
            return original(self, create_forward_fn, *args, **kwargs)
        if not available():
            # vLLM chose the v2 runner by its own default for this model (the plugin refuses
            # VLLM_USE_V2_MODEL_RUNNER=1 at load): with npugraph's recorders in vllm-ascend's
            # backends, this manager's own update would leave stale lengths, silently
            raise ConfigError(
                f"npugraph: vLLM runs its model runner v2, and vllm-ascend {vllm_ascend.version()}'s "
                f"{_MANAGER[0]}.{_MANAGER[1]} is not one npugraph serves (it has no _updatable_graph_replay); "
                "set VLLM_USE_V2_MODEL_RUNNER=0 to serve with npugraph on the v1 runner, or NPUGRAPH_ENABLE=0"
            )
        return _capture(self, create_forward_fn)

    return capture


def _capture(manager: Any, create_forward_fn: Callable[..., Any]) -> None:
    """vLLM's capture order (PIECEWISE first: its larger activations size the pool), each
    FULL descriptor's forward captured by npugraph's runtime."""
    import torch
    from vllm.compilation.counter import compilation_counter
    from vllm.config import CUDAGraphMode

    graph_capture = __import__(CUDAGRAPH_UTILS, fromlist=["_"]).graph_capture
    if getattr(manager, "ubatch_runner", None) is not None:
        raise ConfigError("npugraph: vLLM's micro-batched (DBO) graphs under model runner v2 are not served yet")
    runtime = runtime_for(manager.vllm_config)
    with graph_capture(device=manager.device):
        for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            descs = list(manager._capture_descs.get(mode, ()))
            if mode == CUDAGraphMode.FULL and manager._max_full_descs_to_capture is not None:
                # vLLM's memory profile: a sample; the sizes it stands for, for npugraph's
                # estimate (kv_budget.estimate_graph_memory_v2)
                setattr(manager.vllm_config, PROFILED_FULL_TOKENS, [int(d.num_tokens) for d in descs])
                descs = descs[: manager._max_full_descs_to_capture]
            for desc in descs:
                forward = create_forward_fn(desc, warmup=True)
                forward(CUDAGraphMode.NONE)
                if desc.cg_mode == CUDAGraphMode.PIECEWISE:
                    if manager.use_breakable_cg:
                        raise ConfigError(
                            "npugraph: vLLM's breakable graphs (VLLM_USE_BREAKABLE_CUDAGRAPH) are not served"
                        )
                    forward(CUDAGraphMode.PIECEWISE)  # the compiled model's static wrappers capture
                    continue
                forward = create_forward_fn(desc, warmup=False)  # a fresh attention state, as vLLM's
                samples = manager._capture_mem_samples
                if samples is not None:
                    torch.accelerator.synchronize()
                    free_before = torch.accelerator.get_memory_info()[0]
                if runtime.has(desc, namespace=NAMESPACE):
                    # captured before by another manager of this engine (vLLM's memory profile
                    # captures a sample with one, then tears it down): this capture replaces it
                    runtime.reset(NAMESPACE, desc)
                keep: list[Any] = []
                with vllm_ascend.capturing(runtime, NAMESPACE, keep):
                    runtime.capture(
                        forward,
                        CUDAGraphMode.NONE,
                        key=desc,
                        namespace=NAMESPACE,
                        tokens=int(desc.num_tokens),
                        require_attention=True,
                    )
                if samples is not None:
                    torch.accelerator.synchronize()
                    samples.append(free_before - torch.accelerator.get_memory_info()[0])
                manager.graphs[desc] = GraphStep(runtime, desc, manager, keep)
                compilation_counter.num_cudagraph_captured += 1
    manager._graphs_captured = True


def _replays(run_fullgraph: Callable[[Any, Any], Any]) -> dict[str, Callable[..., Any]]:
    """What install() puts in place of vllm-ascend's manager's per-step update (its replay with
    ``UpdatableGraph``'s update for FIA/PA, and with ``update_full_graph_params`` for the
    rest): the replay alone, which is npugraph's step (:class:`GraphStep`), through vLLM's
    ``run_fullgraph`` (resolved once here, not at every step), which slices the outputs."""

    def replay_only(manager: Any, desc: Any) -> Any:
        if not isinstance(manager.graphs.get(desc), GraphStep):
            raise NpuGraphError(
                f"graph {desc} of vLLM's v2 runner was not captured by npugraph; install npugraph before the "
                "model runner captures (NPUGRAPH_ENABLE=1 and the vllm.general_plugins entry point)"
            )
        return run_fullgraph(manager, desc)

    def _updatable_graph_replay(manager: Any, desc: Any, attn_metadata: Any) -> Any:
        return replay_only(manager, desc)

    def _graph_relay(manager: Any, attn_backend: Any, desc: Any, num_tokens: int, attn_metadata: Any) -> Any:
        return replay_only(manager, desc)

    return {"_updatable_graph_replay": _updatable_graph_replay, "_graph_relay": _graph_relay}


_REPLAYED = ("_updatable_graph_replay", "_graph_relay")  # the names _replays() gives


def available() -> bool:
    """Whether vLLM and vllm-ascend here have the v2 graph manager npugraph serves: vllm-ascend's
    ``ModelAclGraphManager`` of the UpdatableGraph generation (its ``_updatable_graph_replay``:
    vllm-ascend 0.30 with vLLM 0.30, whose capture loop's ``create_forward_fn`` returns the
    forward alone).  An earlier one (0.23's, which updates inside ``run_fullgraph``, over a vLLM
    whose ``create_forward_fn`` also returns an attention state) is not served."""
    manager = _class(_MANAGER)
    return (
        manager is not None
        and "_updatable_graph_replay" in vars(manager)
        and _class((CUDAGRAPH_UTILS, "CudaGraphManager")) is not None
    )


def install() -> list[str]:
    """Serve the v2 runner's FULL graphs (see the module doc): the names replaced, or none
    where vLLM has no v2 runner.  Installed whether or not this process will run the v2 runner:
    vLLM decides that later, per model, from its configuration (``VllmConfig.use_v2_model_runner``,
    which some vllm-ascend releases patch to follow the variable alone).  Where vllm-ascend's
    manager is not one npugraph serves (:func:`available`), only the capture loop is wrapped,
    and it refuses that manager's capture by name."""
    if _class((CUDAGRAPH_UTILS, "CudaGraphManager")) is None:
        return []
    wrap_method((CUDAGRAPH_UTILS, "CudaGraphManager"), "capture", _capturing_loop)
    replaced = [f"{CUDAGRAPH_UTILS}.CudaGraphManager.capture"]
    if not available():
        return replaced
    manager = _class(_MANAGER)
    for name, replay in _replays(_class((CUDAGRAPH_UTILS, "ModelCudaGraphManager")).run_fullgraph).items():
        if name in vars(manager) and not hasattr(manager, f"_npugraph_original_{name}"):
            setattr(manager, f"_npugraph_original_{name}", vars(manager)[name])
            setattr(manager, name, replay)
            replaced.append(f"{_MANAGER[0]}.{_MANAGER[1]}.{name}")
    return replaced


def uninstall() -> None:
    """Put back what :func:`install` replaced."""
    unwrap_method((CUDAGRAPH_UTILS, "CudaGraphManager"), "capture")
    manager = _class(_MANAGER)
    if manager is not None:
        for name in _REPLAYED:
            restore(manager, name)
