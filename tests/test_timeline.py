"""The modeled timeline: its rules on synthetic call logs, and the recording device on real updaters.

No timing is asserted here (that is the benchmark's job): the model is checked on logs
whose host costs are given, so every expected figure follows from the rules.
"""

from __future__ import annotations

import json
import time

import attrs
import pytest

import npusim as sim
from npugraph.bench import measured, modeled, rivals
from npugraph.bench.timeline import Call, Costs, RecordingDevice, StepLog, chrome_trace, min_log, model_steps

COSTS = Costs(attention_us=60.0)
FIA_LAYER = 22 + 120 + 30 + 12  # begin + op + end + record, the fused call's total


def _fused_log(layers: int, workers: int = 1, replay_first: bool = True) -> StepLog:
    replay = [Call(kind="replay", thread=0)]
    tasks = [Call(kind="fused", thread=i % workers, task=i) for i in range(layers)]
    calls = replay + tasks if replay_first else tasks + replay
    mine = [c for c in calls if c.thread == 0]
    fork = next(j for j, c in enumerate(mine) if c.task >= 0)
    return StepLog(calls=tuple(calls), fork=fork)


def test_one_thread_is_host_bound_by_its_update_calls():
    r = model_steps(_fused_log(20), COSTS, kernel="fia", layers=20)
    assert r.host_us_per_step == pytest.approx(COSTS.replay + 20 * FIA_LAYER)
    assert r.steps_per_s == pytest.approx(1e6 / r.host_us_per_step, rel=1e-6)


def test_gil_free_updates_from_four_threads_overlap():
    one = model_steps(_fused_log(20), COSTS, kernel="fia", layers=20)
    four = model_steps(_fused_log(20, workers=4), COSTS, kernel="fia", layers=20)
    assert four.host_us_per_step == pytest.approx(COSTS.replay + 5 * FIA_LAYER)
    assert four.steps_per_s > 3 * one.steps_per_s


def test_python_holds_the_gil_so_it_serialises_across_threads():
    calls = [Call(kind="replay", thread=0)] + [
        Call(kind="update_begin", thread=i % 2, task=i, python_us=100.0) for i in range(4)
    ]
    r = model_steps(StepLog(calls=tuple(calls), fork=1), Costs(attention_us=1.0), kernel="fia", layers=4)
    # 4 x (100 us of Python + 22 us begin), all under the GIL: nothing overlaps
    assert r.host_us_per_step == pytest.approx(Costs().replay + 4 * (100 + 22))


def test_device_bound_steps_run_at_the_device_limit_when_replayed_first():
    costs = Costs(attention_us=200.0)
    r = model_steps(_fused_log(32), costs, kernel="fia", layers=32)
    assert r.steps_per_s == pytest.approx(1e6 / (32 * 200.0), rel=1e-3)
    late = model_steps(_fused_log(32, replay_first=False), costs, kernel="fia", layers=32)
    assert late.step_latency_us > r.step_latency_us, "update-first: the graph starts only after every update"


def test_a_host_synchronize_before_the_replay_loses_the_overlap():
    costs = Costs(attention_us=200.0)
    calls = tuple(
        [Call(kind="fused", thread=0, task=i) for i in range(32)]
        + [Call(kind="synchronize", thread=0), Call(kind="replay", thread=0)]
    )
    r = model_steps(StepLog(calls=calls, fork=0), costs, kernel="fia", layers=32)
    first = model_steps(_fused_log(32), costs, kernel="fia", layers=32)
    assert r.steps_per_s < first.steps_per_s, "the synchronize and the replay's host cost sit between device steps"
    assert r.step_latency_us > first.step_latency_us, "and the graph starts only after every update"


def test_recording_logs_one_updater_and_the_legacy_loop():
    sim.configure()
    rt, _, table, _q = measured._setup(8, 8, "fia", cost=False)
    impls = rivals._implementations(rt, 8, "fia")
    dev, step = impls["npugraph"]
    inp = rivals._step_input(rt, 8, [5] * 8, table)
    with dev.recording() as logs:
        step(inp)
    (log,) = logs
    fused = [(c.thread, c.task) for c in log.calls if c.kind == "fused"]
    assert fused == [(0, i) for i in range(8)], "one thread updates every task, in layer order"
    assert log.calls[0].kind == "replay"
    dev, step = impls["legacy"]
    with dev.recording() as logs:
        step(inp)
    kinds = [c.kind for c in logs[0].calls]
    assert kinds[:2] == ["synchronize", "replay"] and kinds.count("op_launch") == 8 and kinds[-1] == "end"


