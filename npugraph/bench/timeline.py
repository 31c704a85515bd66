"""A modeled device timeline: what a step costs end to end, host and device together.

Each implementation of the per-step update (npugraph with 1 or K update threads, a
reimplementation of vllm-ascend's ``UpdatableGraph`` loop, and of its older loop) runs
against a *recording device*: the same device-API calls, each logged (kind, task,
stream, host thread) and costing nothing, so the thread CPU time between two calls is
the implementation's own Python (the minimum over repeats).  The model then replays
that log on a timeline:

* each device-API call costs its modeled host time (:class:`Costs`: Atlas A2 figures,
  a PA layer update ≈ 59 µs (#15579), an FIA one ≈ 184 µs (#13058), a workspace query
  50 µs, a host synchronize 85 µs plus the wait, ``wait_stream`` an event record and a
  wait); the implementation's Python holds the GIL, the 4-in-1 FIA update does not; the
  recorder's own time per call is calibrated on an empty loop and subtracted, and the
  Python after the last call is counted;
* the device runs the graph layer by layer (the layer's non-attention work, ``other_us``,
  then the attention kernel), and layer ``i``'s attention starts only once its update has
  landed (its event recorded) and the previous step's replay has finished;
* steps follow each other, the host at most one step ahead of the device (it needs the
  outputs to schedule); a host synchronize stalls it until the device is idle.

It reports the modeled step latency, steady-state steps/s, and a Chrome trace
(``chrome://tracing`` or https://ui.perfetto.dev) of host threads and the device.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from npusim import HostCostModel

__all__ = ["Call", "Costs", "RecordingDevice", "StepLog", "TimelineResult", "model_steps", "chrome_trace"]


@attrs.frozen(kw_only=True)
class Call:
    """One device-API call as the implementation made it."""

    # replay, update_begin, op_launch, update_end, event_record, fused, workspace_query, synchronize,
    # event_synchronize (a host wait for one event), wait, wait_stream, end (the step's last
    # Python, after its last device call), engine (the engine's own host work, no device call:
    # the background-thread model); markers of a hand-off to a worker thread, no device call:
    # submit (the main thread hands work over: workers start after it), resume (the worker
    # starts it), join (the main thread waits until every worker is done)
    kind: str
    thread: int  # 0: the calling thread; 1..: update workers (told apart by their update streams)
    task: int = -1  # the layer it concerns (-1: none)
    python_us: float = 0.0  # the implementation's own host time since its previous call on that thread


@attrs.frozen(kw_only=True)
class StepLog:
    """The calls of one step, per thread, in order; ``fork`` is where workers start (main thread's call index)."""

    calls: tuple[Call, ...]
    fork: int = 0


_A2 = HostCostModel.atlas_a2()  # the simulator's calibration: one source for both models


@attrs.frozen(kw_only=True)
class Costs:
    """Modeled host µs per device-API call, and device µs per layer."""

    replay: float = _A2.replay_us
    event_record: float = _A2.event_record_us
    workspace_query: float = _A2.workspace_query_us
    synchronize: float = _A2.synchronize_us
    wait: float = 2.0
    # a host wait for one event (aclrtSynchronizeEvent): no measurement; charged as a stream
    # wait, which is kinder to whoever calls it than a device synchronize
    event_synchronize: float = 2.0
    update_begin: float = _A2.update_begin_us
    update_end: float = _A2.update_end_us
    op_launch_fia: float = _A2.op_launch_us  # 22 + 120 + 30 + 12 = 184 µs per FIA layer (#13058)
    op_launch_pa: float = 8.0  # begin + op + end + record ≈ 59 µs per PA layer (#15579 after #3986)
    pa_update_begin: float = 15.0
    pa_update_end: float = 24.0
    update_lands: float = 3.0  # device time for a task update to land
    # a thread that waited for the GIL held by another wakes this much after its release
    # (0 for one thread; the background-thread model sets it)
    gil_handoff: float = 0.0
    # a thread blocked on a queue or a future wakes this much after it is handed work (the
    # resume and join markers; 0 unless a model of threads sets it)
    thread_wake: float = 0.0
    # the tiling-sink step (vllm-ascend #15336): host launches of the metadata op and the
    # length copy, then the metadata op's AI-CPU time on the update stream before its event lands
    metadata_launch: float = 170.0  # 150-190 us measured
    metadata_device_us: float = 220.0  # 130-320 us measured: a parameter of the sink rows
    # update-free FIA's step: the launches of the length copy (an H2D aclrtMemcpyAsync) and of
    # one elementwise comparison (the mask). Not measured on A2: charged as two eager
    # torch_npu op launches of 25 us each, a figure above what an eager elementwise op
    # costs the host and below FIA's 120 us launch with its tiling
    mask_launch: float = 50.0
    attention_us: float = 60.0  # device time of one layer's attention kernel
    other_us: float = 0.0  # device time of one layer's non-attention work

    @classmethod
    def host_costs(cls, measured: dict[str, Any], **device: float) -> Costs:
        """Costs with the host figures of ``measured`` (``npugraph selftest --calibrate``)
        and the device figures given (per layer: ``attention_us``, ``other_us``)."""
        names = {f.name for f in attrs.fields(cls)} - {
            "attention_us",
            "other_us",
            "update_lands",
            "gil_handoff",
            "thread_wake",
            "metadata_device_us",
        }
        unknown = [k for k in measured if k not in names and k != "device"]
        if unknown:
            raise ValueError(f"unknown host costs {unknown}; expected some of {sorted(names)}")
        return cls(**{k: float(v) for k, v in measured.items() if k in names}, **device)

    def host(self, call: Call, kernel: str) -> float:
        if call.kind in ("end", "engine", "submit"):
            return 0.0
        if call.kind in ("resume", "join"):
            return self.thread_wake
        if call.kind == "wait_stream":  # records an event on the other stream, then waits on it
            return self.event_record + self.wait
        if call.kind == "op_launch":
            return self.op_launch_pa if kernel == "pa" else self.op_launch_fia
        if call.kind == "update_begin" and kernel == "pa":
            return self.pa_update_begin
        if call.kind == "update_end" and kernel == "pa":
            return self.pa_update_end
        if call.kind == "fused":
            return self.update_begin + self.op_launch_fia + self.update_end + self.event_record
        if call.kind == "metadata":
            return self.metadata_launch
        if call.kind == "mask":
            return self.mask_launch
        return float(getattr(self, call.kind, 0.0))


@attrs.frozen(kw_only=True)
class TimelineResult:
    """Modeled figures of ``steps`` consecutive steps."""

    step_latency_us: float  # host start of a step to the device finishing it (mean)
    steps_per_s: float  # steady state
    host_us_per_step: float
    device_us_per_step: float
    events: tuple[dict[str, Any], ...]  # Chrome trace events of the last steps


# --- the recording device -----------------------------------------------------------------


class RecordingDevice:
    """A torch_npu-shaped device whose calls are logged and cost nothing.

    ``ops`` and ``npu`` stand in for ``torch_npu`` and ``torch.npu``; handles and events
    made by :meth:`handle` / :meth:`event` carry the task they belong to.
    """

    def __init__(self, kernel: str, memory: Any = None) -> None:
        self.kernel = kernel
        self._calls: list[tuple[int, int, str, int, float]] = []
        self._lock = threading.Lock()
        self._current = threading.local()  # each host thread's current stream (npu.stream(s))
        self.streams = 0  # update streams made so far: the first is the calling thread's
        self.name = "recording"
        self.is_sim = False
        self.npu = _Npu(self)
        self.ops = _Ops(self)
        self.fused_fia_update = self.ops._C._npu_fused_infer_attention_score_out_graph
        self.device_length_ops = _SinkOps(self)
        self.memory = memory  # the memory of the device it stands in for (where the tables live)
        self.overhead_us = 0.0  # the recorder's own time per logged call (calibrate())
        self.deadlock_errors: tuple[type[BaseException], ...] = ()
        self.race_errors: tuple[type[BaseException], ...] = ()
        self.fault_errors: tuple[type[BaseException], ...] = ()
        self.fused_update_pays = True  # as on hardware (Device.fused_update_pays)

    def device_seconds(self) -> float:
        return 0.0  # the recording device does no work

    def mask_past(self, positions: Any, lengths: Any, out: Any) -> None:
        self.log("mask")  # update-free FIA's mask: the length copy's and the comparison's launches

    # what a device adapter answers on hardware (npugraph.device.Device): no names in its
    # reports, no task group in its errors, no pool sizes
    def name_in_reports(self, obj: Any, name: str) -> None:
        pass

    def names_task(self, message: str, handle: Any) -> bool:
        return False

    def task_group(self, handle: Any) -> Any:
        return None

    def pool_bytes(self, pool: Any) -> int | None:
        return None

    def weak_ref_tensor(self, t: Any) -> Any:
        return t

    def is_device_memory(self, t: Any) -> bool:
        return bool(t.device.type != "cpu")  # the recorded steps' tables are host tables

    def staged(self, t: Any) -> Any:
        return t  # the recorded steps' host tables count as page-locked, as vLLM's CPU tables are

    def handle(self, task: int) -> _Tagged:
        return _Tagged(task)

    def event(self, task: int) -> _Event:
        return _Event(self, task)

    def log(self, kind: str, task: int = -1, stream: Any = None) -> None:
        if stream is None:  # a call on the current stream: the one its thread entered, if any
            stream = getattr(self._current, "stream", None)
        worker = max(0, getattr(stream, "index", 0) - 1)
        with self._lock:
            self._calls.append((threading.get_ident(), worker, kind, task, time.thread_time()))

    def calibrate(self, calls: int = 2000) -> float:
        """Measure what logging one call costs (the gap between back-to-back logged calls
        with nothing between them): :meth:`recording` subtracts it from every gap, so the
        recorder never counts as the implementation's Python."""
        gaps = []
        for _ in range(5):
            self._calls.clear()
            for _ in range(calls):
                self.log("calibration")
            ts = [c[4] for c in self._calls]
            gaps.append((ts[-1] - ts[0]) * 1e6 / (len(ts) - 1))
        self._calls.clear()
        self.overhead_us = min(gaps)
        return self.overhead_us

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[StepLog]]:
        """Record one step: the threads' calls, with each gap of own Python time (less the
        recorder's own per-call time), and the Python after the last call as an ``end`` call."""
        out: list[StepLog] = []
        self._calls.clear()
        last: dict[int, float] = {threading.get_ident(): time.thread_time()}
        yield out
        self.log("end")
        calls: list[Call] = []
        for ident, worker, kind, task, t in self._calls:
            prev = last.get(ident, t)  # a worker's first gap: from its own start, unknown here
            gap = (t - prev) * 1e6 - self.overhead_us  # CPU time is per OS thread
            last[ident] = t
            calls.append(Call(kind=kind, thread=worker, task=task, python_us=max(0.0, gap)))
        mine = [c for c in calls if c.thread == 0]
        fork = next((j for j, c in enumerate(mine) if c.task >= 0), len(mine))
        submit = next((j for j, c in enumerate(mine) if c.kind == "submit"), None)
        if submit is not None:
            # work handed to a real thread: the threads' calls interleave differently each
            # time; per thread they are the same, and the workers start at the hand-off
            calls.sort(key=lambda c: c.thread)
            fork = submit + 1
        out.append(StepLog(calls=tuple(calls), fork=fork))


