"""npugraph as vLLM's static graph wrapper and per-step updater (ACL graph mode).

Install without patching vLLM: the ``vllm.general_plugins`` entry point
``npugraph = npugraph.integrations.vllm:register`` runs :func:`register` in every vLLM
process.  With ``NPUGRAPH_ENABLE=1`` it makes the platform's
``get_static_graph_wrapper_cls()`` return :class:`NpuGraphWrapper` and, when
vllm-ascend is installed, replaces its graph wrapper and parameter-update functions
(see :func:`install`).  On a platform without NPU graphs it leaves vLLM untouched and
says so once in the log (``NPUGRAPH_DEVICE=sim`` forces the simulator, for testing).

The attention metadata contract (what a backend must put in
``forward_context.attn_metadata[layer_name]`` each step): either an
:class:`npugraph.AttentionMetadata`, or any object with

* ``seq_lens_list`` (list[int]) or ``seq_lens_cpu`` / ``seq_lens`` (CPU int tensor [R]),
  the key length of each request including this step's tokens;
* ``block_tables`` / ``block_table`` / ``block_table_tensor`` ([R, cols] int32);
* optionally ``query_start_loc_cpu`` / ``query_start_loc`` (CPU int [R + 1]).

MLA layers (vllm-ascend's MLA metadata): the same fields under ``decode``
(``decode.seq_lens_list``, ``decode.block_table``), and for speculative steps the
cumulative query ends ``actual_seq_lengths_q``.  Sliding-window layers belong to their
own KV-cache group: their metadata (a block table of that group's blocks) is keyed by
their layer names or by the group name.

Layers of one KV-cache group may share one metadata object; it is converted once
per step.  :class:`npugraph.attention.DecodeAttention` is the reference client.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from unittest import mock

import attrs
import torch

from npugraph.errors import ConfigError, MetadataError, NpuGraphError
from npugraph.integrations import vllm_ascend
from npugraph.integrations.common import (  # noqa: F401 (the settings keep their names here)
    ENV_DEVICE,
    ENV_DEVICE_LENGTHS,
    ENV_ENABLE,
    ENV_EVENT_GROUP,
    ENV_REPORT_DIR,
    check_settings,
    enabled,
    report_path,
    runtime_from_env,
)
from npugraph.integrations.common import say_captured as _say_captured
from npugraph.metadata import AttentionMetadata
from npugraph.replay import StepMetadata
from npugraph.runtime import Runtime

__all__ = [
    "DraftNpuGraphWrapper",
    "GraphMemoryEstimate",
    "NpuGraphWrapper",
    "attach_runtime",
    "estimate_graph_memory",
    "install",
    "register",
    "report_path",
    "runtime_for",
    "say_captured",
    "to_attention_metadata",
    "uninstall",
]

# A child of vLLM's own logger: its handler and format show npugraph's lines in vLLM's log.
logger = logging.getLogger("vllm.npugraph")

WRAPPER_PATH = "npugraph.integrations.vllm.NpuGraphWrapper"
_RUNTIME_ATTR = "_npugraph_runtime"


def attach_runtime(vllm_config: Any, runtime: Runtime) -> Runtime:
    """Make every wrapper built for ``vllm_config`` use ``runtime``."""
    setattr(vllm_config, _RUNTIME_ATTR, runtime)
    return runtime


def runtime_for(vllm_config: Any) -> Runtime:
    """The runtime of ``vllm_config`` (created on first use: one per engine config)."""
    rt = getattr(vllm_config, _RUNTIME_ATTR, None)
    if rt is None:
        model = getattr(vllm_config, "model_config", None)
        if model is None:
            raise NpuGraphError(
                "npugraph needs max_model_len: the VllmConfig has no model_config; call "
                "npugraph.integrations.vllm.attach_runtime(vllm_config, Runtime(...)) first"
            )
        rt = runtime_from_env(int(model.max_model_len), "npu" if _platform_has_npu_graphs() else "sim")
        attach_runtime(vllm_config, rt)
    return rt


def to_attention_metadata(obj: Any) -> AttentionMetadata:
    """Read the contract's fields from a backend's metadata object (see the module doc).

    MLA backends (vllm-ascend's ``AscendMLAMetadata``) keep the decode lengths and table
    in ``obj.decode`` (``seq_lens_list``, ``block_table``) and the cumulative query ends of
    speculative steps in ``actual_seq_lengths_q``; those are read when present.
    """
    if isinstance(obj, AttentionMetadata):
        return obj
    ascend = getattr(obj, "actual_seq_lengths_q", None) is not None or isinstance(getattr(obj, "seq_lens", None), list)
    if ascend and getattr(obj, "decode", None) is None:
        return vllm_ascend.metadata_from_ascend(obj)  # vllm-ascend's AscendMetadata: host lengths and query ends
    decode = getattr(obj, "decode", None)
    if decode is not None and getattr(decode, "seq_lens_list", None) is not None:
        meta = to_attention_metadata(decode)
        ends = getattr(decode, "actual_seq_lengths_q", None) or getattr(obj, "actual_seq_lengths_q", None)
        if ends is not None and meta.query_start_loc is None:
            qsl = torch.tensor([0, *[int(x) for x in ends]], dtype=torch.int32, device="cpu")
            meta = AttentionMetadata(seq_lens=meta.seq_lens, block_table=meta.block_table, query_start_loc=qsl)
        return meta
    seq = getattr(obj, "seq_lens_list", None)
    if seq is not None:
        seq_lens = torch.tensor(seq, dtype=torch.int32, device="cpu")  # host-side: the kernels' tiling reads it
    else:
        seq_lens = _first_attr(obj, ("seq_lens_cpu", "seq_lens"))
        if seq_lens is None:
            raise MetadataError(
                f"{type(obj).__name__} has no seq_lens_list / seq_lens_cpu / seq_lens; an attention "
                "backend must provide the per-request key lengths on the host"
            )
        seq_lens = seq_lens.to(torch.int32)
    table = _first_attr(obj, ("block_tables", "block_table", "block_table_tensor"))
    if table is None:
        raise MetadataError(f"{type(obj).__name__} has no block_tables / block_table attribute")
    qsl = _first_attr(obj, ("query_start_loc_cpu", "query_start_loc"))
    return AttentionMetadata(seq_lens=seq_lens, block_table=table, query_start_loc=qsl)


def _first_attr(obj: Any, names: tuple[str, ...]) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return None


def _step_metadata(attn_metadata: Any) -> StepMetadata:
    """Map ``forward_context.attn_metadata`` to npugraph's step metadata.

    A dict keyed by layer name gives a dict; a list of such dicts (micro-batching)
    gives a list, one per micro-batch. Each distinct metadata object is converted once.
    """
    converted: dict[int, AttentionMetadata] = {}

    def one(d: Any) -> dict[str, AttentionMetadata]:
        if not isinstance(d, Mapping):
            raise MetadataError(
                "forward_context.attn_metadata must be a dict keyed by attention layer name (or a list "
                f"of such dicts with micro-batching), got {type(d).__name__}"
            )
        out: dict[str, AttentionMetadata] = {}
        for name, obj in d.items():
            m = converted.get(id(obj))
            if m is None:
                m = converted[id(obj)] = to_attention_metadata(obj)
            out[name] = m
        return out

    if isinstance(attn_metadata, list):
        return [one(d) for d in attn_metadata]
    return one(attn_metadata)


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
        if not self.runtime.has(key, namespace=self.namespace):
            # first call for this key, or its graph was freed (Runtime.reset: the profiling
            # capture that sized the KV cache, see estimate_graph_memory): capture it
            return self._capture(key, args, kwargs)
        if self.check_addresses:
            self._check_addresses(key, args, kwargs)
        metadata = (
            _step_metadata(self._attn_metadata(ctx))
            if self._full and self.runtime.entry(key, namespace=self.namespace).tasks
            else {}
        )
        if metadata:
            # vLLM padded the batch to this descriptor; the graph's padding rule may still
            # refuse it (all request rows real, fewer tokens): then it runs eagerly, as a
            # batch with no graph does
            refused = self.runtime.refusal(key, metadata, namespace=self.namespace)
            if refused is not None:
                if key not in self._eager_keys:
                    self._eager_keys.add(key)
                    logger.warning("npugraph: running a batch of %s eagerly (said once per key): %s", key, refused)
                return self.runnable(*args, **kwargs)
        # the runtime's one step protocol, in its order (replay-first by default: the
        # device starts the graph while the host updates layer by layer)
        return self.runtime.step(key, metadata, namespace=self.namespace)

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
            finally:
                ctx.capturing = was_capturing
        compilation_counter.num_cudagraph_captured += 1
        if not opts.weak_ref_output:
            self._strong[key] = out  # the caller asked the wrapper to own the outputs
        return self.runtime.entry(key, namespace=self.namespace).outputs

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
    as micro-batch ``i`` (:func:`npugraph.integrations.vllm_ascend.draft_step`), and each
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


# --- installation ---------------------------------------------------------------------


def _platform_has_npu_graphs(platform: Any = None) -> bool:
    if platform is None:
        from vllm.platforms import current_platform as platform
    return str(getattr(platform, "device_type", "")) == "npu" or str(getattr(platform, "device_name", "")) == "npu"


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def install(platform: Any = None) -> None:
    """Make vLLM (and vllm-ascend, if installed) use npugraph's wrapper and updater.

    Replaced names, and why it is safe:

    * ``<platform class>.get_static_graph_wrapper_cls`` → returns
      ``npugraph.integrations.vllm.NpuGraphWrapper``: vLLM resolves the wrapper
      class through it by name each time it builds one;
    * vllm-ascend ``vllm_ascend.compilation.acl_graph.ACLGraphWrapper`` (and the
      alias in ``vllm_ascend.worker.model_runner_v1``) → :class:`NpuGraphWrapper`,
      which has the same constructor and call contract;
    * vllm-ascend's own graph recorders and per-step update → npugraph's
      (:func:`npugraph.integrations.vllm_ascend.install`, for its Aug and Sept 2026
      generations): its backends become thin clients, and its update a no-op, since
      npugraph's wrapper updates the graph itself (a second update would record each
      event twice: a lost record, then a hang).

    Every original is kept on the patched object (``_npugraph_original_*``) and
    restored by :func:`uninstall`.  What was replaced is logged; every expected name
    that was not found is warned about, once, by name.
    """
    if platform is None:
        from vllm.platforms import current_platform as platform
    cls = type(platform)
    if not hasattr(cls, "_npugraph_original_wrapper_cls"):
        cls._npugraph_original_wrapper_cls = cls.__dict__.get("get_static_graph_wrapper_cls")
        cls.get_static_graph_wrapper_cls = classmethod(lambda c: WRAPPER_PATH)
    for module_name, names in _PATCHED:
        _patch(module_name, names, NpuGraphWrapper)
    _patch_capture_model()
    _patch_kv_budget()
    vllm_ascend.install()
    for module_name, names in _PATCHED_DRAFT:  # after vllm-ascend's own import order (vllm_ascend.install)
        _patch(module_name, names, DraftNpuGraphWrapper)
    _log_once(f"npugraph: installed as the graph wrapper of {cls.__name__} (pid {os.getpid()})")


# vllm-ascend names install() replaces (where the module and the name exist), and uninstall() restores.
_PATCHED = (
    ("vllm_ascend.compilation.acl_graph", ("ACLGraphWrapper",)),
    ("vllm_ascend.worker.model_runner_v1", ("ACLGraphWrapper",)),
)


# vllm-ascend's speculative proposer (MTP, EAGLE): its draft model's graph wrapper
_PATCHED_DRAFT = (("vllm_ascend.spec_decode.llm_base_proposer", ("ACLGraphWrapper",)),)


# vLLM's model runner, whose capture_model() captures every size (vllm-ascend's calls it too)
_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")


def say_captured(runtime: Runtime) -> str:
    """:func:`npugraph.integrations.report.say_captured` in vLLM's log."""
    return _say_captured(runtime, logger)


