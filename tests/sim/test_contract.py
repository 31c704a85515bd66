"""One test per rule of the graph contract (shared/reference/npu-graph-semantics.md)."""

from __future__ import annotations

import json
import sys
import warnings

import pytest
import torch

import npusim as torch_npu
from npugraph.reference import paged_attention_reference
from npusim import npu
from tests.helpers import equal_on_host

SCALE = 0.125
DEVICE = "npu"  # device memory: the simulator's npu device


def _pa_setup(t=2, n=4, kvn=2, d=16, nb=8, bs=16, cols=4, dtype=torch.float16):
    q = torch.randn(t, n, d, dtype=dtype, device=DEVICE)
    kc = torch.randn(nb, bs, kvn, d, dtype=dtype, device=DEVICE)
    vc = torch.randn(nb, bs, kvn, d, dtype=dtype, device=DEVICE)
    bt = torch.randint(0, nb, (t, cols), dtype=torch.int32, device=DEVICE)
    out = torch.empty(t, n, d, dtype=dtype, device=DEVICE)
    return q, kc, vc, bt, out


def _pa(q, kc, vc, bt, lens, out, ws=None):
    torch_npu._npu_paged_attention(q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt, lens, out, workspace=ws)


def _capture_pa(q, kc, vc, bt, lens, out, ws):
    g = npu.NPUGraph()
    ev = npu.ExternalEvent()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        ev.reset(s)
        npu.graph_task_group_begin(s)
        _pa(q, kc, vc, bt, lens, out, ws)
        h = npu.graph_task_group_end(s)
    return g, ev, h


def _update_pa(us, h, ev, q, kc, vc, bt, lens, out, ws, record=True):
    with npu.stream(us):
        npu.graph_task_update_begin(us, h)
        _pa(q, kc, vc, bt, lens, out, ws)
        npu.graph_task_update_end(us)
        if record:
            ev.record(us)


def _eager_pa(q, kc, vc, bt, lens):
    out = torch.empty_like(q)
    _pa(q, kc, vc, bt, lens, out)
    npu.synchronize()
    return out


def _ws(q, kc, vc, bt, out, max_len=16):
    return torch_npu._npu_paged_attention_get_workspace(
        q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt, torch.full((q.shape[0],), 1, dtype=torch.int32), out
    )


# --- §2 graphs and streams ------------------------------------------------------------


def test_capture_on_default_stream_raises():
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        g.capture_begin()


def test_capture_twice_raises_until_reset():
    g = npu.NPUGraph()
    x = torch.ones(3, device=DEVICE)
    with npu.graph(g):
        x.add_(1)
    with pytest.raises(RuntimeError, match="already owns a captured graph"), npu.graph(g):
        pass
    g.reset()
    with npu.graph(g):
        x.add_(1)
    g.replay()
    assert equal_on_host(x, torch.full((3,), 2.0))


def test_capture_end_on_other_stream_raises():
    g = npu.NPUGraph()
    s = npu.Stream()
    with npu.stream(s):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="Capture must end on the same stream it began on."):
        g.capture_end()
    g.reset()


def test_capture_error_mode_validated():
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"), npu.graph(g, capture_error_mode="strict"):
        pass


@pytest.mark.parametrize("pool", ["", 0, (1,), ("a", "b"), [0, 1]])
def test_a_pool_is_a_pool_id_or_none(pool):
    """torch_npu's binding takes two integers (graph_pool_handle(), another graph's pool())."""
    with pytest.raises(TypeError, match="pool must be None or a pool id"), npu.graph(npu.NPUGraph(), pool=pool):
        pass
    g = npu.NPUGraph()
    with npu.graph(g, pool=(0, 123456)):
        torch.zeros(2, device=DEVICE).add_(1)
    assert g.pool() == (0, 123456)


def test_replay_and_pool_before_capture_raise():
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="Called NPUGraph::replay without a preceding successful capture."):
        g.replay()
    with pytest.raises(RuntimeError, match="pool without a preceding successful capture"):
        g.pool()


