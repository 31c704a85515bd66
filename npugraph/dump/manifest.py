"""The capture manifest: a versioned JSON description of everything captured.

Schema (``schema_version`` 1)::

  {"schema_version": 1, "device": str, "max_model_len": int,
   "totals": {"graphs", "tasks", "workspace_bytes", "pool_bytes", "output_bytes", "memory_bytes"},
   "namespaces": {ns: {"keys": [
       {"key": repr, "tokens": int, "batch": int, "capture_seconds": float,
        "memory_bytes": int (the device memory its capture took; absent in older manifests),
        "pool": [int, int], "kernel": "pa"|"fia", "kernel_reason": str,
        "workspace": {"bytes": int, "shared_by": [task indices]}, "output_bytes": int,
        "replays": int, "steps": int, "replayable": bool, "phase": str (the step phase),
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
from typing import Any

import torch

from npugraph.capture import CapturedGraph, CaptureManager
from npugraph.dump.trace import UpdateTrace
from npugraph.errors import NpuGraphError
from npugraph.files import FileError, read_json, write_text
from npugraph.replay import GraphState, ReplayUpdater

__all__ = ["SCHEMA_VERSION", "ManifestError", "build_manifest", "load_manifest", "save_manifest", "schema_problems"]

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


def build_manifest(
    manager: CaptureManager, updater: ReplayUpdater | None = None, trace: UpdateTrace | None = None
) -> dict[str, Any]:
    """Describe every captured graph of ``manager`` (its step state, and its recent updates)."""
    namespaces: dict[str, Any] = {}
    totals = {"graphs": 0, "tasks": 0, "workspace_bytes": 0, "pool_bytes": 0, "output_bytes": 0, "memory_bytes": 0}
    for ns in manager.namespaces():
        keys = []
        for e in manager.entries(ns):
            state = updater.state(e) if updater is not None else None
            out_bytes = _tensor_bytes(e.outputs)
            keys.append(
                {
                    "key": repr(e.key),
                    "tokens": e.tokens,
                    "batch": e.batch,
                    "capture_seconds": e.capture_seconds,
                    "memory_bytes": e.memory_bytes,
                    "pool": list(e.pool) if isinstance(e.pool, tuple) else repr(e.pool),
                    "kernel": e.choice.kernel,
                    "kernel_reason": e.choice.reason,
                    "workspace": {
                        "bytes": e.workspace_bytes,
                        "shared_by": [t.index for t in e.tasks],
                    },
                    "output_bytes": out_bytes,
                    "replays": state.replays if state is not None else 0,
                    "steps": state.steps if state is not None else 0,
                    "replayable": state.replayable if state is not None else True,
                    "phase": state.phase.value if state is not None else "idle",
                    "tasks": _tasks(e, state),
                    "trace": [r.to_json() for r in (trace.records(ns, e.key) if trace is not None else [])],
                }
            )
            totals["graphs"] += 1
            totals["tasks"] += len(e.tasks)
            totals["workspace_bytes"] += e.workspace_bytes
            totals["output_bytes"] += out_bytes
            totals["memory_bytes"] += e.memory_bytes
        keys.sort(key=lambda k: int(k["tokens"]))  # type: ignore[call-overload]
        namespaces[ns] = {"keys": keys}
        if ns in manager.configured:
            namespaces[ns]["configured_sizes"] = [k for k in manager.configured[ns] if isinstance(k, int)]
    pool_bytes = manager.device.pool_bytes(manager._pool)
    if pool_bytes is not None:
        totals["pool_bytes"] = pool_bytes
    return {
        "schema_version": SCHEMA_VERSION,
        "device": manager.device.name,
        "max_model_len": manager.max_model_len,
        "totals": totals,
        "namespaces": namespaces,
    }


def _tasks(e: CapturedGraph, state: GraphState | None) -> list[dict[str, Any]]:
    """Each captured task of ``e``: what it was captured with, and what it was last given."""
    steps = state.steps if state is not None else 0
    # a tiling-sink task's lengths are its group's, written once (at its first task)
    writer = {id(t.lens): t.index for t in reversed(e.tasks) if t.lens is not None}
    tasks = []
    for t in e.tasks:
        kw = t.kwargs()
        i = writer.get(id(t.lens), t.index) if t.lens is not None else t.index
        applied = state.applied[i] if state is not None else None
        host_now = None
        if applied is not None:  # this task's own lengths, as last written into it
            host_now = {
                k: list(v) if isinstance(v, tuple) else [int(x) for x in v.tolist()] for k, v in applied.items()
            }
        slot_lens = state.last_lens.get(t.slot) if state is not None else None
        tasks.append(
            {
                "index": t.index,
                "layer": t.layer,
                "group": t.group,
                "ubatch": t.ubatch,
                "op": t.spec.name,
                "kernel": t.spec.kernel + (f".{t.spec.overload}" if t.spec.overload else ""),
                "task_group": None if t.handle is None else _obj_id(t.handle),
                "event": _obj_id(t.event),
                "waits": t.waits,
                "records": t.records,
                "lens_on_device": None
                if t.lens is None
                else {"lengths": _arg(t.lens.lens, False), "plan": _arg(t.lens.meta, False)},
                "args": {k: _arg(v, k in t.spec.host_args) for k, v in kw.items()},
                "host_at_capture": {k: list(v) for k, v in t.host_at_capture.items()},
                "workspace_required": t.workspace_bytes,
                "num_reqs": None if slot_lens is None else slot_lens.num_reqs,
                "last_update": None if host_now is None else {"step": steps, "host": host_now},
            }
        )
    return tasks


def save_manifest(doc: dict[str, Any], path: str) -> None:
    """Write a manifest as JSON (never through a symlink)."""
    write_text(path, json.dumps(doc, indent=1, default=repr))


class ManifestError(NpuGraphError, ValueError):
    """A file is not a readable capture manifest of this schema."""


_KEY_FIELDS: dict[str, type] = {
    "key": str,
    "tokens": int,
    "batch": int,
    "kernel": str,
    "kernel_reason": str,
    "workspace": dict,
    "replays": int,
    "steps": int,
    "replayable": bool,
    "tasks": list,
}
_TASK_FIELDS: dict[str, type] = {
    "index": int,
    "layer": str,
    "group": str,
    "op": str,
    "kernel": str,
    "args": dict,
    "host_at_capture": dict,
}


def schema_problems(doc: Any) -> list[str]:
    """What makes ``doc`` not a manifest of :data:`SCHEMA_VERSION` (empty if none)."""
    if not isinstance(doc, dict):
        return [f"the document is a JSON {type(doc).__name__}, not an object"]
    if doc.get("schema_version") != SCHEMA_VERSION:
        return [f"schema_version is {doc.get('schema_version')!r}, expected {SCHEMA_VERSION}"]
    out = []
    for name, typ in (("device", str), ("max_model_len", int), ("totals", dict), ("namespaces", dict)):
        if not isinstance(doc.get(name), typ):
            out.append(f"{name!r} is missing or not a {typ.__name__}")
    if out:
        return out
    for ns, nsdoc in doc["namespaces"].items():
        if not isinstance(nsdoc, dict) or not isinstance(nsdoc.get("keys"), list):
            out.append(f"namespaces[{ns!r}] has no list of 'keys'")
            continue
        for i, k in enumerate(nsdoc["keys"]):
            where = f"namespaces[{ns!r}].keys[{i}]"
            if not isinstance(k, dict):
                out.append(f"{where} is not an object")
                continue
            out += [
                f"{where}.{f} is missing or not a {t.__name__}" for f, t in _KEY_FIELDS.items() if not _is(k.get(f), t)
            ]
            for j, t in enumerate(k.get("tasks") or []):
                tw = f"{where}.tasks[{j}]"
                if not isinstance(t, dict):
                    out.append(f"{tw} is not an object")
                    continue
                out += [
                    f"{tw}.{f} is missing or not a {ty.__name__}"
                    for f, ty in _TASK_FIELDS.items()
                    if not _is(t.get(f), ty)
                ]
    return out


def _is(v: Any, t: Any) -> bool:
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, t)


def load_manifest(path: str) -> dict[str, Any]:
    """Read a manifest (or post-mortem) file: size-capped, schema-checked, never through a symlink."""
    try:
        doc = read_json(path, "manifest")
    except FileError as exc:
        raise ManifestError(str(exc)) from exc
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise ManifestError(
            f"{path}: written by a newer npugraph (schema_version {version}; this one reads {SCHEMA_VERSION}); "
            "upgrade npugraph to read it"
        )
    problems = schema_problems(doc)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ManifestError(f"{path}: not a capture manifest: {'; '.join(problems[:3])}{more}")
    return doc  # type: ignore[no-any-return]
