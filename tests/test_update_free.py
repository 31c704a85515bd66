"""Update-free decode graphs: FIA's lengths frozen to a width, each request's own length
masked on the device; no task update, no per-layer event.

Checked end to end (replay bitwise equal to the same step run eagerly with the same width
and mask, and close to the float64 reference, which runs none of npugraph's code), one
layer against float64 at lengths where one key more or less shows, by what a step issues on
the device, by the width each step picks, and by its refusals.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as sim
from npugraph import AttentionMetadata, Runtime
from npugraph.capture import WidthKey
from npugraph.errors import BatchRefused, CaptureFailed, MetadataError, NpuGraphError
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.models.stack import AttentionStack
from npugraph.policy import KernelChoice, UpdateFreeCosts
from npugraph.reference import paged_attention_reference
from npugraph.runtime import pick_width

from .helpers import assert_engine_serves, run

BS = 16


def _engine(sizes=(4, 8), widths=(48, 80), layers=3, updated=True, **rt_kwargs):
    cfg = DecoderConfig(layers=layers, max_model_len=128, num_blocks=64)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, **rt_kwargs)
    eng = DecodeEngine(rt, Decoder(cfg, rt), list(sizes), widths=widths, updated=updated)
    eng.capture()
    return cfg, rt, eng


@pytest.mark.parametrize("order", ["replay-first", "update-first"])
def test_update_free_graphs_serve_right_in_both_orders(order):
    cfg, rt, eng = _engine(order=order)
    kernels = {e.key: e.choice.kernel for e in rt.entries()}
    assert kernels[WidthKey(8, 48)] == kernels[WidthKey(4, 80)] == "fia_frozen"
    assert "update-free" in rt.entry(WidthKey(8, 80)).choice.reason
    assert "fia_frozen at [4@w48, 4@w80, 8@w48, 8@w80] (update-free" in rt.capture_report()
    assert run(eng, cfg, 40, seed=2) == 0
    assert_engine_serves(eng, steps=8, seed=5)  # also against the float64 reference
    replays = {e["key"]: e["replays"] for e in rt.summary()}
    assert sum(replays[WidthKey(s, w)] for s in (4, 8) for w in (48, 80)) > 0, replays


def _layer(batch=4, width=64, cols=8, layers=1, updated=False, **rt_kwargs):
    """One graph of ``layers`` attention layers at ``width`` (and its updated graph)."""
    rt = Runtime("sim", max_model_len=cols * BS, **rt_kwargs)
    stack = AttentionStack(rt, layers=layers, heads=4, kv_heads=2, head_size=64, block_size=BS, num_blocks=40)
    dev = rt.device.memory
    table = torch.zeros(batch, cols, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 4, 64, generator=torch.Generator().manual_seed(1)).to(torch.float16).to(dev)
    meta = AttentionMetadata(seq_lens=torch.ones(batch, dtype=torch.int32), block_table=table)
    if updated:
        rt.capture(stack, q, meta, key=batch)
    rt.capture(stack, q, meta, key=batch, width=width)
    stack.table = table  # the graphs read it: alive as long as they may replay
    return rt, stack, q


def _meta(lens, cols=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(40, generator=g)[:cols] for _ in lens]).to(torch.int32)
    return AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(1, 64), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_one_update_free_layer_sees_exactly_each_requests_keys(lens, seed):
    """Short lengths, so that one key more or less than a request's own (a mask off by one,
    a stale length) moves the output far past fp16's error."""
    rt, stack, q = _layer()
    meta = _meta(lens, seed=seed)
    out = rt.step(4, {"default": meta}).clone()
    rt.synchronize()
    k, v = stack.caches[0]
    r = len(lens)
    ref = paged_attention_reference(q[:r], k, v, meta.block_table, lens, 64**-0.5)
    assert (out[:r].cpu().double() - ref).abs().max() < 1e-2


def test_a_step_replays_the_narrowest_width_that_holds_it_else_the_updated_graph():
    rt, stack, q = _layer(width=32, updated=True)
    rt.capture(stack, q, _meta([1] * 4), key=4, width=64)
    picked = _picked(rt, ([5, 32, 1], [33, 2], [64, 64, 64, 64], [65, 1], [128]))
    assert picked == ["4@w32", "4@w64", "4@w64", "4", "4"]