def test_capture_records_and_does_not_execute():
    cache = torch.zeros(4, 3, device=DEVICE)
    w = torch.randn(3, 3, device=DEVICE)
    x = torch.randn(2, 3, device=DEVICE)
    idx = torch.tensor([1, 3])
    g = npu.NPUGraph()
    with npu.graph(g):
        y = torch.relu(x @ w)
        cache.index_copy_(0, idx, y)
    assert equal_on_host(cache, torch.zeros(4, 3, device=DEVICE)), "capture must not touch the cache"
    assert torch.isnan(y).all(), "captured results only exist after replay (buffer is poisoned)"
    g.replay()
    npu.synchronize()
    assert equal_on_host(cache[idx], torch.relu(x @ w))
    x.copy_(torch.randn(2, 3, device=DEVICE))  # new input contents, same buffer
    g.replay()
    npu.synchronize()
    assert equal_on_host(y, torch.relu(x @ w)), "replay re-executes on the same buffers"


@pytest.mark.parametrize("read", ["item", "tolist", "cpu", "bool"])
def test_host_read_of_captured_result_raises(read):
    x = torch.randn(3, device=DEVICE)
    g = npu.NPUGraph()
    with pytest.raises(torch_npu.CaptureError, match="not permitted when stream is capturing"), npu.graph(g):
        y = x.sum()
        if read == "item":
            y.item()
        elif read == "tolist":
            y.tolist()
        elif read == "cpu":
            y.cpu()
        else:
            bool(y > 0)
    g.reset()


def test_data_dependent_shape_cannot_be_captured():
    x = torch.randn(8, device=DEVICE)
    g = npu.NPUGraph()
    with pytest.raises(torch_npu.CaptureError, match="Data-dependent"), npu.graph(g):
        torch.nonzero(x)


def test_pool_is_shared_and_graph_buffers_keep_addresses():
    pool = npu.graph_pool_handle()
    x = torch.randn(4, device=DEVICE)
    g1, g2 = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(g1, pool=pool):
        a = x * 2
    with npu.graph(g2, pool=pool):
        b = x * 3
    assert g1.pool() == g2.pool() == pool
    assert torch_npu.pool_bytes(pool) >= a.nbytes + b.nbytes
    ptr = a.data_ptr()
    g1.replay()
    g2.replay()
    npu.synchronize()
    assert a.data_ptr() == ptr and equal_on_host(a, x * 2) and equal_on_host(b, x * 3)


def test_replay_is_asynchronous_and_ordered_by_events():
    """Replay enqueues; a graph waiting on an ExternalEvent runs when it is recorded."""
    x = torch.ones(2, device=DEVICE)
    ev = npu.ExternalEvent()
    g = npu.NPUGraph()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        x.mul_(3)
    g.replay()  # blocked on ev
    us = npu.Stream()
    with npu.stream(us):  # a read on the blocked stream would wait for it (forever)
        assert equal_on_host(x, torch.ones(2, device=DEVICE)), "must not have run yet"
    ev.record(us)
    npu.synchronize()
    assert equal_on_host(x, torch.full((2,), 3.0))


def test_debug_dump_writes_json(tmp_path):
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g, _, _ = _capture_pa(q, kc, vc, bt, lens, out, None)
    p = tmp_path / "g.json"
    g.debug_dump(str(p))
    doc = json.loads(p.read_text())
    kinds = [n["kind"] for n in doc["nodes"]]
    assert "ExtWaitNode" in kinds and "KernelTask" in kinds
    # torch_npu writes the aligned form beside a dump it wrote (the raw dump unchanged)
    aligned = json.loads((tmp_path / "g.aligned.json").read_text())
    starts = [n["ts"] for n in aligned["nodes"]]
    assert starts == sorted(starts) and len(starts) == len(kinds) and json.loads(p.read_text()) == doc
    with pytest.warns(UserWarning):
        npu.NPUGraph().debug_dump(str(tmp_path / "none.json"))
    assert not (tmp_path / "none.json").exists() and not (tmp_path / "none.aligned.json").exists()


# --- §3 task groups -------------------------------------------------------------------


def test_task_group_needs_capturing_stream():
    with pytest.raises(RuntimeError, match="not capturing"):
        npu.graph_task_group_begin(npu.Stream())


