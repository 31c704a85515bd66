"""Memory as a device has it (contract §9): graphs own memory, not objects; pools reuse it.

Each test here fails on a simulator that keeps the Python tensors of a capture alive
(the kinder-than-hardware behaviour), or on an npugraph that relies on it.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import npusim as torch_npu
from npugraph import Runtime
from npugraph.errors import ReplayFailed
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.reference import paged_attention_reference
from npusim import npu

from .helpers import equal_on_host

SCALE = 0.125
DEVICE = "npu"  # device memory: the simulator's npu device


def _pa_inputs(t=2, n=4, kvn=2, d=64, nb=8, bs=16, cols=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, n, d, generator=g).half().to(DEVICE)
    kc = torch.randn(nb, bs, kvn, d, generator=g).half().to(DEVICE)
    vc = torch.randn(nb, bs, kvn, d, generator=g).half().to(DEVICE)
    bt = torch.randperm(nb, generator=g)[: t * cols].reshape(t, cols).int().to(DEVICE)
    return q, kc, vc, bt


def _pa(q, kc, vc, bt, lens, out, ws=None):
    torch_npu._npu_paged_attention(q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt, lens, out, workspace=ws)


# --- the simulator ----------------------------------------------------------------------


def test_graph_keeps_memory_not_the_python_objects():
    x = torch.randn(16, device=DEVICE)
    refs = []

    def body():
        y = x * 2  # an intermediate: only the graph's memory should outlive the capture
        refs.append(weakref.ref(y))
        return y + 1

    g = npu.NPUGraph()
    with npu.graph(g):
        out = body()
    gc.collect()
    assert refs[0]() is None, "a weakref to a captured intermediate is dead once the capturing code drops it"
    out_ref = weakref.ref(out)
    alias = torch_npu._C._weak_ref_tensor(out)
    del out
    gc.collect()
    assert out_ref() is None, "nor does the graph keep its outputs' Python objects"
    g.replay()
    npu.synchronize()
    assert equal_on_host(alias, x * 2 + 1), "the graph still writes the memory, read through the alias"


def test_weak_ref_tensor_is_a_non_owning_alias():
    t = torch.randn(4, 6, device=DEVICE)[:, 1:5]  # a view with an offset and strides
    a = torch_npu._C._weak_ref_tensor(t)
    assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (t.data_ptr(), t.shape, t.stride(), t.dtype)
    a.fill_(3)
    assert (t == 3).all(), "same memory"
    r = weakref.ref(t)
    del t
    gc.collect()
    assert r() is None, "the alias keeps nothing alive"


def test_graphs_sharing_a_pool_alias_each_others_memory():
    pool = npu.graph_pool_handle()
    x = torch.arange(8.0, device=DEVICE)
    ga, gb = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(ga, pool=pool):
        a = x * 2
    a_alias = torch_npu._C._weak_ref_tensor(a)
    del a  # as vLLM does: the wrapper keeps only a weak reference to the output
    with npu.graph(gb, pool=pool):
        b = x + 100
    assert b.data_ptr() == a_alias.data_ptr(), "a freed block of the pool is reused by the next capture"
    ga.replay()
    npu.synchronize()
    assert equal_on_host(a_alias, x * 2)
    gb.replay()
    npu.synchronize()
    assert equal_on_host(a_alias, x + 100), "replaying graph B overwrites what graph A left there"


def test_private_pools_do_not_alias():
    x = torch.arange(8.0, device=DEVICE)
    ga, gb = npu.NPUGraph(), npu.NPUGraph()
    with npu.graph(ga):
        a = x * 2
    a_ptr = a.data_ptr()
    del a
    with npu.graph(gb):
        b = x + 1
    assert b.data_ptr() != a_ptr


def test_freed_and_reallocated_block_table_is_a_use_after_free():
    q, kc, vc, bt = _pa_inputs()
    table = bt.clone()  # the engine's block-table buffer, captured by address
    out = torch.empty_like(q)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    g, ev = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        npu.graph_task_group_begin(s)
        _pa(q, kc, vc, table, lens, out)
        npu.graph_task_group_end(s)
    del table  # the engine frees the buffer ...
    new_table = bt.clone()  # ... and allocates a new one (another address, as far as the graph knows)
    assert new_table.shape == bt.shape
    ev.record(npu.Stream())
    g.replay()  # asynchronous: the fault comes back from the next synchronize, as on hardware
    with pytest.raises(torch_npu.ReplayFault, match=r"argument 'block_table'.*freed by its owner") as info:
        npu.synchronize()
    assert f"graph #{g.graph_id}" in str(info.value) and "_npu_paged_attention" in str(info.value)
    assert isinstance(info.value.__cause__, torch_npu.UseAfterFree)
    assert info.value.__cause__.argument == "block_table"
    assert info.value.graph is g
    npu.synchronize()  # reported once; the device goes on


def test_fresh_workspace_per_update_is_accepted():
    """vllm-ascend's PA update: a workspace queried for these lengths at every update, dropped at once."""
    q, kc, vc, bt = _pa_inputs(t=2)
    out = torch.empty_like(q)
    captured = torch.tensor([1, 1], dtype=torch.int32)
    ws = torch_npu._npu_paged_attention_get_workspace(q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt, captured, out)
    g, ev = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        npu.graph_task_group_begin(s)
        _pa(q, kc, vc, bt, captured, out, ws)
        handle = npu.graph_task_group_end(s)
    del ws
    us = npu.Stream()
    for lens in ([3, 16], [16, 1], [7, 7]):
        ctx = torch.tensor(lens, dtype=torch.int32)
        with npu.stream(us):
            npu.graph_task_update_begin(us, handle)
            fresh = torch_npu._npu_paged_attention_get_workspace(
                q, kc, vc, kc.shape[2], q.shape[1], SCALE, bt, ctx, out
            )
            _pa(q, kc, vc, bt, ctx, out, fresh)
            npu.graph_task_update_end(us)
            ev.record(us)
        del fresh  # dropped at once: scratch reused serially is what hardware tolerates
        g.replay()
        npu.synchronize()
        ref = paged_attention_reference(q, kc, vc, bt, lens, SCALE)
        assert (out.cpu().double() - ref).abs().max() < 4e-3


