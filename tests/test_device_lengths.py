"""The tiling-sink FIA path: lengths and plan in device memory, no per-layer update.

The simulator's two ops are checked against the float64 reference; the runtime's path is
checked end to end (replay equal to eager and close to the float64 reference, which
shares none of npugraph's code), by what a step issues on the device (no task update, one
metadata op per KV-cache group, one event), and by its fallbacks and refusals.
"""

from __future__ import annotations

import contextlib
import random

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npusim as sim
from npugraph import AttentionMetadata, Runtime
from npugraph.errors import GraphDeadlock, MetadataError, NpuGraphError
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.reference import paged_attention_reference

from .helpers import assert_engine_serves, run

DEV = torch.device("npu", 0)
META = sim._npu_fused_infer_attention_score_v2_sink_metadata
SINK = sim.npu_fused_infer_attention_score_v2_sink


def _cache(seed: int, nb: int = 32, bs: int = 16, kvn: int = 2, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nb, bs, kvn, d, generator=g, dtype=torch.float32).to(torch.float16)
    v = torch.randn(nb, bs, kvn, d, generator=g, dtype=torch.float32).to(torch.float16)
    return k.to(DEV), v.to(DEV)


def _sink_call(q, k, v, bt, qlen, kvlen, meta, out, *, heads, kvn, mask=None):
    nb, bs, _, d = k.shape
    SINK.out(
        q,
        k.view(nb, bs, kvn * d),
        v.view(nb, bs, kvn * d),
        actual_seq_qlen=qlen,
        actual_seq_kvlen=kvlen,
        block_table=bt,
        meta_data=meta,
        num_query_heads=heads,
        num_key_value_heads=kvn,
        softmax_scale=d**-0.5,
        block_size=bs,
        sparse_mode=3 if mask is not None else 0,
        atten_mask=mask,
        out=[out, torch.empty(1, dtype=torch.float32, device=DEV)],
    )


def _lens(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype).to(DEV)


@pytest.mark.parametrize("tokens_per_request", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_sink_kernel_matches_the_float64_reference(seed, tokens_per_request):
    sim.install_npu_device()
    rng = random.Random(seed)
    heads, kvn, d, bs = 8, 2, 64, 16
    k, v = _cache(seed, bs=bs, kvn=kvn, d=d)
    batch = 5
    kv = [rng.randint(tokens_per_request, 8 * bs) for _ in range(batch - 1)] + [0]  # a padding row
    qlens = [tokens_per_request] * (batch - 1) + [tokens_per_request]
    ends = [sum(qlens[: i + 1]) for i in range(batch)]
    t = ends[-1]
    bt = torch.tensor([rng.sample(range(32), 8) for _ in range(batch)], dtype=torch.int32).to(DEV)
    q = torch.randn(t, heads, d, generator=torch.Generator().manual_seed(seed + 9)).to(torch.float16).to(DEV)
    qlen, kvlen = _lens(ends), _lens(kv)
    meta = torch.zeros(1024, dtype=torch.uint32, device=DEV)
    META(
        qlen,
        kvlen,
        num_query_heads=heads,
        num_key_value_heads=kvn,
        head_dim=d,
        block_size=bs,
        meta_data=meta,
        sparse_mode=3 if tokens_per_request > 1 else 0,
    )
    out = torch.zeros(t, heads, d, dtype=torch.float16, device=DEV)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1).to(DEV) if tokens_per_request > 1 else None
    _sink_call(q, k, v, bt, qlen, kvlen, meta, out, heads=heads, kvn=kvn, mask=mask)
    real = batch - 1
    ref = paged_attention_reference(q[: ends[real - 1]], k, v, bt[:real], kv[:real], d**-0.5, qlens[:real])
    got = out.cpu().double()
    assert (got[: ends[real - 1]] - ref).abs().max() < 2e-2
    assert got[ends[real - 1] :].abs().max() == 0, "a request with no key gives zeros"


def test_sink_kernel_reads_lengths_on_the_device_and_refuses_what_the_device_refuses():
    sim.install_npu_device()
    k, v = _cache(3)
    bt = torch.arange(16, dtype=torch.int32).view(2, 8).to(DEV)
    q = torch.randn(2, 8, 64).to(torch.float16).to(DEV)
    out = torch.empty(2, 8, 64, dtype=torch.float16, device=DEV)
    meta = torch.zeros(1024, dtype=torch.uint32, device=DEV)
    with pytest.raises(ValueError, match="actual_seq_qlen.*cpu tensor.*device memory"):
        _sink_call(q, k, v, bt, torch.tensor([1, 2], dtype=torch.int32), _lens([3, 4]), meta, out, heads=8, kvn=2)
    with pytest.raises(ValueError, match="must be a device tensor"):
        _sink_call(q, k, v, bt, (1, 2), _lens([3, 4]), meta, out, heads=8, kvn=2)
    with pytest.raises(ValueError, match="head_dim.*256"):
        META(
            _lens([1, 2]),
            _lens([3, 4]),
            num_query_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            block_size=16,
            meta_data=meta,
        )
    with pytest.raises(ValueError, match="meta_data.*uint32"):
        META(
            _lens([1, 2]),
            _lens([3, 4]),
            num_query_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            block_size=16,
            meta_data=torch.zeros(1024, dtype=torch.int32, device=DEV),
        )
    with pytest.raises(sim.StaleTilingError, match="holds no tiling plan"):  # never planned
        _sink_call(q, k, v, bt, _lens([1, 2]), _lens([3, 4]), meta, out, heads=8, kvn=2)