class _Tagged:
    def __init__(self, task: int) -> None:
        self.task = task


class _Event(_Tagged):
    def __init__(self, dev: RecordingDevice, task: int) -> None:
        super().__init__(task)
        self.dev = dev

    def record(self, stream: Any = None) -> None:
        self.dev.log("event_record", self.task, stream)

    def synchronize(self) -> None:
        self.dev.log("event_synchronize")

    def query(self) -> bool:
        return True  # the recorded device has no pending work


class _Stream:
    def __init__(self, dev: RecordingDevice, index: int = 0) -> None:
        self.dev, self.index = dev, index

    def wait_event(self, event: Any) -> None:
        self.dev.log("wait", stream=self)

    def wait_stream(self, stream: Any) -> None:
        self.dev.log("wait_stream", stream=self)


class _Npu:
    def __init__(self, dev: RecordingDevice) -> None:
        self.dev = dev
        self._main = _Stream(dev)

    def Stream(self) -> _Stream:
        self.dev.streams += 1
        return _Stream(self.dev, self.dev.streams)

    def Event(self, **_: Any) -> _Event:
        return _Event(self.dev, -1)

    def current_stream(self) -> _Stream:
        return self._main

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        local = self.dev._current
        before = getattr(local, "stream", None)
        local.stream = s
        try:
            yield
        finally:
            local.stream = before

    def synchronize(self) -> None:
        self.dev.log("synchronize")

    def graph_task_update_begin(self, stream: Any, handle: _Tagged) -> None:
        self.dev.log("update_begin", handle.task, stream)

    def graph_task_update_end(self, stream: Any) -> None:
        self.dev.log("update_end", stream=stream)


