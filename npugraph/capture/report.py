"""The capture report: one line on what is captured and what capture chose, and why."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from npugraph.capture.records import CapturedGraph

__all__ = ["capture_report"]


def capture_report(
    entries: Sequence[CapturedGraph],
    *,
    namespace: str | None,
    seconds: float | None,
    pool_bytes: int | None,
    events: Mapping[str, tuple[int, int]],
    event_group_set: bool,
) -> str:
    """One line on ``entries``: graphs, attention tasks, kernels, time (``seconds``, else the
    captures' own), device memory (per size, what each capture took), pool memory, then what
    capture chose and why.  ``events``: per namespace, its tasks per ExternalEvent and its
    first graph's task count; ``event_group_set``: whether the group size was set, not chosen."""
    kernels: dict[str, int] = {}
    for e in entries:
        kernels[e.choice.kernel] = kernels.get(e.choice.kernel, 0) + 1
    took = seconds if seconds is not None else sum(e.capture_seconds for e in entries)
    where = f"namespace {namespace!r}" if namespace is not None else "all namespaces"
    return (
        f"{len(entries)} graphs captured in {where} ({sum(len(e.tasks) for e in entries)} attention tasks; "
        + ", ".join(f"{n} {k}" for k, n in sorted(kernels.items()))
        + f") in {took:.1f} s"
        + _memory_summary(entries)
        + (f", graph pool {pool_bytes / 2**20:.1f} MiB" if pool_bytes is not None else "")
        + _choices_summary(entries, events, event_group_set)
    )


def _memory_summary(entries: Sequence[CapturedGraph]) -> str:
    """The device memory the captures took, in all and per size (largest first)."""
    if not entries:
        return ""
    taken = sorted(entries, key=lambda e: -e.tokens)
    mib = [(e.size_label, e.memory_bytes / 2**20) for e in taken]
    each = ", ".join(f"{t}: {m:.1f}" for t, m in mib[:8]) + (", ..." if len(mib) > 8 else "")
    return f", device memory {sum(m for _, m in mib):.1f} MiB (per size, MiB: {each})"


def _choices_summary(
    entries: Sequence[CapturedGraph], events: Mapping[str, tuple[int, int]], event_group_set: bool
) -> str:
    """What capture chose, and why: each kernel's sizes (with why FIA's lengths are or are
    not on the device), and the ExternalEvents per namespace."""
    if not entries:
        return ""
    sizes: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    for e in sorted(entries, key=lambda e: (e.tokens, str(e.key))):
        sizes.setdefault(e.choice.kernel, []).append(e.size_label)
        _, _, detail = e.choice.reason.partition("; ")
        if e.choice.kernel == "fia_frozen":
            detail = "update-free: lengths frozen to each graph's width (@w), the real ones masked on the device"
        if detail:
            why.setdefault(e.choice.kernel, detail)
    kernels = ", ".join(
        f"{k} at [{', '.join(v)}]" + (f" ({why[k]})" if k in why else "") for k, v in sorted(sizes.items())
    )
    per_namespace = []
    for ns, (g, tasks) in sorted(events.items()):
        per_layer = any(t.lens is None for e in entries if e.namespace == ns for t in e.tasks)
        if not per_layer:
            continue
        how = "set" if event_group_set else f"auto, {tasks} tasks"
        per_namespace.append(
            f"{ns!r}: one per layer ({how})" if g == 1 else f"{ns!r}: one per {g} layers updated per layer ({how})"
        )
    sink = any(t.lens is not None for e in entries for t in e.tasks)
    parts = (["one per step for graphs with their lengths on the device"] if sink else []) + per_namespace
    return f"; kernels: {kernels}; ExternalEvents: " + ", ".join(parts)