def _patch_capture_model() -> None:
    """After vLLM's ``capture_model`` returns, say what npugraph captured in this process."""
    try:
        module = __import__(_RUNNER[0], fromlist=["_"])
    except Exception:  # vLLM without its model runner (or broken): nothing to say after
        return
    cls = getattr(module, _RUNNER[1], None)
    if cls is None or hasattr(cls, "_npugraph_original_capture_model"):
        return
    original = cls.capture_model

    @functools.wraps(original)
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        config = getattr(self, "vllm_config", None)
        runtime = getattr(config, _RUNTIME_ATTR, None)
        if runtime is not None and runtime.manager.entries():
            say_captured(runtime)
            estimate = getattr(config, _ESTIMATE_ATTR, None)
            if estimate is not None:
                held = sum(e.memory_bytes for e in runtime.entries())
                logger.info(
                    "npugraph: graph memory: %.2f MiB estimated before the KV cache and left out of its budget; "
                    "the capture took %.2f MiB (each size measured alone; a pool the profiling capture grew is "
                    "reused)",
                    estimate.bytes / _MIB,
                    held / _MIB,
                )
        return out

    cls._npugraph_original_capture_model = original
    cls.capture_model = capture_model


# vllm-ascend's worker, whose determine_available_memory() sizes the KV cache, and its runner
_WORKER = ("vllm_ascend.worker.worker", "NPUWorker")
_ASCEND_RUNNER = "vllm_ascend.worker.model_runner_v1"
_ACL_GRAPH = "vllm_ascend.compilation.acl_graph"
_GRAPH_PARAMS = ("_graph_params", "_draft_graph_params", "_draft_graph_prefill_params")
_ESTIMATE_ATTR = "_npugraph_graph_memory_estimate"
_MIB = float(1 << 20)


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
            f"{self.bytes / _MIB:.2f} MiB for {self.sizes} sizes (the largest size's capture took "
            f"{self.first / _MIB:.2f} MiB, each further size {self.per_graph / _MIB:.2f} MiB; vLLM's figure, "
            f"warm-up included: {self.vllm / _MIB:.2f} MiB)"
        )