class _Ops:
    def __init__(self, dev: RecordingDevice) -> None:
        self.dev = dev
        self._C = _FusedNamespace(dev)
        self.npu_fused_infer_attention_score = _Kernel(dev)
        self.npu_fused_infer_attention_score_v2 = _Kernel(dev)

    def _npu_paged_attention(self, *args: Any, **kwargs: Any) -> None:
        self.dev.log("op_launch")

    def _npu_paged_attention_get_workspace(self, *args: Any, **kwargs: Any) -> Any:
        self.dev.log("workspace_query")
        return kwargs.get("out")  # stands in for the workspace tensor


class _Kernel:
    def __init__(self, dev: RecordingDevice) -> None:
        self.dev = dev

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.dev.log("op_launch")

    def out(self, *args: Any, **kwargs: Any) -> None:
        self.dev.log("op_launch")


class _SinkOps:
    """The tiling-sink pair: the metadata op is a logged call (its launch and the length
    copy's, modeled together); the kernel is never issued outside a capture."""

    def __init__(self, dev: RecordingDevice) -> None:
        self.dev = dev
        self.npu_fused_infer_attention_score_v2_sink = _Kernel(dev)

    def _npu_fused_infer_attention_score_v2_sink_metadata(self, *args: Any, **kwargs: Any) -> None:
        self.dev.log("metadata")


