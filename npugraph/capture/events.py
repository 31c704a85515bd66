"""Event grouping: which attention tasks of a graph updated per layer share an ExternalEvent."""

from __future__ import annotations

import attrs

__all__ = ["AUTO_EVENT_GROUP", "AUTO_EVENT_GROUP_MIN", "EventSchedule", "group_size"]

# Event grouping by default (``event_group=None``): a namespace whose graphs have at least
# AUTO_EVENT_GROUP_MIN tasks updated per layer records one ExternalEvent per
# AUTO_EVENT_GROUP of them.  Modeled on A2 host costs (npugraph bench): +5% steps/s on
# host-bound FIA decode at 20 layers and +26% on PA at batch 4, step latency +4%, within
# 1.05 of UpdatableGraph's; below 20 layers the gain is within the model's noise.
AUTO_EVENT_GROUP = 10
AUTO_EVENT_GROUP_MIN = 2 * AUTO_EVENT_GROUP


def group_size(task_count: int, event_group: int | None) -> int:
    """Tasks per ExternalEvent in a namespace's graphs updated per layer: ``event_group``, or
    (``None``) AUTO_EVENT_GROUP once the namespace's first graph has AUTO_EVENT_GROUP_MIN
    tasks (``task_count``), else 1."""
    if event_group is not None:
        return event_group
    return AUTO_EVENT_GROUP if task_count >= AUTO_EVENT_GROUP_MIN else 1


@attrs.frozen(kw_only=True)
class EventSchedule:
    """Which tasks of a graph of ``tasks`` attention tasks share an ExternalEvent.

    Groups of ``size`` tasks from the first, then the last task alone: the graph waits
    once per group (at its first task) and the update records once (after its last), so
    a step makes fewer event records; the last task alone keeps the step's latency (the
    device runs one layer after the last update lands, as without groups).
    """

    tasks: int
    size: int

    def waits(self, i: int) -> bool:
        return i == self.tasks - 1 or i % self.size == 0

    def records(self, i: int) -> bool:
        return i >= self.tasks - 2 or i % self.size == self.size - 1

    @classmethod
    def of(cls, tasks: int | None, size: int) -> EventSchedule | None:
        """The schedule of graphs of ``tasks`` tasks (None: not counted yet) in groups of
        ``size``, or None where every task keeps its own event (groups of 1, or under 3 tasks)."""
        if size == 1 or tasks is None or tasks < 3:
            return None
        return cls(tasks=tasks, size=size)