def test_a_request_longer_than_every_width_is_refused_naming_it_and_serving_goes_on():
    rt, stack, q = _layer(width=32)
    good = _meta([3, 9])
    ref = rt.step(4, {"default": good}).clone()
    with pytest.raises(BatchRefused, match=r"main/4: request 1 of 'default' has 40 keys, over the widest.*\(32\)"):
        rt.step(4, {"default": _meta([3, 40])})
    # the graph of a width, stepped directly with a longer request (a stale width): refused by name
    with pytest.raises(BatchRefused, match=r"main/4@w32 layer .*: request 0 has 33 keys, over the 32"):
        rt.update(WidthKey(4, 32), {"default": _meta([33])})
    assert torch.equal(rt.step(4, {"default": good}), ref), "the next good step is right"


def test_an_update_free_step_issues_no_task_update_and_one_event_record():
    rt, _stack, _q = _layer(layers=5)
    entry = rt.entry(WidthKey(4, 64))
    assert all(t.handle is None and t.lens is not None for t in entry.tasks)
    assert sum(t.records for t in entry.tasks) == 1 and sum(t.waits for t in entry.tasks) == 1
    rt.step(4, {"default": _meta([3, 4])})
    rt.synchronize()
    before = dict(sim.counters())
    for i in range(3):
        rt.step(4, {"default": _meta([5 + i, 6 + i])})
    rt.synchronize()
    after = sim.counters()
    assert after.get("graph_task_update_begin", 0) == before.get("graph_task_update_begin", 0)
    assert after["event_record"] - before.get("event_record", 0) <= 3 * 2  # the graph's one event (+ the copy's)


def test_block_ids_across_the_whole_width_are_checked():
    """The kernel reads every block of the width, not only a request's own: an id past a
    request's blocks but within the width is refused before any device call."""
    rt, _stack, _q = _layer(width=64)
    meta = _meta([3, 5])
    meta.block_table[1, 3] = 99  # column 3: past request 1's one block, within 64 / 16 = 4 columns
    with pytest.raises(MetadataError, match=r"block_table\[1, 3\] = 99"):
        rt.step(4, {"default": meta})
    meta.block_table[1, 3] = 0
    meta.block_table[1, 5] = 99  # past the width: never read
    rt.step(4, {"default": meta})
    rt.synchronize()


@pytest.mark.parametrize(
    ("width", "why"),
    [
        (40, "not a whole number of blocks of 16"),
        (144, "over max_model_len=128"),
        (0, "width must be an int >= 1"),
    ],
)
def test_a_width_the_graph_cannot_take_is_refused_at_capture(width, why):
    with pytest.raises(CaptureFailed, match=why):
        _layer(width=width)


def test_a_speculative_or_windowed_graph_is_not_captured_update_free():
    cfg = DecoderConfig(layers=2, max_model_len=128, num_blocks=64, window=32, global_every=2)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    eng = DecodeEngine(rt, Decoder(cfg, rt), [4], widths=[64])
    with pytest.raises(CaptureFailed, match="update-free at width 64 cannot run layer .*sliding window"):
        eng.capture()


def _picked(rt, steps):
    picked = []
    for lens in steps:
        before = {repr(e.key): rt.graph_state(e.key).steps for e in rt.entries()}
        rt.step(4, {"default": _meta(lens)})
        rt.synchronize()
        after = {repr(e.key): rt.graph_state(e.key).steps for e in rt.entries()}
        picked += [k for k in after if after[k] != before[k]]
    return picked


@pytest.mark.parametrize(
    ("per_key", "expect"),
    [(0.01, ["4@w32", "4@w64", "4@w32"]), (1.0, ["4", "4", "4"]), (0.1, ["4@w32", "4", "4@w32"])],
)
def test_modeled_costs_send_each_step_to_the_faster_graph(per_key, expect):
    """Update-free over 4 rows reads 128 keys at width 32, 256 at 64; the updated graph pays
    20 us of host update and reads the step's own keys."""
    costs = UpdateFreeCosts(
        updated_host_us=20.0, update_free_host_us=2.0, device_other_us=0.0, attention_us_per_key=per_key
    )
    rt, stack, q = _layer(width=32, updated=True, update_free=costs)
    rt.capture(stack, q, _meta([1] * 4), key=4, width=64)
    assert _picked(rt, ([1, 1, 1, 1], [33, 2], [30, 2])) == expect


@settings(max_examples=60, deadline=None)
@given(
    host=st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)),
    other=st.floats(0, 1e4),
    per_key=st.floats(0, 10),
    rows=st.integers(1, 64),
    lens=st.lists(st.integers(1, 4096), min_size=1, max_size=64),
    widths=st.lists(st.integers(1, 8192), min_size=1, max_size=6),
)
def test_the_choice_takes_the_faster_of_the_two_and_never_a_width_too_narrow(host, other, per_key, rows, lens, widths):
    costs = UpdateFreeCosts(
        updated_host_us=host[0], update_free_host_us=host[1], device_other_us=other, attention_us_per_key=per_key
    )
    ladder = sorted(set(widths))
    w = pick_width(ladder, max(lens), sum(lens), rows, costs, updated=True)
    fits = [x for x in ladder if x >= max(lens)]
    if w is None:
        assert not fits or costs.update_free_us(fits[0], rows) > costs.updated_us(sum(lens))
    else:
        assert w == fits[0] and costs.update_free_us(w, rows) <= costs.updated_us(sum(lens))
    # with no updated graph the narrowest width that fits is taken, whatever the costs
    assert pick_width(ladder, max(lens), sum(lens), rows, costs, updated=False) == (fits[0] if fits else None)