def test_task_group_holds_exactly_one_op():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g = npu.NPUGraph()
    with pytest.raises(torch_npu.CaptureError, match="exactly one op call"), npu.graph(g):
        s = npu.current_stream()
        npu.graph_task_group_begin(s)
        _pa(q, kc, vc, bt, lens, out)
        _pa(q, kc, vc, bt, lens, out)


def test_a_kernel_on_another_stream_while_one_captures_is_refused_naming_both():
    # capture_error_mode='global' (the default): work on any other stream during a capture
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    side = npu.Stream()
    g = npu.NPUGraph()
    refused = r"_npu_paged_attention\S* issued on .*stream#\d+> while .*stream#\d+> is capturing"
    with pytest.raises(torch_npu.CaptureError, match=refused), npu.graph(g), npu.stream(side):
        _pa(q, kc, vc, bt, lens, out)
    npu.synchronize()  # and the device serves on
    assert equal_on_host(_eager_pa(q, kc, vc, bt, lens), _eager_pa(q, kc, vc, bt, lens))


# --- §4 task updates ------------------------------------------------------------------


def test_stale_lengths_without_update_and_right_answer_after():
    q, kc, vc, bt, out = _pa_setup()
    cap = torch.tensor([3, 5], dtype=torch.int32)
    new = torch.tensor([9, 2], dtype=torch.int32)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE)
    g, ev, h = _capture_pa(q, kc, vc, bt, cap, out, ws)
    us = npu.Stream()
    # skip the update: record the event only → the graph runs with captured lengths
    ev.record(us)
    g.replay()
    npu.synchronize()
    assert equal_on_host(out, _eager_pa(q, kc, vc, bt, cap))
    assert not equal_on_host(out, _eager_pa(q, kc, vc, bt, new))
    _update_pa(us, h, ev, q, kc, vc, bt, new, out, ws)
    g.replay()
    npu.synchronize()
    assert equal_on_host(out, _eager_pa(q, kc, vc, bt, new))


def test_update_stream_rules():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g, ev, h = _capture_pa(q, kc, vc, bt, lens, out, None)
    with pytest.raises(RuntimeError, match="must not be the graph's capture stream"):
        npu.graph_task_update_begin(npu.graph.default_capture_stream, h)
    us = npu.Stream()
    with pytest.raises(RuntimeError, match="no update in progress"):
        npu.graph_task_update_end(us)


def test_op_inside_update_is_not_executed_and_must_match():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g, ev, h = _capture_pa(q, kc, vc, bt, lens, out, None)
    us = npu.Stream()
    out.fill_(7)
    _update_pa(us, h, ev, q, kc, vc, bt, torch.tensor([1, 1], dtype=torch.int32), out, None)
    npu.synchronize()
    assert (out == 7).all(), "the op inside an update is not executed"
    # a call the op accepts, in another dtype: another kernel than the captured task's
    bf16 = [t.to(torch.bfloat16) for t in (q, kc, vc, out)]
    with npu.stream(us):
        npu.graph_task_update_begin(us, h)
        with pytest.raises(torch_npu.UpdateMismatchError, match="'query' was Tensor.*captured dtype"):
            _pa(*bf16[:3], bt, lens, bf16[3])
        npu.graph_task_update_end(us)
    with npu.stream(us):
        npu.graph_task_update_begin(us, h)
        with pytest.raises(torch_npu.UpdateMismatchError, match="differs from the op captured"):
            torch_npu.npu_fused_infer_attention_score(
                q.unsqueeze(1), q.unsqueeze(1), q.unsqueeze(1), num_heads=4, input_layout="BSND"
            )
        npu.graph_task_update_end(us)


def test_host_args_are_copied_at_call_time():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g, ev, h = _capture_pa(q, kc, vc, bt, lens, out, None)
    expected = _eager_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32))
    lens[0] = 11  # mutating the host tensor later changes nothing
    ev.record(npu.Stream())
    g.replay()
    npu.synchronize()
    assert equal_on_host(out, expected)


