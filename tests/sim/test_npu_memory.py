"""The simulator on its own device: ``npu`` tensors are device memory, CPU tensors host memory.

On npu tensors the contract's memory rules hold as hardware has them, told by
``tensor.device``: a host read of npu memory waits for the stream, one of CPU memory never
does; eager ops on npu memory are stream-ordered; a graph keeps npu memory, not objects,
and a replay that would read freed npu memory is reported; pools hand out npu blocks.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

import npusim as torch_npu
from npugraph.reference import paged_attention_reference
from npusim import npu

from .test_contract import SCALE
from .test_contract import _capture_pa as _capture_pa_ws


def _pa_setup(t=2, n=4, kvn=2, d=16, nb=8, bs=16, cols=4):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, n, d, generator=g).to(torch.float16).npu()
    kc = torch.randn(nb, bs, kvn, d, generator=g).to(torch.float16).npu()
    vc = torch.randn(nb, bs, kvn, d, generator=g).to(torch.float16).npu()
    bt = torch.randint(0, nb, (t, cols), dtype=torch.int32, generator=g).npu()
    out = torch.empty(t, n, d, dtype=torch.float16, device="npu")
    return q, kc, vc, bt, out


def _capture_pa(q, kc, vc, bt, lens, out):
    return _capture_pa_ws(q, kc, vc, bt, lens, out, None)  # the contract tests' capture, on npu tensors


def _update(h, ev, q, kc, vc, bt, lens, out):
    us = npu.Stream()
    with npu.stream(us):
        npu.graph_task_update_begin(us, h)
        torch_npu._npu_paged_attention(q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt, lens, out)
        npu.graph_task_update_end(us)
        ev.record(us)


def _reference(q, kc, vc, bt, lens):
    """The float64 reference, on the host (no simulator code on that path)."""
    return paged_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), lens, SCALE, [1] * len(lens))


def test_an_npu_graph_replays_updated_lengths_right():
    q, kc, vc, bt, out = _pa_setup()
    g, ev, h = _capture_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32), out)
    for lens in ([7, 1], [64, 33]):
        _update(h, ev, q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), out)
        g.replay()
        npu.synchronize()
        assert out.device.type == "npu"
        err = (out.cpu().double() - _reference(q, kc, vc, bt, lens)).abs().max().item()
        assert err < 4e-3, err
    assert torch_npu.is_device_memory(out) and not torch_npu.is_device_memory(out.cpu())


def test_host_reads_wait_for_npu_memory_only():
    """A replay waits on the device for its update: reading npu memory on the host would
    hang (DeadlockError here); reading host memory never waits, and an eager op on npu
    memory is queued behind the replay, not run."""
    q, kc, vc, bt, out = _pa_setup()
    g, ev, h = _capture_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32), out)
    host = torch.tensor([1.0, 2.0])
    g.replay()  # waits for ev
    copy = out.clone()  # queued on the stream behind the replay
    assert host.sum().item() == 3.0  # host memory: no wait
    with pytest.raises(torch_npu.DeadlockError, match="tolist"):
        copy.tolist()
    ev.record(npu.Stream())
    npu.synchronize()
    assert torch.equal(copy.cpu(), out.cpu()), "the clone ran after the replay, in stream order"


def test_an_in_place_op_that_returns_nothing_is_queued_behind_a_replay_as_aten_runs_it():
    """``aten::_foreach_copy_`` (SGLang's graph runner fills its buffers with it before a
    replay) returns nothing, and torch's binding then hands back its first argument; queued
    on a stream behind a replay that waits, it must do the same and copy once the stream runs
    (found through SGLang: the simulator's dispatch returned an empty tuple where aten returns
    None, and torch raised)."""
    q, kc, vc, bt, out = _pa_setup()
    g, ev, h = _capture_pa(q, kc, vc, bt, torch.tensor([3, 5], dtype=torch.int32), out)
    dsts = [torch.zeros(3, device="npu"), torch.zeros(2, device="npu")]
    srcs = [torch.arange(3.0).npu(), torch.arange(2.0).npu() + 5]
    g.replay()  # waits for ev: what follows on the stream is queued
    assert torch._foreach_copy_(dsts, srcs) == dsts
    ev.record(npu.Stream())
    npu.synchronize()
    assert [d.cpu().tolist() for d in dsts] == [[0.0, 1.0, 2.0], [5.0, 6.0]]


def test_a_graph_keeps_npu_memory_not_objects_and_reports_use_after_free():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    g = npu.NPUGraph()
    with npu.graph(g):
        tmp = q * 2  # an intermediate in the graph's pool, on npu
        torch_npu._npu_paged_attention(tmp, kc, vc, 2, 4, SCALE, bt, lens, out)
    assert tmp.device.type == "npu"
    alive = weakref.ref(tmp)
    del tmp
    assert alive() is None, "the graph holds the memory, not the Python tensor"
    g.replay()
    npu.synchronize()
    ref = _reference(q * 2, kc, vc, bt, [3, 5])
    assert (out.cpu().double() - ref).abs().max().item() < 8e-3
    del kc  # the graph reads the model's cache: freeing it is the model's bug
    g.replay()
    with pytest.raises(torch_npu.ReplayFault, match="key_cache"):
        npu.synchronize()


def test_weak_references_alias_npu_memory_and_keep_nothing_alive():
    t = torch.arange(8.0, device="npu")
    w = torch_npu._C._weak_ref_tensor(t)
    assert w.device == t.device and w.data_ptr() == t.data_ptr() and torch.equal(w.cpu(), t.cpu())
    t.add_(1)
    assert w.cpu().tolist() == [float(i + 1) for i in range(8)]
    alive = weakref.ref(t)
    del t
    assert alive() is None


def test_pools_hand_out_npu_blocks_shared_between_graphs():
    q, kc, vc, bt, out = _pa_setup()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    pool = npu.graph_pool_handle()
    g1, g2 = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(g1, pool=pool):
        a = q + 1
        first = a.data_ptr()
        del a
    with npu.graph(g2, pool=pool):
        b = q + 2
    assert b.device.type == "npu" and b.data_ptr() == first, "the freed block is reused by the next capture"
    before = npu.memory_allocated()
    assert before >= b.numel() * b.element_size()
    g2.replay()
    npu.synchronize()
    assert torch.equal(b.cpu(), (q.cpu() + 2))
    del lens, out


def test_math_on_npu_matches_the_host():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g)
    y = x.npu()
    assert torch.allclose(torch.nn.functional.silu(y).cpu(), torch.nn.functional.silu(x))
    assert torch.allclose((y @ y.T).cpu(), x @ x.T)
    assert math.isclose(y.norm().item(), x.norm().item(), rel_tol=1e-6)


def test_host_operands_beside_npu_ones_are_refused_except_an_index_ops_indices():
    """As on a device: an index op may take host indices; any other host operand (values,
    a concatenated tensor) beside npu memory is refused, and a 0-d host scalar is a value."""
    b = torch.zeros(6, device="npu")
    b[torch.tensor([0, 3])] = torch.tensor([5.0, 6.0], device="npu")  # host indices, device values
    assert b[torch.tensor([0, 3])].cpu().tolist() == [5.0, 6.0]
    for bad in (
        lambda: b.index_put_((torch.tensor([1]),), torch.tensor([7.0, 8.0])[:1]),
        lambda: torch.cat([b, torch.ones(2)]),
        lambda: b + torch.ones(6),
    ):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            bad()
    assert (b * torch.tensor(2.0)).cpu().tolist() == [10.0, 0.0, 0.0, 12.0, 0.0, 0.0]


def test_memory_an_eager_kernel_saw_is_freed_once_its_owners_drop_it():
    """The simulator keeps what a kernel saw alive only while somebody may still use it.

    vllm-ascend's precision tests make a 4 GiB KV cache per test and run one eager kernel
    on it; a simulator that kept every cache a kernel had seen until its registry held
    1,024 entries ran out of memory by the sixth test.  Hardware frees a dropped cache."""
    q, _, _, bt, out = _pa_setup()
    chunk = 384 << 20  # bytes per cache pair: 6 of them, 2.25 GiB, pass through
    nb = chunk // (2 * 16 * 2 * 16 * 2)
    npu.synchronize()
    base = npu.memory_allocated()
    peak = 0
    for _ in range(6):
        kc = torch.zeros(nb, 16, 2, 16, dtype=torch.float16, device="npu")
        vc = torch.zeros_like(kc)
        torch_npu._npu_paged_attention(q, kc, vc, 2, 4, SCALE, bt, torch.tensor([5, 9], dtype=torch.int32), out)
        npu.synchronize()
        del kc, vc
        peak = max(peak, npu.memory_allocated() - base)
    # at most one GiB of dropped caches waits for the next prune, beside the live pair
    assert peak <= (1 << 30) + 2 * chunk, peak / 2**30
    assert out.isfinite().all()


def test_the_card_counts_memory_once_however_many_aliases_a_graph_holds():
    """torch.npu.memory_allocated is what the card holds: a non-owning alias (a graph's, a weak
    reference), a host view and an npu view of it add nothing; a copy adds its bytes; a
    capture adds what its graph's pool holds, and no alias of the cache it reads (vLLM's
    'Graph capturing took 2.00 GiB' was the KV cache counted again through its aliases)."""
    q, kc, vc, bt, out = _pa_setup(nb=64)
    gc.collect()  # what earlier tests left: freed now, not inside the measurement (a capture collects)
    before = npu.memory_allocated()
    w = torch_npu._C._weak_ref_tensor(kc)
    h = torch_npu.host_view(kc)
    v = torch.ops.npugraph_sim.device_view(h, 0)
    assert npu.memory_allocated() == before and w.data_ptr() == v.data_ptr() == kc.data_ptr()
    c = kc.clone()
    assert npu.memory_allocated() - before == c.numel() * c.element_size()
    del c, w, h, v
    gc.collect()
    start = npu.memory_allocated()
    g = npu.NPUGraph()
    pool = npu.graph_pool_handle()
    with npu.graph(g, pool=pool):
        y = torch_npu._C._weak_ref_tensor(kc)[0] * 2  # an alias of the cache, and 1 block of new memory
    grown = npu.memory_allocated() - start
    assert grown <= torch_npu.pool_bytes(pool) < kc.numel() * kc.element_size()
    assert torch_npu.pool_bytes(pool) >= y.numel() * y.element_size()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_zeroing_a_large_allocation_gives_its_pages_back_and_reads_zeros_at_every_byte():
    # vLLM and SGLang zero their KV caches (gigabytes) at start-up: a large allocation is a
    # mapping of its own whose whole pages a zero_ gives back (they read as zeros), its
    # partial pages at either end written; what lies outside the range keeps its values
    n = (96 << 20) + 123
    pattern = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    x = torch.empty(n, dtype=torch.uint8, device="npu")
    x.copy_(pattern)  # every page touched
    npu.synchronize()
    lo, hi = 4093, n - 5001  # neither end on a page
    before = _resident_bytes()
    x[lo:hi].zero_()
    given_back = before - _resident_bytes()
    expected = pattern.clone()
    expected[lo:hi] = 0
    assert torch.equal(x.cpu(), expected)
    assert given_back > 80 << 20, given_back
    x[lo : lo + 3] = 9  # the given-back pages are memory like any other
    expected[lo : lo + 3] = 9
    assert torch.equal(x.cpu(), expected)
    x.zero_()
    assert int(x.count_nonzero()) == 0
    small = torch.full((1000,), 3.0, device="npu")  # a small one: zeroed as any op does
    assert float(small.zero_().abs().sum()) == 0.0


def test_the_host_heap_is_kept_only_when_asked_and_unless_the_environment_tunes_glibc_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device's temporaries come from the host's heap, not a mapping each (npusim.bench's
    engine loop spent two thirds of its time faulting pages in without it); a process that
    sets glibc's own knobs keeps them."""
    import sys

    from npusim.device import backend

    monkeypatch.delenv(backend.ENV_KEEP_HEAP, raising=False)
    assert backend.keep_host_heap() is False, "off unless asked for (the soak's resident memory)"
    monkeypatch.setenv(backend.ENV_KEEP_HEAP, "1")
    assert backend.keep_host_heap() is (sys.platform == "linux")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert backend.keep_host_heap() is False
