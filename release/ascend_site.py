"""What the release environment runs at interpreter start (``ascend_site.pth``): what an
Ascend host settles by being one, and, for release/generate.py only, its counts.

* ``vllm_ascend_C``, vllm-ascend's C++ custom ops (built against CANN), cannot be here.
  vllm-ascend decides lazily whether they exist (``vllm_ascend.utils.enable_custom_op``,
  cached): it imports ``vllm_ascend.vllm_ascend_C`` the first time a layer asks.  With
  ``torch.compile`` (vllm-ascend's ACL graph mode) that first time is inside Dynamo's trace,
  where an import that fails stops the compilation.  On an Ascend host the import succeeds;
  here it cannot, so the answer ("disabled", logged once) is settled as soon as
  ``vllm_ascend.utils`` is imported, outside any trace.
  From 0.28.0rc1 on, vllm-ascend's RMSNorm with a residual imports ``vllm_ascend_C`` with no
  fallback (every decoder layer; read off its ``ops/layernorm.py``): there, the simulator's
  stand-in for the extension
  (``npusim.surfaces.vllm_ascend_c``, the ``_C_ascend`` ops the models here reach) is what
  the import finds, and vllm-ascend runs with its custom ops enabled, as on a host.
* torch reads a set ``CI`` variable as "this is torch's own CI" and then turns its
  deprecation of custom ops that return an input (vllm-ascend 0.23.0.post1's
  ``maybe_pad_and_reduce`` at TP 1) from a warning into an error.  A user's host (or a CI
  of theirs that is not torch's) gets the warning: so does this environment, whatever
  ``CI`` says, unless ``TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING`` is set by hand.
* vllm-ascend pins torch 2.10; this environment has the torch the simulator is built for
  (2.14), whose AOT-autograd cache, bundled by vLLM around its compiles, asserts that every
  compiled graph is inductor's code ("expected OutputCode").  vllm-ascend's fusion-pass
  compile (``fusion_pass_compile``: vLLM's default ``FULL_AND_PIECEWISE`` mode, with or
  without npugraph) returns a plain graph, so an engine started with no compilation
  config stopped at start-up (Ascend hosts on torch 2.11 and later report the same).  Its
  compiles run without the bundled cache here, as the simulator's npugraph_ex runs its own.
* With ``NPUGRAPH_VLLM_COUNTS=DIR`` (release/generate.py), the process that runs the model
  (vLLM's EngineCore) times each per-step graph update, vllm-ascend's
  ``update_full_graph_params`` and npugraph's ``ReplayUpdater._write``, counts the steps
  vllm-ascend runs as a full graph (the target's, and an MTP draft's apart) and npugraph's
  steps, and keeps npugraph's capture report, into ``DIR/counts-<pid>.json``
  (release/engine_counts.py).
* With ``NPUGRAPH_SOAK_SAMPLES=DIR`` (make soak), the engine process samples its memory,
  graphs, events and forward passes into ``DIR`` (release/soak_probe.py).
* With ``NPUGRAPH_VLLM_FAULT=host-copy`` (release/test_faults.py), each Llama MLP calls a
  custom op that reads a value to the host while a graph is being captured: a model whose
  layer copies to the host under capture (on a device, ``rtMemcpy`` fails with 107030).
"""

from __future__ import annotations

import collections
import functools
import os
import sys
from pathlib import Path
from typing import Any

from npusim_hook import after_import


def _needs_custom_ops() -> bool:
    """Whether this release's layers import ``vllm_ascend_C`` with no fallback (0.28.0rc1 on)."""
    # release/ (runs.py) on the path for this one import: a user's process must not find
    # release/'s other files before its own modules
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        from runs import needs_custom_ops
    finally:
        sys.path.remove(here)
    return needs_custom_ops()


def _settle_custom_ops(utils: Any) -> None:
    """Settle whether vllm-ascend's custom ops exist as ``vllm_ascend.utils`` finishes loading,
    outside any trace: 0.28 on finds the simulator's stand-in for ``vllm_ascend_C`` (installed
    here, not at interpreter start: a process that never imports vllm-ascend never imports
    the simulator for it), 0.23 finds none."""
    if _needs_custom_ops():
        from npusim.surfaces import vllm_ascend_c

        vllm_ascend_c.install()
    utils.enable_custom_op()


