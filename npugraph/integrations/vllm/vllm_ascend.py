"""vllm-ascend's own attention backends as thin clients of npugraph.

vllm-ascend records its graph path itself, in two generations:

* **Aug 2026** (``compilation/acl_graph.py``, ``attention/attention_v1.py``): while the
  forward context says ``capturing``, ``AscendAttentionBackendImpl.full_graph_pa`` /
  ``full_graph_fia`` / ``full_graph_fia_v2`` record an ExternalEvent, a task group and the
  kernel into module-level ``GraphParams``; per step the runner calls
  ``update_full_graph_params(...)``, which calls each backend's ``update_graph_params``
  staticmethod to re-issue them.
* **Sept 2026** (``compilation/updatable_graph.py``, PRs #15908/#16798; the V2 runner's
  ``worker/v2/updatable_graph.py``): backends call ``register_task(operation, kwargs,
  provider)`` and ``get_capture_resource(key, factory, use_max_workspace)``, which find the
  ``UpdatableGraph`` being captured through a ``ContextVar``; per step the runner resolves
  each task's ``ParamProvider`` and calls ``graph.update(update_stream, tasks)``.

:func:`install` makes both record through :meth:`npugraph.Runtime.attention` instead (the
recorders become thin clients: one npugraph task per layer, validated, padded and
updated by npugraph's one step protocol), and turns their per-step update into a no-op —
npugraph's wrapper already updated the graph, and a second update would record every
event twice (a lost record, then a hang).  It says what it replaced.  vllm-ascend's names
drift: where one it expects is missing it replaces nothing, and the plugin refuses by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from npugraph.errors import CaptureFailed
from npugraph.integrations.vllm.metadata import metadata_from_ascend
from npugraph.metadata import AttentionMetadata
from npugraph.ops import AttentionCall
from npugraph.runtime import Runtime

__all__ = ["Replaced", "capturing", "detect", "draft_step", "import_in_order", "install", "uninstall"]

logger = logging.getLogger("vllm.npugraph")

_OPS = "vllm_ascend.ops"
_ATTENTION = "vllm_ascend.attention.attention_v1"
_ACL_GRAPH = "vllm_ascend.compilation.acl_graph"
_UPDATABLE = ("vllm_ascend.compilation.updatable_graph", "vllm_ascend.worker.v2.updatable_graph")
_IMPL = "AscendAttentionBackendImpl"
_MLA = "vllm_ascend.attention.mla_v1"
_MLA_IMPL = "AscendMLAImpl"
_RECORDERS = ("full_graph_pa", "full_graph_fia", "full_graph_fia_v2")
_MARK = "_npugraph_original_"


@attrs.frozen(kw_only=True)
class _Capture:
    """The runtime a capture records into, the graph's namespace, and where device memory a
    recorder made for the graph is kept alive as long as the graph (its caller's list)."""

    runtime: Runtime
    namespace: str
    keep: list[Any]


# The capture in progress (set by NpuGraphWrapper around a capture): a ContextVar, as
# vllm-ascend's own active graph is, so that the recorders need no global.
_CAPTURING: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("npugraph_capturing", default=None)
# The attention layer whose forward is running (its name keys the step's metadata).
_LAYER: contextvars.ContextVar[str | None] = contextvars.ContextVar("npugraph_layer", default=None)


@contextlib.contextmanager
def capturing(runtime: Runtime, namespace: str, keep: list[Any] | None = None) -> Iterator[None]:
    """Route vllm-ascend's recorders to ``runtime`` for the capture this block runs; device
    memory a recorder makes for the graph is appended to ``keep``, which the caller holds
    as long as the graph lives."""
    token = _CAPTURING.set(_Capture(runtime=runtime, namespace=namespace, keep=[] if keep is None else keep))
    try:
        yield
    finally:
        _CAPTURING.reset(token)


@attrs.frozen(kw_only=True)
class Replaced:
    """What :func:`install` found: the generation, the names it replaced, those it missed."""

    generation: str
    replaced: tuple[str, ...]
    missing: tuple[str, ...]


def version() -> str:
    """The installed vllm-ascend's version, as its distribution records it."""
    try:
        return importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return "(of no recorded version)"


def detect() -> str | None:
    """Which vllm-ascend generation is importable: ``"sept-2026"``, ``"aug-2026"`` or None."""
    if any(_module(m) is not None and hasattr(_module(m), "register_task") for m in _UPDATABLE):
        return "sept-2026"
    attn = _module(_ATTENTION)
    if attn is not None and hasattr(getattr(attn, _IMPL, None), "full_graph_pa"):
        return "aug-2026"
    return None


def install() -> Replaced | None:
    """Make the installed vllm-ascend's backends record through npugraph (see the module doc).

    Returns what was replaced (None where vllm-ascend is not installed) and logs it.  Where
    an expected name is missing (a release whose internals moved), it puts back what it had
    replaced and returns the names it missed: half a replacement would leave a kernel that
    vllm-ascend records and nobody updates, or updated twice, so the plugin refuses whole
    (:func:`npugraph.integrations.vllm.plugin.install` says so in one ERROR line).
    """
    import_in_order()
    generation = detect()
    if generation is None:
        if _module("vllm_ascend") is None:
            return None
        # neither generation's mark: this release records and updates its graphs some other way
        marks = f"{_ATTENTION}.{_IMPL}.full_graph_pa (Aug 2026) or {_UPDATABLE[0]}.register_task (Sept 2026)"
        return Replaced(generation="unknown", replaced=(), missing=(marks,))
    replaced: list[str] = []
    missing: list[str] = []
    impl = getattr(_module(_ATTENTION), _IMPL, None)
    if impl is not None:
        _replace_attr(impl, "forward", _named_forward(impl), f"{_ATTENTION}.{_IMPL}.forward", replaced, missing)
    else:
        missing.append(f"{_ATTENTION}.{_IMPL}")
    if generation == "aug-2026" and impl is not None:
        for name in _RECORDERS:
            _replace_attr(impl, name, _recorder(name), f"{_ATTENTION}.{_IMPL}.{name}", replaced, missing)
        label = f"{_ATTENTION}.{_IMPL}.update_graph_params"
        _replace_attr(impl, "update_graph_params", staticmethod(_noop), label, replaced, missing)
    mla = getattr(_module(_MLA), _MLA_IMPL, None)
    if mla is not None and "_forward_decode" in vars(mla):
        where = f"{_MLA}.{_MLA_IMPL}"
        _replace_attr(mla, "forward", _named_forward(mla), f"{where}.forward", replaced, missing)
        _replace_attr(
            mla,
            "_forward_decode",
            _mla_decode(vars(mla)["_forward_decode"]),
            f"{where}._forward_decode",
            replaced,
            missing,
        )
    acl_graph = _module(_ACL_GRAPH)
    if generation == "aug-2026" or hasattr(acl_graph, "update_full_graph_params"):
        # 0.30 still updates its MLA (and SFA, DSA) layers there, from GraphParams that
        # npugraph's capture leaves empty: npugraph updates every layer itself
        _replace_everywhere("update_full_graph_params", _noop, _ACL_GRAPH, replaced, missing)
    if generation != "aug-2026":
        for module_name in _UPDATABLE:
            if _module(module_name) is None:
                continue
            _replace_everywhere("register_task", _register_task, module_name, replaced, missing)
            _replace_everywhere("get_capture_resource", _get_capture_resource, module_name, replaced, missing)
            graph_cls = getattr(_module(module_name), "UpdatableGraph", None)
            if graph_cls is None:
                missing.append(f"{module_name}.UpdatableGraph")
                continue
            where = f"{module_name}.UpdatableGraph"
            _replace_attr(graph_cls, "resolve_tasks", _no_tasks, f"{where}.resolve_tasks", replaced, missing)
            _replace_attr(graph_cls, "update", _noop_method, f"{where}.update", replaced, missing)
    result = Replaced(generation=generation, replaced=tuple(replaced), missing=tuple(missing))
    if missing:
        uninstall()
        return attrs.evolve(result, replaced=())
    logger.info("npugraph: vllm-ascend (%s) installed; replaced %s", generation, ", ".join(replaced) or "nothing")
    return result


def import_in_order() -> None:
    """Import vllm-ascend's ops package first, as its worker does, before any other of its
    modules npugraph reads.

    Its modules import each other in a cycle (0.23.0.post1: attention_v1 -> device_op -> ops ->
    fused_moe -> experts_selector -> device_op; 0.29.0rc1: worker/v2/aclgraph_utils -> ... ->
    fused_moe.moe_mlp -> device_op) that closes only from the ops package.  The plugin loads
    before the worker, so it imports in the same order: from anywhere else the import fails
    halfway and leaves the cycle's modules half-initialised for vLLM's own imports."""
    _module(_OPS)


def uninstall() -> None:
    """Put back every name :func:`install` replaced."""
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("vllm_ascend"):
            continue
        _restore(module)
        for value in list(vars(module).values()):
            if isinstance(value, type):
                _restore(value)


def _module(name: str) -> Any:
    """The module ``name``, or None where it does not exist (another failure is logged)."""
    try:
        return __import__(name, fromlist=["_"])
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(f"{exc.name}.")):
            _log_import_failure(name, exc)
        return None
    except Exception as exc:
        _log_import_failure(name, exc)
        return None