class _FusedNamespace:
    def __init__(self, dev: RecordingDevice) -> None:
        self.dev = dev

    def _npu_fused_infer_attention_score_out_graph(
        self, us: Any, handle: _Tagged, event: _Event, *a: Any, **k: Any
    ) -> None:
        self.dev.log("fused", handle.task, us)


class ShadowGraph:
    """The graph object of a shadow entry: its replay is a logged call."""

    def __init__(self, dev: RecordingDevice) -> None:
        self.dev = dev

    def replay(self) -> None:
        self.dev.log("replay")


# --- the model --------------------------------------------------------------------------------


def min_log(logs: Sequence[StepLog]) -> StepLog:
    """Per call position, the smallest own-Python gap over repeats (the calls must line up)."""
    base = logs[0]
    same = [
        lg
        for lg in logs
        if [(c.kind, c.thread, c.task) for c in lg.calls] == [(c.kind, c.thread, c.task) for c in base.calls]
    ]
    calls = tuple(
        attrs.evolve(c, python_us=min(lg.calls[j].python_us for lg in same)) for j, c in enumerate(base.calls)
    )
    return StepLog(calls=calls, fork=base.fork)


def _host_threads(
    log: StepLog, costs: Costs, kernel: str, t0: float, device_idle: float
) -> tuple[float, dict[int, float], float, list[dict[str, Any]]]:
    """Run one step's calls on the host: returns (host end, event time per task, replay issue time, trace events).

    Segments of own Python and of ordinary calls hold the GIL (one thread at a time); the
    4-in-1 (``fused``) runs without it.  Workers start when the main thread reaches ``fork``.
    A thread that waited for the GIL while another held it starts ``gil_handoff`` after
    the release (the wake of a blocked thread).
    """
    by_thread: dict[int, list[Call]] = {}
    for c in log.calls:
        by_thread.setdefault(c.thread, []).append(c)
    pos = dict.fromkeys(by_thread, 0)
    gil_free_at = t0
    holder = 0  # the thread that held the GIL last
    events: dict[int, float] = {}
    replay_at = t0
    trace: list[dict[str, Any]] = []
    main_done = 0
    heap: list[tuple[float, int]] = [(t0, 0)]
    stream_ready = t0  # when the update stream's device work (metadata ops) is done
    started = {0}
    workers = set(by_thread) - {0}
    finished: set[int] = set()
    joining: float | None = None  # when the main thread began to wait in a join
    end = t0
    while heap:
        t, th = heapq.heappop(heap)
        calls = by_thread[th]
        if pos[th] >= len(calls):
            end = max(end, t)
            finished.add(th)
            if joining is not None and finished >= workers:
                heapq.heappush(heap, (max(joining, t), 0))  # the last worker is done: wake the join
                joining = None
            continue
        c = calls[pos[th]]
        if c.kind == "join" and not finished >= workers:
            joining = t  # woken when the last worker is done
            continue
        # own Python, under the GIL
        start = max(t, gil_free_at)
        if th != holder and gil_free_at > t:
            start += costs.gil_handoff  # it waited for another thread: woken after the release
        holder = th
        py_end = start + c.python_us
        gil_free_at = py_end
        cost = costs.host(c, kernel)
        if c.kind == "fused":
            call_start, call_end = py_end, py_end + cost  # GIL released
        elif c.kind in ("synchronize", "event_synchronize"):
            call_start = py_end
            call_end = max(py_end, device_idle) + cost
            gil_free_at = call_end
        else:
            call_start, call_end = py_end, py_end + cost
            gil_free_at = call_end
        if c.python_us:
            trace.append(_ev("python", th, start, c.python_us))
        trace.append(_ev(c.kind + (f" #{c.task}" if c.task >= 0 else ""), th, call_start, call_end - call_start))
        if c.kind == "metadata":
            # the AI-CPU op runs on the update stream after its launch, and after the previous
            # replay, which reads the lengths and plan it rewrites (the update stream waits for it)
            stream_ready = max(stream_ready, call_end, device_idle) + costs.metadata_device_us
        if c.kind in ("event_record", "fused") and c.task >= 0:
            events[c.task] = max(call_end, stream_ready)  # an event lands after the stream's work
        if c.kind == "replay":
            replay_at = call_end
        pos[th] += 1
        if th == 0:
            main_done += 1
            if main_done == log.fork:
                for w in by_thread:
                    if w not in started:
                        started.add(w)
                        heapq.heappush(heap, (call_end, w))
        heapq.heappush(heap, (call_end, th))
    return end, events, replay_at, trace


