"""The simulated device: its work scheduler and counters, and its streams and regular events.

The simulated NPU is a process-wide resource, as the real one is, so this module keeps
one :class:`SimState`; :func:`reset` replaces it (tests do so before each case).  Streams
and events stay with it because the three refer to each other: the device makes its
default stream, every stream and event call finds the process's device, and a stream's
``wait_stream`` records an event.  What refers to them one way lives apart: the
configuration and host-cost model (:mod:`.config`), ExternalEvents (:mod:`.external`) and
torch's stream context (:mod:`npusim.surfaces.streams`).

Model: every stream is an ordered queue of work items.  After each host call the
scheduler runs whatever is runnable.  By default it runs everything it can at once
("work runs as soon as nothing blocks it"); in adversarial mode it runs a random,
seeded number of steps, picking among runnable streams at random, and only drains
completely at a synchronize.  Work on different streams is ordered only by events.
A synchronize that finds work still blocked raises :class:`DeadlockError` at once
instead of waiting for the device timeout.
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from npusim.errors import CaptureError, DeadlockError, ReplayFault
from npusim.runtime.config import SimConfig
from npusim.runtime.eager import EagerOrdering
from npusim.runtime.faults import Faults
from npusim.runtime.memory import Memory

__all__ = ["SimState", "Stream", "Event", "KernelWork", "get_state", "locked", "reset"]


class _Work(Protocol):
    def ready(self) -> bool: ...

    def step(self, max_nodes: int) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


_ids = itertools.count(1)


def _new_id() -> int:
    return next(_ids)


class SimState:
    """The one simulated device of this process."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.adversarial = config.adversarial_seed is not None
        self.rng = random.Random(config.adversarial_seed)
        self.counters: collections.Counter[str] = collections.Counter()
        self.active: list[Stream] = []
        self.capture: Any = None  # the CaptureSession in progress (npusim.runtime.capture)
        self.default_stream = Stream._create(self, name="default", is_default=True)
        # The current stream is per host thread, as in torch; one lock serialises the
        # device's bookkeeping between threads (parallel updates), never the GIL-free waits.
        self._local = threading.local()
        self.lock = threading.RLock()
        self.memory = Memory()
        self.device_index = 0
        self.device_clock = 0.0  # seconds of simulated device time (Event.elapsed_time)
        self._costs = config.cost_model
        # Replay faults (kernel errors inside a replay) waiting for the next synchronize,
        # which reports them as hardware does: a replay is asynchronous.
        self.faults: list[Any] = []
        self.injected = Faults(config.faults)  # faults to inject, and the counts toward them
        # host seconds spent executing device work (replays, kernels, updates landing): on
        # the simulator the device runs on the CPU, inside whichever host call unblocks it
        self.busy_s = 0.0
        # The one task-update session open now (stream, host thread), and the updates
        # each stream has queued that have not landed: CANN allows one updater at a time.
        self.update_session: tuple[Stream, int] | None = None
        self.issuing: Any = None  # the work whose own enqueue is running the device now
        self.updates_in_flight: collections.Counter[Stream] = collections.Counter()
        # host seconds the simulator spent in its own code (own): its entry points' time, less
        # the device work run inside them (busy_s) and the modelled host cost spent there
        # (charged_s), which stands for the real call's and so is the caller's
        self.own_s = 0.0
        self.charged_s = 0.0

    @property
    def current_stream(self) -> Stream:
        return getattr(self._local, "stream", None) or self.default_stream

    @current_stream.setter
    def current_stream(self, stream: Stream) -> None:
        self._local.stream = stream

    # --- host cost and call counting -------------------------------------------------
    def charge(self, what: str) -> None:
        """Count one device call and spend its modelled host time.

        The time is busy-waited (the GIL held), except inside :meth:`gil_free`, where it is
        owed and slept off afterwards, outside the device lock (the 4-in-1 update is C++
        that releases the GIL).
        """
        self.counters[what] += 1
        model = self._costs
        if model is None:
            return
        us = getattr(model, what + "_us", 0.0)
        if not us:
            return
        if getattr(self._local, "owed", None) is not None:
            self._local.owed += us
            return
        self.charged_s += us * 1e-6
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    def own(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``, counting its host time as the simulator's own (:attr:`own_s`), less
        the device's work and the modelled host cost spent inside it.  Nested calls (an
        entry point calling another) count once, at the outermost."""
        local = self._local
        if getattr(local, "own", False):
            return fn(*args, **kwargs)
        local.own = True
        t0, busy, charged = time.perf_counter(), self.busy_s, self.charged_s
        try:
            return fn(*args, **kwargs)
        finally:
            local.own = False
            # another host thread's device work or modelled cost in between is taken off too:
            # exact with one issuing thread, an underestimate with several
            spent = time.perf_counter() - t0 - (self.busy_s - busy) - (self.charged_s - charged)
            with self.lock:
                self.own_s += spent

    def gil_free(self, body: Callable[[], Any]) -> Any:
        """Run ``body`` under the device lock, then spend its modelled host time without the GIL."""
        self._local.owed = 0.0
        try:
            with self.lock:
                result = body()
        finally:
            owed, self._local.owed = self._local.owed, None
        if owed:
            self.charged_s += owed * 1e-6
            time.sleep(owed * 1e-6)
        return result

    # --- scheduling ------------------------------------------------------------------
    def enqueue(self, stream: Stream, work: _Work) -> None:
        stream._queue.append(work)
        if len(stream._queue) == 1:
            self.active.append(stream)
        self.issuing = work
        try:
            self.pump()
        finally:
            self.issuing = None

    def run_eager(self, work: Any, body: Callable[[], Any], label: str) -> None:
        """Run an eager op or kernel queued on a stream.

        Run by the call that issued it, its error is that call's; run later (behind other
        work), the error is held for the next synchronize, as a device reports the error
        of asynchronous work, instead of coming out of whichever call happened to run it.
        """
        try:
            body()
        except Exception as exc:
            if self.issuing is work:
                raise
            fault = ReplayFault(
                f"{label} failed on the device: {type(exc).__name__}: {str(exc).rstrip('.')}. It ran "
                "after the call that issued it had returned, so its error comes at this synchronize"
            )
            fault.__cause__ = exc
            self.faults.append(fault)

    def pump(self, drain: bool = False) -> None:
        """Run runnable work: everything (default, or ``drain``) or a random slice."""
        with self.lock:
            try:
                self._pump(drain)
            finally:
                self._sync_ordering()

    def _pump(self, drain: bool) -> None:
        if not self.active:
            return
        # Device work is the device's, not host code: no host-side mode sees the aten ops its
        # kernels compute with on the host.  The simulator's own (the eager ordering, a
        # capture's recorder and host-read guard) passed them through already, yet each cost a
        # Python call per op: half of a 32-layer step's device work.  A mode of the program's
        # (a tracer, an op counter) has no business seeing the device's arithmetic either.
        # torch's own C guards, not popping the mode stacks: a pump runs at every launch
        # (about 0.5 µs here against 4 for torch.utils._python_dispatch._disable_current_modes)
        with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
            self._run_ready(drain)

    def _run_ready(self, drain: bool) -> None:
        if self.adversarial and not drain:
            budget = self.rng.randint(0, 4)
            max_nodes = 1
        else:
            budget = -1
            max_nodes = 1 if self.adversarial else 1 << 30
        while budget != 0 and self.active:
            ready = [s for s in self.active if s._queue[0].ready()]
            if not ready:
                return
            s = self.rng.choice(ready) if self.adversarial else ready[0]
            work = s._queue[0]
            t0 = time.perf_counter()
            try:
                finished = work.step(max_nodes)
            except BaseException:
                # A failed work item is dropped so that the device stays usable.
                self._pop(s)
                raise
            finally:
                self.busy_s += time.perf_counter() - t0
            if finished:
                self._pop(s)
            budget -= 1

    def _sync_ordering(self) -> None:
        """Eager ops of this host thread are stream-ordered while work is pending (``_eager``)."""
        ordering = getattr(self._local, "ordering", None)
        if self.active:
            if self.capture is not None:
                # a capture records every op (and its mode must stay on top, to be popped at
                # its end): the ordering comes with the next device call after it
                return
            if ordering is None:
                ordering = self._local.ordering = EagerOrdering(self)
            if not ordering.installed:
                ordering.install()
        elif ordering is not None and ordering.installed:
            ordering.uninstall()

    def retire(self) -> None:
        """This device is being replaced: its ordering on this thread leaves or goes inert."""
        ordering = getattr(self._local, "ordering", None)
        if ordering is not None:
            if ordering.installed:
                ordering.uninstall()
            ordering.state = None  # passes everything through if it could not leave the stack

    def _pop(self, s: Stream) -> None:
        s._queue.popleft()
        if not s._queue:
            self.active.remove(s)

    def drain(self, what: str, stream: Stream | None = None) -> None:
        """Run all work (of ``stream`` and what it depends on); raise if any stays blocked.

        A replay fault since the last synchronize is raised first (the device reports
        the error of asynchronous work at the next synchronize).
        """
        self.pump(drain=True)
        self.raise_faults()
        stuck = [s for s in self.active if stream is None or s is stream]
        if not stuck:
            return
        blocked = [s._queue[0].describe() | {"stream": s} for s in self.active]
        lines = [f"{what} would block forever: the device is deadlocked."]
        for info in blocked:
            lines.append(f"  - {info['stream']!r}: {info['text']}")
        lines.append(
            "Every ExternalEvent a graph waits on must be recorded (after "
            "graph_task_update_end) before the graph can run past that wait."
        )
        raise DeadlockError("\n".join(lines), blocked)

    def raise_faults(self) -> None:
        """Raise the first replay fault not reported yet (the others are counted in it)."""
        if not self.faults:
            return
        first, rest = self.faults[0], self.faults[1:]
        self.faults = []
        for f in (first, *rest):
            # what the cancelled rest of each replay left set: the records that landed since
            f.waits_skipped = tuple(e for e in f.waits_skipped if e._flag)
        first.others = tuple(rest)
        if rest:
            first.args = (f"{first.args[0]} (and {len(rest)} later replay fault(s))",)
        raise first


_STATE: SimState | None = None


def locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` holding the device lock (entry points a host thread may call concurrently),
    its time the simulator's own (:meth:`SimState.own`)."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        st = get_state()
        with st.lock:
            return st.own(fn, *args, **kwargs)

    return inner


def get_state() -> SimState:
    """Return the simulated device, creating it with the default config on first use."""
    global _STATE
    if _STATE is None:
        _STATE = SimState(SimConfig())
    return _STATE


def reset(config: SimConfig | None = None) -> SimState:
    """Replace the simulated device by a fresh one (all queues, counters and config)."""
    global _STATE
    if _STATE is not None:
        _STATE.retire()
    _STATE = SimState(config or SimConfig())
    return _STATE


# --- streams -------------------------------------------------------------------------


class Stream:
    """An ordered queue of device work (``torch.npu.Stream``)."""

    _state: SimState
    _queue: collections.deque[_Work]
    _name: str
    _is_default: bool
    _updating: Any  # the task group handle between update begin/end
    _update_ops: int
    stream_id: int
    priority: int

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        return cls._create(get_state(), name=None, is_default=False)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass

    @classmethod
    def _create(cls, state: SimState, name: str | None, is_default: bool) -> Stream:
        self = object.__new__(cls)
        self._state = state
        self._queue = collections.deque()
        self.stream_id = _new_id()
        self._name = name or f"stream#{self.stream_id}"
        self._is_default = is_default
        self._updating = None
        self._update_ops = 0
        self.priority = 0
        return self

    def __repr__(self) -> str:
        return f"<sim.npu.Stream {self._name}>"

    @property
    def device(self) -> str:
        return "npu:0"

    @locked
    def wait_event(self, event: Event) -> None:
        """Make all future work on this stream wait for ``event``'s latest record."""
        self._state.enqueue(self, _EventWait(event, event._issued))

    @locked
    def wait_stream(self, stream: Stream) -> None:
        """Make all future work on this stream wait for the work queued on ``stream``."""
        ev = Event()
        ev.record(stream)
        self.wait_event(ev)

    @locked
    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    @locked
    def query(self) -> bool:
        self._state.pump(drain=True)
        return not self._queue

    @locked
    def synchronize(self) -> None:
        self._state.charge("synchronize")
        self._state.drain(f"{self!r}.synchronize()", stream=self)


