"""Eager aten work on device memory runs in stream order (contract §4: streams), on every
adversarial seed; a read without the ordering sees memory as hardware would.

Each of these tests fails on a simulator that runs eager ops on the host at once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npugraph.reference import paged_attention_reference
from npusim import npu
from tests.helpers import close_on_host, equal_on_host

SEEDS = range(8)
DEVICE = "npu"  # device memory: the simulator's npu device


@pytest.fixture(autouse=True)
def _fresh_device():
    yield
    torch_npu.configure()


def _shared_pool_graphs(x, y):
    """Two graphs of one pool whose outputs share memory: g2 reuses the block g1's output freed."""
    pool = npu.graph_pool_handle()
    g1, g2 = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(g1, pool=pool):
        out1 = x * 2
    out1 = torch_npu._C._weak_ref_tensor(out1)  # the graph keeps the memory; the block is free again
    with npu.graph(g2, pool=pool):
        out2 = y * 3
    assert out1.data_ptr() == out2.data_ptr(), "the pool must hand g1's block to g2"
    return g1, g2, out1, out2


def _replay_blocked(body):
    """Capture ``body()`` behind a wait on a fresh ExternalEvent and replay it: the replay
    stays queued on the current stream until the returned event is recorded."""
    ev = npu.ExternalEvent()
    g = npu.NPUGraph()
    with npu.graph(g):
        ev.wait(npu.current_stream())
        body()
    g.replay()
    return ev


