"""Half steps called out of order: noted while a call runs, warned of once it returns.

A misordered half step discards work nobody ran (an update no replay ran, a replay released
with no request).  The updater notes each one, once per graph and kind, and the public call
that found it warns at the caller's line when it has done all it does: a warning turned into
an error then interrupts nothing.
"""

from __future__ import annotations

import warnings

import attrs

from npugraph.capture import CapturedGraph
from npugraph.errors import StepOrderWarning
from npugraph.replay.diagnose import caller_level
from npugraph.replay.phases import GraphState

__all__ = ["ABANDONED_REPLAY", "DISCARDED_UPDATE", "SECOND_REPLAY", "Misorders"]

# the kinds of misordered half steps StepOrderWarning names
DISCARDED_UPDATE = "discarded update"
SECOND_REPLAY = "second replay"
ABANDONED_REPLAY = "abandoned replay"

_WHAT = {
    DISCARDED_UPDATE: "discarded the update made before it, which no replay ran",
    SECOND_REPLAY: "came while its previous replay still waited for an update; that replay was "
    "released and ran with no request (zeros)",
    ABANDONED_REPLAY: "released this graph's replay, which waited for an update that never came; "
    "it ran with no request (zeros)",
}


@attrs.define
class Misorders:
    """The misordered halves the current call found (graph, kind, the call that found it)."""

    notes: list[tuple[CapturedGraph, str, str]] = attrs.field(factory=list)

    def note(self, entry: CapturedGraph, state: GraphState, kind: str, call: str) -> None:
        """Note, once per graph and kind, that a half step discarded work nobody ran."""
        if kind in state.warned:
            return
        state.warned.add(kind)
        self.notes.append((entry, kind, call))

    def warn(self, order: str) -> None:
        """Warn of every noted half (in ``order``, the updater's), at the caller's line."""
        notes, self.notes = self.notes, []
        steps = (
            "replay() then update() (the replay waits on the device for its update)"
            if order == "replay-first"
            else "update() then replay()"
        )
        for entry, kind, call in notes:
            warnings.warn(
                f"{entry.namespace}/{entry.key!r}: this {call} {_WHAT[kind]}. In {order} order a step is "
                f"{steps}; call the two halves in that order for one graph at a time, or use step(). "
                "(Said once per graph.)",
                StepOrderWarning,
                stacklevel=caller_level(),
            )