def test_steps_chosen_either_way_by_cost_stay_equal_to_eager():
    costs = UpdateFreeCosts(
        updated_host_us=300.0, update_free_host_us=30.0, device_other_us=100.0, attention_us_per_key=0.5
    )
    cfg, rt, eng = _engine(update_free=costs)
    assert run(eng, cfg, 30, seed=3) == 0
    replays = {e["key"]: e["replays"] for e in rt.summary()}
    assert replays[8] + replays[4] > 0 and sum(replays[WidthKey(s, w)] for s in (4, 8) for w in (48, 80)) > 0


def test_update_free_costs_refuse_a_negative_figure():
    with pytest.raises(ValueError, match="attention_us_per_key must be >= 0"):
        UpdateFreeCosts(updated_host_us=1, update_free_host_us=1, device_other_us=0, attention_us_per_key=-1)


_SHARED: dict[str, tuple] = {}


def _shared(order):
    if order not in _SHARED:  # one engine per order: hypothesis runs many sequences
        _SHARED[order] = _engine(sizes=(8,), widths=(32, 64), layers=2, order=order)
    return _SHARED[order]


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(st.sampled_from(["step", "long", "badblock", "replay", "update", "sync"]), min_size=2, max_size=10),
    order=st.sampled_from(["replay-first", "update-first"]),
)
def test_any_sequence_of_steps_refusals_and_halves_leaves_update_free_graphs_serving(ops, order):
    """Steps, a request over the widest width (refused), a block id out of the cache within the
    width (refused), and the halves of a step on a width's graph alone, in any order: the next
    good step is right."""
    cfg, rt, eng = _shared(order)
    batches = list(Workload(cfg, [8], seed=11).steps(len(ops) + 1))
    for op, b in zip(ops, batches):
        meta = b.meta
        try:
            if op == "step":
                eng.step(b)
            elif op == "long":
                lens = meta.seq_lens.clone()
                lens[0] = 100  # over the widest width (64), under max_model_len (128)
                rt.update(WidthKey(8, 64), {"default": AttentionMetadata(seq_lens=lens, block_table=meta.block_table)})
            elif op == "badblock":
                table = meta.block_table.clone()
                table[0, 3] = 10_000  # within width 64's 4 columns, past the request's own blocks
                rt.update(WidthKey(8, 64), {"default": AttentionMetadata(seq_lens=meta.seq_lens, block_table=table)})
            elif op == "replay":
                rt.replay(WidthKey(8, 64))
            elif op == "update":
                rt.update(WidthKey(8, 64), {"default": meta})
            else:
                rt.synchronize()
        except NpuGraphError:  # every failure is typed; what matters is the next good step
            pass
    with contextlib.suppress(NpuGraphError):
        rt.synchronize()
    last = batches[-1]
    assert torch.equal(eng.step(last), eng.eager(last))


class _Frozen:
    """A policy of the user's own that names the update-free kernel (FixedPolicy refuses it)."""

    def choose(self, namespace, key, tokens, calls):
        return KernelChoice(kernel="fia_frozen", reason="mine")


def test_a_policy_cannot_choose_the_update_free_kernel_without_a_width():
    with pytest.raises(CaptureFailed, match="fia_frozen is captured with width=W, not chosen by a policy"):
        _layer(width=64, updated=True, policy=_Frozen())


def test_a_block_size_cann_does_not_take_in_decode_is_refused_at_capture():
    rt = Runtime("sim", max_model_len=64)
    stack = AttentionStack(rt, layers=1, heads=2, kv_heads=1, head_size=64, block_size=8, num_blocks=16)
    dev = rt.device.memory
    table = torch.zeros(2, 8, dtype=torch.int32, device=dev)
    q = torch.zeros(2, 2, 64, dtype=torch.float16, device=dev)
    meta = AttentionMetadata(seq_lens=torch.ones(2, dtype=torch.int32), block_table=table)
    with pytest.raises(CaptureFailed, match="block size 8 is not a multiple of 16"):
        rt.capture(stack, q, meta, key=2, width=32)