def _log_import_failure(name: str, exc: Exception) -> None:
    logger.warning("npugraph: importing %s failed (%s: %s); its names are not replaced", name, type(exc).__name__, exc)


def _replace_attr(owner: Any, name: str, value: Any, label: str, replaced: list[str], missing: list[str]) -> None:
    if name not in vars(owner):
        missing.append(label)
        return
    if f"{_MARK}{name}" not in vars(owner):
        setattr(owner, f"{_MARK}{name}", vars(owner)[name])
        setattr(owner, name, value)
    replaced.append(label)


def _replace_everywhere(name: str, value: Any, home: str, replaced: list[str], missing: list[str]) -> None:
    """Replace ``home.name`` and every vllm-ascend module's copy of it (``from home import name``)."""
    original = getattr(_module(home), name, None)
    if original is None:
        missing.append(f"{home}.{name}")
        return
    for module in list(sys.modules.values()):
        mod_name = getattr(module, "__name__", "")
        if module is None or not mod_name.startswith("vllm_ascend") or vars(module).get(name) is not original:
            continue
        setattr(module, f"{_MARK}{name}", original)
        setattr(module, name, value)
        replaced.append(f"{mod_name}.{name}")


def _restore(owner: Any) -> None:
    for attr in [a for a in vars(owner) if a.startswith(_MARK)]:
        setattr(owner, attr[len(_MARK) :], vars(owner)[attr])
        delattr(owner, attr)


