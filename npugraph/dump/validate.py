"""Invariants a healthy capture manifest satisfies; each violation names its location."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Violation", "validate_manifest", "diff_manifests"]


@attrs.frozen(kw_only=True)
class Violation:
    """One broken rule: which rule, where, and what was found."""

    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.message}"


def _arg_bytes(arg: dict[str, Any] | None) -> int | None:
    if arg and arg.get("kind") == "tensor":
        return int(arg["bytes"])
    return None


def _kv_host(task: dict[str, Any], host: dict[str, Any]) -> list[int]:
    for name in ("context_lens", "actual_seq_lengths_kv", "actual_seq_kvlen"):
        if name in host:
            return [int(x) for x in host[name]]
    return []


def validate_manifest(doc: dict[str, Any]) -> list[Violation]:
    """Check ``doc`` (a manifest or post-mortem); return every violation found."""
    out: list[Violation] = []
    max_len = int(doc.get("max_model_len", 0))
    handles: dict[Any, str] = {}
    events: dict[Any, tuple[str, str]] = {}  # event -> (its graph, its first task)
    for ns, nsdoc in doc.get("namespaces", {}).items():
        keys = nsdoc.get("keys", [])
        tokens = [k["tokens"] for k in keys]
        if tokens != sorted(tokens):
            out.append(Violation(rule="keys-sorted", where=f"{ns}", message=f"keys are not sorted by size: {tokens}"))
        configured = nsdoc.get("configured_sizes")
        if configured is not None and sorted(configured) != sorted(tokens):
            missing = sorted(set(configured) - set(tokens))
            extra = sorted(set(tokens) - set(configured))
            out.append(
                Violation(
                    rule="keys-cover-sizes",
                    where=ns,
                    message=f"captured sizes differ from the configured ones (missing {missing}, unexpected {extra})",
                )
            )
        layer_order = None
        for k in keys:
            where = f"{ns}/{k['key']}"
            layers = [(t.get("ubatch", 0), t["layer"]) for t in k["tasks"]]
            if len(set(layers)) != len(layers):
                dup = sorted({x for x in layers if layers.count(x) > 1})
                out.append(
                    Violation(rule="one-task-per-layer", where=where, message=f"layers with several tasks: {dup}")
                )
            if layer_order is None:
                layer_order = layers
            elif layers != layer_order:
                out.append(
                    Violation(
                        rule="same-layers",
                        where=where,
                        message=_layer_difference(layers, layer_order),
                    )
                )
            ws_bytes = int(k.get("workspace", {}).get("bytes", 0))
            for t in k["tasks"]:
                out += _task_violations(
                    t, f"{where} task {t['index']} ({t['layer']})", where, ws_bytes, max_len, handles, events
                )
            out += _padding_violations(k, where)
    return out


def _task_violations(
    t: dict[str, Any],
    tw: str,
    where: str,
    ws_bytes: int,
    max_len: int,
    handles: dict[Any, str],
    events: dict[Any, tuple[str, str]],
) -> list[Violation]:
    """The violations of task ``t`` (``tw`` names it, ``where`` its graph): its task group and
    event shared with another graph's, its workspace, its lengths at capture and last update.
    ``handles`` and ``events`` collect what earlier tasks used."""
    out: list[Violation] = []
    ident = t.get("task_group")
    if ident is not None and ident in handles:  # a tiling-sink task has none
        out.append(
            Violation(
                rule="unique-handles",
                where=tw,
                message=f"task_group {ident} is also used by {handles[ident]}",
            )
        )
    elif ident is not None:
        handles[ident] = tw
    # tasks of one graph may share an event (event grouping, tiling-sink tasks); graphs may not
    ident = t.get("event")
    if ident in events and events[ident][0] != where:
        out.append(
            Violation(rule="unique-events", where=tw, message=f"event {ident} is also used by {events[ident][1]}")
        )
    elif ident not in events:
        events[ident] = (where, tw)
    need = int(t.get("workspace_required", 0))
    have = _arg_bytes(t["args"].get("workspace"))
    if have is None:
        have = ws_bytes
    if have < need:
        out.append(
            Violation(
                rule="workspace",
                where=tw,
                message=f"workspace of {have} bytes is below the {need} bytes {t['op']} needs at max_model_len",
            )
        )
    kc = t["args"].get("key_cache") or t["args"].get("key")
    bt = t["args"].get("block_table")
    cap = None
    if kc and bt and kc.get("kind") == "tensor" and bt.get("kind") == "tensor":
        cap = int(bt["shape"][1]) * int(kc["shape"][1])
    for label, host in (
        ("capture", t.get("host_at_capture") or {}),
        ("last update", (t.get("last_update") or {}).get("host") or {}),
    ):
        lens = _kv_host(t, host)
        for i, x in enumerate(lens):
            if x > max_len or (cap is not None and x > cap) or x < 0:
                out.append(
                    Violation(
                        rule="lengths",
                        where=f"{tw} {label}",
                        message=f"length[{i}] = {x} outside [0, min(max_model_len={max_len}, table capacity={cap})]",
                    )
                )
                break
    return out


def _padding_violations(k: dict[str, Any], where: str) -> list[Violation]:
    """Every traced step of graph ``k`` whose padding requests had non-zero lengths."""
    out: list[Violation] = []
    for rec in k.get("trace", []):
        for g, lens in rec.get("groups", {}).items():
            real = lens.get("num_reqs")
            if real is None:
                continue
            pad = lens["kv_lens"][real:]
            if any(pad):
                out.append(
                    Violation(
                        rule="padding-zero",
                        where=f"{where} step {rec['step']} group {g}",
                        message=f"padding requests {real}.. have non-zero lengths {pad}",
                    )
                )
    return out


def _task_sig(t: dict[str, Any]) -> tuple[Any, ...]:
    shapes = tuple(
        (name, tuple(a.get("shape", ())), a.get("dtype"))
        for name, a in sorted(t["args"].items())
        if a.get("kind") == "tensor"
    )
    return (t["layer"], t["op"], shapes)


def diff_manifests(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two manifests: keys, kernels, and tasks (op, shape, dtype, layer)."""
    lines: list[str] = []
    for ns in sorted(set(a.get("namespaces", {})) | set(b.get("namespaces", {}))):
        ka = {k["key"]: k for k in a.get("namespaces", {}).get(ns, {}).get("keys", [])}
        kb = {k["key"]: k for k in b.get("namespaces", {}).get(ns, {}).get("keys", [])}
        for key in sorted(set(ka) - set(kb)):
            lines.append(f"{ns}/{key}: only in A")
        for key in sorted(set(kb) - set(ka)):
            lines.append(f"{ns}/{key}: only in B")
        for key in sorted(set(ka) & set(kb), key=lambda x: (len(x), x)):
            x, y = ka[key], kb[key]
            if x["kernel"] != y["kernel"]:
                lines.append(f"{ns}/{key}: kernel {x['kernel']} -> {y['kernel']}")
            if len(x["tasks"]) != len(y["tasks"]):
                lines.append(f"{ns}/{key}: {len(x['tasks'])} tasks -> {len(y['tasks'])}")
            for tx, ty in zip(x["tasks"], y["tasks"]):
                sx, sy = _task_sig(tx), _task_sig(ty)
                if sx == sy:
                    continue
                what = []
                if sx[0] != sy[0]:
                    what.append(f"layer {sx[0]} -> {sy[0]}")
                if sx[1] != sy[1]:
                    what.append(f"op {sx[1]} -> {sy[1]}")
                if sx[2] != sy[2]:
                    da, db = dict((n, (s, d)) for n, s, d in sx[2]), dict((n, (s, d)) for n, s, d in sy[2])
                    for n in sorted(set(da) | set(db)):
                        if da.get(n) != db.get(n):
                            what.append(f"{n} {da.get(n)} -> {db.get(n)}")
                lines.append(f"{ns}/{key} task {tx['index']}: " + "; ".join(what))
    return lines


def _layer_difference(layers: list[tuple[int, str]], first: list[tuple[int, str]]) -> str:
    """Where two layer orders part: the first position that differs, or the count."""
    i = next((j for j, (a, b) in enumerate(zip(layers, first)) if a != b), min(len(layers), len(first)))
    if i < min(len(layers), len(first)):
        return (
            f"task {i} is layer {layers[i][1]!r} (micro-batch {layers[i][0]}) but in the namespace's first key "
            f"{first[i][1]!r} (micro-batch {first[i][0]}): the keys record their layers in other orders"
        )
    return f"{len(layers)} layers, the namespace's first key has {len(first)}"
