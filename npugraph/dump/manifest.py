"""The capture manifest: a versioned JSON description of everything captured.

Schema (``schema_version`` 1)::

  {"schema_version": 1, "device": str, "max_model_len": int,
   "totals": {"graphs", "tasks", "workspace_bytes", "pool_bytes", "output_bytes"},
   "namespaces": {ns: {"keys": [
       {"key": repr, "tokens": int, "batch": int, "capture_seconds": float,
        "pool": [int, int], "kernel": "pa"|"fia", "kernel_reason": str,
        "workspace": {"bytes": int, "shared_by": [task indices]}, "output_bytes": int,
        "replays": int, "steps": int, "replayable": bool,
        "tasks": [{"index", "layer", "group", "op", "task_group", "event",
                   "args": {name: {"kind": "tensor", "shape", "dtype", "device",
                                   "address", "bytes"} | {"kind": "host", "value"}
                                 | {"kind": "value", "value"}},
                   "host_at_capture": {...},
                   "last_update": {"step", "host": {...}} | null}],
        "trace": [update records, oldest first]}]}}}
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from npugraph.capture.manager import strong_tree

if TYPE_CHECKING:
    from npugraph.capture.manager import CaptureManager
    from npugraph.dump.trace import UpdateTrace

__all__ = ["SCHEMA_VERSION", "build_manifest", "save_manifest", "load_manifest"]

SCHEMA_VERSION = 1


def _arg(value: Any, host: bool) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        if host:
            return {"kind": "host", "value": [int(x) for x in value.tolist()]}
        return {
            "kind": "tensor",
            "shape": list(value.shape),
            "dtype": str(value.dtype).replace("torch.", ""),
            "device": str(value.device),
            "address": value.data_ptr(),
            "bytes": value.numel() * value.element_size(),
        }
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return {"kind": "tensors", "items": [_arg(v, False) for v in value]}
    if isinstance(value, (tuple, list)):
        return {"kind": "host" if host else "value", "value": [int(x) for x in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "host" if host else "value", "value": value}
    return {"kind": "value", "value": repr(value)}


def _obj_id(obj: Any) -> int:
    for attr in ("event_id", "_group"):
        v = getattr(obj, attr, None)
        if isinstance(v, int):
            return v
        if v is not None and hasattr(v, "group_id"):
            return int(v.group_id)
    return id(obj)


def _tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a (nested) output structure: memory the outputs pin."""
    if isinstance(tree, torch.Tensor):
        return tree.untyped_storage().nbytes()
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(x) for x in tree)
    if isinstance(tree, dict):
        return sum(_tensor_bytes(x) for x in tree.values())
    return 0


def build_manifest(manager: CaptureManager, trace: UpdateTrace | None = None) -> dict[str, Any]:
    """Describe every captured graph of ``manager`` (and its recent updates)."""
    namespaces: dict[str, Any] = {}
    totals = {"graphs": 0, "tasks": 0, "workspace_bytes": 0, "pool_bytes": 0, "output_bytes": 0}
    for ns in manager.namespaces():
        keys = []
        for e in manager.entries(ns):
            tasks = []
            for t in e.tasks:
                kw = t.kwargs()
                last = e.last_update
                host_now = None
                if last is not None and t.slot in last.groups:
                    host_now = {
                        k: list(v) if isinstance(v, tuple) else [int(x) for x in v.tolist()]
                        for k, v in t.spec.host_values(last.groups[t.slot]).items()
                    }
                tasks.append(
                    {
                        "index": t.index,
                        "layer": t.layer,
                        "group": t.group,
                        "ubatch": t.ubatch,
                        "op": t.spec.name,
                        "kernel": t.spec.kernel + (f".{t.spec.overload}" if t.spec.overload else ""),
                        "task_group": _obj_id(t.handle),
                        "event": _obj_id(t.event),
                        "args": {k: _arg(v, k in t.spec.host_args) for k, v in kw.items()},
                        "host_at_capture": {k: list(v) for k, v in t.host_at_capture.items()},
                        "workspace_required": t.workspace_bytes,
                        "num_reqs": None if last is None or t.slot not in last.groups else last.groups[t.slot].num_reqs,
                        "last_update": None if host_now is None else {"step": last.step, "host": host_now},  # type: ignore[union-attr]
                    }
                )
            recs = trace.records(ns, e.key) if trace is not None else []
            out_bytes = _tensor_bytes(strong_tree(e.outputs))
            keys.append(
                {
                    "key": repr(e.key),
                    "tokens": e.tokens,
                    "batch": e.batch,
                    "capture_seconds": e.capture_seconds,
                    "pool": list(e.pool) if isinstance(e.pool, tuple) else repr(e.pool),
                    "kernel": e.choice.kernel,
                    "kernel_reason": e.choice.reason,
                    "workspace": {
                        "bytes": e.workspace_bytes,
                        "shared_by": [t.index for t in e.tasks],
                    },
                    "output_bytes": out_bytes,
                    "replays": e.replays,
                    "steps": e.steps,
                    "replayable": e.replayable,
                    "tasks": tasks,
                    "trace": [r.to_json() for r in recs],
                }
            )
            totals["graphs"] += 1
            totals["tasks"] += len(e.tasks)
            totals["workspace_bytes"] += e.workspace_bytes
            totals["output_bytes"] += out_bytes
        keys.sort(key=lambda k: int(k["tokens"]))  # type: ignore[call-overload]
        namespaces[ns] = {"keys": keys}
        if ns in manager.configured:
            namespaces[ns]["configured_sizes"] = [k for k in manager.configured[ns] if isinstance(k, int)]
    pool = manager._pool
    if pool is not None and manager.device.is_sim:
        totals["pool_bytes"] = int(manager.device.ops.pool_bytes(pool))
    return {
        "schema_version": SCHEMA_VERSION,
        "device": manager.device.name,
        "max_model_len": manager.max_model_len,
        "totals": totals,
        "namespaces": namespaces,
    }


def save_manifest(doc: dict[str, Any], path: str) -> None:
    """Write a manifest as JSON."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=repr)


def load_manifest(path: str) -> dict[str, Any]:
    """Read a manifest (or post-mortem) file; refuse other schema versions."""
    with open(path) as f:
        doc = json.load(f)
    v = doc.get("schema_version")
    if v != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {v!r} is not supported (expected {SCHEMA_VERSION})")
    return doc
