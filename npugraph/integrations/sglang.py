"""SGLang's NPU decode graphs, captured and updated by npugraph.

SGLang 0.5.23 (``sglang.srt.hardware_backend.npu``) captures one ``torch.npu.NPUGraph`` per
decode batch size with torch_npu's auto-dispatch capture and, every step, rewrites the
attention lengths with torch_npu's ``NPUGraph.update`` on a worker thread beside the replay.
This plugin, loaded through SGLang's ``sglang.srt.plugins`` entry points and active with
``NPUGRAPH_ENABLE=1``, hooks (through SGLang's own ``HookRegistry``, ``AROUND`` hooks):

* ``NPUCudaGraphBackend.capture_one``: SGLang's two warm-ups as it runs them, then the
  capture by npugraph's capture manager (one task per attention layer, kernel chosen per
  batch size, event grouping, its capture report);
* ``AscendAttnBackend.forward_decode_graph``: while npugraph captures, a plain MHA layer's
  attention goes to :meth:`npugraph.Runtime.attention` (the KV-cache write stays SGLang's);
* ``NPUCudaGraphBackend.replay_with_input_update``: one :meth:`npugraph.Runtime.step` from the
  step's lengths and the graph's block table (which SGLang has refreshed): validated,
  updated and replayed by npugraph.  torch_npu's ``update`` never runs;
* ``DecodeCudaGraphRunner.capture``: after all sizes, one INFO line in the scheduler process
  and the capture manifest written to :func:`report_path` (``$NPUGRAPH_REPORT_DIR``,
  default: the temporary directory).

and, at SGLang's request intake (a ``BEFORE`` hook, in the server's main process):

* ``TokenizerManager._validate_one_request``: a prompt holding a token id outside the
  vocabulary is refused with SGLang's own request error (a 400 with the message).  SGLang
  0.5.23 checks no prompt id against the vocabulary, and its scheduler's embedding lookup
  then takes the whole server down (on a device, the lookup faults the NPU): this guards
  that SGLang defect, whatever graphs the server runs.

Only SGLang's target decode runner (``NPUGraphRunner``) of a model whose attention layers are
all plain MHA is taken; anything else (MLA, attention sinks, sliding windows, speculative
draft runners) stays SGLang's, and the plugin says so by name.  :func:`uninstall` restores.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import pkgutil
from collections.abc import Callable
from typing import Any

import attrs
import torch

from npugraph.capture import WidthKey
from npugraph.errors import ConfigError, NpuGraphError
from npugraph.integrations.common import (
    ENV_ENABLE,
    capture_widths,
    check_settings,
    enabled,
    env_update_free,
    report_path,
    runtime_from_env,
    say_captured,
    vocabulary_refusal,
    widths_for,
)
from npugraph.metadata import AttentionMetadata
from npugraph.ops import AttentionCall
from npugraph.runtime import Runtime

__all__ = ["ENV", "install", "load_plugin", "uninstall", "report_path"]

logger = logging.getLogger("sglang.npugraph")

ENV = ENV_ENABLE
_BACKEND = "sglang.srt.hardware_backend.npu.graph_runner.npu_cudagraph_backend.NPUCudaGraphBackend"
_ATTENTION = "sglang.srt.hardware_backend.npu.attention.ascend_backend.AscendAttnBackend"
_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
# the decode runner npugraph takes (its draft and ViT siblings stay SGLang's)
_DECODE_RUNNER = "NPUGraphRunner"
_STATE = "_npugraph_state"
_MARK = "_npugraph_original_"


@attrs.define
class _State:
    """npugraph's side of one SGLang NPU graph backend."""

    runtime: Runtime
    namespace: str
    tables: dict[Any, torch.Tensor] = attrs.field(factory=dict)  # shape key -> the graph's block table
    capturing: Any = None  # the shape key being captured
    # NPUGRAPH_UPDATE_FREE: the widths each size's update-free graphs take (None: none; ()
    # the default ladder, set at the first capture from its block size), and their outputs
    # (a step returns those of the graph it replayed)
    update_free: tuple[int, ...] | None = None
    widths: tuple[int, ...] | None = None
    outputs: dict[Any, Any] = attrs.field(factory=dict)