def test_workspace_too_small_raises_with_simulator_note():
    q, kc, vc, bt, out = _pa_setup(t=1)
    short = torch.tensor([2], dtype=torch.int32)
    long_ = torch.tensor([16], dtype=torch.int32)
    args = (q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt)
    ws_short = torch_npu._npu_paged_attention_get_workspace(*args, short, out)
    ws_long = torch_npu._npu_paged_attention_get_workspace(*args, long_, out)
    with pytest.raises(torch_npu.WorkspaceTooSmall, match="Simulator check"):
        _pa(q, kc, vc, bt, short, out, ws=torch.empty(ws_short.numel() - 1, dtype=torch.uint8, device=DEVICE))
    _pa(q, kc, vc, bt, short, out, ws=ws_short)
    npu.synchronize()
    del ws_long


def test_pa_workspace_is_not_monotonic():
    from npusim.kernels import pa_workspace_bytes

    short = pa_workspace_bytes(1, 8, 1, 128, 100)
    long_ = pa_workspace_bytes(1, 8, 1, 128, 6144)
    assert short > long_, "a shorter context needs a larger workspace (split-KV)"


# --- §5 ExternalEvent -----------------------------------------------------------------


def test_second_wait_without_record_raises():
    ev = npu.ExternalEvent()
    g = npu.NPUGraph()
    with pytest.raises(RuntimeError, match="cannot be associated with multiple wait operations"), npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        ev.wait(s)
    g.reset()


def test_wait_never_recorded_is_a_deadlock_naming_graph_and_event():
    q, kc, vc, bt, out = _pa_setup()
    g, ev, h = _capture_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32), out, None)
    g.replay()
    with pytest.raises(torch_npu.DeadlockError) as info:
        npu.synchronize()
    msg = str(info.value)
    assert f"graph #{g.graph_id}" in msg and f"ExternalEvent #{ev.event_id}" in msg
    assert "<sim.npu.Stream default>" in msg, "names the stream"
    assert "task group" in msg and "never recorded" in msg
    assert info.value.blocked[0]["event"] is ev


def test_lost_record_raises_race():
    ev = npu.ExternalEvent()
    us = npu.Stream()
    ev.record(us)
    with pytest.raises(
        torch_npu.RaceError,
        match=r"recorded on <sim.npu.Stream stream#\d+> while its flag was already set: this record is lost",
    ):
        ev.record(us)


def test_update_overtaking_a_queued_replay_is_a_race():
    """Update B lands before the replay that should have run with update A."""
    q, kc, vc, bt, out = _pa_setup()
    g, ev, h = _capture_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32), out, None)
    us, main = npu.Stream(), npu.Stream()
    blocker = npu.ExternalEvent()
    with npu.stream(main):
        blocker.wait(main)  # hold main so the replay stays queued
        _update_pa(us, h, ev, q, kc, vc, bt, torch.tensor([2, 2], dtype=torch.int32), out, None)
        g.replay()
        with pytest.raises(torch_npu.RaceError, match="Order the update stream after the previous replay"):
            _update_pa(us, h, ev, q, kc, vc, bt, torch.tensor([4, 4], dtype=torch.int32), out, None, record=False)


def test_ordering_update_stream_after_replay_avoids_the_race():
    q, kc, vc, bt, out = _pa_setup()
    g, ev, h = _capture_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32), out, None)
    us, main = npu.Stream(), npu.Stream()
    blocker = npu.ExternalEvent()
    a = torch.tensor([2, 2], dtype=torch.int32)
    b = torch.tensor([4, 4], dtype=torch.int32)
    with npu.stream(main):
        blocker.wait(main)
        _update_pa(us, h, ev, q, kc, vc, bt, a, out, None)
        g.replay()
        done = npu.Event()
        done.record(main)
        us.wait_event(done)  # the fix: the next update waits for this replay
        _update_pa(us, h, ev, q, kc, vc, bt, b, out, None)
        blocker.record(npu.Stream())
        npu.synchronize()
    assert equal_on_host(out, _eager_pa(q, kc, vc, bt, a)), "the replay ran with update A's lengths"