def _noop(*args: Any, **kwargs: Any) -> None:
    """vllm-ascend's per-step update: npugraph's wrapper already updated the graph."""


def _noop_method(self: Any, *args: Any, **kwargs: Any) -> None:
    """``UpdatableGraph.update``: npugraph's wrapper already updated the graph."""


def _no_tasks(self: Any, *args: Any, **kwargs: Any) -> tuple[()]:
    """``UpdatableGraph.resolve_tasks``: npugraph holds the tasks; nothing to resolve."""
    return ()


def _named_forward(impl: type) -> Callable[..., Any]:
    """``forward(self, layer, ...)`` that makes the layer's name known to the recorders
    (``layer`` is the attention layer, or its name: MLA's ``forward(layer_name, ...)``)."""
    original = vars(impl)["forward"]

    @functools.wraps(original)
    def forward(self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        name: str | None = layer if isinstance(layer, str) else None
        if name is None:
            name = getattr(self, "kv_sharing_target_layer_name", None) or getattr(layer, "layer_name", None)
        token = _LAYER.set(name)
        try:
            return original(self, layer, *args, **kwargs)
        finally:
            _LAYER.reset(token)

    return forward


def draft_step() -> int:
    """Which draft step of vllm-ascend's merged draft is running (0 outside a draft).

    vllm-ascend's proposer runs the draft model's layers once per draft token inside one
    graph, and points ``forward_context.attn_metadata`` at that step's entry of
    ``forward_context.draft_attn_metadatas`` before each: the step is that entry's index.
    npugraph records each step's attention as that micro-batch, updated from its own
    step's metadata (:class:`npugraph.integrations.vllm.DraftNpuGraphWrapper`).
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return 0
    ctx = get_forward_context()
    steps = getattr(ctx, "draft_attn_metadatas", None)
    if not isinstance(steps, list):
        return 0
    return next((i for i, meta in enumerate(steps) if meta is ctx.attn_metadata), 0)


def _one_token_rows(meta: AttentionMetadata, tokens: int, keep: list[Any]) -> AttentionMetadata:
    """The capture-time metadata of a later draft step as vllm-ascend serves it.

    vllm-ascend's proposer captures every draft step with the first's metadata (requests
    of ``1 + k`` query tokens) but serves its later steps, in a full graph, as ``tokens``
    requests of one query token each (``attn_update_stack_num_spec_norm``: the block table
    padded to one row per token, the query ends 1, 2, ...), and updates their attention
    so.  The graph's task is therefore captured with one row per token, every row's key
    length its request's, and as its block table a buffer of that many rows which each
    step's table is copied into: one the draft wrapper made before the capture (in
    ``keep``).  Not one made here: inside the capture it would be a block of the graph's
    pool, which an earlier node of the same graph (the first draft step's, freed by then)
    may write at every replay after the step's table was copied in: the replay would read
    whatever that node left there as block ids (refused with ``CaptureFailed``).
    """
    table = meta.block_table
    made = [t for t in keep if t.shape[0] >= tokens and t.shape[1] >= table.shape[1] and t.dtype == table.dtype]
    if not made:
        raise CaptureFailed(
            f"a later draft step of {tokens} tokens needs a block-table buffer of {tokens} rows made before the "
            "capture; capture the draft through npugraph's DraftNpuGraphWrapper"
        )
    per = tokens // max(1, meta.num_reqs)
    seq = meta.seq_lens.repeat_interleave(per)[:tokens].contiguous()
    return AttentionMetadata(seq_lens=seq, block_table=made[0][:tokens, : int(table.shape[1])], query_start_loc=None)


def _current() -> _Capture:
    cap = _CAPTURING.get()
    if cap is None:
        raise CaptureFailed(
            "vllm-ascend recorded a graph task outside an npugraph capture: its ACLGraphWrapper (or another "
            "wrapper) captured the graph, so npugraph would never update it. Install npugraph before the model "
            "runner builds its wrappers (NPUGRAPH_ENABLE=1 and the vllm.general_plugins entry point)."
        )
    return cap


def _layer(self: Any, layer: Any = None) -> str:
    name = getattr(layer, "layer_name", None) or _LAYER.get() or getattr(self, "_layer_name", None)
    if not name:
        raise CaptureFailed(
            "vllm-ascend's recorder ran without a layer name: npugraph keys every task by the layer whose "
            "metadata updates it; call the backend through its forward(layer, ...)"
        )
    return str(name)


def _attend(self: Any, query: torch.Tensor, meta: Any, out: torch.Tensor, layer: Any = None) -> None:
    cap = _current()
    window = getattr(self, "sliding_window", None)
    npu_meta = metadata_from_ascend(meta)
    call = AttentionCall(
        query=query,
        key_cache=self.key_cache,
        value_cache=self.value_cache,
        block_table=npu_meta.block_table,
        out=out.view(query.shape[0], self.num_heads, -1),
        num_heads=int(self.num_heads),
        num_kv_heads=int(self.num_kv_heads),
        scale=float(self.scale),
        window=int(window) if window else None,
    )
    cap.runtime.attention(_layer(self, layer), call, npu_meta, namespace=cap.namespace, ubatch=draft_step())


def _recorder(name: str) -> Callable[..., Any]:
    """The replacement of one ``full_graph_*`` recorder, with its signature and return."""
    if name == "full_graph_pa":

        def full_graph_pa(self: Any, query: torch.Tensor, attn_metadata: Any, output: Any = None) -> Any:
            _attend(self, query, attn_metadata, output)
            return output

        return full_graph_pa

    def full_graph_fia(
        self: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        layer: Any = None,
    ) -> tuple[torch.Tensor, int]:
        if name == "full_graph_fia_v2" and getattr(self, "sinks", None) is not None:
            raise CaptureFailed(
                f"layer {_layer(self, layer)!r} has attention sinks (FIA v2 learnable_sink): npugraph's FIA "
                "declarations do not pass sinks yet; capture this model with vllm-ascend's own graph mode"
            )
        num_tokens = int(attn_metadata.actual_seq_lengths_q[-1])
        view = output.view(query.shape[0], self.num_heads, -1)
        _attend(self, query, attn_metadata, view, layer)
        return view, num_tokens

    full_graph_fia.__name__ = name
    return full_graph_fia


def _mla_refusal(impl: Any, dequant_scale: Any) -> str | None:
    """Why npugraph cannot record this MLA layer's decode (vllm-ascend's variants it has no
    declaration for), or None."""
    if getattr(impl, "fa_quant_layer", False) or dequant_scale is not None:
        return "its attention is quantised (fa_quant)"
    if getattr(impl, "enable_kv_nz", False):
        return "its KV cache is in the NZ format (enable_kv_nz)"
    if getattr(impl, "head_padding", 0):
        return f"its {impl.num_heads} heads are padded to a power of two"
    if getattr(impl, "qk_rope_head_dim", 64) == 0:
        return "it has no rope part (MLA-NoPE)"
    return None


def _mla_decode_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``_forward_decode``'s arguments as ``(q_nope, q_pe, k_nope, k_pe, block_size,
    attn_metadata, dequant_scale_q_nope)``, from either of vllm-ascend's signatures: 0.23's
    seven, or 0.30's ``(decode_preprocess_res, block_size, attn_metadata)``, whose first is
    its ``DecodeMLAPreprocessResult`` (``ql_nope``, ``q_pe``, ``k_nope``, ``k_pe``, ...)."""
    first = args[0] if args else kwargs.get("decode_preprocess_res")
    if hasattr(first, "ql_nope"):
        bound = dict(zip(("decode_preprocess_res", "block_size", "attn_metadata"), args)) | kwargs
        res = bound["decode_preprocess_res"]
        return (
            res.ql_nope,
            res.q_pe,
            res.k_nope,
            res.k_pe,
            bound["block_size"],
            bound["attn_metadata"],
            res.dequant_scale_q_nope,
        )
    names = ("q_nope", "q_pe", "k_nope", "k_pe", "block_size", "attn_metadata", "dequant_scale_q_nope")
    bound = dict(zip(names, args)) | kwargs
    return tuple(bound.get(n) for n in names)