def estimate_graph_memory(runner: Any) -> GraphMemoryEstimate:
    """Measure the device memory the runner's graphs will hold, before the KV cache exists.

    vLLM's own profiling capture (``GPUModelRunner.profile_cudagraph_memory``: the two
    largest sizes of each mode against a minimal KV cache) runs as vllm-ascend runs vLLM's
    capture (its torch.cuda → torch.npu names); npugraph's measure of each capture makes
    the estimate (:class:`GraphMemoryEstimate`).  The profiling graphs are freed after it
    (vLLM frees only its own wrappers'), so the real capture captures every size again,
    into the same pool.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    ascend = sys.modules[_ASCEND_RUNNER]
    config = runner.vllm_config
    runtime = runtime_for(config)
    initialize = runner.initialize_kv_cache
    dispatcher = runner.cudagraph_dispatcher
    get_descs = dispatcher.get_capture_descs
    modes: list[Any] = []

    def initialize_kv_cache(kv_cache_config: Any, is_profiling: bool = False) -> None:
        # vLLM's profiling asks for is_profiling=True; vllm-ascend 0.23's runner takes no
        # such argument (its PR #14293 adds it) and builds the minimal cache as any other
        initialize(kv_cache_config)

    def get_capture_descs() -> Any:
        modes[:] = get_descs()  # the sizes vLLM will capture, per mode
        return modes

    # vllm-ascend sets its graph parameters once per process, at the KV cache's
    # initialisation: the real one must find them unset again
    params = sys.modules.get(_ACL_GRAPH)
    saved = {name: getattr(params, name) for name in _GRAPH_PARAMS if hasattr(params, name)}
    runner.initialize_kv_cache = initialize_kv_cache
    dispatcher.get_capture_descs = get_capture_descs
    try:
        module = ascend._get_gpu_model_runner_module_name(runner)
        with ascend._torch_cuda_wrapper(), ascend._replace_gpu_model_runner_function_wrapper(module):
            vllm_bytes = int(GPUModelRunner.profile_cudagraph_memory(runner))
        took: dict[int, int] = {}  # per token count: what its captures took (every namespace)
        for entry in runtime.entries():
            took[entry.tokens] = took.get(entry.tokens, 0) + entry.memory_bytes
        return GraphMemoryEstimate.of([[int(d.num_tokens) for d in descs] for _, descs in modes], took, vllm_bytes)
    finally:
        del runner.initialize_kv_cache
        del dispatcher.get_capture_descs
        for name, value in saved.items():
            setattr(params, name, value)
        for layer in config.compilation_config.static_forward_context.values():
            # vllm-ascend's attention keeps the KV cache its first forward saw (set to None in
            # its __init__): the minimal profiling cache, which vLLM's clean-up does not reach
            impl = getattr(layer, "impl", None)
            for name in ("key_cache", "value_cache"):
                if getattr(impl, name, None) is not None:
                    setattr(impl, name, None)
        runtime.reset()  # the profiling graphs: each wrapper captures its keys again
        gc.collect()
        torch.npu.empty_cache()  # type: ignore[attr-defined]


# what estimate_graph_memory() uses of vllm-ascend and vLLM, by module: checked before patching
_KV_BUDGET_NAMES = (
    (_WORKER[0], (_WORKER[1],)),
    (
        _ASCEND_RUNNER,
        ("_torch_cuda_wrapper", "_replace_gpu_model_runner_function_wrapper", "_get_gpu_model_runner_module_name"),
    ),
    (_ACL_GRAPH, ("_graph_params",)),
    (_RUNNER[0], (_RUNNER[1],)),
)


def kv_budget_missing() -> list[str]:
    """The names the KV-cache budget's estimate needs and this vllm-ascend/vLLM lacks."""
    missing = []
    for module_name, names in _KV_BUDGET_NAMES:
        module = sys.modules.get(module_name)
        missing += [f"{module_name}.{n}" for n in names if module is None or not hasattr(module, n)]
    runner = getattr(sys.modules.get(_RUNNER[0]), _RUNNER[1], None)
    if runner is not None and not hasattr(runner, "profile_cudagraph_memory"):
        missing.append(f"{_RUNNER[0]}.{_RUNNER[1]}.profile_cudagraph_memory")
    return missing