def test_reset_is_a_noop():
    ev = npu.ExternalEvent()
    s = npu.Stream()
    ev.record(s)
    ev.reset(s)
    x = torch.zeros(1, device=DEVICE)
    g = npu.NPUGraph()
    with npu.graph(g):
        ev.wait(npu.current_stream())
        x.add_(1)
    g.replay()
    npu.synchronize()
    assert x.item() == 1.0


# --- §6 auto-dispatch -----------------------------------------------------------------


def test_update_without_auto_dispatch_raises():
    g = npu.NPUGraph()
    x = torch.zeros(1, device=DEVICE)
    with npu.graph(g):
        x.add_(1)
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        g.update(cpu_update_input=[{"context_lens": [1]}])


def _auto_pa_graph(n_ops=2):
    q, kc, vc, bt, _ = _pa_setup()
    outs = [torch.empty_like(q) for _ in range(n_ops)]
    lens = torch.tensor([1, 1], dtype=torch.int32)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        for o in outs:
            _pa(q, kc, vc, bt, lens, o)
    return g, (q, kc, vc, bt), outs


def test_auto_dispatch_broadcast_and_per_record_update():
    g, (q, kc, vc, bt), outs = _auto_pa_graph()
    a = torch.tensor([5, 7], dtype=torch.int32)
    g.update(cpu_update_input=[{"context_lens": a}])  # broadcast
    g.replay()
    npu.synchronize()
    ref = _eager_pa(q, kc, vc, bt, a)
    assert all(equal_on_host(o, ref) for o in outs)
    b = torch.tensor([2, 9], dtype=torch.int32)
    g.update(cpu_update_input=[{"context_lens": a}, {"context_lens": b}])
    g.replay()
    npu.synchronize()
    assert equal_on_host(outs[0], ref) and equal_on_host(outs[1], _eager_pa(q, kc, vc, bt, b))
    with pytest.raises(
        RuntimeError, match="there are 2 operators that need to be updated by capture, and there are only 3"
    ):
        g.update(cpu_update_input=[{"context_lens": a}] * 3)


def test_auto_dispatch_ignores_keys_an_op_does_not_have_silently_as_torch_npu():
    g, (q, kc, vc, bt), outs = _auto_pa_graph(1)
    g.update(cpu_update_input=[{"context_lens": torch.tensor([4, 4], dtype=torch.int32)}])
    g.replay()
    npu.synchronize()
    before = outs[0].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch_npu says nothing of a key it does not know
        g.update(cpu_update_input=[{"context_len": torch.tensor([1, 1], dtype=torch.int32)}])
    g.replay()
    npu.synchronize()
    assert equal_on_host(outs[0], before), "a misspelt key changes nothing"


def test_adversarial_mode_defers_work_until_a_synchronize():
    """Seeded adversarial scheduling leaves queued work pending; synchronize drains it."""
    deferred = 0
    for seed in range(6):
        torch_npu.configure(adversarial_seed=seed)
        x = torch.zeros(1, device=DEVICE)
        g = npu.NPUGraph()
        with npu.graph(g):
            x.add_(1)
            x.add_(1)
        g.replay()
        with npu.stream(npu.Stream()):  # not ordered after the replay: memory as it is now
            if x.item() != 2.0:
                deferred += 1
        assert x.item() == 2.0, "a read on the replay's stream waits for it"
    assert deferred > 0, "some seeds must defer the replay"


def test_update_to_shorter_lengths_can_outgrow_a_workspace_sized_for_long_ones():
    """vllm-ascend PR #3986: a workspace sized with one long fake length is too small later."""
    q, kc, vc, bt, out = _pa_setup(t=1, n=4, kvn=1, cols=8, bs=256, nb=8)
    long_ = torch.tensor([2048], dtype=torch.int32)
    args = (q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt)
    ws = torch_npu._npu_paged_attention_get_workspace(*args, long_, out)
    g, ev, h = _capture_pa(q, kc, vc, bt, long_, out, ws)
    us = npu.Stream()
    with pytest.raises(torch_npu.WorkspaceTooSmall, match="torch_npu does not size-check"):
        _update_pa(us, h, ev, q, kc, vc, bt, torch.tensor([16], dtype=torch.int32), out, ws)