# The backend whose capture is running (set around npugraph's capture): the attention hook
# reads it, as vllm-ascend's recorders read their active graph, with no global.
_CAPTURING: contextvars.ContextVar[_State | None] = contextvars.ContextVar("npugraph_sglang_capture", default=None)


def _after_init(result: Any, backend: Any, cuda_graph_runner: Any, *args: Any, **kwargs: Any) -> None:
    """``NPUCudaGraphBackend.__init__``: take the backend if its runner is SGLang's decode runner."""
    name = type(cuda_graph_runner).__name__
    if name != _DECODE_RUNNER:
        _say_once(f"npugraph: {name}'s graphs stay SGLang's (npugraph takes {_DECODE_RUNNER}, the decode graphs)")
        return
    model_config = cuda_graph_runner.model_runner.model_config
    runtime = runtime_from_env(int(model_config.context_len), "npu")
    state = _State(runtime=runtime, namespace=runtime.unique_namespace("sglang.decode"), update_free=env_update_free())
    setattr(backend, _STATE, state)


def _state(backend: Any) -> _State | None:
    return getattr(backend, "__dict__", {}).get(_STATE)


def _capture_one(
    original: Callable[..., Any],
    backend: Any,
    shape_key: Any,
    forward_fn: Callable[[], Any],
    capture_inputs: Any = None,
    post_warmup_hook: Callable[[], None] | None = None,
) -> None:
    state = _state(backend)
    if state is None:
        return original(backend, shape_key, forward_fn, capture_inputs, post_warmup_hook)
    # SGLang's two warm-ups, as its capture_one runs them (kernels loaded, one-time set-up paid)
    for _ in range(2):
        backend._device_module.synchronize()
        backend._tp_group.barrier()
        forward_fn()
        if post_warmup_hook is not None:
            post_warmup_hook()
    state.capturing = shape_key
    token = _CAPTURING.set(state)
    try:
        size = getattr(shape_key, "size", shape_key)
        tokens = int(size) if isinstance(size, int) else None
        out = state.runtime.capture(forward_fn, key=shape_key, namespace=state.namespace, tokens=tokens)
        if state.update_free is not None:
            if state.widths is None:
                entry = state.runtime.entry(shape_key, namespace=state.namespace)
                state.widths = widths_for(state.runtime, entry, state.update_free)
            kw = {"key": shape_key, "namespace": state.namespace, "tokens": tokens, "log": logger}
            outs = capture_widths(state.runtime, state.widths, forward_fn, **kw)
            if outs is None:
                state.update_free = state.widths = None
            else:
                state.outputs.update({WidthKey(shape_key, w): o for w, o in outs.items()})
    finally:
        _CAPTURING.reset(token)
        state.capturing = None
    backend._graphs[shape_key] = state  # SGLang's can_run asks whether the key is there
    backend._outputs[shape_key] = out