@pytest.mark.parametrize("seed", SEEDS)
def test_a_clone_between_two_replays_of_one_pool_reads_the_first(seed):
    torch_npu.configure(adversarial_seed=seed)
    x, y = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    g1, g2, out1, out2 = _shared_pool_graphs(x, y)
    g1.replay()
    first = out1.clone()  # queued after g1 and before g2 on the same stream
    g2.replay()
    npu.synchronize()
    torch.testing.assert_close(first, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(out2, y * 3, rtol=0, atol=0)


def test_a_clone_on_another_stream_without_ordering_reads_what_hardware_would():
    """No wait between the replay's stream and the clone's: some seeds read before the replay wrote."""
    wrong = 0
    for seed in SEEDS:
        torch_npu.configure(adversarial_seed=seed)
        x, y = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
        g1, g2, out1, _ = _shared_pool_graphs(x, y)
        g1.replay()
        side = npu.Stream()
        with npu.stream(side):
            first = out1.clone()
        g2.replay()
        npu.synchronize()
        wrong += not equal_on_host(first, x * 2)
        if wrong:
            break
    assert wrong > 0, "an unordered read must go wrong on some seed"


@pytest.mark.parametrize("seed", SEEDS)
def test_the_same_clone_is_right_once_the_stream_waits(seed):
    torch_npu.configure(adversarial_seed=seed)
    x, y = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    g1, g2, out1, _ = _shared_pool_graphs(x, y)
    main = npu.current_stream()
    g1.replay()
    side = npu.Stream()
    side.wait_stream(main)
    with npu.stream(side):
        first = out1.clone()
    main.wait_stream(side)  # g2 overwrites the block: after the clone read it
    g2.replay()
    npu.synchronize()
    torch.testing.assert_close(first, x * 2, rtol=0, atol=0)


def test_eager_work_queues_behind_a_replay_that_waits_for_its_event():
    """Replay-first order: the graph waits on the device; the host goes on without waiting."""
    x = torch.ones(8, device=DEVICE)
    ev = _replay_blocked(lambda: x.mul_(3))  # queued until ev is recorded
    copy = x.clone()  # behind the replay: no host wait, no deadlock
    x.add_(1)  # an index write after it, also in order
    us = npu.Stream()
    ev.record(us)
    npu.synchronize()
    assert equal_on_host(copy, torch.full((8,), 3.0))
    assert equal_on_host(x, torch.full((8,), 4.0))
    assert torch._C._len_torch_dispatch_stack() == 0, "with nothing pending the ordering leaves the mode stack"


def test_a_host_read_waits_for_its_stream_and_a_blocked_stream_hangs():
    x = torch.ones(4, device=DEVICE)
    ev = _replay_blocked(lambda: x.mul_(5))
    with pytest.raises(torch_npu.DeadlockError, match=r"tolist\(\) on a device tensor"):
        x.tolist()  # hardware: the copy to the host waits for the replay, which waits forever
    ev.record(npu.Stream())
    assert x.tolist() == [5.0] * 4


@pytest.mark.parametrize("seed", SEEDS)
def test_a_blocking_copy_from_host_memory_waits_for_the_stream(seed):
    """torch_npu synchronizes the stream before a blocking host-to-device copy: behind a
    replay that waits for its event the host hangs; behind a runnable one it waits, then copies."""
    torch_npu.configure(adversarial_seed=seed)
    dev = torch.zeros(4, device=DEVICE)
    ev = _replay_blocked(lambda: dev.add_(1))
    host = torch.full((4,), 7.0)
    with pytest.raises(torch_npu.DeadlockError, match=r"a blocking copy into device memory from pageable host"):
        dev.copy_(host)
    ev.record(npu.Stream())
    g = npu.NPUGraph()
    with npu.graph(g):
        dev.add_(1)
    g.replay()
    dev.copy_(host)  # the host waits for the replay: the copy lands after it
    host.fill_(-1.0)
    npu.synchronize()
    assert dev.tolist() == [7.0] * 4


@pytest.mark.parametrize("pinned", [False, True])
def test_a_non_blocking_copy_waits_unless_its_host_memory_is_page_locked(pinned):
    """CANN's aclrtMemcpyAsync from pageable memory returns once the copy has run (the host
    waits for the stream); from page-locked memory it is queued and returns at once."""
    dev = torch.zeros(4, device=DEVICE)
    ev = _replay_blocked(lambda: dev.add_(1))
    host = torch.full((4,), 7.0)
    if pinned:
        host = torch_npu.pin_memory(host)
        assert torch_npu.is_pinned(host) and torch_npu.is_pinned(host[1:])
        dev.copy_(host, non_blocking=True)  # queued behind the blocked replay: no wait
        ev.record(npu.Stream())
        npu.synchronize()
        assert dev.tolist() == [7.0] * 4
    else:
        with pytest.raises(torch_npu.DeadlockError, match=r"a non-blocking copy into device memory from pageable"):
            dev.copy_(host, non_blocking=True)
        ev.record(npu.Stream())
        npu.synchronize()
        assert dev.tolist() == [1.0] * 4


@pytest.mark.parametrize("seed", SEEDS)
def test_a_blocking_copy_into_host_memory_waits_for_the_stream(seed):
    """``host.copy_(device)`` reads device memory on the host: torch_npu synchronizes the
    stream first, so behind a replay that waits for its event the host hangs, and behind a
    runnable one it gets what the replay wrote (queued instead, it returned at once with its
    destination unwritten)."""
    torch_npu.configure(adversarial_seed=seed)
    dev = torch.ones(4, device=DEVICE)
    ev = _replay_blocked(lambda: dev.mul_(3))
    host = torch.zeros(4)
    with pytest.raises(torch_npu.DeadlockError, match=r"a blocking copy from device memory into pageable host"):
        host.copy_(dev)
    ev.record(npu.Stream())
    g = npu.NPUGraph()
    with npu.graph(g):
        dev.add_(1)
    g.replay()
    host.copy_(dev)  # waits for the replay
    assert host.tolist() == [4.0] * 4


@pytest.mark.parametrize("pinned", [False, True])
def test_a_non_blocking_copy_into_host_memory_waits_unless_it_is_page_locked(pinned):
    """The same rule as into the device: into pageable memory the host waits for the stream;
    into page-locked memory the copy is queued and lands when the stream reaches it."""
    dev = torch.ones(4, device=DEVICE)
    ev = _replay_blocked(lambda: dev.mul_(3))
    host = torch_npu.pin_memory(torch.zeros(4)) if pinned else torch.zeros(4)
    if pinned:
        host.copy_(dev, non_blocking=True)  # queued behind the blocked replay: no wait
        ev.record(npu.Stream())
        npu.synchronize()
        assert host.tolist() == [3.0] * 4
    else:
        with pytest.raises(torch_npu.DeadlockError, match=r"a non-blocking copy from device memory into pageable"):
            host.copy_(dev, non_blocking=True)


def _kv_write_setup():
    blocks, bs, heads, d = 4, 16, 2, 16
    kc = torch.zeros(blocks, bs, heads, d, dtype=torch.float16, device=DEVICE)
    vc = torch.zeros_like(kc)
    return kc, vc


@pytest.mark.parametrize("seed", SEEDS)
def test_an_eager_read_after_an_in_graph_kv_write_sees_it(seed):
    torch_npu.configure(adversarial_seed=seed)
    kc, vc = _kv_write_setup()
    k = torch.randn(3, 2, 16, dtype=torch.float16, device=DEVICE)
    v = torch.randn(3, 2, 16, dtype=torch.float16, device=DEVICE)
    slots = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
    g = npu.NPUGraph()
    with npu.graph(g):
        torch_npu._npu_reshape_and_cache(k, v, kc, vc, slots)
    g.replay()
    seen = kc.view(-1, 2, 16)[slots.long()].clone()  # gather + clone, queued after the write
    kc.zero_()  # and a reset after the read
    npu.synchronize()
    torch.testing.assert_close(seen, k, rtol=0, atol=0)
    assert not kc.any()


@pytest.mark.parametrize("seed", SEEDS)
def test_an_eager_kernel_and_the_ops_after_it_run_in_order(seed):
    """An eager PA launch is queued like any work; a scale of its output follows it."""
    torch_npu.configure(adversarial_seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 16, dtype=torch.float16, generator=g, device=DEVICE)
    kc = torch.randn(8, 16, 2, 16, dtype=torch.float16, generator=g, device=DEVICE)
    vc = torch.randn(8, 16, 2, 16, dtype=torch.float16, generator=g, device=DEVICE)
    bt = torch.randint(0, 8, (2, 4), dtype=torch.int32, generator=g, device=DEVICE)
    lens = torch.tensor([5, 33], dtype=torch.int32)
    out = torch.empty_like(q)
    torch_npu._npu_paged_attention(q, kc, vc, 2, 4, 0.125, bt, lens, out)
    doubled = out * 2
    npu.synchronize()
    ref = paged_attention_reference(q, kc, vc, bt, [5, 33], scale=0.125)
    torch.testing.assert_close(doubled.cpu().double(), 2 * ref, rtol=2e-2, atol=2e-2)


WRITES = {
    "fill_": lambda b: b.fill_(5.0),
    "zero_": lambda b: b.zero_(),
    "copy_": lambda b: b.copy_(torch.full_like(b, 5.0)),
    "index_put_": lambda b: b.index_put_(
        (torch.tensor([0, 3]),), torch.tensor([5.0, 6.0]).pin_memory().to(b.device, non_blocking=True)
    ),
    "slice assignment": lambda b: (b.__setitem__(slice(2, 6), 7.0), b)[1],
    "masked_fill_": lambda b: b.masked_fill_(b > 0, 5.0),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(WRITES))
def test_an_eager_write_between_two_replays_lands_between_them(name, seed):
    """The first replay reads the old input, the second the written one."""
    torch_npu.configure(adversarial_seed=seed)
    buf = torch.randn(8, device=DEVICE)
    g = npu.NPUGraph()
    with npu.graph(g):
        out = buf * 2
    old, new = buf.clone(), WRITES[name](buf.clone())
    g.replay()
    first = out.clone()
    WRITES[name](buf)
    g.replay()
    second = out.clone()
    npu.synchronize()
    torch.testing.assert_close(first, old * 2, rtol=0, atol=0)
    torch.testing.assert_close(second, new * 2, rtol=0, atol=0)


def test_a_metadata_query_neither_waits_nor_is_refused():
    """``is_same_size`` answers from shapes: no wait on a blocked stream, none in a capture."""
    x = torch.ones(4, device=DEVICE)

    def body():
        x.mul_(2)
        assert x.is_same_size(torch.empty(4, device=DEVICE)), "a capture answers a metadata query"

    ev = _replay_blocked(body)
    assert x.is_same_size(torch.empty(4, device=DEVICE)), "a blocked stream does not block a metadata query"
    with pytest.raises(torch_npu.DeadlockError):
        close_on_host(x, torch.ones(4, device=DEVICE))  # a value read: waits for the stream
    ev.record(npu.Stream())
    assert close_on_host(x, torch.full((4,), 2.0))


def test_a_host_table_copied_to_the_device_stays_host_memory():
    """The engine's host table (page-locked, as vLLM's CPU tables are), copied behind a
    blocked replay, is still the host's: the host writes and reads it at once (no wait for
    the stream), and the copy takes what it held when the copy ran."""
    dev = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    ev = _replay_blocked(lambda: dev.add_(1))
    host = torch_npu.pin_memory(torch.full((2, 4), 7, dtype=torch.int32))
    dev.copy_(host, non_blocking=True)
    assert not torch_npu.is_device_memory(host)
    host[0, 0] = 9  # the host's own memory: written at once
    assert host.tolist()[0][0] == 9, "a host read of host memory does not wait for the device"
    ev.record(npu.Stream())
    npu.synchronize()
    assert dev.tolist() == [[9, 7, 7, 7], [7, 7, 7, 7]], "the non-blocking copy read the host memory when it ran"


@pytest.mark.parametrize("seed", SEEDS)
def test_work_queued_during_a_capture_does_not_outlive_the_capture_recorder(seed):
    """An event recorded on another stream while capturing (thread-local capture mode)
    may stay queued; the capture still ends cleanly and eager ordering follows it."""
    torch_npu.configure(adversarial_seed=seed)
    x = torch.ones(4, device=DEVICE)
    side = npu.Stream()
    g = npu.NPUGraph()
    with npu.graph(g, capture_error_mode="thread_local"):
        for _ in range(4):
            npu.Event().record(side)  # device work queued while capturing
        x.mul_(2)
    kinds = {type(torch._C._get_dispatch_stack_at(i)).__name__ for i in range(torch._C._len_torch_dispatch_stack())}
    assert kinds <= {"_OrderDispatch"}, f"the capture left {kinds} on the dispatch stack"
    g.replay()
    npu.synchronize()
    assert x.tolist() == [2.0] * 4
    assert torch._C._len_torch_dispatch_stack() == 0


# One stream's program: replays of two graphs whose outputs share a pool block, eager
# writes of their input, clones of the shared output and host reads of it.
_PROGRAM_OPS = (
    "replay g1",
    "replay g2",
    "clone",
    "host read",
    "mul_",
    "add_",
    "fill_",
    "index_put_",
    "copy pageable",  # blocking, from pageable host memory: the host waits for the stream
    "copy pageable non-blocking",  # from pageable memory: waits too (CANN)
    "copy pinned non-blocking",  # queued: reads the page-locked bytes when it runs
)


def _run_program(program, *, adversarial_seed):
    """Run ``program`` on the simulator; return every clone and host read, in order."""
    torch_npu.configure(adversarial_seed=adversarial_seed)
    buf = torch.arange(16, dtype=torch.float32, device=DEVICE)
    pool = npu.graph_pool_handle()
    g1, g2 = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(g1, pool=pool):
        out = buf * 2
    out = torch_npu._C._weak_ref_tensor(out)
    with npu.graph(g2, pool=pool):
        out2 = buf + 1
    assert out2.data_ptr() == out.data_ptr()
    seen = []
    for i, op in enumerate(program):
        if op == "replay g1":
            g1.replay()
        elif op == "replay g2":
            g2.replay()
        elif op == "clone":
            seen.append(out.clone())
        elif op == "host read":
            seen.append(torch.tensor(out.tolist()))
        else:
            _write(buf, op, i, pin=torch_npu.pin_memory)
    npu.synchronize()
    return seen


def _write(buf, op, i, pin=lambda t: t):
    if op.startswith("copy"):
        host = torch.arange(16, dtype=torch.float32, device=DEVICE) * (i + 1)
        if op == "copy pinned non-blocking":
            buf.copy_(pin(host), non_blocking=True)
        else:
            buf.copy_(host, non_blocking=op.endswith("non-blocking"))
    elif op == "mul_":
        buf.mul_(3)
    elif op == "add_":
        buf.add_(i)
    elif op == "fill_":
        buf.fill_(float(i))
    else:
        # the values reach the device as an engine sends them: a non-blocking copy from pinned memory
        values = torch.tensor([float(i), -float(i)]).pin_memory().to(buf.device, non_blocking=True)
        buf.index_put_((torch.tensor([1, 5]),), values)


def _expected(program):
    """The same program in program order on plain tensors (no simulator, no graphs)."""
    buf = torch.arange(16, dtype=torch.float32, device=DEVICE)
    mem = torch.full((16,), float("nan"))  # the shared block, never written yet
    seen = []
    for i, op in enumerate(program):
        if op == "replay g1":
            mem = buf * 2
        elif op == "replay g2":
            mem = buf + 1
        elif op in ("clone", "host read"):
            seen.append(mem.clone())
        else:
            _write(buf, op, i)
    return seen


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(st.sampled_from(_PROGRAM_OPS), min_size=1, max_size=14), seed=st.integers(0, 10**6))
@example(program=["replay g1", "copy pageable", "clone"], seed=2)  # the copy must wait for the replay
@example(program=["replay g1", "copy pageable non-blocking", "host read"], seed=14)
@example(program=["replay g2", "copy pinned non-blocking", "replay g1", "clone"], seed=5)
def test_one_streams_eager_work_and_replays_run_in_program_order(program, seed):
    """Whatever the adversarial schedule, one stream's replays, eager writes (copies from
    pageable and page-locked host memory among them), clones and host reads see what
    running the program in order on plain tensors sees."""
    got = _run_program(program, adversarial_seed=seed)
    want = _expected(program)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert equal_on_host(g, w) or (g.isnan().all() and w.isnan().all()), f"read {i} of {program}: {g} != {w}"