def _mla_decode(original: Callable[..., Any]) -> Callable[..., Any]:
    """``AscendMLAImpl._forward_decode`` as a thin client of npugraph inside its capture.

    vllm-ascend's decode of an MLA layer runs FIA v2 with rope arguments on the latent
    cache; captured, it records the kernel with the step's lengths and its own event into
    its ``GraphParams``.  Inside npugraph's capture the same attention is npugraph's MLA
    task (the ``mla`` declaration: FIA with rope arguments, one latent KV head), with the
    layer's decode metadata (``decode.seq_lens_list``, ``decode.block_table``); its output
    is the latent attention per token and head, which the layer's own up projection turns
    into values, as vllm-ascend's.  Outside npugraph's capture, vllm-ascend's own code runs.
    """

    @functools.wraps(original)
    def _forward_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        cap = _CAPTURING.get()
        if cap is None:
            return original(self, *args, **kwargs)
        q_nope, q_pe, k_nope, k_pe, block_size, attn_metadata, dequant_scale_q_nope = _mla_decode_args(args, kwargs)
        layer = _layer(self)
        why = _mla_refusal(self, dequant_scale_q_nope)
        if why is not None:
            raise CaptureFailed(f"MLA layer {layer!r}: {why}; capture this model with vllm-ascend's own graph mode")
        meta = metadata_from_ascend(attn_metadata.decode)
        tokens, latent = int(q_nope.shape[0]), int(self.kv_lora_rank)
        step = draft_step()
        if step > 0 and meta.query_start_loc is not None and meta.num_reqs < tokens:
            meta = _one_token_rows(meta, tokens, cap.keep)
        out = torch.empty(tokens, self.num_heads, latent, dtype=q_pe.dtype, device=q_pe.device)
        call = AttentionCall(
            query=q_nope.contiguous(),  # [T, N, latent]: the up-projected query, transposed (vllm-ascend's copy too)
            key_cache=k_nope.view(-1, block_size, 1, latent),
            value_cache=k_nope.view(-1, block_size, 1, latent),
            block_table=meta.block_table,
            out=out,
            num_heads=int(self.num_heads),
            num_kv_heads=1,
            scale=float(self.scale),
            query_rope=q_pe,
            key_rope_cache=k_pe.view(-1, block_size, 1, int(self.qk_rope_head_dim)),
        )
        cap.runtime.attention(layer, call, meta, namespace=cap.namespace, ubatch=step)
        return self._v_up_proj(out.transpose(0, 1))  # [N, T, latent], as FIA's NBSD output

    return _forward_decode