def test_chrome_trace_names_processes_and_threads():
    r = model_steps(_fused_log(4, workers=2), COSTS, kernel="fia", layers=4)
    doc = json.loads(json.dumps(chrome_trace({"host_bound": {"npugraph_k2": r}})))
    names = {e["args"].get("name") for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"host_bound: npugraph_k2", "host (main)", "host update worker 1", "device stream"} <= names
    assert all(e["dur"] >= 0 for e in doc["traceEvents"] if e["ph"] == "X")


def test_the_recorder_does_not_count_itself_and_counts_the_python_after_the_last_call():
    dev = RecordingDevice("fia")
    overhead = dev.calibrate()
    assert overhead > 0
    # the least gap per position over repeats, as the bench reads its logs (min_log): a
    # moment of machine slowness in one recording is not the recorder counting itself
    # (a recorder that does not subtract itself reads about 80 calls' worth; half of that is
    # the limit, so that only a machine slower by half through every recording could fail it)
    recorded = []
    for _ in range(9):
        with dev.recording() as logs:
            for _ in range(80):
                dev.log("event_record", 0)
        recorded += logs
    own = sum(c.python_us for c in min_log(recorded).calls[:-1])
    assert own < 0.5 * 80 * overhead, "80 back-to-back calls are not 80 calls' worth of Python"
    with dev.recording() as logs:
        dev.log("replay")
        end = time.thread_time() + 0.002
        while time.thread_time() < end:  # 2 ms of Python after the last device call
            pass
    assert logs[0].calls[-1].kind == "end" and logs[0].calls[-1].python_us >= 1500


def test_updatable_graph_baselines_follow_the_merged_code():
    sim.configure()
    rt, _, table, _q = measured._setup(4, 4, "pa", cost=False)
    impls = rivals._implementations(rt, 4, "pa")
    inp = rivals._step_input(rt, 4, [5] * 4, table)
    kinds = {}
    for name in ("updatable_mrv1", "updatable_mrv2", "legacy"):
        dev, step = impls[name]
        with dev.recording() as logs:
            step(inp)
        kinds[name] = [c.kind for c in logs[0].calls if c.kind != "end"]
    assert kinds["updatable_mrv1"][:2] == ["synchronize", "replay"], "MRV1: a host synchronize before the replay"
    assert kinds["updatable_mrv2"][:2] == ["replay", "wait_stream"], "MRV2: the update stream waits for the replay"
    for name in ("updatable_mrv1", "updatable_mrv2", "legacy"):
        assert kinds[name].count("workspace_query") == 1, f"{name}: the PA workspace once per pass (#15579)"
        assert kinds[name].count("event_record") == 4
    assert kinds["legacy"][:2] == ["synchronize", "replay"], "the runner's order: synchronize, replay, update"


@pytest.mark.parametrize("kernel", ["pa", "fia"])
def test_both_modeled_npugraph_graphs_read_the_steps_table_in_place(kernel):
    # an engine's graphs read its one block-table buffer: a graph with a buffer of its own
    # would copy the table in every step and be charged for it, the other not
    sim.configure()
    shape = modeled.ModeledShape(
        label="t", layers=4, size=4, kernel=kernel, attention_us=1.0, other_us=1.0, source="test", event_group=2
    )
    rt, grouped, table, _queries = modeled._modeled_runtimes(shape)
    for runtime in (rt, grouped):
        for task in runtime.entry(4).tasks:
            (name,) = task.spec.refreshed_buffers
            assert task.args[name].data_ptr() == table.data_ptr(), "the step's own table, read in place"
    assert sum(t.records for t in grouped.entry(4).tasks) < 4 == sum(t.records for t in rt.entry(4).tasks)


def test_a_thread_that_waited_for_the_gil_wakes_a_handoff_after_its_release():
    calls = (
        Call(kind="replay", thread=0),
        Call(kind="end", thread=0, python_us=100.0),
        Call(kind="end", thread=1, python_us=10.0),
    )
    log = StepLog(calls=calls, fork=1)
    costs = Costs(attention_us=1.0)
    plain = model_steps(log, costs, kernel="fia", layers=1)
    woken = model_steps(log, attrs.evolve(costs, gil_handoff=21.0), kernel="fia", layers=1)
    # thread 1 is ready when the replay ends but thread 0's Python holds the GIL
    assert plain.host_us_per_step == pytest.approx(costs.replay + 100 + 10)
    assert woken.host_us_per_step == pytest.approx(costs.replay + 100 + 21 + 10)


