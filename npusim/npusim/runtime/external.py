r"""ExternalEvents: the one-bit device flags a captured graph waits on (``torch.npu.ExternalEvent``),
and the work items that record and wait on them outside a capture.

Apart from regular :class:`~npusim.runtime.state.Event`\ s because their rule differs: a
record sets a flag that one wait consumes, so a second record before that wait is lost (a
hang on hardware, :class:`~npusim.errors.RaceError` here)."""

from __future__ import annotations

from typing import Any

from npusim.errors import RaceError
from npusim.runtime.state import Stream, _new_id, get_state, locked

__all__ = ["ExternalEvent", "external_event_name", "fire_external_record"]


class ExternalEvent:
    """A one-bit device flag (``torch.npu.ExternalEvent``).

    ``record`` enqueues "flag = 1" (a record while the flag is already 1 is lost:
    the simulator raises :class:`RaceError` when it lands).  ``wait`` enqueues
    "block until flag == 1, then flag = 0"; inside a capture it becomes a graph node.
    ``reset`` is a no-op, as on every CANN that has task groups.
    """

    def __init__(self) -> None:
        self.event_id = _new_id()
        self._flag = 0
        self._waits_since_record = 0
        self.label: str | None = None  # simulator-only: shown in error messages

    def __repr__(self) -> str:
        return f"<sim.npu.ExternalEvent #{self.event_id}>"

    @locked
    def record(self, stream: Stream) -> None:
        st = get_state()
        st.charge("event_record")
        self._waits_since_record = 0
        if st.capture is not None and st.capture.stream is stream:
            st.capture.record_external(self, wait=False)
            return
        st.enqueue(stream, _ExternalRecord(self, stream))

    @locked
    def wait(self, stream: Stream) -> None:
        st = get_state()
        if self._waits_since_record >= 1:
            raise RuntimeError(
                "External event: A single record operation cannot be associated with multiple wait operations."
            )
        self._waits_since_record += 1
        if st.capture is not None and st.capture.stream is stream:
            st.capture.record_external(self, wait=True)
            return
        st.enqueue(stream, _ExternalWait(self))

    def reset(self, stream: Stream) -> None:
        """No-op on every CANN that has task groups (kept for old code)."""


# --- plain work items ----------------------------------------------------------------


def external_event_name(event: ExternalEvent) -> str:
    return f"{event!r}" + (f" [{event.label}]" if event.label else "")


class _ExternalRecord:
    def __init__(self, event: ExternalEvent, stream: Stream) -> None:
        self.event = event
        self.stream = stream

    def ready(self) -> bool:
        return True

    def step(self, max_nodes: int) -> bool:
        fire_external_record(self.event, where=f"on {self.stream!r}")
        return True

    def describe(self) -> dict[str, Any]:
        return {"text": f"record of {external_event_name(self.event)}", "event": self.event}


def fire_external_record(event: ExternalEvent, where: str = "") -> None:
    """Set the flag; a record that lands while it is already set is lost (and so is one
    an injected ``lost-record`` fault takes)."""
    if get_state().injected.record_lost():
        return
    if event._flag:
        raise RaceError(
            f"{external_event_name(event)} was recorded {where} while its flag was already set: "
            "this record is lost, and the next replay waiting on it would hang. Record each "
            "task's event exactly once per replay (after its update), and order the update "
            "stream after the previous replay.",
            event=event,
        )
    event._flag = 1


class _ExternalWait:
    def __init__(self, event: ExternalEvent) -> None:
        self.event = event

    def ready(self) -> bool:
        return bool(self.event._flag)

    def step(self, max_nodes: int) -> bool:
        self.event._flag = 0
        return True

    def describe(self) -> dict[str, Any]:
        return {
            "text": f"wait on {external_event_name(self.event)}, which is never recorded",
            "event": self.event,
        }