def _ev(name: str, tid: int, ts: float, dur: float, pid: int = 0) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(ts, 3), "dur": round(max(dur, 0.0), 3)}


def model_steps(
    log: StepLog,
    costs: Costs,
    *,
    kernel: str,
    layers: int,
    steps: int = 12,
    recorded_by: Sequence[int] | None = None,
) -> TimelineResult:
    """Run ``steps`` identical steps of ``log`` on the modeled host and device.

    ``recorded_by[i]``: the task whose event record lets layer ``i`` run (event grouping:
    the last task of ``i``'s group; default ``i``).
    The host starts step ``k + 1`` once it is done with step ``k`` and the device has
    finished step ``k - 1`` (it samples from an output one step behind, as with async
    scheduling); the steady state is measured over the last two thirds of the steps.
    """
    t_host = 0.0
    device_end = 0.0
    starts, ends, host_d, dev_d = [], [], [], []
    trace: list[dict[str, Any]] = []
    for k in range(steps):
        prev_end = device_end
        host_end, events, replay_at, host_trace = _host_threads(log, costs, kernel, t_host, prev_end)
        t = max(replay_at, prev_end)  # the graph starts when issued and the previous step is done
        dev_start = t
        dev_trace = []
        for i in range(layers):
            t += costs.other_us
            by = recorded_by[i] if recorded_by is not None else i
            land = max(events.get(by, replay_at), prev_end) + costs.update_lands
            start = max(t, land)
            t = start + costs.attention_us
            dev_trace.append(_ev(f"layer {i} attention", 100, start, costs.attention_us))
        device_end = t
        starts.append(t_host)
        ends.append(device_end)
        host_d.append(host_end - t_host)
        dev_d.append(device_end - dev_start)
        if k >= steps - 3:
            trace += host_trace + dev_trace
        # the engine needs step k's output before step k + 2: the host runs at most one step ahead
        t_host = max(host_end, ends[-2]) if len(ends) >= 2 else host_end
    warm = max(1, steps // 3)
    n = steps - warm
    return TimelineResult(
        step_latency_us=sum(e - s for s, e in zip(starts[warm:], ends[warm:])) / n,
        steps_per_s=1e6 * n / (ends[-1] - ends[warm - 1]),
        host_us_per_step=sum(host_d[warm:]) / n,
        device_us_per_step=sum(dev_d[warm:]) / n,
        events=tuple(trace),
    )


def chrome_trace(shapes: dict[str, dict[str, TimelineResult]]) -> dict[str, Any]:
    """One Chrome trace: a process per shape and implementation, its host threads and the device."""
    events: list[dict[str, Any]] = []
    pid = 0
    for shape, results in shapes.items():
        for name, r in results.items():
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{shape}: {name}"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for tid in sorted({e["tid"] for e in r.events}):
                label = "device stream" if tid == 100 else ("host (main)" if tid == 0 else f"host update worker {tid}")
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
            events += [dict(e, pid=pid) for e in r.events]
            pid += 1
    return {"traceEvents": events, "displayTimeUnit": "ms"}