def _unbundled_fusion_pass_compile(module: Any) -> None:
    compile_fn = module.fusion_pass_compile

    @functools.wraps(compile_fn)
    def fusion_pass_compile(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch._functorch.config.patch(bundled_autograd_cache=False, force_autograd_cache=False):
            return compile_fn(*args, **kwargs)

    module.fusion_pass_compile = fusion_pass_compile


class _Counting:
    """What the check counts and times in vllm-ascend's own update and graph steps, each
    hooked as its module finishes loading (``after_import``), into ``counts``."""

    def __init__(self, counts: Any) -> None:
        self.counts = counts
        # vllm-ascend 0.30's per-step UpdatableGraph timer (acl_graph's), for the v2 runner's
        self.step_timers: list[Any] = []

    def acl_graph(self, module: Any) -> None:
        counts = self.counts
        # replaced as the module finishes loading: every vllm-ascend module that imports the
        # name by value (``from ...acl_graph import update_full_graph_params``) gets this one
        whole = module.update_full_graph_params
        timed_call = counts.time(module, "update_full_graph_params", "vllm_ascend_update", "vllm_ascend_update_walls")
        tokens = counts.values.setdefault("vllm_ascend_update_tokens", [])

        def counted(
            attn_backend: Any, update_stream: Any, forward_context: Any, num_tokens: int, *a: Any, **k: Any
        ) -> Any:
            tokens.append(int(num_tokens))  # the step's padded size, beside its seconds
            return timed_call(attn_backend, update_stream, forward_context, num_tokens, *a, **k)

        uses_updatable = getattr(module, "use_updatable_graph", None)
        if uses_updatable is None:  # 0.23: every layer's update is there
            module.update_full_graph_params = counted
        else:
            # 0.30: MLA's update is still there; a backend on UpdatableGraph (FIA, PA) returns
            # at once, its update timed around its replay instead (below)
            def update_full_graph_params(attn_backend: Any, *args: Any, **kwargs: Any) -> Any:
                run = whole if uses_updatable(attn_backend) else counted
                return run(attn_backend, *args, **kwargs)

            module.update_full_graph_params = update_full_graph_params
            self._time_updatable_graph(module, tokens)

    def _time_updatable_graph(self, module: Any, tokens: list[int]) -> None:
        counts = self.counts
        step_timers = self.step_timers
        # vllm-ascend 0.30's update of FIA and PA: the graph's tasks resolved from the step's
        # metadata before its replay, and re-issued after it (ACLGraphWrapper's
        # _updatable_graph_replay); the two parts' host seconds are one step's update
        from timing import timed

        graph_cls, wrapper_cls = module.UpdatableGraph, module.ACLGraphWrapper
        parts: list[float] = []
        wall_parts: list[float] = []  # the same calls' whole wall times, device time included
        own_parts: list[float] = []  # the simulator's own host seconds in them
        calls: collections.Counter[str] = collections.Counter()
        graph_cls.resolve_tasks = timed(graph_cls, "resolve_tasks", parts, calls, walls=wall_parts, own=own_parts)
        graph_cls.update = timed(graph_cls, "update", parts, calls, walls=wall_parts, own=own_parts)
        # the lists counts.time made for update_full_graph_params: one step's entry in each
        seconds = counts.values["vllm_ascend_update_seconds"]
        own = counts.values["vllm_ascend_update_own"]
        walls = counts.values["vllm_ascend_update_walls"]
        device_calls = counts.values["vllm_ascend_update_device_calls"]

        def one_step(replay: Any, step_tokens: Any) -> Any:
            # ``replay`` (a replay with its update) as one step's entry; ``step_tokens(arg)`` its
            # padded size from the replay's first argument
            def _updatable_graph_replay(self: Any, first: Any, *args: Any, **kwargs: Any) -> Any:
                parts.clear()
                wall_parts.clear()
                own_parts.clear()
                calls.clear()
                try:
                    return replay(self, first, *args, **kwargs)
                finally:
                    seconds.append(sum(parts))
                    walls.append(sum(wall_parts))
                    own.append(sum(own_parts))
                    tokens.append(step_tokens(first))
                    device_calls.update(calls)
                    counts.write()

            return _updatable_graph_replay

        def batch_tokens(forward_context: Any) -> int:
            return int(getattr(getattr(forward_context, "batch_descriptor", None), "num_tokens", 0) or 0)

        wrapper_cls._updatable_graph_replay = one_step(wrapper_cls._updatable_graph_replay, batch_tokens)
        step_timers.append(one_step)

    def v2_manager(self, v2: Any) -> None:
        counts = self.counts
        step_timers = self.step_timers
        # vLLM's model runner v2: vllm-ascend's ModelAclGraphManager updates as ACLGraphWrapper
        # does (its _updatable_graph_replay(desc, attn_metadata), timed alike: its module
        # imports acl_graph first), and each FULL replay is a graph step
        manager = v2.ModelAclGraphManager
        for one_step in step_timers:
            manager._updatable_graph_replay = one_step(
                manager._updatable_graph_replay, lambda desc: int(getattr(desc, "num_tokens", 0) or 0)
            )
        run = manager.run_fullgraph
        counts.values["graph_steps"] = 0

        def run_fullgraph(self: Any, desc: Any) -> Any:
            counts.values["graph_steps"] += 1
            try:
                return run(self, desc)
            finally:
                counts.write()

        manager.run_fullgraph = run_fullgraph

    def graph_steps(self, cls: type, key: str) -> None:
        counts = self.counts
        # vllm-ascend's own decision that a step replays a full graph (in both graph modes:
        # under npugraph's plugin the update it then calls is npugraph's no-op), once vLLM
        # has finished capturing (npugraph's wrapper marks the forward context as capturing
        # only inside its own capture, vllm-ascend's for the whole capture run); the counts
        # written after it (a draft's replay, before it, wrote without it)
        from vllm.compilation import monitor

        import npusim as sim

        decide = cls._update_full_graph_params_if_needed
        counts.values[key] = 0
        # the simulated device's seconds so far at each graph step: their differences are a
        # step's device work (release/update_cost.py), the simulator running it on the host
        device_at = counts.values.setdefault(f"{key}_device_at", [])

        def counted(self: Any, forward_context: Any, *args: Any, **kwargs: Any) -> Any:
            serving = not monitor.cudagraph_capturing_enabled and not forward_context.capturing
            if serving and forward_context.cudagraph_runtime_mode.name == "FULL":
                counts.values[key] += 1
                device_at.append(sim.device_seconds())
            try:
                return decide(self, forward_context, *args, **kwargs)
            finally:
                counts.write()

        cls._update_full_graph_params_if_needed = counted

    def model_runner(self, module: Any) -> None:
        self.graph_steps(module.NPUModelRunner, "graph_steps")

    def proposer(self, module: Any) -> None:
        # the draft model's (MTP) own decision: a second graph per speculative step
        self.graph_steps(module.AscendSpecDecodeBaseProposer, "draft_graph_steps")


def _count(folder: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # release/: engine_counts.py
    from engine_counts import EngineCounts

    counting = _Counting(EngineCounts(folder))
    after_import("vllm_ascend.compilation.acl_graph", counting.acl_graph)
    after_import("vllm_ascend.worker.model_runner_v1", counting.model_runner)
    after_import("vllm_ascend.worker.v2.aclgraph_utils", counting.v2_manager)
    after_import("vllm_ascend.spec_decode.llm_base_proposer", counting.proposer)
    counting.counts.npugraph(after_import, write_each_step=True)


def _host_copy_in_every_mlp(llama: Any) -> None:
    import torch

    # a custom op for the npu device, as vLLM registers its own: torch.compile keeps it
    # opaque, so its Python runs at every call of the compiled model, the capture's included
    @torch.library.custom_op(
        "npugraph_release::host_peek", mutates_args=(), device_types="npu", schema="(Tensor x) -> Tensor"
    )
    def host_peek(x: torch.Tensor) -> torch.Tensor:
        if torch.npu.is_current_stream_capturing():
            x.flatten()[0].item()  # a read to the host of a value only the replay will have
        return x.clone()

    @host_peek.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    forward = llama.LlamaMLP.forward

    def peeking(self: Any, x: torch.Tensor) -> torch.Tensor:
        return forward(self, torch.ops.npugraph_release.host_peek(x))

    llama.LlamaMLP.forward = peeking


def _start() -> None:
    os.environ.setdefault("TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "0")
    after_import("vllm_ascend.utils", _settle_custom_ops)
    after_import("vllm_ascend.compilation.compiler_interface", _unbundled_fusion_pass_compile)
    if os.environ.get("NPUGRAPH_VLLM_COUNTS"):
        _count(os.environ["NPUGRAPH_VLLM_COUNTS"])
    if os.environ.get("NPUGRAPH_SOAK_SAMPLES"):  # make soak (release/soak.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # release/: soak_probe.py
        from soak_probe import install

        install(os.environ["NPUGRAPH_SOAK_SAMPLES"], after_import, "vllm")
    if os.environ.get("NPUGRAPH_VLLM_FAULT") == "host-copy":
        after_import("vllm.model_executor.models.llama", _host_copy_in_every_mlp)


# Once per process: site runs this venv's .pth files twice at start (its venv() and then its
# main() each add site-packages), and a second run would hook everything twice (the soak's
# samples came from two probes in one process, one of which missed the graphs).
if not getattr(sys, "_npugraph_release_site", False):
    sys._npugraph_release_site = True  # type: ignore[attr-defined]
    _start()
