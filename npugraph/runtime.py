"""The runtime an engine holds: capture, update and replay, plus the attention entry point."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs
import torch

from npugraph.capture import CapturedGraph, CaptureManager, WidthKey
from npugraph.device import Device, load_device
from npugraph.dump.manifest import build_manifest, save_manifest
from npugraph.dump.postmortem import PostMortem
from npugraph.dump.trace import UpdateTrace
from npugraph.errors import BatchRefused, ConfigError, MetadataError, NpuGraphError, UnknownKeyError
from npugraph.metadata import AttentionMetadata, capture_lens, convert, eager_rows
from npugraph.ops import FIA_FROZEN, AttentionCall
from npugraph.policy import KernelPolicy, UpdateFreeCosts
from npugraph.replay import ORDERS, GraphState, ReplayUpdater, StepMetadata

__all__ = ["PAD_SLOT_ID", "Runtime"]

# vLLM's padding slot: the KV-cache write kernels skip it, so a padding token writes nowhere.
PAD_SLOT_ID = -1
# What Runtime.step pads a shorter input with (others: 0): a padding token's slot must not
# be a slot of the cache, or it overwrites a real token's key and value.
DEFAULT_PAD_VALUES: Mapping[str, float] = MappingProxyType({"slot_mapping": PAD_SLOT_ID})


class Runtime:
    """Capture a model's decode step per padded size, then update and replay it per step.

    Workflow:

    1. create the runtime and the model; the model's attention layers are
       :class:`npugraph.attention.DecodeAttention` clients of this runtime;
    2. :meth:`capture` once per key (token count or any hashable key), largest first,
       passing the static input buffers the graph reads (the callable runs once,
       recorded, not executed);
    3. per step, :meth:`step` copies the step's inputs into those buffers, updates the
       graph's lengths and block tables from the step's metadata, and replays it
       (or call :meth:`update` and :meth:`replay` yourself, in either order);
    4. :meth:`synchronize` before reading outputs on the host; a device hang becomes
       :class:`~npugraph.errors.GraphDeadlock` naming namespace, key and layer.

    Outputs are non-owning aliases of the graph's memory: valid until another graph of
    the same pool replays (clone what you keep).  Outside capture the attention
    clients run eagerly, with the kernel the graph of the same size uses.
    """

    def __init__(
        self,
        device: str | Device = "sim",
        *,
        max_model_len: int,
        policy: KernelPolicy | None = None,
        validate: bool = True,
        skip_unchanged: bool = True,
        fused_update: bool | None = None,
        order: str = "replay-first",
        progress: bool = False,
        postmortem_dir: str | None = None,
        trace_depth: int = 16,
        eager_fallback: Callable[[Hashable, StepMetadata, Mapping[str, torch.Tensor]], Any] | None = None,
        defer_block_check: bool | None = None,
        event_group: int | None = None,
        device_lengths: bool = True,
        update_free: UpdateFreeCosts | None = None,
    ) -> None:
        if order not in ORDERS:  # before any device work
            raise ConfigError(f"order must be 'replay-first' or 'update-first', got {order!r}")
        self.device = load_device(device)
        self.manager = CaptureManager(
            self.device,
            max_model_len=max_model_len,
            progress=progress,
            event_group=event_group,
            device_lengths=device_lengths,
        )
        self.trace = UpdateTrace(depth=trace_depth)
        self.updater = ReplayUpdater(
            self.manager,
            order=order,
            validate=validate,
            skip_unchanged=skip_unchanged,
            fused_update=fused_update,
            on_error=self._on_error,
            on_update=self.trace.note,
            defer_block_check=defer_block_check,
        )
        self.manager.on_captured = self.updater.register
        self.postmortem = PostMortem(self.manager, self.updater, self.trace, postmortem_dir)
        self.validate = validate
        self.eager_fallback = eager_fallback
        # per step, a key's update-free graph or its updated one, by these modeled costs
        # (None: the update-free graph whenever a width holds the step)
        self.update_free = update_free
        self._namespaces: dict[str, int] = {}
        # per (namespace, key): its update-free graphs' widths and the graphs, narrowest first
        # (rebuilt at capture and reset, so a step builds nothing to pick among them)
        self._ladders: dict[tuple[str, Hashable], _Ladder] = {}
        if policy is not None:
            self.set_policy(policy)

    def set_policy(self, policy: KernelPolicy) -> None:
        """Use ``policy`` for graphs captured from now on (checked against this device)."""
        check = getattr(policy, "check_device", None)
        if check is not None:
            check(self.device.name)
        self.manager.policy = policy

    @property
    def max_model_len(self) -> int:
        return self.manager.max_model_len

    @property
    def order(self) -> str:
        """``"replay-first"`` (default: the device starts the graph while the host updates)
        or ``"update-first"``: the order of the two halves of every step."""
        return self.updater.order

    @order.setter
    def order(self, order: str) -> None:
        self.updater.order = order

    def _on_error(self, err: NpuGraphError, entry: CapturedGraph | None) -> None:
        self.postmortem.on_error(err, entry)

    # --- the attention entry point ---------------------------------------------------
    def attention(
        self,
        layer: str,
        call: AttentionCall,
        meta: AttentionMetadata,
        *,
        namespace: str = "main",
        group: str = "default",
        ubatch: int = 0,
    ) -> None:
        """Run one decode-attention call: eagerly, or recorded when capturing.

        ``ubatch`` is the micro-batch index when one forward runs several micro-batches
        through the same layers (their step metadata is then a list, one per micro-batch).
        Eagerly, ``meta`` may describe fewer requests than the query has token rows
        (vLLM's PIECEWISE steps carry padded tokens but unpadded metadata): the spare
        rows are padding and produce zeros.
        """
        tokens = int(call.query.shape[0])
        rows = int(call.block_table.shape[0])
        if self.manager.capturing:
            width, lens = capture_lens(meta, tokens=tokens, rows=rows, tokens_per_request=call.tokens_per_request)
            self.manager.attention(layer, group, _widened(call, width), lens, ubatch)
            return
        batch, width = eager_rows(meta, tokens=tokens, rows=rows, tokens_per_request=call.tokens_per_request)
        run = _widened(call, width)
        if batch > rows:
            run = attrs.evolve(run, block_table=_pad_rows(run.block_table, batch))
        if run.block_table.device != run.query.device:
            # a host table (an engine's CPU metadata): the kernel reads the table on the device
            staged = self.device.staged(run.block_table)
            run = attrs.evolve(run, block_table=staged.to(run.query.device, non_blocking=True))
        lens = convert(
            meta,
            batch=batch,
            tokens=tokens,
            max_model_len=self.max_model_len,
            block_size=run.block_size,
            num_blocks=int(run.key_cache.shape[0]),
            capacity_blocks=int(run.block_table.shape[1]),
            where=f"eager {namespace} layer {layer!r}",
            validate=self.validate,
            tokens_per_request=call.tokens_per_request if meta.query_start_loc is None else 1,
            table_device=self.device.memory,
        )
        ladder = self._ladders.get((namespace, tokens)) if self._ladders else None
        frozen = None
        if ladder:
            updated = self.manager.has(namespace, tokens)
            kv = lens.kv_lens
            frozen = pick_width(ladder.widths, max(kv), sum(kv), batch, self.update_free, updated)
        if frozen is not None and FIA_FROZEN.unsupported(run) is None:
            # the kernel the step's replay would run: update-free at the narrowest width that holds it
            FIA_FROZEN.run_eager(self.device, run, lens, width=frozen)
            return
        self.manager.eager_kernel(namespace, tokens, run).run_eager(self.device, run, lens)

    # --- capture / update / replay ---------------------------------------------------
    def capture(
        self,
        fn: Callable[..., Any],
        *args: Any,
        key: Hashable,
        namespace: str = "main",
        tokens: int | None = None,
        static_inputs: Mapping[str, torch.Tensor] | None = None,
        require_attention: bool = True,
        width: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Capture ``fn(*args, **kwargs)`` for ``key``; see :meth:`CaptureManager.capture`.

        ``width``: capture it update-free, FIA's lengths frozen to ``width`` keys and each
        request's own length masked on the device (no per-layer update); stored as
        ``WidthKey(key, width)``, beside ``key``'s other widths and its updated graph (captured
        without ``width``).  :meth:`step` of ``key`` then replays the narrowest width that
        holds the step's longest request, else the updated graph.
        Capturing synchronizes the device first (as ``torch.npu.graph`` does): an error
        of earlier steps is reported here, typed, before anything is captured.
        """
        self.synchronize()
        if width is not None and tokens is None and isinstance(key, int) and not isinstance(key, bool):
            tokens = key
        try:
            return self.manager.capture(
                fn,
                *args,
                key=key if width is None else WidthKey(key, width),
                namespace=namespace,
                tokens=tokens,
                static_inputs=static_inputs,
                require_attention=require_attention,
                width=width,
                **kwargs,
            )
        finally:
            self._index_widths()

    def _index_widths(self) -> None:
        """The update-free graphs of each key, narrowest first (after every capture and reset)."""
        ladders: dict[tuple[str, Hashable], list[tuple[int, CapturedGraph]]] = {}
        for e in self.manager.entries():
            if isinstance(e.key, WidthKey):
                ladders.setdefault((e.namespace, e.key.key), []).append((e.key.width, e))
                if e.key.key != e.tokens:  # an engine's own key (vLLM's batch descriptor): eager
                    # steps, which know only their token count, find the widths by it too
                    ladders.setdefault((e.namespace, e.tokens), []).append((e.key.width, e))
        self._ladders = {k: _Ladder.of(dict(v)) for k, v in ladders.items()}

    def capture_all(
        self,
        keys: Iterable[Hashable],
        make: Callable[[Hashable], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
        *,
        namespace: str = "main",
        size: Callable[[Hashable], int] | None = None,
    ) -> None:
        """Capture every key, largest first (smaller graphs reuse the shared pool).

        ``make(key)`` returns ``(fn, args, kwargs)`` for :meth:`capture`; ``size(key)``
        orders non-integer keys (default: the key itself).  Synchronizes first, as
        :meth:`capture` does.
        """
        self.synchronize()
        self.manager.capture_all(keys, make, namespace=namespace, size=size)

    def capture_report(self, namespace: str | None = None) -> str:
        """One line on what is captured (also logged at INFO after :meth:`capture_all`):
        graphs, attention tasks, kernels, capture time, graph-pool memory."""
        return self.manager.capture_report(namespace)

    # --- what is captured ------------------------------------------------------------
    def entries(self, namespace: str | None = None) -> list[CapturedGraph]:
        """The captured graphs (of one namespace, or all)."""
        return self.manager.entries(namespace)

    def entry(self, key: Hashable, *, namespace: str = "main") -> CapturedGraph:
        """The captured graph of ``key``; raises :class:`~npugraph.errors.UnknownKeyError`
        listing the captured keys."""
        return self.manager.entry(namespace, key)

    def has(self, key: Hashable, *, namespace: str = "main") -> bool:
        """Whether ``key`` has a captured graph in ``namespace``."""
        return self.manager.has(namespace, key)

    def key_for(self, num_tokens: int, num_reqs: int | None = None, *, namespace: str = "main") -> Hashable:
        """The smallest captured key whose graph :meth:`step` runs for a batch of
        ``num_reqs`` real requests (default: ``num_tokens``, plain decode) with
        ``num_tokens`` real query tokens (the last entry of its ``query_start_loc``, or
        tokens per request times requests); :meth:`step` then pads the inputs and the
        metadata to that graph.

        It applies the rule the step's update applies (:func:`npugraph.metadata.batch_refusal`):
        the graph must hold the requests and the tokens, and spare tokens need a padding
        row, so a graph whose request rows are all real takes no spare token.  Raises
        :class:`~npugraph.errors.UnknownKeyError` when no captured graph runs the batch.
        """
        reqs = num_tokens if num_reqs is None else num_reqs
        entries = sorted(self.manager.entries(namespace), key=lambda e: (e.tokens, e.batch))
        for e in entries:
            if self.updater.plan(e).refusal(num_tokens, reqs) is None:
                return e.key
        have = [e.tokens for e in entries]
        why = ""
        if entries:
            why = f"; the largest, {entries[-1].key!r}: {self.updater.plan(entries[-1]).refusal(num_tokens, reqs)}"
        raise UnknownKeyError(
            f"no graph in namespace {namespace!r} holds {num_tokens} tokens and {reqs} requests (captured token "
            f"counts: {have}{why}); run this batch eagerly (Runtime(eager_fallback=...)) or "
            "capture a larger size, with a spare request row if the batch's tokens do not fill it"
        )

    def refusal(self, key: Hashable, metadata: StepMetadata, *, namespace: str = "main") -> str | None:
        """Why the graph of ``key`` cannot run the batch ``metadata`` holds, by the rule
        :meth:`key_for` applies (too many requests or tokens, or spare tokens with no
        padding row), or ``None``.  An engine whose batch was padded to a key it did not
        choose (vLLM's dispatcher) asks this before :meth:`step`, and runs the batch eagerly
        when it gets a reason; nothing else is checked (:meth:`step` validates the rest)."""
        return self.updater.refusal(namespace, key, metadata)

    def graph_state(self, key: Hashable, *, namespace: str = "main") -> GraphState:
        """The step state of the graph of ``key``: its phase, replays, steps, last lengths."""
        return self.updater.state(self.manager.entry(namespace, key))

    def reset(self, namespace: str | None = None, key: Hashable | None = None) -> None:
        """Free captured graphs: one key, one namespace, or all (the keys capture again).

        Synchronizes first: a graph must not be freed while the device may still run it.
        """
        self.synchronize()
        self.manager.reset(namespace, key)
        if key is not None:  # the key's update-free graphs go with it
            for ns, k in list(self._ladders):
                if k == key and namespace in (None, ns):
                    for w in self._ladders[(ns, k)].widths:
                        self.manager.reset(ns, WidthKey(k, w))
        self._index_widths()

    def unique_namespace(self, prefix: str) -> str:
        """A namespace name not used yet by this runtime (``prefix.0``, ``prefix.1``, ...)."""
        n = self._namespaces.get(prefix, 0)
        self._namespaces[prefix] = n + 1
        return f"{prefix}.{n}"

    def update(self, key: Hashable, metadata: StepMetadata, *, namespace: str = "main") -> None:
        """Write the step's metadata into the graph of ``key`` (no host synchronize).

        ``metadata``: layer or KV-cache-group name → :class:`AttentionMetadata`, or a
        list of such mappings, one per micro-batch.
        """
        self.updater.update(namespace, key, metadata)

    def replay(self, key: Hashable, *, namespace: str = "main") -> Any:
        """Enqueue the graph of ``key``; return its outputs (aliases of the graph's memory).

        They are valid until another graph of the same pool replays: clone what you keep.
        """
        self.updater.replay(namespace, key)
        return self.manager.entry(namespace, key).outputs

    def step(
        self,
        key: Hashable,
        metadata: StepMetadata,
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        namespace: str = "main",
        pad_values: Mapping[str, float] | None = None,
        refusable: bool = False,
    ) -> Any:
        """Copy ``inputs`` into the captured buffers, then update and replay; return the outputs.

        Each input's first dimension may be shorter than the captured buffer; the rest
        is filled with ``pad_values[name]``, else :data:`DEFAULT_PAD_VALUES` (``-1`` for
        ``slot_mapping``), else 0.  **Padding tokens run the whole
        model, KV-cache write included**: their slot must write nowhere — ``-1``
        (vLLM's ``PAD_SLOT_ID``, which the cache-write kernels skip) — or it overwrites
        whatever request owns that slot, silently (a replay-vs-eager check cannot see it:
        both write the same garbage).  Name your slot input ``slot_mapping``, or pass
        ``pad_values`` for it.  A key that was never captured raises
        :class:`~npugraph.errors.UnknownKeyError` listing the captured keys, or runs
        ``eager_fallback(key, metadata, inputs)`` when one was configured.  Bad metadata
        is refused before any device call; after any error the next good step succeeds.

        ``refusable=True``: the caller runs a batch this graph's padding rule refuses some
        other way (eagerly: vLLM's wrapper, whose batch vLLM padded to a descriptor it chose),
        and gets :class:`~npugraph.errors.BatchRefused` for it, before the graph is updated or
        replayed (``inputs`` are copied already, into buffers no replay then reads), not
        reported as a fault: one call per engine step,
        the metadata resolved once (:meth:`refusal` asks the same without stepping).
        """
        entry = self.graph_for(key, metadata, namespace=namespace)  # the step's one lookup
        if entry is None:
            if self.eager_fallback is not None:
                return self.eager_fallback(key, metadata, inputs or {})
            entry = self.manager.entry(namespace, key)  # raises, listing the captured keys
        return self.step_graph(entry, metadata, inputs, pad_values=pad_values, refusable=refusable)

    def graph_for(self, key: Hashable, metadata: StepMetadata, *, namespace: str = "main") -> CapturedGraph | None:
        """The graph a step of ``key`` with ``metadata`` replays, or ``None`` (none captured):
        with update-free graphs of ``key``, the narrowest width that holds the step (unless
        ``update_free``'s costs model the updated graph faster), else its updated graph; a
        request longer than every width with no updated graph is refused
        (:class:`~npugraph.errors.BatchRefused`, naming it)."""
        entry = self.find(key, namespace=namespace)
        ladder = self._ladders.get((namespace, key)) if self._ladders else None
        if ladder:
            entry = _narrowest(ladder, entry, metadata, f"{namespace}/{key!r}", self.update_free)
        return entry

    def find(self, key: Hashable, *, namespace: str = "main") -> CapturedGraph | None:
        """The captured graph of ``key``, or ``None``: an engine's one lookup per step, whose
        graph it then steps with :meth:`step_graph` (or captures, where there is none)."""
        return self.manager.find(namespace, key)

    def step_graph(
        self,
        entry: CapturedGraph,
        metadata: StepMetadata,
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        pad_values: Mapping[str, float] | None = None,
        refusable: bool = False,
    ) -> Any:
        """:meth:`step` of a graph :meth:`find` returned."""
        if inputs:  # (a refused step leaves them in buffers no replay reads: the next step's overwrite them)
            self.copy_inputs(entry, inputs, pad_values)
        return self.updater.step_entry(entry, metadata, refusable=refusable)

    def copy_inputs(
        self,
        entry: CapturedGraph,
        inputs: Mapping[str, torch.Tensor],
        pad_values: Mapping[str, float] | None = None,
    ) -> None:
        """Copy ``inputs`` into ``entry``'s static input buffers, padding the rest.

        Every input is checked before any is copied, so a bad one changes nothing.
        """
        pads = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
        where = f"{entry.namespace}/{entry.key!r}"
        pairs = []
        for name, src in inputs.items():
            dst = entry.static_inputs.get(name)
            if dst is None:
                raise MetadataError(
                    f"{where}: no static input named {name!r} was registered at capture "
                    f"(have {sorted(entry.static_inputs)})"
                )
            if not isinstance(src, torch.Tensor) or src.dim() == 0:
                what = type(src).__name__ if not isinstance(src, torch.Tensor) else "a 0-d tensor"
                raise MetadataError(f"{where}: input {name!r} must be a tensor of rows, got {what}")
            if src.dim() != dst.dim() or src.shape[1:] != dst.shape[1:]:
                raise MetadataError(
                    f"{where}: input {name!r} has shape {list(src.shape)}; the captured buffer is "
                    f"{list(dst.shape)} (only the first dimension may be shorter)"
                )
            if int(src.shape[0]) > int(dst.shape[0]):
                raise MetadataError(
                    f"{where}: input {name!r} has {int(src.shape[0])} rows, the captured buffer {int(dst.shape[0])}"
                )
            if src.dtype != dst.dtype:
                # a silent cast would hide a model or engine bug (float32 activations into fp16)
                raise MetadataError(
                    f"{where}: input {name!r} is {src.dtype}, the captured buffer {dst.dtype}; convert it "
                    "yourself if that is what you mean"
                )
            if src.device.type not in ("cpu", self.device.memory.type):
                raise MetadataError(
                    f"{where}: input {name!r} is on {src.device}; pass it on the host or on {self.device.memory}"
                )
            pairs.append((name, src, dst))
        for name, src, dst in pairs:
            n = int(src.shape[0])
            dst[:n].copy_(self.device.staged(src), non_blocking=True)
            if n < dst.shape[0]:
                dst[n:].fill_(pads.get(name, 0))

    def synchronize(self) -> None:
        """Wait for the device; name the namespace, key and layer if it would hang.

        A replay still waiting for its update is released (it runs with no request) and
        reported as :class:`~npugraph.errors.GraphDeadlock` (the device would otherwise wait
        out its event timeout); a fault inside a replay
        raises :class:`~npugraph.errors.ReplayFailed` naming graph and layer.  Then a bad
        block id found by the device-side check of a device-resident block table is
        reported (:class:`~npugraph.errors.MetadataError` naming step, key and layer).
        """
        self.updater.synchronize()

    # --- introspection ---------------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        """One row per captured graph: namespace, key, kernel and why, tasks, workspace."""
        rows = []
        for e in self.manager.entries():
            rows.append(
                {
                    "namespace": e.namespace,
                    "key": e.key,
                    "tokens": e.tokens,
                    "kernel": e.choice.kernel,
                    "reason": e.choice.reason,
                    "tasks": len(e.tasks),
                    "workspace_bytes": e.workspace_bytes,
                    "replays": self.updater.state(e).replays,
                    "phase": self.updater.state(e).phase.value,
                }
            )
        return rows

    def manifest(self) -> dict[str, Any]:
        """The capture manifest (see :mod:`npugraph.dump.manifest`)."""
        return build_manifest(self.manager, self.updater, self.trace)

    def save_manifest(self, path: str) -> None:
        save_manifest(self.manifest(), path)


@attrs.frozen
class _Ladder:
    """A key's update-free graphs: their widths, narrowest first, and the graph of each."""

    widths: tuple[int, ...]
    graphs: tuple[CapturedGraph, ...]

    @classmethod
    def of(cls, by_width: Mapping[int, CapturedGraph]) -> _Ladder:
        widths = tuple(sorted(by_width))
        return cls(widths=widths, graphs=tuple(by_width[w] for w in widths))


@attrs.frozen
class _Longest:
    """A step's longest request (its keys, index and metadata name) and all its keys."""

    keys: int
    index: int
    name: str
    total: int


def _longest(metadata: StepMetadata) -> _Longest | None:
    """The step's longest request and its keys in all (each distinct metadata once), or
    ``None`` where the metadata is malformed (the step's validation then says how)."""
    per = metadata if isinstance(metadata, Sequence) and not isinstance(metadata, (str, bytes)) else [metadata]
    keys = index = total = 0
    name = ""
    seen: set[int] = set()
    try:
        for mapping in per:
            for label, m in mapping.items():
                if id(m) in seen or m.seq_lens.numel() == 0:
                    continue
                seen.add(id(m))
                lens = m.seq_lens.tolist()
                n = max(lens)
                total += sum(lens)
                if n > keys:
                    keys, index, name = n, lens.index(n), str(label)
    except (AttributeError, TypeError, RuntimeError, ValueError):
        return None
    return _Longest(keys, index, name, total)


def pick_width(
    widths: Sequence[int], longest: int, keys: int, rows: int, costs: UpdateFreeCosts | None, updated: bool
) -> int | None:
    """The update-free width a step runs at: the narrowest of ``widths`` that holds its
    ``longest`` request, unless ``costs`` model the updated graph (there is one: ``updated``)
    faster for its ``keys`` on ``rows`` request rows; ``None``: the updated graph."""
    width = next((w for w in widths if longest <= w), None)
    if width is not None and costs is not None and updated and not costs.prefers_update_free(width, rows, keys):
        return None
    return width


def _narrowest(
    ladder: _Ladder,
    updated: CapturedGraph | None,
    metadata: StepMetadata,
    where: str,
    costs: UpdateFreeCosts | None = None,
) -> CapturedGraph | None:
    """The graph a step of ``where`` replays: the narrowest update-free width that holds its
    longest request (unless ``costs`` model the updated graph faster), else the updated graph
    (per layer); a request longer than every width, with no updated graph, is refused naming it."""
    longest = _longest(metadata)
    if longest is None:
        return updated if updated is not None else ladder.graphs[-1]  # its validation reports the metadata
    rows = ladder.graphs[0].batch
    width = pick_width(ladder.widths, longest.keys, longest.total, rows, costs, updated is not None)
    if width is not None:
        return ladder.graphs[ladder.widths.index(width)]
    if updated is not None:
        return updated
    raise BatchRefused(
        f"{where}: request {longest.index} of {longest.name!r} has {longest.keys} keys, over the widest "
        f"update-free graph ({ladder.widths[-1]}); capture a wider width, or this key without a width "
        "(lengths updated per step)"
    )


def _widened(call: AttentionCall, tokens_per_request: int) -> AttentionCall:
    """``call`` running ``tokens_per_request`` query tokens per request (causal when over 1)."""
    if tokens_per_request == call.tokens_per_request:
        return call
    return attrs.evolve(call, tokens_per_request=tokens_per_request)


def _pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """``table`` with zero rows appended up to ``rows`` (eager padding requests read no block)."""
    out = torch.zeros(rows, table.shape[1], dtype=table.dtype, device=table.device)
    out[: table.shape[0]].copy_(table)
    return out