# --- §4 one updater at a time ---------------------------------------------------------------


def test_two_update_sessions_on_two_streams_overlapping_are_refused_citing_cann():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g1, ev1, h1 = _capture_pa(q, kc, vc, bt, lens, out, None)
    g2, ev2, h2 = _capture_pa(q, kc, vc, bt, lens, torch.empty_like(out), None)
    a, b = npu.Stream(), npu.Stream()
    npu.graph_task_update_begin(a, h1)
    with pytest.raises(torch_npu.ConcurrentUpdateError, match=r"concurrent updates from multiple threads or multiple"):
        npu.graph_task_update_begin(b, h2)
    with npu.stream(a):
        _pa(q, kc, vc, bt, lens, out)
    npu.graph_task_update_end(a)
    _update_pa(b, h2, ev2, q, kc, vc, bt, lens, out, None)  # consecutive sessions are fine


def test_an_update_session_open_in_another_thread_is_refused():
    import threading

    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g1, ev1, h1 = _capture_pa(q, kc, vc, bt, lens, out, None)
    g2, ev2, h2 = _capture_pa(q, kc, vc, bt, lens, torch.empty_like(out), None)
    opened, release = threading.Event(), threading.Event()

    def other():
        s = npu.Stream()
        npu.graph_task_update_begin(s, h1)
        opened.set()
        release.wait(10)
        with npu.stream(s):
            _pa(q, kc, vc, bt, lens, out)
        npu.graph_task_update_end(s)

    t = threading.Thread(target=other)
    t.start()
    assert opened.wait(10)
    try:
        with pytest.raises(torch_npu.ConcurrentUpdateError, match="another host thread has an update session open"):
            npu.graph_task_update_begin(npu.Stream(), h2)
    finally:
        release.set()
        t.join()
    _update_pa(npu.Stream(), h2, ev2, q, kc, vc, bt, lens, out, None)  # after it ended: fine


def test_updates_still_queued_on_another_stream_are_an_overlap():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g1, ev1, h1 = _capture_pa(q, kc, vc, bt, lens, out, None)
    g2, ev2, h2 = _capture_pa(q, kc, vc, bt, lens, torch.empty_like(out), None)
    a, b = npu.Stream(), npu.Stream()
    blocker = npu.Stream()
    with npu.stream(blocker):
        never = npu.ExternalEvent()
        never.wait(blocker)  # blocker waits until we record it
    hold = npu.Event()
    hold.record(blocker)
    a.wait_event(hold)  # `a` cannot run its update until `blocker` moves
    _update_pa(a, h1, ev1, q, kc, vc, bt, lens, out, None, record=False)
    with pytest.raises(torch_npu.ConcurrentUpdateError, match="have not landed yet"):
        _update_pa(b, h2, ev2, q, kc, vc, bt, lens, out, None, record=False)
    never.record(npu.Stream())  # a's update lands ...
    npu.synchronize()
    _update_pa(b, h2, ev2, q, kc, vc, bt, lens, out, None)  # ... and b may update


# --- §2 torch_npu's capture signature -------------------------------------------------------