def test_an_eager_op_that_fails_after_its_call_returned_is_reported_at_the_next_synchronize():
    """The index is out of range: the gather fails when the stream reaches it, behind a
    waiting replay.  The call that releases the replay is not the one to blame."""
    x = torch.ones(4, device=DEVICE)
    ev = _replay_blocked(lambda: x.mul_(2))
    bad = torch.index_select(x, 0, torch.tensor([0, 7]))  # shapes are fine: queued
    ev.record(npu.Stream())  # runs the replay and the gather, and returns
    with pytest.raises(torch_npu.ReplayFault, match=r"eager aten op aten.index_select.default failed") as info:
        npu.synchronize()
    assert info.value.graph is None and isinstance(info.value.__cause__, IndexError)
    assert x.tolist() == [2.0] * 4, "the replay before it ran"
    del bad
    npu.synchronize()  # reported once


@pytest.mark.parametrize("order", ["replay-first", "update-first"])
def test_the_runtime_names_eager_work_when_it_failed_not_a_graph(order):
    """The engine's own gather fails behind a step on a busy device: the synchronize says
    the failure was outside npugraph's graphs, and the same runtime serves the next step."""
    from npugraph.errors import ReplayFailed
    from tests.helpers import Harness, query_for

    h = Harness([4], layers=2, order=order)
    meta = h.random_meta(3)
    q = query_for(h, 4, 0)
    hold = npu.ExternalEvent()
    hold.wait(npu.current_stream())  # the device is busy: what follows stays queued
    out = h.rt.step(4, {"default": meta}, inputs={"query": q})
    first = out.clone()
    junk = torch.index_select(out.flatten(), 0, torch.tensor([10**9]))  # queued behind the step
    hold.record(npu.Stream())  # runs the step and the gather, and returns
    with pytest.raises(ReplayFailed, match=r"outside npugraph's graphs \(an eager op or kernel on a stream\)"):
        h.rt.synchronize()
    del junk
    h.check(first, q, dict.fromkeys(h.names, meta))  # the step before the gather was right
    h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
