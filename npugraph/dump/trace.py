"""A bounded trace of recent updates (the updater's ``on_update`` hook)."""

from __future__ import annotations

import collections
import time
from typing import Any

import attrs

from npugraph.capture import CapturedGraph
from npugraph.metadata import StepLens
from npugraph.replay import GraphState

__all__ = ["UpdateRecord", "UpdateTrace"]


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
            "groups": {
                g: {"kv_lens": list(sl.kv_lens), "q_ends": list(sl.q_ends), "num_reqs": sl.num_reqs}
                for g, sl in self.groups.items()
            },
        }


class UpdateTrace:
    """The last ``depth`` updates of every graph (a ring buffer per graph).

    Recording costs one small record per step (lengths are shared, not copied).
    It is the updater's ``on_update`` hook: the core never imports this module.
    """

    def __init__(self, depth: int = 16) -> None:
        self.depth = depth
        self._rings: dict[tuple[str, Any], collections.deque[UpdateRecord]] = {}

    def note(self, entry: CapturedGraph, state: GraphState) -> None:
        if self.depth <= 0:
            return
        k = (entry.namespace, entry.key)
        ring = self._rings.get(k)
        if ring is None:
            ring = self._rings[k] = collections.deque(maxlen=self.depth)
        ring.append(
            UpdateRecord(
                step=state.steps,
                namespace=entry.namespace,
                key=entry.key,
                time=time.time(),
                groups=dict(state.last_lens),
                reissued=state.last_reissued,
            )
        )

    def records(self, namespace: str, key: Any) -> list[UpdateRecord]:
        return list(self._rings.get((namespace, key), ()))