class _UpdatableLike(npu.NPUGraph):
    """A subclass overriding capture_begin with torch_npu's signature, as vllm-ascend's UpdatableGraph does."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.seen = (pool, capture_error_mode, self.auto_dispatch_capture)
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)


def test_a_subclass_with_torch_npus_capture_begin_signature_captures():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    pool = npu.graph_pool_handle()
    g = _UpdatableLike()
    with npu.graph(g, pool=pool, capture_error_mode="thread_local"):
        _pa(q, kc, vc, bt, lens, out)
    assert g.seen == (pool, "thread_local", False)
    g2 = _UpdatableLike()
    with npu.graph(g2):  # no pool: capture_begin(capture_error_mode=...) only
        _pa(q, kc, vc, bt, lens, out)
    assert g2.seen == (None, "global", False)
    g.replay()
    npu.synchronize()
    assert equal_on_host(out, _eager_pa(q, kc, vc, bt, lens))


def test_auto_dispatch_capture_is_an_attribute_of_the_graph():
    g = npu.NPUGraph()
    assert g.auto_dispatch_capture is False
    npu.graph(g, auto_dispatch_capture=True)
    assert g.auto_dispatch_capture is True


def test_the_graph_context_ends_the_capture_even_when_the_body_raises():
    g = npu.NPUGraph()
    with pytest.raises(ZeroDivisionError), npu.graph(g):
        raise ZeroDivisionError
    assert not npu.is_current_stream_capturing()
    g.reset()
    q, kc, vc, bt, out = _pa_setup()
    with npu.graph(g):
        _pa(q, kc, vc, bt, torch.tensor([1, 2], dtype=torch.int32), out)


def test_install_torch_npu_makes_module_level_imports_resolve_to_the_simulator():

    # the test process has the npu device (conftest), whose device module torch.npu is
    assert "torch_npu" not in sys.modules and torch.npu is npu
    torch_npu.install_torch_npu()
    try:
        import torch_npu as imported  # as vllm-ascend does at module level

        assert imported is torch_npu and torch.npu is npu and sys.modules["torch_npu.npu"] is npu
        torch_npu.install_torch_npu()  # idempotent
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g):
            pass
    finally:
        torch_npu.uninstall_torch_npu()
    assert "torch_npu" not in sys.modules and torch.npu is npu, "the npu device stays, with its module"
    torch_npu.uninstall_torch_npu()  # a no-op now


@pytest.mark.parametrize("v2", [False, True])
def test_host_length_tensors_are_host_values_inside_a_capture(v2):
    """vllm-ascend sizes FIA's workspace inside its capture, passing the step's lengths as
    a host int tensor.  Lengths are host values (hardware reads them on the host at the
    call), so checking them records nothing and reads nothing the capture produced; before,
    the check's comparisons were recorded and the following host read refused."""
    t, n, d, bs, nb = 4, 4, 64, 16, 8
    q = torch.randn(t, n, d, dtype=torch.float16, device=DEVICE)
    kc = torch.randn(nb, bs, n * d, dtype=torch.float16, device=DEVICE)
    bt = torch.zeros(t, 2, dtype=torch.int32, device=DEVICE)
    qlen = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    kvlen = torch.tensor([5, 9, 2, 17], dtype=torch.int32)
    if v2:
        helper = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace
        names = {"actual_seq_qlen": qlen, "actual_seq_kvlen": kvlen, "num_query_heads": n, "softmax_scale": 0.1}
    else:
        helper = torch_npu._npu_fused_infer_attention_score_get_max_workspace
        names = {"actual_seq_lengths": qlen, "actual_seq_lengths_kv": kvlen, "num_heads": n, "scale": 0.1}
    kwargs = dict(block_table=bt, num_key_value_heads=n, input_layout="TND", block_size=bs, **names)
    eager = helper(q, kc, kc, **kwargs)
    g, s = npu.NPUGraph(), npu.Stream()
    with npu.graph(g, stream=s):
        captured = helper(q, kc, kc, **kwargs)
        # made inside the capture, as vllm-ascend makes them: a host tensor all the same
        inside = dict(kwargs)
        for name, value in names.items():
            if isinstance(value, torch.Tensor):
                inside[name] = torch.tensor(value.tolist(), dtype=torch.int32)
        made_inside = helper(q, kc, kc, **inside)
        assert int(inside[next(iter(names))].sum()) == 10, "a host read of a host tensor, inside the capture"
    assert captured.numel() == eager.numel() == made_inside.numel() > 0, "the same maximum, inside the capture"
    assert kvlen.tolist() == [5, 9, 2, 17], "the caller's lengths are untouched"