def test_a_metadata_op_captured_in_the_graph_replays_a_stale_plan_and_the_simulator_says_so():
    sim.install_npu_device()
    k, v = _cache(4)
    bt = torch.arange(16, dtype=torch.int32).view(2, 8).to(DEV)
    q = torch.randn(2, 8, 64).to(torch.float16).to(DEV)
    out = torch.empty(2, 8, 64, dtype=torch.float16, device=DEV)
    qlen, kvlen = _lens([1, 2]), _lens([5, 9])
    meta = torch.zeros(1024, dtype=torch.uint32, device=DEV)
    args = dict(num_query_heads=8, num_key_value_heads=2, head_dim=64, block_size=16, meta_data=meta)
    META(qlen, kvlen, **args)  # a plan for (5, 9), made eagerly
    g = sim.npu.NPUGraph()
    with sim.npu.graph(g):
        META(qlen, kvlen, **args)  # captured: an AI-CPU node a replay does not re-run
        _sink_call(q, k, v, bt, qlen, kvlen, meta, out, heads=8, kvn=2)
    g.replay()
    sim.npu.synchronize()  # the lengths the plan was made for: fine
    kvlen.copy_(torch.tensor([7, 30], dtype=torch.int32))
    g.replay()
    with pytest.raises(sim.ReplayFault, match="StaleTilingError.*computed for other lengths.*not re-run on replay"):
        sim.npu.synchronize()
    META(qlen, kvlen, **args)  # outside the graph, before the replay: right
    g.replay()
    sim.npu.synchronize()
    ref = paged_attention_reference(q, k, v, bt, [7, 30], 64**-0.5)
    assert (out.cpu().double() - ref).abs().max() < 2e-2


# --- the runtime's path ---------------------------------------------------------------


def _engine(sizes=(2, 8, 16), layers=4, **rt_kwargs):
    cfg = DecoderConfig(layers=layers, num_blocks=160, max_model_len=256)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, **rt_kwargs)
    eng = DecodeEngine(rt, Decoder(cfg, rt), list(sizes))
    eng.capture()
    return cfg, rt, eng


@pytest.mark.parametrize("order", ["replay-first", "update-first"])
def test_fia_sizes_take_the_sink_path_by_default_and_serve_right(order):
    cfg, rt, eng = _engine(order=order)
    kernels = {e.key: e.choice.kernel for e in rt.entries()}
    assert kernels == {2: "pa", 8: "fia_sink", 16: "fia_sink"}
    assert "lengths on the device" in rt.entry(8).choice.reason
    report = rt.capture_report()
    assert "2 fia_sink" in report and "1 pa" in report
    assert run(eng, cfg, 40, seed=2) == 0
    assert_engine_serves(eng, steps=6, seed=5)  # also against the float64 reference


def test_a_sink_step_issues_no_task_update_one_metadata_op_per_group_and_one_event():
    cfg, rt, eng = _engine(sizes=(16,), layers=6)
    entry = rt.entry(16)
    assert all(t.handle is None and t.lens is not None for t in entry.tasks)
    assert sum(t.records for t in entry.tasks) == 1 and sum(t.waits for t in entry.tasks) == 1
    assert len(entry.lens_groups) == 1, "one KV-cache group: one length buffer and plan"
    batches = list(Workload(cfg, [16], seed=3).steps(4))
    eng.step(batches[0])
    before = dict(sim.counters())
    for b in batches[1:]:
        eng.step(b)
    after = sim.counters()
    steps = len(batches) - 1
    assert after.get("graph_task_update_begin", 0) == before.get("graph_task_update_begin", 0)
    metadata = "op:_npu_fused_infer_attention_score_v2_sink_metadata"
    assert after[metadata] - before.get(metadata, 0) == steps


def test_unchanged_lengths_skip_the_write_but_not_the_event():
    cfg, rt, eng = _engine(sizes=(8,))
    b = next(iter(Workload(cfg, [8], seed=4).steps(1)))
    ref = eng.step(b).clone()
    metadata = "op:_npu_fused_infer_attention_score_v2_sink_metadata"
    n = sim.counters()[metadata]
    again = eng.step(b).clone()  # same lengths: the plan in device memory is still right
    assert sim.counters()[metadata] == n
    assert torch.equal(ref, again)


