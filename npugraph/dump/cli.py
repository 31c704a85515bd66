"""``npugraph dump``: inspect, diff, validate and draw capture manifests."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from npugraph.dump.manifest import ManifestError, load_manifest
from npugraph.dump.validate import diff_manifests, validate_manifest

__all__ = ["add_parser", "run", "to_dot"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dump", help="inspect, diff, validate or draw a capture manifest / post-mortem")
    ds = p.add_subparsers(dest="dump_command", required=True)
    i = ds.add_parser("inspect", help="summary per namespace, or one graph's tasks with --key")
    i.add_argument("file")
    i.add_argument("--key", help="show this key's tasks and arguments (the key as written, or its token count)")
    i.add_argument("--namespace", default=None, help="where --key is looked up (default: every namespace)")
    d = ds.add_parser("diff", help="what differs between two manifests (exit 1 if they differ)")
    d.add_argument("a")
    d.add_argument("b")
    v = ds.add_parser("validate", help="check the manifest's invariants (exit 1 on any violation)")
    v.add_argument("file")
    g = ds.add_parser("dot", help="Graphviz DOT of one graph")
    g.add_argument("file")
    g.add_argument("--key", required=True)
    g.add_argument("--namespace", default=None)
    p.set_defaults(func=run)


def _find_key(doc: dict[str, Any], key: str, namespace: str | None = None) -> tuple[str, dict[str, Any]]:
    """The graph ``key`` names: its repr as written in the manifest, or its token count
    (``--key 4`` selects ``BatchDescriptor(num_tokens=4, ...)`` when it is the only one)."""
    keys = [(ns, k) for ns, nd in doc["namespaces"].items() if namespace in (None, ns) for k in nd["keys"]]
    exact = [(ns, k) for ns, k in keys if k["key"] == key]
    by_tokens = [(ns, k) for ns, k in keys if key.strip().isdigit() and k.get("tokens") == int(key)]
    for found in (exact, by_tokens):
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = [f"{ns}/{k['key']}" for ns, k in found]
            raise ManifestError(
                f"key {key!r} matches {len(found)} graphs ({names[:6]}); pick one with --namespace or its whole key"
            )
    have = [f"{ns}/{k['key']}" for ns, k in keys]
    raise ManifestError(f"no key {key!r} in the manifest (a key as written, or a token count; have {have[:12]})")


def _fmt_arg(a: dict[str, Any]) -> str:
    kind = a.get("kind")
    if kind == "tensor":
        return f"{a['dtype']}{a['shape']} @{a['address']:#x} ({a['bytes']} B)"
    if kind == "tensors":
        return "[" + ", ".join(_fmt_arg(x) for x in a["items"]) + "]"
    v = a.get("value")
    if isinstance(v, list) and len(v) > 12:
        return f"{v[:12]}... ({len(v)})"
    return repr(v)


def inspect(doc: dict[str, Any], key: str | None = None, namespace: str | None = None) -> str:
    lines = []
    if "error" in doc:
        e = doc["error"]
        lines.append(f"POST-MORTEM: {e['type']}: {e['message']}")
    t = doc["totals"]
    lines.append(
        f"device {doc['device']}, max_model_len {doc['max_model_len']}: {t['graphs']} graphs, {t['tasks']} tasks, "
        f"workspaces {t['workspace_bytes']} B, pool {t['pool_bytes']} B"
    )
    if key is not None:
        ns, k = _find_key(doc, key, namespace)
        lines.append(
            f"{ns}/{k['key']}: kernel {k['kernel']} ({k['kernel_reason']}), workspace {k['workspace']['bytes']} B"
        )
        for task in k["tasks"]:
            last = task.get("last_update")
            lines.append(
                f"  task {task['index']:>3} {task['layer']} [{task['op']}] group #{task['task_group']} "
                f"event #{task['event']} last step {last['step'] if last else '-'}"
            )
            for name, a in task["args"].items():
                lines.append(f"      {name:<22} {_fmt_arg(a)}")
            if last:
                for name, v in last["host"].items():
                    lines.append(f"      {name + ' (last)':<22} {v[:12]}{'...' if len(v) > 12 else ''}")
        if k.get("trace"):
            lines.append("  recent updates:")
            for rec in k["trace"]:
                for g, lens in rec["groups"].items():
                    lines.append(
                        f"    step {rec['step']} group {g}: kv_lens {lens['kv_lens'][:12]}, "
                        f"{rec.get('reissued', '?')} tasks re-issued"
                    )
        return "\n".join(lines)
    for ns, nsdoc in doc["namespaces"].items():
        lines.append(f"namespace {ns}:")
        w = max([3, *(len(str(k["key"])) for k in nsdoc["keys"])])  # long keys (BatchDescriptor) stay aligned
        lines.append(
            f"  {'key':>{w}} {'tokens':>6} {'kernel':>8} {'tasks':>6} {'workspace B':>12} {'replays':>8} "
            f"{'last step':>9}  phase"
        )
        for k in nsdoc["keys"]:
            phase = k.get("phase", "idle" if k["replayable"] else "broken")
            lines.append(
                f"  {k['key']:>{w}} {k['tokens']:>6} {k['kernel']:>8} {len(k['tasks']):>6} "
                f"{k['workspace']['bytes']:>12} {k['replays']:>8} {k['steps']:>9}  {phase}"
            )
    return "\n".join(lines)


def _q(text: Any) -> str:
    """``text`` escaped for a double-quoted DOT string (names come from the model)."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def to_dot(doc: dict[str, Any], key: str, namespace: str | None = None) -> str:
    """One graph as DOT: tasks in stream order, event-wait edges from the update stream, groups boxed."""
    ns, k = _find_key(doc, key, namespace)
    out = [f'digraph "{_q(ns)}/{_q(k["key"])}" {{', "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    out.append('  subgraph cluster_update { label="update stream"; style=dashed;')
    for t in k["tasks"]:
        out.append(f'    upd{t["index"]} [label="update+record\\nevent #{_q(t["event"])}", shape=ellipse];')
    out.append("  }")
    prev = None
    for t in k["tasks"]:
        i = t["index"]
        out.append(f'  subgraph cluster_g{i} {{ label="task group #{_q(t["task_group"])}"; style=rounded;')
        out.append(f'    wait{i} [label="wait event #{_q(t["event"])}", shape=diamond];')
        out.append(f'    task{i} [label="{_q(t["layer"])}\\n{_q(t["kernel"])}"];')
        out.append("  }")
        out.append(f"  wait{i} -> task{i};")
        out.append(f'  upd{i} -> wait{i} [style=dashed, label="record"];')
        if prev is not None:
            out.append(f"  task{prev} -> wait{i};")
        prev = i
    out.append("}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    cmd = args.dump_command
    if cmd == "inspect":
        print(inspect(load_manifest(args.file), args.key, args.namespace))
        return 0
    if cmd == "diff":
        lines = diff_manifests(load_manifest(args.a), load_manifest(args.b))
        print("\n".join(lines) if lines else "no differences")
        return 1 if lines else 0
    if cmd == "validate":
        violations = validate_manifest(load_manifest(args.file))
        for v in violations:
            print(v)
        print(f"{len(violations)} violation(s)" if violations else "ok: no violations")
        return 1 if violations else 0
    if cmd == "dot":
        print(to_dot(load_manifest(args.file), args.key, args.namespace))
        return 0
    print(f"unknown dump command {cmd}", file=sys.stderr)
    return 2
