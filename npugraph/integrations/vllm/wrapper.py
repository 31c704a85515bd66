"""vLLM's static graph wrapper, through npugraph: :class:`NpuGraphWrapper` captures a
runnable per batch descriptor and runs each later call as one runtime step;
:class:`DraftNpuGraphWrapper` does so for a speculative draft.  The runtime is one per
engine config (:func:`runtime_for`)."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from unittest import mock

import torch

from npugraph.errors import BatchRefused, ConfigError, NpuGraphError
from npugraph.integrations.common import capture_widths, env_update_free, runtime_from_env, widths_for
from npugraph.integrations.vllm import vllm_ascend
from npugraph.integrations.vllm.metadata import step_metadata
from npugraph.runtime import Runtime

__all__ = ["DraftNpuGraphWrapper", "NpuGraphWrapper", "attach_runtime", "platform_has_npu_graphs", "runtime_for"]

# A child of vLLM's own logger: its handler and format show npugraph's lines in vLLM's log.
logger = logging.getLogger("vllm.npugraph")

RUNTIME_ATTR = "_npugraph_runtime"  # the VllmConfig attribute holding its runtime


def attach_runtime(vllm_config: Any, runtime: Runtime) -> Runtime:
    """Make every wrapper built for ``vllm_config`` use ``runtime``."""
    setattr(vllm_config, RUNTIME_ATTR, runtime)
    return runtime


def runtime_for(vllm_config: Any) -> Runtime:
    """The runtime of ``vllm_config`` (created on first use: one per engine config)."""
    rt = getattr(vllm_config, RUNTIME_ATTR, None)
    if rt is None:
        model = getattr(vllm_config, "model_config", None)
        if model is None:
            raise NpuGraphError(
                "npugraph needs max_model_len: the VllmConfig has no model_config; call "
                "npugraph.integrations.vllm.attach_runtime(vllm_config, Runtime(...)) first"
            )
        rt = runtime_from_env(int(model.max_model_len), "npu" if platform_has_npu_graphs() else "sim")
        attach_runtime(vllm_config, rt)
    return rt


def platform_has_npu_graphs(platform: Any = None) -> bool:
    if platform is None:
        from vllm.platforms import current_platform as platform
    return str(getattr(platform, "device_type", "")) == "npu" or str(getattr(platform, "device_name", "")) == "npu"


def _noop_call(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _gc_disabled(enabled: bool, device_npu: Any) -> Iterator[None]:
    """Skip ``gc.collect`` and the allocators' ``empty_cache`` during capture (vLLM's
    ``gc_disable``): each would run once per captured piece and make capture slow."""
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(gc, "collect", _noop_call))
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "empty_cache"):
            stack.enter_context(mock.patch.object(accelerator, "empty_cache", _noop_call))
        if hasattr(device_npu, "empty_cache"):  # torch.npu on Ascend, the simulator's npu module here
            stack.enter_context(mock.patch.object(device_npu, "empty_cache", _noop_call))
        yield


def _inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[str, int]]:
    out = [(f"args[{i}]", a.data_ptr()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    out += [(k, v.data_ptr()) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return out


class NpuGraphWrapper:
    """Capture and replay a runnable per ``BatchDescriptor`` through npugraph (vLLM's wrapper).

    Workflow of each call:

    1. no forward context, or its ``cudagraph_runtime_mode`` is NONE or not this
       wrapper's mode → call the runnable (pass-through);
    2. first call for the context's ``batch_descriptor`` → capture it through the
       runtime's :class:`~npugraph.capture.CaptureManager` into the shared pool
       (warm-up, kernel choice, capture) and return the outputs;
    3. later calls → one :meth:`Runtime.step <npugraph.runtime.Runtime.step>` in the
       runtime's order: in FULL mode the graph's attention tasks are updated from
       ``forward_context.attn_metadata`` (on the runtime's update stream, after the
       previous replay, no host synchronize) and the graph replays; return the outputs.

    It does not copy inputs: as in vLLM, the model runner passes persistent buffers
    whose addresses must not change.  With ``check_addresses`` (default: when
    debug logging is on) that is verified on every replay, keyword arguments included.
    FULL graphs live in ``namespace`` (default ``"main"``; a draft model passes
    ``namespace="draft"``); each PIECEWISE wrapper gets its own namespace.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        vllm_config: Any,
        runtime_mode: Any,
        cudagraph_options: Any = None,
        *,
        runtime: Runtime | None = None,
        namespace: str | None = None,
        check_addresses: bool | None = None,
        **kwargs: Any,
    ) -> None:
        from vllm.config import CUDAGraphMode

        if runtime_mode == CUDAGraphMode.NONE:
            raise ValueError("NpuGraphWrapper needs runtime_mode FULL or PIECEWISE, not NONE")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.runtime = runtime if runtime is not None else runtime_for(vllm_config)
        if cudagraph_options is None:
            from vllm.compilation.cuda_graph import CUDAGraphOptions

            cudagraph_options = CUDAGraphOptions()
        self.cudagraph_options = cudagraph_options
        base = namespace or "main"
        self._full = runtime_mode == CUDAGraphMode.FULL
        self.namespace = base if self._full else self.runtime.unique_namespace(f"{base}.piecewise")
        if check_addresses is None:  # as vLLM's wrapper: on with its debug logging (VLLM_LOGGING_LEVEL=DEBUG)
            check_addresses = logging.getLogger("vllm").isEnabledFor(logging.DEBUG) or logger.isEnabledFor(
                logging.DEBUG
            )
        self.check_addresses = check_addresses
        self._addresses: dict[Any, list[tuple[str, int]]] = {}
        self._strong: dict[Any, Any] = {}
        self._kept: dict[Any, list[Any]] = {}  # per key: device memory a recorder made for its graph
        self._eager_keys: set[Any] = set()  # keys that ran a batch eagerly (warned once each)
        # NPUGRAPH_UPDATE_FREE: each FULL size's update-free graphs too, at these widths
        # (None: none; set at the first capture, from the engine's block size)
        self._widths: tuple[int, ...] | None = None
        self._update_free = env_update_free() if self._full else None

    # vllm-ascend 0.30's ACLGraphWrapper interface, which its runners and proposers call: the
    # update stream, attention backend and a draft's metadata feed its own UpdatableGraph
    # update.  npugraph updates from the forward context on its runtime's own stream, so
    # they are kept for whoever reads them, and used for nothing.
    def set_update_stream(self, update_stream: Any) -> None:
        self.update_stream = update_stream

    def set_attn_backend(self, attn_backend: Any) -> None:
        self.attn_backend = attn_backend

    def update_draft_model_metadata(self, draft_model_metadata: list[dict[str, Any]]) -> None:
        self.draft_model_metadata = draft_model_metadata

    def __getattr__(self, key: str) -> Any:
        runnable = self.__dict__.get("runnable")
        if runnable is not None and hasattr(runnable, key):
            return getattr(runnable, key)
        raise AttributeError(f"neither NpuGraphWrapper nor its runnable {runnable!r} has attribute {key!r}")

    def unwrap(self) -> Callable[..., Any]:
        """The innermost runnable (wrappers nest: FULL around PIECEWISE)."""
        r = self.runnable
        return r.unwrap() if hasattr(r, "unwrap") else r

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        ctx = get_forward_context()
        mode = ctx.cudagraph_runtime_mode
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        key = ctx.batch_descriptor
        if key is None:
            raise NpuGraphError(f"{self.runtime_mode.name} step without a batch_descriptor in the forward context")
        entry = self.runtime.find(key, namespace=self.namespace)  # the step's one lookup
        if entry is None:
            # first call for this key, or its graph was freed (Runtime.reset: the profiling
            # capture that sized the KV cache, see estimate_graph_memory): capture it
            return self._capture(key, args, kwargs)
        if self.check_addresses:
            self._check_addresses(key, args, kwargs)
        metadata = step_metadata(self._attn_metadata(ctx)) if self._full and entry.tasks else {}
        try:
            if self._widths is not None and metadata:  # the narrowest update-free graph that holds it
                entry = self.runtime.graph_for(key, metadata, namespace=self.namespace) or entry
            # the runtime's one step protocol, in its order (replay-first by default: the
            # device starts the graph while the host updates layer by layer)
            return self.runtime.step_graph(entry, metadata, refusable=True)
        except BatchRefused as refused:
            # vLLM padded the batch to this descriptor; the graph's padding rule may still
            # refuse it (all request rows real, fewer tokens): then it runs eagerly, as a
            # batch with no graph does (refused before any device call)
            if key not in self._eager_keys:
                self._eager_keys.add(key)
                logger.warning("npugraph: running a batch of %s eagerly (said once per key): %s", key, refused)
            return self.runnable(*args, **kwargs)

    def _attn_metadata(self, ctx: Any) -> Any:
        """The attention metadata of this wrapper's step in vLLM's forward context ``ctx``."""
        return ctx.attn_metadata

    def _capture(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from vllm.compilation.counter import compilation_counter
        from vllm.compilation.monitor import validate_cudagraph_capturing_enabled

        opts = self.cudagraph_options
        if opts.debug_log_enable:
            logger.debug("npugraph: capturing %s graph %s/%s", self.runtime_mode.name, self.namespace, key)
        # Once vLLM has turned capturing off (serving), a new batch descriptor must fail, not capture.
        validate_cudagraph_capturing_enabled()
        self._addresses[key] = _inputs(args, kwargs)
        from vllm.forward_context import get_forward_context

        ctx: Any = get_forward_context()
        was_capturing = getattr(ctx, "capturing", False)
        with (
            _gc_disabled(opts.gc_disable, self.runtime.device.npu),
            vllm_ascend.capturing(self.runtime, self.namespace, self._kept.setdefault(key, [])),
        ):
            # vllm-ascend's backends take their graph path (now npugraph's recorders) while
            # the forward context says so, as its own ACLGraphWrapper sets it
            ctx.capturing = True
            try:
                out = self.runtime.capture(
                    self.runnable,
                    *args,
                    key=key,
                    namespace=self.namespace,
                    tokens=int(key.num_tokens),
                    require_attention=self._full,
                    **kwargs,
                )
                if self._update_free is not None and self.runtime.entry(key, namespace=self.namespace).tasks:
                    self._capture_widths(key, args, kwargs)
            finally:
                ctx.capturing = was_capturing
        compilation_counter.num_cudagraph_captured += 1
        if not opts.weak_ref_output:
            self._strong[key] = out  # the caller asked the wrapper to own the outputs
        return self.runtime.entry(key, namespace=self.namespace).outputs

    def _capture_widths(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``key``'s update-free graphs (NPUGRAPH_UPDATE_FREE), widest first, in the updated
        graph's capturing state; where the mode cannot run the model (MLA, sliding windows,
        speculative steps) this wrapper keeps updated graphs alone, and says so once."""
        if self._widths is None:
            self._widths = widths_for(
                self.runtime, self.runtime.entry(key, namespace=self.namespace), self._update_free
            )
        if None is capture_widths(
            self.runtime,
            self._widths,
            self.runnable,
            *args,
            key=key,
            namespace=self.namespace,
            tokens=int(key.num_tokens),
            log=logger,
            **kwargs,
        ):
            self._update_free = self._widths = None

    def _check_addresses(self, key: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        expected = self._addresses.get(key, [])
        got = _inputs(args, kwargs)
        if got == expected:
            return
        exp, now = dict(expected), dict(got)
        for name in list(exp) + [n for n in now if n not in exp]:
            if exp.get(name) != now.get(name):
                e, g = exp.get(name), now.get(name)
                raise NpuGraphError(
                    f"input address check for {self.namespace}/{key}: argument {name!r} moved "
                    f"(expected {e:#x} at capture, got {g:#x})"
                    if e is not None and g is not None
                    else f"input address check for {self.namespace}/{key}: tensor argument {name!r} "
                    f"{'is missing' if g is None else 'was not there at capture'}"
                )


class DraftNpuGraphWrapper(NpuGraphWrapper):
    """:class:`NpuGraphWrapper` for a speculative draft model's FULL graph (vllm-ascend's
    MTP/EAGLE proposer wraps its merged draft in ``ACLGraphWrapper``).

    The draft is captured and replayed under the target's batch descriptors, so its graphs
    live in their own namespace, ``"draft"``.  With several draft tokens the merged draft
    runs its layers once per token inside one graph, each draft step with its own metadata
    (``forward_context.draft_attn_metadatas``): the recorders record step ``i``'s attention
    as micro-batch ``i`` (:func:`npugraph.integrations.vllm.vllm_ascend.draft_step`), and each
    step's update takes that list, one metadata per draft step.  vllm-ascend serves the
    later steps of an MTP draft on MLA as one query token per row
    (``_one_token_rows``); other drafts of several tokens are refused at model load.
    """

    def __init__(self, runnable: Callable[..., Any], vllm_config: Any, runtime_mode: Any, *args: Any, **kwargs: Any):
        spec = getattr(vllm_config, "speculative_config", None)
        self.draft_tokens = tokens = int(getattr(spec, "num_speculative_tokens", 1) or 1)
        method = str(getattr(spec, "method", "?"))
        mla = bool(getattr(getattr(vllm_config, "model_config", None), "is_deepseek_mla", False))
        if tokens > 1 and not (method == "mtp" and mla):
            raise ConfigError(
                f"npugraph's plugin captures a draft of several tokens for MTP on an MLA model; this engine "
                f"drafts {tokens} with {method!r}{'' if mla else ' on a model without MLA'} "
                f"(num_speculative_tokens={tokens}). Serve it with num_speculative_tokens=1, or without npugraph "
                "(NPUGRAPH_ENABLE=0: vllm-ascend's own graph mode)."
            )
        kwargs.setdefault("namespace", "draft")
        super().__init__(runnable, vllm_config, runtime_mode, *args, **kwargs)

    def _attn_metadata(self, ctx: Any) -> Any:
        steps = getattr(ctx, "draft_attn_metadatas", None)
        return steps if isinstance(steps, list) and steps else ctx.attn_metadata

    def _capture(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.draft_tokens > 1 and key not in self._kept:
            # the later draft steps' block table, one row per token (vllm-ascend serves them
            # so): made here, outside the capture and its pool, which each step's table is
            # copied into (vllm_ascend._one_token_rows)
            cache = self.vllm_config.cache_config
            cols = -(-int(self.vllm_config.model_config.max_model_len) // int(cache.block_size))
            tokens = int(key.num_tokens)
            memory = self.runtime.device.memory
            inputs = [
                t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.device.type == memory.type
            ]
            device = inputs[0].device if inputs else memory
            self._kept[key] = [torch.zeros(tokens, cols, dtype=torch.int32, device=device)]
        return super()._capture(key, args, kwargs)
