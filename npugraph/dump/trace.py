"""A bounded trace of recent updates, and post-mortem dumps when a step fails."""

from __future__ import annotations

import collections
import json
import os
import time
from typing import TYPE_CHECKING, Any

import attrs

from npugraph.ops.base import StepLens

if TYPE_CHECKING:
    from npugraph.capture.manager import CaptureManager, GraphEntry
    from npugraph.errors import NpuGraphError
    from npugraph.replay.updater import ReplayUpdater

__all__ = ["UpdateRecord", "UpdateTrace", "PostMortem"]


@attrs.frozen(kw_only=True)
class UpdateRecord:
    """One applied update: the step number, when, the lengths per KV-cache group, and how
    many tasks were re-issued (the others had unchanged lengths and only recorded events)."""

    step: int
    namespace: str
    key: Any
    time: float
    groups: dict[str, StepLens]
    reissued: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "namespace": self.namespace,
            "key": repr(self.key),
            "time": self.time,
            "reissued": self.reissued,
            "groups": {g: {"kv_lens": list(sl.kv_lens), "q_ends": list(sl.q_ends)} for g, sl in self.groups.items()},
        }


class UpdateTrace:
    """The last ``depth`` updates of every graph (a ring buffer per graph).

    Recording costs one small record per step (lengths are shared, not copied).
    """

    def __init__(self, depth: int = 16) -> None:
        self.depth = depth
        self._rings: dict[tuple[str, Any], collections.deque[UpdateRecord]] = {}

    def note(self, entry: GraphEntry, updater: ReplayUpdater) -> None:
        if self.depth <= 0:
            return
        k = (entry.namespace, entry.key)
        ring = self._rings.get(k)
        if ring is None:
            ring = self._rings[k] = collections.deque(maxlen=self.depth)
        rec = UpdateRecord(
            step=entry.steps,
            namespace=entry.namespace,
            key=entry.key,
            time=time.time(),
            groups=dict(entry.last_lens),
            reissued=entry.last_reissued,
        )
        ring.append(rec)
        entry.last_update = rec

    def records(self, namespace: str, key: Any) -> list[UpdateRecord]:
        return list(self._rings.get((namespace, key), ()))


class PostMortem:
    """Write the manifest and update trace to ``folder`` when a step fails."""

    def __init__(self, manager: CaptureManager, trace: UpdateTrace, folder: str | None) -> None:
        self.manager = manager
        self.trace = trace
        self.folder = folder
        self._count = 0

    def on_error(self, err: NpuGraphError, entry: GraphEntry | None) -> None:
        if self.folder is None or err.postmortem is not None:
            return
        from npugraph.dump.manifest import build_manifest

        os.makedirs(self.folder, exist_ok=True)
        self._count += 1
        path = os.path.join(self.folder, f"npugraph-postmortem-{os.getpid()}-{self._count}.json")
        doc = build_manifest(self.manager, self.trace)
        doc["error"] = {
            "type": type(err).__name__,
            "message": str(err),
            "namespace": entry.namespace if entry else None,
            "key": repr(entry.key) if entry else None,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=repr)
        err.postmortem = path
        if err.args:
            err.args = (f"{err.args[0]} [post-mortem written to {path}]", *err.args[1:])