def _pa_log(layers: int) -> StepLog:
    calls = [Call(kind="replay", thread=0)]
    for i in range(layers):
        calls += [
            Call(kind="update_begin", thread=0, task=i, python_us=1.0),
            Call(kind="op_launch", thread=0, task=i),
            Call(kind="update_end", thread=0, task=i),
            Call(kind="event_record", thread=0, task=i),
        ]
    return StepLog(calls=(*calls, Call(kind="end", thread=0, python_us=2.0)))


@pytest.mark.parametrize("engine_us", [250.0, 1000.0])
def test_a_background_update_thread_overlaps_the_engine_only_with_gil_free_updates(engine_us):
    """The engine's host work (Python) and the update share the GIL: beside GIL-free 4-in-1
    updates it hides; beside PA's ordinary calls it only adds the hand-offs."""
    costs = attrs.evolve(COSTS, gil_handoff=modeled.HANDOFF_US)

    def sps(log: StepLog, background: bool, kernel: str) -> float:
        step = modeled.engine_step(log, engine_us, background=background)
        return model_steps(step, costs if background else COSTS, kernel=kernel, layers=20).steps_per_s

    fused = _fused_log(20)
    assert sps(fused, True, "fia") > sps(fused, False, "fia")
    in_line = model_steps(modeled.engine_step(fused, engine_us, background=False), COSTS, kernel="fia", layers=20)
    assert in_line.host_us_per_step == pytest.approx(COSTS.replay + 20 * FIA_LAYER + engine_us)
    pa = _pa_log(20)
    assert sps(pa, True, "pa") < sps(pa, False, "pa")


@pytest.mark.parametrize("kernel", ["pa", "fia"])
def test_torch_npu_update_baseline_follows_sglang_and_torch_npu(kernel):
    # SGLang 0.5.23's replay_with_input_update: fence wait, submit, replay, wait for the
    # worker, new fence; torch_npu's update_capture_record on the worker: per record begin,
    # the op re-issued, end, the record's event; no workspace query (captured at max)
    sim.configure()
    rt, _, table, _q = measured._setup(4, 4, kernel, cost=False)
    impls = rivals._implementations(rt, 4, kernel)
    dev, step = impls["torch_npu_update"]
    logs = []
    for lens in ([5] * 4, [7, 1, 2, 9]):
        with dev.recording() as log:
            step(rivals._step_input(rt, 4, lens, table))
        logs += log
    second = logs[1]
    main = [c.kind for c in second.calls if c.thread == 0]
    worker = [(c.kind, c.task) for c in second.calls if c.thread == 1]
    assert main == ["event_synchronize", "submit", "replay", "join", "event_record", "end"]
    assert second.fork == 2, "the worker starts at the hand-off"
    assert worker[0] == ("resume", -1)
    per_record = [k for k, _ in worker[1:]]
    assert per_record == ["update_begin", "op_launch", "update_end", "event_record"] * 4
    assert [t for k, t in worker if k == "event_record"] == [0, 1, 2, 3], "one event per record, in order"
    assert "workspace_query" not in main + per_record
    assert next(c.kind for c in logs[0].calls if c.thread == 0) == "submit", "no fence before the first step"


def test_a_join_waits_for_the_worker_and_a_fence_for_the_device():
    calls = (
        Call(kind="submit", thread=0),
        Call(kind="replay", thread=0),
        Call(kind="join", thread=0),
        Call(kind="end", thread=0),
        Call(kind="resume", thread=1),
        Call(kind="event_record", thread=1, task=0, python_us=500.0),
    )
    costs = Costs(attention_us=1.0, thread_wake=21.0)
    r = model_steps(StepLog(calls=calls, fork=1), costs, kernel="fia", layers=1)
    # the calling thread ends a wake after the worker's 500 us and its record, not at its
    # replay; the worker, woken at the hand-off, waits for the replay's hold on the GIL
    worker_done = costs.replay + 21.0 + 500.0 + costs.event_record
    assert r.host_us_per_step == pytest.approx(worker_done + 21.0)
    # a fence wait holds the host until the previous step's device work is done: no running ahead
    fenced = (Call(kind="event_synchronize", thread=0), *calls)
    slow = attrs.evolve(costs, attention_us=5000.0)
    free = model_steps(StepLog(calls=calls, fork=1), slow, kernel="fia", layers=1)
    held = model_steps(StepLog(calls=fenced, fork=2), slow, kernel="fia", layers=1)
    assert held.host_us_per_step > free.host_us_per_step + 4000