def test_without_the_ops_or_when_off_fia_keeps_the_per_layer_update_and_says_why():
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=128)
    bare = Runtime(attrs.evolve(rt.device, device_length_ops=None), max_model_len=128)
    off = Runtime("sim", max_model_len=128, device_lengths=False)
    for r, why in ((bare, "has no tiling-sink FIA"), (off, None)):
        eng = DecodeEngine(r, Decoder(cfg, r), [8])
        eng.capture()
        e = r.entry(8)
        assert e.choice.kernel == "fia"
        assert all(t.handle is not None for t in e.tasks)
        if why:
            assert why in e.choice.reason
        assert run(eng, cfg, 6, seed=1) == 0


def test_one_layer_is_below_the_break_even_and_keeps_the_per_layer_update():
    cfg, rt, eng = _engine(sizes=(8,), layers=1)
    e = rt.entry(8)
    assert e.choice.kernel == "fia"
    assert "below the 2 from which the tiling-sink path saves host time" in e.choice.reason
    assert run(eng, cfg, 6, seed=1) == 0


def test_two_layers_of_one_group_with_different_lengths_are_refused():
    cfg, rt, eng = _engine(sizes=(8,), layers=2)
    b = next(iter(Workload(cfg, [8], seed=4).steps(1)))
    ref = eng.step(b).clone()
    other = AttentionMetadata(seq_lens=b.meta.seq_lens + 1, block_table=b.meta.block_table)
    layers = rt.entry(8).layers
    with pytest.raises(MetadataError, match="one device-length buffer"):
        rt.update(8, {layers[0]: b.meta, layers[1]: other})
    assert torch.equal(eng.step(b), ref), "serving goes on"


def test_a_replay_with_no_update_is_released_and_the_next_step_is_right():
    cfg, rt, eng = _engine(sizes=(8,))
    batches = list(Workload(cfg, [8], seed=6).steps(3))
    eng.step(batches[0])
    rt.replay(8)  # replay-first: it waits on the device for the lengths
    with pytest.raises(GraphDeadlock):
        rt.synchronize()
    assert run(eng, cfg, 4, seed=7) == 0
    assert_engine_serves(eng, steps=3, seed=8)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.sampled_from(["step", "bad", "replay", "update", "sync"]), min_size=2, max_size=10),
    order=st.sampled_from(["replay-first", "update-first"]),
)
def test_any_sequence_of_steps_bad_metadata_and_halves_leaves_the_sink_graph_serving(ops, order):
    cfg, rt, eng = _shared_engine(order)
    batches = list(Workload(cfg, [8], seed=9).steps(len(ops) + 1))
    for op, b in zip(ops, batches):
        try:
            if op == "step":
                eng.step(b)
            elif op == "bad":
                bad = AttentionMetadata(seq_lens=b.meta.seq_lens.float(), block_table=b.meta.block_table)
                rt.update(8, {"default": bad})
            elif op == "replay":
                rt.replay(8)
            elif op == "update":
                rt.update(8, {"default": b.meta})
            else:
                rt.synchronize()
        except NpuGraphError:  # every failure is typed; what matters is the next good step
            pass
    with contextlib.suppress(NpuGraphError):
        rt.synchronize()
    last = batches[-1]
    assert torch.equal(eng.step(last), eng.eager(last))


_ENGINES: dict[str, tuple] = {}


def _shared_engine(order):
    if order not in _ENGINES:
        _ENGINES[order] = _engine(sizes=(8,), layers=2, order=order)
    cfg, rt, eng = _ENGINES[order]
    rt.order = order
    return cfg, rt, eng


def test_a_page_locked_buffer_is_refilled_only_after_its_copy_ran():
    """The lengths are copied from page-locked memory when the stream gets there: a step
    issued while the previous copy still waits must take another buffer (the ring grows),
    or the waiting copy would read the new step's lengths."""
    cfg, rt, eng = _engine(sizes=(8,), layers=2)
    write = rt.updater.plan(rt.entry(8)).lens_writes[0]
    npu = rt.device.npu
    blocked = npu.Stream()
    gate = npu.ExternalEvent()
    gate.wait(blocked)  # everything issued on it waits until the gate is recorded
    first = {"actual_seq_qlen": tuple(range(1, 9)), "actual_seq_kvlen": (5,) * 8}
    second = {"actual_seq_qlen": tuple(range(1, 9)), "actual_seq_kvlen": (9,) * 8}
    with npu.stream(blocked):
        write.write(first)
        write.write(second)  # the first copy has not run: its buffer is still being read
    assert len(write.ring) == 2
    assert [int(x) for x in write.ring[0].values[1]] == [5] * 8, "the waiting copy's lengths are intact"
    gate.record(npu.current_stream())
    npu.synchronize()
    assert write.group.kvlen.tolist() == [9] * 8
    with npu.stream(blocked):
        write.write(first)  # both copies ran: a buffer is free again
    npu.synchronize()
    assert len(write.ring) == 2 and write.group.kvlen.tolist() == [5] * 8