def _forward_decode_graph(
    original: Callable[..., Any],
    attn: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: Any,
    forward_batch: Any,
    save_kv_cache: bool = True,
    q_rope: torch.Tensor | None = None,
    k_rope: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    state = _CAPTURING.get()
    if state is None:
        return original(attn, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks)
    why = _not_plain_mha(attn, layer, q_rope, sinks)
    if why is not None:
        # a layer npugraph cannot update would keep its capture-time lengths: refuse the capture
        raise NpuGraphError(
            f"npugraph cannot capture SGLang's decode graph {state.namespace}/{state.capturing}: layer "
            f"{layer.layer_id} is {why}; unset {ENV} to use SGLang's own NPU graphs for this model"
        )
    meta_in = attn.forward_metadata
    if save_kv_cache:  # the KV-cache write stays SGLang's, as its graph path issues it
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        loc = KVWriteLoc(forward_batch.out_cache_loc, meta_in.swa_out_cache_loc)
        attn.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
    heads, kv_heads = int(layer.tp_q_head_num), int(layer.tp_k_head_num)
    page = int(attn.page_size)
    query = q.reshape(-1, heads, int(layer.qk_head_dim))
    out = torch.empty(query.shape[0], heads, int(layer.v_head_dim), dtype=q.dtype, device=q.device)
    call = AttentionCall(
        query=query,
        key_cache=attn.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, page, kv_heads, layer.qk_head_dim),
        value_cache=attn.token_to_kv_pool.get_value_buffer(layer.layer_id).view(-1, page, kv_heads, layer.v_head_dim),
        block_table=meta_in.block_tables,
        out=out,
        num_heads=heads,
        num_kv_heads=kv_heads,
        scale=float(layer.scaling),
    )
    state.tables[state.capturing] = meta_in.block_tables
    meta = AttentionMetadata(seq_lens=_lens(meta_in), block_table=meta_in.block_tables)
    state.runtime.attention(f"layers.{layer.layer_id}", call, meta, namespace=state.namespace)
    return out.view(query.shape[0], heads * int(layer.v_head_dim))


def _not_plain_mha(attn: Any, layer: Any, q_rope: Any, sinks: Any) -> str | None:
    if getattr(attn, "use_mla", False) or q_rope is not None:
        return "an MLA layer"
    if sinks is not None:
        return "a layer with attention sinks"
    if getattr(attn, "is_hybrid_swa", False) or getattr(layer, "sliding_window_size", -1) not in (-1, None):
        return "a sliding-window layer"
    if getattr(layer, "logit_cap", 0) or getattr(layer, "is_cross_attention", False):
        return "a layer with a logit cap or cross-attention"
    return None


def _lens(meta: Any) -> torch.Tensor:
    lens = meta.seq_lens_cpu_int
    seq = lens.tolist() if lens is not None else list(meta.seq_lens_cpu_list)
    return torch.tensor(seq, dtype=torch.int32, device="cpu")


def _replay_with_input_update(
    original: Callable[..., Any],
    backend: Any,
    shape_key: Any,
    seq_lens: Any,
    attr_name: str | None = None,
    attr_type: Any = None,
    cpu_update_input: list[Any] | None = None,
) -> Any:
    state = _state(backend)
    if state is None or shape_key not in state.tables:
        return original(backend, shape_key, seq_lens, attr_name, attr_type, cpu_update_input)
    if cpu_update_input is not None:  # one dict per speculative step: a draft runner's convention
        raise NpuGraphError(
            f"npugraph: SGLang replays {state.namespace}/{shape_key} with one update per speculative step, "
            f"which its decode graphs never take; unset {ENV} for this model"
        )
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    meta = AttentionMetadata(
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cpu"), block_table=state.tables[shape_key]
    )
    metadata = {"default": meta}
    if not state.outputs:
        state.runtime.step(shape_key, metadata, namespace=state.namespace)
        return backend._outputs[shape_key]
    # with update-free graphs: the narrowest that holds the step (else the updated one), and its outputs
    entry = state.runtime.graph_for(shape_key, metadata, namespace=state.namespace)
    assert entry is not None  # the size was captured (state.tables has it)
    state.runtime.step_graph(entry, metadata)
    return state.outputs.get(entry.key, backend._outputs[shape_key])


def _after_capture(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """``DecodeCudaGraphRunner.capture``: say, once per engine process, that npugraph is active here."""
    state = _state(getattr(runner, "backend", None))
    if state is None:
        return
    say_captured(state.runtime, logger, state.namespace)


def _refuse_out_of_vocabulary(manager: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    """``TokenizerManager._validate_one_request``, before SGLang's checks: a prompt token id
    outside ``[0, vocab_size)`` is a ``ValueError``, which SGLang's endpoints answer with a
    400 and its message, as they answer a prompt longer than the context."""
    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    refused = vocabulary_refusal(input_ids, vocab, "SGLang", "SGLang's scheduler")
    if refused is not None:
        raise ValueError(refused)


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


_HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    (f"{_BACKEND}.__init__", "after", _after_init),
    (f"{_BACKEND}.capture_one", "around", _capture_one),
    (f"{_BACKEND}.replay_with_input_update", "around", _replay_with_input_update),
    (f"{_ATTENTION}.forward_decode_graph", "around", _forward_decode_graph),
    (f"{_RUNNER}.capture", "after", _after_capture),
)
# The request guard stands on its own: installed with the plugin whatever graphs SGLang runs.
_INTAKE: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    (f"{_TOKENIZER}._validate_one_request", "before", _refuse_out_of_vocabulary),
)
_KINDS = {"after": "AFTER", "around": "AROUND", "before": "BEFORE"}