# --- events --------------------------------------------------------------------------


class Event:
    """A regular stream event (``torch.npu.Event``): waits see its latest record."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.event_id = _new_id()
        self._issued = 0  # sequence number of the latest record() call
        self._completed = 0  # sequence number of the latest record that ran
        self._time = 0.0

    def __repr__(self) -> str:
        return f"<sim.npu.Event #{self.event_id}>"

    @locked
    def record(self, stream: Stream | None = None) -> None:
        st = get_state()
        stream = stream or st.current_stream
        if st.capture is not None and st.capture.stream is stream:
            raise _capture_unsupported("Event.record on the capturing stream")
        self._issued += 1
        st.enqueue(stream, _EventRecord(self, self._issued))

    @locked
    def wait(self, stream: Stream | None = None) -> None:
        st = get_state()
        (stream or st.current_stream).wait_event(self)

    @locked
    def query(self) -> bool:
        get_state().pump(drain=True)
        return self._completed >= self._issued

    @locked
    def synchronize(self) -> None:
        st = get_state()
        st.charge("synchronize")
        st.pump(drain=True)
        if self._completed < self._issued:
            st.drain(f"{self!r}.synchronize()")
        st.raise_faults()

    def elapsed_time(self, end_event: Event) -> float:
        return (end_event._time - self._time) * 1e3


def _capture_unsupported(what: str) -> Exception:
    return CaptureError(f"{what}: the simulator captures a single stream; fork/join not modelled")


class _EventRecord:
    def __init__(self, event: Event, seq: int) -> None:
        self.event, self.seq = event, seq

    def ready(self) -> bool:
        return True

    def step(self, max_nodes: int) -> bool:
        self.event._completed = max(self.event._completed, self.seq)
        self.event._time = get_state().device_clock
        return True

    def describe(self) -> dict[str, Any]:
        return {"text": f"record of {self.event!r}", "event": self.event}


class _EventWait:
    def __init__(self, event: Event, seq: int) -> None:
        self.event, self.seq = event, seq

    def ready(self) -> bool:
        return self.event._completed >= self.seq

    def step(self, max_nodes: int) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"text": f"wait on {self.event!r} (record #{self.seq})", "event": self.event}


class KernelWork:
    """One eager kernel launch queued on a stream."""

    def __init__(self, run: Any, label: str) -> None:
        self.run, self.label = run, label

    def ready(self) -> bool:
        return True

    def step(self, max_nodes: int) -> bool:
        get_state().run_eager(self, self.run, self.label)
        return True

    def describe(self) -> dict[str, Any]:
        return {"text": self.label}