def test_an_update_may_point_a_task_at_another_tensor():
    q, kc, vc, bt = _pa_inputs()
    out = torch.zeros_like(q)
    lens = torch.tensor([4, 4], dtype=torch.int32)
    g, ev = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        npu.graph_task_group_begin(s)
        _pa(q, kc, vc, bt, lens, out)
        handle = npu.graph_task_group_end(s)
    other = torch.zeros_like(q)
    us = npu.Stream()
    with npu.stream(us):
        npu.graph_task_update_begin(us, handle)
        _pa(q, kc, vc, bt, lens, other)
        npu.graph_task_update_end(us)
        ev.record(us)
    g.replay()
    npu.synchronize()
    assert not out.any(), "the captured out is no longer written"
    ref = paged_attention_reference(q, kc, vc, bt, [4, 4], SCALE)
    assert (other.cpu().double() - ref).abs().max() < 4e-3


def test_names_real_torch_npu_code_uses_exist():
    assert isinstance(torch_npu._C._NPUTaskGroupHandle, type)
    npu.empty_cache()


# --- npugraph on it -----------------------------------------------------------------------


def _decoder(sizes, layers=2):
    cfg = DecoderConfig(layers=layers, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    return cfg, rt, model, DecodeEngine(rt, model, sizes)


def test_updates_and_replays_reach_intermediates_dropped_after_capture():
    cfg, rt, model, eng = _decoder([4])
    eng.capture()
    gc.collect()
    entry = rt.manager.entry("main", 4)
    q = entry.tasks[1].tensor("query")  # layer 1's query: an alias; nobody holds the tensor any more
    assert q is not None
    for b in Workload(cfg, [4], seed=3).steps(6):
        ref = eng.eager(b).clone()
        got = eng.step(b)
        assert equal_on_host(got, ref)


def test_capture_writes_nothing_not_even_the_kv_cache():
    """A capture in the middle of serving: the callable is recorded, not run."""
    cfg, rt, model, eng = _decoder([2])
    for layer in model.layers:
        layer.k_cache.fill_(0.5)
    eng.buffers["slot_mapping"][:2] = torch.tensor([17, 18])  # a live request's slots
    before = [layer.k_cache.clone() for layer in model.layers]
    eng.capture()
    assert all(equal_on_host(layer.k_cache, b) for layer, b in zip(model.layers, before))


def test_outputs_are_valid_until_another_graph_of_the_pool_replays():
    rt = Runtime("sim", max_model_len=64)
    x = torch.arange(8.0, device=DEVICE)
    rt.capture(lambda: x * 2, key="a", tokens=8, require_attention=False)
    rt.capture(lambda: x + 100, key="b", tokens=8, require_attention=False)
    out_a = rt.replay("a")
    rt.synchronize()
    assert equal_on_host(out_a, x * 2)
    kept = out_a.clone()  # what a caller must do to keep it
    rt.replay("b")
    rt.synchronize()
    assert equal_on_host(out_a, x + 100), "graph b reused graph a's output memory"
    assert equal_on_host(kept, x * 2)


def test_replay_returns_aliases_not_none():
    cfg, rt, model, eng = _decoder([2])
    eng.capture()
    gc.collect()
    b = next(iter(Workload(cfg, [2], seed=1).steps(1)))
    out = rt.step(
        2,
        {"default": b.meta},
        inputs={"input_ids": b.input_ids, "positions": b.positions, "slot_mapping": b.slot_mapping},
    )
    assert isinstance(out, torch.Tensor) and out.shape == (2, cfg.vocab_size)


def test_a_freed_static_input_is_reported_at_replay_naming_the_graph():
    rt = Runtime("sim", max_model_len=64)
    inputs = {"x": torch.arange(8.0, device=DEVICE)}
    rt.capture(lambda x: x * 2, inputs["x"], key=8, require_attention=False)
    del inputs
    gc.collect()
    rt.replay(8)
    with pytest.raises(ReplayFailed, match=r"replay of main/8 failed: UseAfterFree.*freed by its owner"):
        rt.synchronize()


def test_model_tensors_are_not_kept_alive_by_the_runtime():
    cfg, rt, model, eng = _decoder([2])
    eng.capture()
    for b in Workload(cfg, [2], seed=2).steps(3):
        eng.step(b)
    refs = [weakref.ref(layer.k_cache) for layer in model.layers] + [weakref.ref(model.lm_head.weight)]
    del model, eng, b
    gc.collect()
    assert all(r() is None for r in refs)
    assert rt.manager.entry("main", 2).tasks, "the graph is still captured (addresses only)"


_MEASURED = """
import json
from npugraph import Runtime
import npusim as sim
from npugraph.models import Decoder, DecoderConfig
from npugraph.models.engine import DecodeEngine
cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
rt = Runtime("sim", max_model_len=cfg.max_model_len)
DecodeEngine(rt, Decoder(cfg, rt), [1, 4, 16, 64]).capture()
print(json.dumps({"took": {e.tokens: e.memory_bytes for e in rt.manager.entries()},
                  "pool": sim.pool_bytes(rt.manager._pool), "report": rt.capture_report(),
                  "manifest": rt.manifest()["totals"]["memory_bytes"]}))
"""


def test_each_capture_says_the_device_memory_it_took_and_smaller_graphs_reuse_the_pool():
    # measured as a device does it (free memory before and after each capture, as vLLM
    # does), per size; largest first, so the smaller graphs of the shared pool reuse its
    # blocks.  Memory freed during a capture counts against it, so in a process of its own
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MEASURED], capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    took, pool = {int(k): v for k, v in out["took"].items()}, out["pool"]
    # what the first capture took is what the pool holds, and a few KiB of npugraph's own
    assert 0 < pool <= took[64] < pool + 64 * 1024, (took, pool)
    assert all(took[k] < pool // 10 for k in (16, 4, 1)), took  # reused (a few bytes of npugraph's own)
    assert (
        f"device memory {sum(took.values()) / 2**20:.1f} MiB (per size, MiB: 64: {pool / 2**20:.1f}, 16: 0.0"
        in (out["report"])
    ), out["report"]
    assert out["manifest"] == sum(took.values())