def _resolve(target: str) -> Any:
    try:
        return pkgutil.resolve_name(target)
    except (ImportError, AttributeError, ValueError):
        return None


def install() -> bool:
    """Register npugraph's hooks with SGLang's ``HookRegistry`` (applied by SGLang after its
    plugins load, or here when called outside that).  Returns whether every graph target was
    found; each one missing is warned about by name and no graph hook is registered (the
    request guard is, where SGLang has its target)."""
    from sglang.srt.plugins import hook_registry as hr

    for target, _, _ in _INTAKE:
        if _resolve(target) is None:
            logger.warning("npugraph: SGLang has no %s; prompt ids go unguarded", target)
    _register(hr, [h for h in _INTAKE if _resolve(h[0]) is not None])
    missing = [target for target, _, _ in _HOOKS if _resolve(target) is None]
    for target in missing:
        logger.warning("npugraph: SGLang has no %s; npugraph leaves SGLang's NPU graphs as they are", target)
    if not missing:
        _register(hr, _HOOKS)
    if hr._current_plugin_source.get() is None:  # not inside SGLang's load_plugins: apply now
        hr.HookRegistry.apply_hooks()
    if missing:
        return False
    logger.info(
        "npugraph: SGLang's NPU decode graphs will be captured and updated by npugraph in the scheduler process "
        "(%s, %s, %s hooked)",
        "capture_one",
        "replay_with_input_update",
        "forward_decode_graph",
    )
    return True


def _register(hr: Any, hooks: Any) -> None:
    """Register each ``(target, kind, hook)`` not registered yet, SGLang's own function kept
    on its class for :func:`uninstall`."""
    for target, kind, hook in hooks:
        if any(h is hook for _, h, _ in hr.HookRegistry._hooks.get(target, [])):
            continue  # installed already
        owner_name, _, attr = target.rpartition(".")
        owner = _resolve(owner_name)
        if _MARK + attr not in owner.__dict__:  # SGLang's own, kept on its class for uninstall()
            setattr(owner, _MARK + attr, owner.__dict__[attr])
        hr.HookRegistry.register(target, hook, getattr(hr.HookType, _KINDS[kind]))


def uninstall() -> None:
    """Put SGLang's own functions back and drop npugraph's hooks."""
    from sglang.srt.plugins import hook_registry as hr

    mine = {hook for _, _, hook in _HOOKS + _INTAKE}
    for target, _, _ in _HOOKS + _INTAKE:
        owner_name, _, attr = target.rpartition(".")
        owner = _resolve(owner_name)
        if owner is not None and _MARK + attr in owner.__dict__:
            setattr(owner, attr, owner.__dict__[_MARK + attr])
            delattr(owner, _MARK + attr)
        hooks = hr.HookRegistry._hooks.get(target, [])
        hooks[:] = [entry for entry in hooks if entry[1] not in mine]
        hr.HookRegistry._patched.discard(target)


def load_plugin() -> None:
    """SGLang's ``sglang.srt.plugins`` entry point: install when ``NPUGRAPH_ENABLE`` is on, its
    settings checked first (a bad one is one error line, and SGLang is left untouched)."""
    if not enabled():
        return
    try:
        check_settings()
    except ConfigError as exc:
        logger.error("npugraph: %s; SGLang left untouched", exc)
        return
    install()
