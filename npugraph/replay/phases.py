"""The step table's state: where each captured graph is in its step protocol.

A captured graph's per-step state is one :class:`GraphState`, whose :class:`StepPhase` says
which call may come next (the table is :class:`StepPhase`'s);
what capture recorded stays frozen in :class:`~npugraph.capture.CapturedGraph`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from npugraph.metadata import AttentionMetadata, StepLens

__all__ = ["ORDERS", "GraphState", "StepMetadata", "StepPhase"]

# Layer or KV-cache-group name -> metadata; a list of those with micro-batching.
StepMetadata = Mapping[str, AttentionMetadata] | Sequence[Mapping[str, AttentionMetadata]]

ORDERS = ("replay-first", "update-first")


class StepPhase(enum.Enum):
    """Where a captured graph is in its step protocol (:class:`~npugraph.replay.ReplayUpdater`'s).

    The phases, and the call that moves a graph from each (``order`` decides the two calls
    a step makes):

    =================  =======================  ==================================
    phase              call                     next phase
    =================  =======================  ==================================
    IDLE               update                   UPDATED
    IDLE               replay (replay-first)    REPLAY_QUEUED
    IDLE               replay (update-first)    refused: update first
    UPDATED            replay (update-first)    IDLE (the replay runs the update)
    UPDATED            replay (replay-first)    REPLAY_QUEUED (the stale update's
                                                events are consumed first)
    UPDATED            update                   UPDATED (the earlier update's
                                                events are consumed first)
    UPDATED            another graph's update   BROKEN (it rewrote a block-table
                       into a shared buffer     buffer this update's lengths read)
    REPLAY_QUEUED      update (replay-first)    IDLE (the waiting replay runs it)
    REPLAY_QUEUED      update (update-first)    UPDATED (the waiting replay of an
                                                earlier step is released first)
    REPLAY_QUEUED      replay                   REPLAY_QUEUED (the waiting one is
                                                released first)
    BROKEN             update                   UPDATED (stale events consumed,
                                                every task re-issued)
    BROKEN             replay (replay-first)    REPLAY_QUEUED (likewise)
    BROKEN             replay (update-first)    refused: update first
    =================  =======================  ==================================
    """

    IDLE = "idle"  # no update pending, no replay waiting
    UPDATED = "updated"  # an update landed; the next replay runs it
    REPLAY_QUEUED = "replay-queued"  # a replay waits on the device for its update
    BROKEN = "broken"  # an update or replay failed part-way: tasks may hold several steps' lengths


@attrs.define(kw_only=True, eq=False)
class GraphState:
    """The per-step state of one captured graph (what capture recorded stays frozen).

    ``pending[i]``: task ``i`` recorded its event (it ends its event group) and no replay
    consumed it yet (``last_reissued``: tasks re-issued by the last update, each tiling-sink
    group written counting as one);
    ``applied[i]``: the host values last written into task ``i`` (identity tells an
    unchanged task; ``None``: unknown, re-issue it); ``lens_of[i]`` / ``host_of[i]``: the
    lengths task ``i`` was last given and their host values (a step with equal lengths
    reuses both objects, so its tasks skip the re-issue); ``done``: two events its
    replays record in turn (the next update is ordered after them); ``last_lens``: each
    length slot's latest lengths (for dumps); ``last_update_s`` / ``last_replay_s``: host
    seconds of the last step's two halves, without the simulator's device work (which
    runs inside host calls).
    """

    phase: StepPhase = StepPhase.IDLE
    pending: list[bool]
    applied: list[Any]
    lens_of: list[StepLens | None]
    host_of: list[tuple[StepLens, dict[str, Any]] | None]
    done: tuple[Any, Any]
    # recorded on the engine's stream before a replay() that waits for its update: the
    # update reads the engine's device tables after what the engine issued before it
    ready: Any
    waiting_done: Any = None  # the done event of the replay that waits for its update
    last_lens: dict[str, StepLens] = attrs.field(factory=dict)
    steps: int = 0
    replays: int = 0
    last_reissued: int = 0
    last_update_s: float = 0.0
    last_replay_s: float = 0.0
    warned: set[str] = attrs.field(factory=set)  # the StepOrderWarning kinds said for this graph

    @property
    def replayable(self) -> bool:
        """Whether a replay may run now without a complete update first."""
        return self.phase is not StepPhase.BROKEN