def _patch_kv_budget() -> None:
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
        estimate = estimate_graph_memory(self.model_runner)
        setattr(config, _ESTIMATE_ATTR, estimate)
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


def _restore(obj: Any, name: str) -> None:
    """Put back ``obj.<name>`` as it was before npugraph replaced it (kept beside it as
    ``_npugraph_original_<name>``); nothing if ``obj`` is None or was not patched."""
    marker = f"_npugraph_original_{name}"
    if obj is not None and hasattr(obj, marker):
        setattr(obj, name, getattr(obj, marker))
        delattr(obj, marker)


def _unpatch_kv_budget() -> None:
    _restore(getattr(sys.modules.get(_WORKER[0]), _WORKER[1], None), "determine_available_memory")


def _unpatch_capture_model() -> None:
    _restore(getattr(sys.modules.get(_RUNNER[0]), _RUNNER[1], None), "capture_model")


def _patch(module_name: str, names: tuple[str, ...], value: Any) -> None:
    try:
        module = __import__(module_name, fromlist=["_"])
    except Exception:  # vllm-ascend absent (or broken): nothing to replace
        return
    for name in names:
        if hasattr(module, name) and not hasattr(module, f"_npugraph_original_{name}"):
            current = getattr(module, name)
            if isinstance(current, type) and issubclass(current, NpuGraphWrapper):
                # imported from a module patched before it: vllm-ascend's own class is
                # the one that module keeps (what uninstall() puts back here too)
                current = _original_wrapper(name, current)
            setattr(module, f"_npugraph_original_{name}", current)
            setattr(module, name, value)


