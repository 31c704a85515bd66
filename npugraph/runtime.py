"""The runtime an engine holds: capture, update and replay, plus the attention entry point."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from npugraph.capture.manager import CaptureManager, GraphEntry, Phase, strong_tree
from npugraph.device import Device, load_device
from npugraph.errors import GraphDeadlock, GraphRace, NpuGraphError
from npugraph.ops import SPECS, AttentionCall
from npugraph.replay.lens import AttentionMetadata, convert, pad_lens
from npugraph.replay.updater import ReplayUpdater, StepMetadata, describe_device_error

__all__ = ["Runtime"]


class Runtime:
    """Capture a model's decode step per padded size, then update and replay it per step.

    Workflow:

    1. create the runtime and the model; the model's attention layers are
       :class:`npugraph.attention.DecodeAttention` clients of this runtime;
    2. :meth:`capture` once per key (token count or any hashable key), largest first,
       passing the static input buffers the graph reads;
    3. per step, :meth:`step` copies the step's inputs into those buffers, updates the
       graph's lengths and block tables from the step's metadata, and replays it
       (or call :meth:`update` and :meth:`replay` yourself, in either order);
    4. :meth:`synchronize` before reading outputs on the host; a device hang becomes
       :class:`~npugraph.errors.GraphDeadlock` naming namespace, key and layer.

    Outside capture the attention clients run eagerly, with the kernel the graph of
    the same size uses, so eager and replayed steps compute the same thing.
    """

    def __init__(
        self,
        device: str | Device = "sim",
        *,
        max_model_len: int,
        policy: Any = None,
        validate: bool = True,
        skip_unchanged: bool = True,
        fused_update: bool | None = None,
        order: str = "update-first",
        progress: bool = False,
        postmortem_dir: str | None = None,
        trace_depth: int = 16,
        eager_fallback: Callable[[Hashable, StepMetadata, Mapping[str, torch.Tensor]], Any] | None = None,
    ) -> None:
        if order not in ("update-first", "replay-first"):
            raise ValueError(f"order must be 'update-first' or 'replay-first', got {order!r}")
        self.device = load_device(device)
        self.manager = CaptureManager(self.device, max_model_len=max_model_len, progress=progress)
        from npugraph.dump.trace import PostMortem, UpdateTrace

        self.trace = UpdateTrace(depth=trace_depth)
        self.postmortem = PostMortem(self.manager, self.trace, postmortem_dir)
        self.updater = ReplayUpdater(
            self.manager,
            validate=validate,
            skip_unchanged=skip_unchanged,
            fused_update=fused_update,
            on_error=self.postmortem.on_error,
        )
        self.order = order
        self.validate = validate
        self.eager_fallback = eager_fallback
        self._namespaces: dict[str, int] = {}
        if policy is not None:
            self.set_policy(policy)

    def set_policy(self, policy: Any) -> None:
        """Use ``policy`` for graphs captured from now on (checked against this device)."""
        check = getattr(policy, "check_device", None)
        if check is not None:
            check(self.device.name)
        self.manager.policy = policy

    @property
    def max_model_len(self) -> int:
        return self.manager.max_model_len

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
        """
        tokens = int(call.query.shape[0])
        batch = int(call.block_table.shape[0])
        if self.manager.phase is not Phase.IDLE:
            lens = pad_lens(
                meta.seq_lens.tolist(),
                None if meta.query_start_loc is None else meta.query_start_loc.tolist()[1:],
                batch,
                tokens,
            )
            self.manager.attention(layer, group, call, lens, ubatch)
            return
        lens = convert(
            meta,
            batch=batch,
            tokens=tokens,
            max_model_len=self.max_model_len,
            block_size=call.block_size,
            num_blocks=int(call.key_cache.shape[0]),
            capacity_blocks=int(call.block_table.shape[1]),
            where=f"eager {namespace} layer {layer!r}",
            validate=self.validate,
        )
        choice = self.manager.kernel_for(namespace, tokens)
        if choice is None or choice.kernel not in SPECS:
            choice = self.manager.policy.choose(namespace, tokens, tokens, [call])
        spec = SPECS[choice.kernel]
        spec.launch(self.device, spec.arguments(call, lens, None))

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
        **kwargs: Any,
    ) -> Any:
        """Capture ``fn(*args, **kwargs)`` for ``key``; see :meth:`CaptureManager.capture`."""
        return self.manager.capture(
            fn,
            *args,
            key=key,
            namespace=namespace,
            tokens=tokens,
            static_inputs=static_inputs,
            require_attention=require_attention,
            **kwargs,
        )

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
        self.trace.note(self.manager.entry(namespace, key), self.updater)

    def replay(self, key: Hashable, *, namespace: str = "main") -> Any:
        """Enqueue the graph of ``key``; return its (static) outputs."""
        self.updater.replay(namespace, key)
        return strong_tree(self.manager.entry(namespace, key).outputs)

    def step(
        self,
        key: Hashable,
        metadata: StepMetadata,
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        namespace: str = "main",
        pad_values: Mapping[str, float] | None = None,
    ) -> Any:
        """Copy ``inputs`` into the captured buffers, update, replay; return the outputs.

        Each input's first dimension may be shorter than the captured buffer; the rest
        is filled with ``pad_values[name]`` (default 0).  A key that was never
        captured raises :class:`~npugraph.errors.UnknownKeyError` listing the captured
        keys, or runs ``eager_fallback(key, metadata, inputs)`` when one was configured.
        """
        if self.eager_fallback is not None and not self.manager.has(namespace, key):
            return self.eager_fallback(key, metadata, inputs or {})
        entry = self.manager.entry(namespace, key)
        if inputs:
            self.copy_inputs(entry, inputs, pad_values)
        if self.order == "update-first":
            self.update(key, metadata, namespace=namespace)
            return self.replay(key, namespace=namespace)
        out = self.replay(key, namespace=namespace)
        self.update(key, metadata, namespace=namespace)
        return out

    def copy_inputs(
        self,
        entry: GraphEntry,
        inputs: Mapping[str, torch.Tensor],
        pad_values: Mapping[str, float] | None = None,
    ) -> None:
        """Copy ``inputs`` into ``entry``'s static input buffers, padding the rest."""
        pads = pad_values or {}
        for name, src in inputs.items():
            dst = entry.static_inputs.get(name)
            if dst is None:
                raise NpuGraphError(
                    f"{entry.namespace}/{entry.key!r}: no static input named {name!r} was "
                    f"registered at capture (have {sorted(entry.static_inputs)})"
                )
            n = int(src.shape[0])
            if n > dst.shape[0]:
                raise NpuGraphError(
                    f"{entry.namespace}/{entry.key!r}: input {name!r} has {n} rows, the "
                    f"captured buffer {int(dst.shape[0])}"
                )
            dst[:n].copy_(src, non_blocking=True)
            if n < dst.shape[0]:
                dst[n:].fill_(pads.get(name, 0))

    def synchronize(self) -> None:
        """Wait for the device; name the namespace, key and layer if it would hang."""
        try:
            self.device.npu.synchronize()
        except self.device.deadlock_errors as exc:
            err: NpuGraphError = GraphDeadlock(describe_device_error(self.manager, exc))
            self.postmortem.on_error(err, None)
            raise err from exc
        except self.device.race_errors as exc:
            err = GraphRace(describe_device_error(self.manager, exc))
            self.postmortem.on_error(err, None)
            raise err from exc

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
                    "replays": e.replays,
                }
            )
        return rows

    def manifest(self) -> dict[str, Any]:
        """The capture manifest (see :mod:`npugraph.dump`)."""
        from npugraph.dump.manifest import build_manifest

        return build_manifest(self.manager, self.trace)

    def save_manifest(self, path: str) -> None:
        from npugraph.dump.manifest import save_manifest

        save_manifest(self.manifest(), path)