def test_a_weak_reference_of_host_memory_is_host_memory():
    """vllm-ascend's register_task weak-refs every kwarg, the CPU lengths among them.  On
    hardware torch_npu._C._weak_ref_tensor of a host tensor is a host tensor, and reading it
    never waits; the simulator took it for device memory, so each later host read waited for
    the stream, which serialised vllm-ascend's 310P order (replay, update, no host sync) and
    hid its race.  Here a replay waits on the stream for an update: reading the weak-ref'd
    host lengths must not wait for it (before, it raised DeadlockError)."""
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g, ev, h = _capture_pa(q, kc, vc, bt, lens, out, None)
    host_lens = torch.tensor([4, 6], dtype=torch.int32)
    weak = torch_npu._C._weak_ref_tensor(host_lens)
    g.replay()  # queued: it waits on the device for ev
    assert weak.tolist() == [4, 6] and host_lens.sum().item() == 10  # no wait
    assert weak.data_ptr() == host_lens.data_ptr() and not torch_npu.is_device_memory(weak)
    ev.record(npu.Stream())
    npu.synchronize()
    # memory a kernel uses is the device's, weak reference or not
    weak_out = torch_npu._C._weak_ref_tensor(out)
    assert torch_npu.is_device_memory(weak_out)


def test_an_update_may_retile_a_task_to_other_sizes_as_vllm_ascends_mtp_draft_does():
    """vllm-ascend's MTP draft captures each later draft step's FIA as 3 requests of 3 query
    tokens and updates it, every step, to 9 requests of one token each (a block table of 9
    rows, one per token, each with its own key length); its nightly serves that on Ascend
    (DeepSeek-R1, 3 draft tokens, FULL_DECODE_ONLY).  Hardware takes an update's arguments
    whole, sizes included; the replay then computes the updated task, here checked against
    a float64 reference of 9 one-token requests."""
    n, kvn, d, bs, nb = 4, 1, 64, 16, 12
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, n, d, generator=gen).half().to(DEVICE)
    kc = torch.randn(nb, bs, kvn * d, generator=gen).half().to(DEVICE)
    vc = torch.randn(nb, bs, kvn * d, generator=gen).half().to(DEVICE)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1).to(DEVICE)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    kv = [20, 35, 9]  # each request's key length, its three query tokens the last three

    def fia(bt, qends, kvlens, **more):
        kwargs = dict(
            atten_mask=mask,
            actual_seq_lengths=qends,
            actual_seq_lengths_kv=kvlens,
            block_table=bt,
            num_heads=n,
            scale=SCALE,
            input_layout="TND",
            num_key_value_heads=kvn,
            sparse_mode=3,
            block_size=bs,
        )
        if not more:
            return torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, kc, vc, **kwargs)
        return torch_npu.npu_fused_infer_attention_score.out(q, kc, vc, **kwargs, **more)

    out = torch.empty(9, n, d, dtype=torch.float16, device=DEVICE)
    lse = torch.empty(9, n, 1, dtype=torch.float32, device=DEVICE)
    captured_bt = tables.to(DEVICE)
    ws = fia(captured_bt, [3, 6, 9], kv)
    g, s = npu.NPUGraph(), npu.Stream()
    with npu.graph(g, stream=s):
        ev = npu.ExternalEvent()
        ev.wait(s)
        npu.graph_task_group_begin(s)
        fia(captured_bt, [3, 6, 9], kv, workspace=ws, out=[out, lse])
        h = npu.graph_task_group_end(s)
    us = npu.Stream()
    # each token one request: its request's block rows, its own key length
    rows = tables.repeat_interleave(3, dim=0)
    one_each = [k - 2 + i for k in kv for i in range(3)]
    updated_bt = rows.to(DEVICE)
    with npu.stream(us):
        npu.graph_task_update_begin(us, h)
        fia(updated_bt, list(range(1, 10)), one_each, workspace=ws, out=[out, lse])
        npu.graph_task_update_end(us)
        ev.record(us)
    g.replay()
    npu.synchronize()
    ref = paged_attention_reference(
        q.cpu(), kc.cpu().view(nb, bs, kvn, d), vc.cpu().view(nb, bs, kvn, d), rows, one_each, SCALE
    )
    err = (out.cpu().double() - ref).abs().max().item()
    assert err < 4e-3, err
    # the same attention as the captured 3 requests of 3 causal tokens: the reference agrees
    causal = paged_attention_reference(
        q.cpu(), kc.cpu().view(nb, bs, kvn, d), vc.cpu().view(nb, bs, kvn, d), tables, kv, SCALE, query_lens=[3, 3, 3]
    )
    assert (causal - ref).abs().max().item() < 1e-9