# --- the Sept 2026 generation: register_task / get_capture_resource ----------------------


def _register_task(operation: Callable[..., Any], kwargs: dict[str, Any], provider: Any) -> None:
    """``register_task`` backed by npugraph: a known attention op becomes a runtime task."""
    cap = _CAPTURING.get()
    if cap is None:
        operation(**kwargs)  # eager, as vllm-ascend's own does
        return
    call, meta = _call_from_task(cap.runtime.device.ops, operation, kwargs)
    name = getattr(provider, "layer_name", None) or _LAYER.get()
    if not name:
        raise CaptureFailed(
            f"register_task({getattr(operation, '__name__', operation)!r}): its provider "
            f"{type(provider).__name__} names no layer; npugraph keys every task by its layer's metadata"
        )
    cap.runtime.attention(str(name), call, meta, namespace=cap.namespace)


def _get_capture_resource(key: Any, factory: Callable[[], Any], use_max_workspace: bool = False) -> Any:
    """Inside an npugraph capture the runtime sizes and owns the workspaces itself."""
    return None if _CAPTURING.get() is not None else factory()


def _call_from_task(
    ops: Any, operation: Callable[..., Any], kw: dict[str, Any]
) -> tuple[AttentionCall, AttentionMetadata]:
    """The npugraph call and metadata an UpdatableGraph task describes (FIA TND paged, or PA);
    the operation is recognised by identity with the device's own entry points."""
    op = getattr(operation, "__name__", str(operation))
    fia = getattr(ops, "npu_fused_infer_attention_score", None)
    if operation is getattr(ops, "_npu_paged_attention", None):
        call = AttentionCall(
            query=kw["query"],
            key_cache=kw["key_cache"],
            value_cache=kw["value_cache"],
            block_table=kw["block_table"],
            out=kw["out"],
            num_heads=int(kw["num_heads"]),
            num_kv_heads=int(kw["num_kv_heads"]),
            scale=float(kw["scale_value"]),
        )
        lens = kw["context_lens"]
        seq = lens.tolist() if isinstance(lens, torch.Tensor) else list(lens)
        lens_t = torch.tensor(seq, dtype=torch.int32, device="cpu")  # host lengths
        return call, AttentionMetadata(seq_lens=lens_t, block_table=kw["block_table"])
    is_fia = fia is not None and operation in (fia, getattr(fia, "out", None))
    if is_fia and kw.get("input_layout") == "TND" and kw.get("block_table") is not None:
        q = kw["query"]
        n, kvn = int(kw["num_heads"]), int(kw.get("num_key_value_heads") or kw["num_heads"])
        key, value = kw["key"], kw["value"]
        nb, bs = int(key.shape[0]), int(key.shape[1])
        sparse, pre = int(kw.get("sparse_mode", 0)), kw.get("pre_tokens")
        call = AttentionCall(
            query=q,
            key_cache=key.view(nb, bs, kvn, -1),
            value_cache=value.view(nb, bs, kvn, -1),
            block_table=kw["block_table"],
            out=kw["out"][0].view(q.shape[0], n, -1),
            num_heads=n,
            num_kv_heads=kvn,
            scale=float(kw.get("scale", 1.0)),
            window=int(pre) + 1 if sparse == 4 and pre is not None else None,
        )
        ends = [int(x) for x in kw["actual_seq_lengths"]]
        kv = [int(x) for x in kw["actual_seq_lengths_kv"]]
        qsl = torch.tensor([0, *ends], dtype=torch.int32, device="cpu")
        return call, AttentionMetadata(
            seq_lens=torch.tensor(kv, dtype=torch.int32, device="cpu"),
            block_table=kw["block_table"],
            query_start_loc=qsl,
        )
    raise CaptureFailed(
        f"register_task({op}): npugraph records PA and paged TND FIA tasks; this operation has no npugraph "
        "declaration yet (capture this model with vllm-ascend's own graph mode)"
    )