def _original_wrapper(name: str, default: Any) -> Any:
    for module_name, names in _PATCHED:
        module = sys.modules.get(module_name)
        if name in names and module is not None and hasattr(module, f"_npugraph_original_{name}"):
            return getattr(module, f"_npugraph_original_{name}")
    return default


def _unpatch(module_name: str, names: tuple[str, ...]) -> None:
    for name in names:
        _restore(sys.modules.get(module_name), name)


def uninstall(platform: Any = None) -> None:
    """Undo :func:`install` on ``platform``: every name it replaced gets its original back."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    cls = type(platform)
    if hasattr(cls, "_npugraph_original_wrapper_cls"):
        original = cls._npugraph_original_wrapper_cls
        del cls.get_static_graph_wrapper_cls
        if original is not None:
            cls.get_static_graph_wrapper_cls = original
        del cls._npugraph_original_wrapper_cls
    for module_name, names in _PATCHED + _PATCHED_DRAFT:
        _unpatch(module_name, names)
    _unpatch_capture_model()
    _unpatch_kv_budget()
    vllm_ascend.uninstall()


def register() -> None:
    """vLLM general-plugin entry point: install npugraph when ``NPUGRAPH_ENABLE=1``.

    It never raises (vLLM's plugin loader would print a traceback and go on): a bad
    setting is one error line in vLLM's log, and vLLM is left untouched.
    """
    if not enabled():
        return
    try:
        device = check_settings()
    except ConfigError as exc:
        logger.error("npugraph: %s; vLLM left untouched", exc)
        return
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        _log_once(f"npugraph: {ENV_ENABLE}=1 but vLLM cannot be imported ({exc}); nothing installed")
        return
    if device is None and not _platform_has_npu_graphs(current_platform):
        _log_once(
            f"npugraph: platform {type(current_platform).__name__} has no NPU graphs; vLLM left "
            f"untouched (set {ENV_DEVICE}=sim to use npugraph's simulator)"
        )
        return
    install(current_platform)
