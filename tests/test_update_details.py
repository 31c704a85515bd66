"""The details of the update path that the end-to-end tests reach only by chance.

Which layers may share one captured block-table buffer, how device-side block-id
checks are reported, which layer a device error names, and what the capture manager
remembers.  Written against mutation testing's survivors (``docs/mutation.md``).
"""

from __future__ import annotations

import gc
import json
import random
import threading
import time
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import npusim as sim
from npugraph import AttentionMetadata, Runtime
from npugraph.capture import CaptureManager
from npugraph.device import load_device
from npugraph.errors import (
    CaptureFailed,
    GraphDeadlock,
    MetadataError,
    NotReplayableError,
    ReplayFailed,
    UpdateFailed,
)
from npugraph.metadata import pad_lens
from npugraph.models import Decoder, DecoderConfig, MLADecoder, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.ops import PA, AttentionCall
from npugraph.ops.fia import causal_mask
from npugraph.ops.pa import _probe_lengths
from npugraph.policy import FixedPolicy, KernelChoice, StaticPolicy
from npugraph.reference import paged_attention_reference
from npugraph.replay import ReplayUpdater, StepPhase, describe_device_error
from npugraph.replay.blockcheck import BadColumns, BlockIdCheck
from npusim import kernels
from tests.helpers import BLOCK, BLOCKS, MAX_LEN, Harness, query_for

# --- layers sharing one captured block-table buffer ---------------------------------------


def _shared(**rt_kwargs: object) -> Harness:
    # FIA updated per layer: each layer may get its own lengths (a tiling-sink graph takes one
    # set per KV-cache group, tests/test_device_lengths.py)
    rt_kwargs.setdefault("device_lengths", False)
    return Harness([8], layers=2, policy=StaticPolicy(), **rt_kwargs)


def _step_with(h: Harness, a: AttentionMetadata, b: AttentionMetadata) -> None:
    """Layer 0 gets ``a``, layer 1 ``b``; both must match the reference."""
    q = query_for(h, 8, 0)
    h.check(h.step(8, {"layer0": a, "layer1": b}, q), q, {"layer0": a, "layer1": b})


def test_a_copy_of_the_same_table_may_share_the_buffer():
    h = _shared()
    a = h.random_meta(5)
    _step_with(h, a, attrs.evolve(a, block_table=a.block_table.clone()))


def test_tables_that_differ_only_beyond_the_requests_may_share_the_buffer():
    h = _shared()
    a = h.random_meta(3)
    wide = torch.cat([a.block_table, torch.zeros(2, a.block_table.shape[1], dtype=torch.int32)])
    other = wide.clone()
    other[3:] = 7  # rows no request reads
    _step_with(h, attrs.evolve(a, block_table=wide), attrs.evolve(a, block_table=other))


def test_a_layer_reading_fewer_columns_of_the_same_table_may_share_the_buffer():
    h = _shared()
    a = h.random_meta(4, [16, 30, 5, 32])  # at most two blocks per request
    narrow = attrs.evolve(a, block_table=a.block_table[:, :2])  # a view: the same memory
    _step_with(h, a, narrow)
    _step_with(h, a, attrs.evolve(a, block_table=narrow.block_table.clone()))  # a copy: compared


def test_another_table_on_the_shared_buffer_is_refused():
    h = _shared()
    a = h.random_meta(4)
    swapped = attrs.evolve(a, block_table=torch.flip(a.block_table, [0]))
    with pytest.raises(
        MetadataError, match=r"layer 'layer1': its metadata has another block table than layer 'layer0'"
    ):
        h.rt.update(8, {"layer0": a, "layer1": swapped})


def test_a_wider_table_than_the_copied_one_is_refused():
    """The buffer holds the first layer's columns only: a layer that needs more would read stale ids."""
    h = _shared()
    a = h.random_meta(4, [16, 30, 5, 32])
    narrow = attrs.evolve(a, block_table=a.block_table[:, :2].clone())
    with pytest.raises(MetadataError, match=r"layer 'layer1': its metadata has another block table"):
        h.rt.update(8, {"layer0": narrow, "layer1": a})


def test_a_layer_with_fewer_requests_reads_the_same_rows():
    h = _shared()
    a = h.random_meta(4)
    _step_with(h, a, AttentionMetadata(seq_lens=a.seq_lens[:3], block_table=a.block_table[:3].clone()))


@pytest.mark.parametrize("view", [False, True])
def test_a_layer_with_more_requests_than_the_copied_table_has_rows_is_refused(view):
    h = _shared()
    b = h.random_meta(4)
    rows = b.block_table[:3] if view else b.block_table[:3].clone()  # a view: the same memory, fewer rows
    a = AttentionMetadata(seq_lens=b.seq_lens[:3], block_table=rows)
    with pytest.raises(MetadataError, match=r"layer 'layer1': its metadata has another block table"):
        h.rt.update(8, {"layer0": a, "layer1": b})


def test_device_tables_are_compared_by_address_never_read():
    """Treated as device memory, a copy cannot be told from another table without a read."""
    h = _shared(defer_block_check=True)
    a = h.random_meta(4)
    view = attrs.evolve(a, block_table=a.block_table[:4])  # the same rows of the same memory
    _step_with(h, a, view)
    with pytest.raises(MetadataError, match=r"another block table"):
        h.rt.update(8, {"layer0": a, "layer1": attrs.evolve(a, block_table=a.block_table.clone())})


# --- device-side block-id checks --------------------------------------------------------------


def _bad_table(meta: AttentionMetadata) -> AttentionMetadata:
    table = meta.block_table.clone()
    table[0, 0] = 10_000
    return attrs.evolve(meta, block_table=table)


def test_several_bad_device_tables_name_the_first_and_count_the_rest():
    # a bad step is only updated (its replay would read a wrong block); the next update replaces it
    h = Harness([4], order="update-first", defer_block_check=True)
    good = h.random_meta(3)
    q = query_for(h, 4, 0)
    h.rt.step(4, {"default": good}, inputs={"query": q})  # step 1
    h.rt.update(4, {"default": _bad_table(good)})  # step 2
    h.rt.step(4, {"default": good}, inputs={"query": q})  # step 3
    h.rt.update(4, {"default": _bad_table(good)})  # step 4
    h.rt.step(4, {"default": good}, inputs={"query": q})  # step 5
    with pytest.raises(MetadataError, match=r"^step 2 of main/4 layer 'layer0': .* \(and 1 later check\(s\)\)\."):
        h.rt.synchronize()
    h.rt.synchronize()  # each check is reported once
    h.check(h.step(4, {"default": good}, q), q, dict.fromkeys(h.names, good))


def test_a_single_bad_device_table_is_named_alone():
    h = Harness([4], order="update-first", defer_block_check=True)
    h.rt.update(4, {"default": _bad_table(h.random_meta(2))})
    with pytest.raises(
        MetadataError,
        match=r"^step 1 of main/4 layer 'layer0': a block id in use in its device-resident block table is not "
        r"a block of the KV cache \(block_table\[0, 0\]: request 0's block 0\)\. That step has already run",
    ):
        h.rt.synchronize()


def test_only_the_last_64_device_checks_are_remembered():
    h = Harness([4], layers=1, order="update-first", defer_block_check=True)
    bad = _bad_table(h.random_meta(2))
    for _ in range(66):
        h.rt.update(4, {"default": bad})
    with pytest.raises(MetadataError, match=r"^step 3 of main/4 .* \(and 63 later check\(s\)\)"):
        h.rt.synchronize()


@pytest.mark.parametrize("deferred", [True, False])
def test_a_bad_id_beside_the_columns_in_use_is_not_reported(deferred):
    """Only the blocks a request reads are checked: a stale id past its length is harmless,
    and block 0 is a block like any other (the exact check runs: the table's minimum is bad)."""
    h = Harness([4], order="update-first", defer_block_check=deferred)
    meta = h.random_meta(2, [16, 20])  # request 0 uses one block, request 1 two
    table = meta.block_table.clone()
    table[0, 1] = -1
    table[1, 2] = 10_000
    table[1, 0] = 0
    ok = attrs.evolve(meta, block_table=table)
    q = query_for(h, 4, 0)
    with torch.device("meta"):  # the checks allocate where the table lives, whatever the default
        out = h.step(4, {"default": ok}, q)
    h.check(out, q, dict.fromkeys(h.names, ok))
    table = table.clone()
    table[1, 1] = 48  # the cache has 48 blocks: 48 is one too many
    bad = {"default": attrs.evolve(meta, block_table=table)}
    if deferred:
        h.rt.update(4, bad)
        with pytest.raises(MetadataError, match=r"^step 2 of main/4 layer 'layer0': a block id in use"):
            h.rt.synchronize()
    else:
        with pytest.raises(MetadataError, match=r"layer 'layer0': block_table\[1, 1\] = 48 is not a block id"):
            h.rt.update(4, bad)


@pytest.mark.parametrize("bad_id", [-1, 48])
def test_the_edges_of_the_block_ids_are_checked_on_the_host_too(bad_id):
    h = Harness([4])
    meta = h.random_meta(2, [16, 20])
    table = meta.block_table.clone()
    table[1, 1] = bad_id
    with pytest.raises(
        MetadataError,
        match=rf"^main/4 layer 'layer0': block_table\[1, 1\] = {bad_id} is not a block id of the KV cache",
    ):
        h.rt.update(4, {"default": attrs.evolve(meta, block_table=table)})
    table[1, 1] = 0 if bad_id < 0 else 47  # the first and last blocks are fine
    ok = attrs.evolve(meta, block_table=table)
    q = query_for(h, 4, 0)
    h.check(h.step(4, {"default": ok}, q), q, dict.fromkeys(h.names, ok))


def test_an_empty_step_queues_no_device_check():
    h = Harness([4], order="update-first", defer_block_check=True)
    q = query_for(h, 4, 0)
    assert not h.step(4, {"default": h.random_meta(0)}, q).any()


# --- which layer a device error names ---------------------------------------------------------


def test_device_errors_are_traced_back_to_their_layers():
    h = Harness([4, 8], layers=2, policy=FixedPolicy("pa"))
    m = h.rt.manager
    e4, e8 = m.entry("main", 4), m.entry("main", 8)
    t0, t1 = e8.tasks

    def named(exc, entry=None):
        return describe_device_error(m, exc, entry)

    hang = sim.DeadlockError(
        "stuck", blocked=[{"event": t1.event}, {"event": None}, {"event": t0.event}, {"event": t1.event}]
    )
    assert named(hang) == (
        "namespace 'main', key 8, layer 'layer1' (task 1, pa); namespace 'main', key 8, layer 'layer0' (task 0, pa): stuck"
    )
    by_group = sim.DeadlockError("stuck", blocked=[{"event": object(), "task_group": e4.tasks[1].handle._group}])
    assert named(by_group) == "namespace 'main', key 4, layer 'layer1' (task 1, pa): stuck"
    both = sim.DeadlockError("stuck", blocked=[{"event": t1.event, "task_group": e4.tasks[0].handle._group}])
    assert named(both).startswith("namespace 'main', key 8, layer 'layer1' "), "the event is the more specific"
    assert named(sim.RaceError("lost", event=t0.event)).startswith("namespace 'main', key 8, layer 'layer0' ")
    race = sim.RaceError("early", task_group=e4.tasks[0].handle._group)
    assert named(race) == "namespace 'main', key 4, layer 'layer0' (task 0, pa): early"
    group_id = e8.tasks[1].handle._group.group_id
    text = RuntimeError(f"kernel failed at node 9 of graph #1 (task group #{group_id})")
    assert named(text).startswith("namespace 'main', key 8, layer 'layer1' (task 1, pa): kernel failed")
    assert named(text, e4).startswith("no captured task matched: "), "only the given graph's tasks"
    assert named(RuntimeError("elsewhere")) == "no captured task matched: elsewhere"
    assert named(sim.RaceError("not ours", event=sim.npu.ExternalEvent())) == "no captured task matched: not ours"


@pytest.mark.no_serving_check("the graph reads a KV cache the test freed: every replay faults")
@pytest.mark.parametrize("order", ["update-first", "replay-first"])
def test_a_replay_on_freed_memory_names_the_layer(order):
    h = Harness([4], layers=3, policy=FixedPolicy("pa"), order=order)
    meta = h.random_meta(2)
    q = query_for(h, 4, 0)
    h.step(4, {"default": meta}, q)
    kept = h.caches.pop("layer1")  # the model drops one layer's KV cache; the graph still reads it
    del kept
    gc.collect()
    h.rt.step(4, {"default": meta}, inputs={"query": q})  # asynchronous: nothing is reported yet
    with pytest.raises(
        ReplayFailed, match=r"^replay of main/4 failed in layer 'layer1' \(task 1, pa\): UseAfterFree"
    ) as info:
        h.rt.synchronize()
    assert "replaying. The rest of that replay was cancelled" in str(info.value), "one full stop"
    assert h.rt.graph_state(4).phase is StepPhase.BROKEN
    h.rt.synchronize()  # reported once


def test_a_failed_update_postmortem_names_its_graph(tmp_path):
    h = Harness([4], postmortem_dir=str(tmp_path))
    meta = h.random_meta(1)
    with pytest.raises(MetadataError) as info:
        h.rt.update(4, {"default": attrs.evolve(meta, seq_lens=torch.tensor([999], dtype=torch.int32))})
    doc = json.loads(Path(info.value.postmortem).read_text())
    assert (doc["error"]["namespace"], doc["error"]["key"]) == ("main", "4")


# --- what the capture manager remembers -------------------------------------------------------


def test_eager_steps_of_a_captured_size_run_the_captured_kernel_whatever_the_policy_says_now():
    h = Harness([4], layers=2, policy=StaticPolicy())
    assert h.rt.manager.entry("main", 4).choice.kernel == "pa"
    h.rt.set_policy(FixedPolicy("fia"))  # for graphs captured from now on
    meta = h.random_meta(3)
    sim.counters().clear()
    h.forward(query_for(h, 4, 0), [{"default": meta}])  # eager, at the captured size 4
    assert sim.counters()["op:_npu_paged_attention"] == 2
    assert sim.counters()["op:npu_fused_infer_attention_score"] == 0
    sim.counters().clear()
    h.forward(query_for(h, 2, 0), [{"default": h.random_meta(2)}])  # not captured: the policy's kernel
    assert sim.counters()["op:_npu_paged_attention"] == 0


def test_a_capture_error_inside_torch_is_placed_in_the_callers_code():
    rt = Runtime("sim", max_model_len=64)
    lin = torch.nn.Linear(3, 3)

    def fn():
        return lin(torch.zeros(2, 4))  # raised inside torch.nn: the line to fix is here

    with pytest.raises(CaptureFailed, match=r"failed at .*test_update_details\.py:\d+ in fn: "):
        rt.capture(fn, key=2, require_attention=False)


def test_reset_frees_only_what_it_names():
    h = Harness([2, 4], layers=1)
    m = h.rt.manager
    h.rt.capture(lambda: torch.zeros(1), key=1, namespace="other", require_attention=False)
    t4 = m.entry("main", 4).tasks[0]
    m.reset("main", 2)
    assert sorted(m.keys("main")) == [4] and m.keys("other") == [1]
    assert m.task_for_event(t4.event) is not None, "the other graphs' tasks are still found"
    m.reset("other")
    assert m.keys("main") == [4] and m.keys("other") == []
    m.reset(key=4)
    assert m.entries() == [] and m.task_for_event(t4.event) is None


def test_capture_all_captures_largest_first_and_lists_sizes_in_order():
    rt = Runtime("sim", max_model_len=64)
    order = []

    sizes = {"a": 2, "b": 1}

    def make(k):
        order.append(k)
        n = sizes.get(k, k)
        return (lambda: torch.zeros(n), (), {"require_attention": False, "tokens": n})

    rt.manager.capture_all([2, 8, 4], make)
    with pytest.warns(UserWarning, match="capture the largest first"):
        rt.manager.capture_all([1, 16], make)  # a second batch after smaller graphs: said
    assert order == [8, 4, 2, 16, 1]
    assert rt.manager.configured["main"] == [1, 2, 4, 8, 16]
    rt.manager.capture_all(["b", "a"], make, namespace="named", size=sizes.__getitem__)
    assert order[-2:] == ["a", "b"] and rt.manager.configured["named"] == ["b", "a"]
    assert sorted(rt.manager.keys("named")) == ["a", "b"] and "a" not in rt.manager.keys("main")


def test_capture_all_keeps_the_heap_out_of_each_captures_collect_and_restores_the_collector():
    """Each capture starts with gc.collect(): while capture_all runs, what existed before
    is frozen (the walks see only new objects) and thawed after, even when a capture fails;
    a process that froze objects itself keeps its freeze."""
    rt = Runtime("sim", max_model_len=64)
    frozen_during = []

    def make(k):
        frozen_during.append(gc.get_freeze_count())
        if k == 3:
            raise ValueError("the model refuses size 3")
        return (lambda: torch.zeros(k), (), {"require_attention": False, "tokens": k})

    own = gc.get_freeze_count()  # the test session froze its imports (conftest)
    gc.unfreeze()
    try:
        rt.manager.capture_all([2, 1], make)
        assert all(n > 0 for n in frozen_during) and gc.get_freeze_count() == 0
        with pytest.raises(ValueError, match="refuses size 3"):
            rt.manager.capture_all([3], make)
        assert gc.get_freeze_count() == 0, "thawed after a failed capture too"
        gc.freeze()
        mine = gc.get_freeze_count()
        rt.manager.capture_all([4], make, namespace="other")
        # neither thawed (the count would drop to about 0) nor frozen more (it would grow);
        # a frozen object may still die by its reference count, so the count may shrink a little
        assert mine * 0.99 <= gc.get_freeze_count() <= mine, "the process's own freeze is left as it was"
    finally:
        gc.unfreeze()
        if own:
            gc.freeze()


# --- placement whatever the process default ---------------------------------------------------


@pytest.mark.parametrize(("kernel", "tpr"), [("pa", 1), ("fia", 1), ("fia", 2)])
def test_a_process_wide_default_device_changes_nothing(kernel, tpr):
    """Every tensor npugraph makes names its device: a default device (as an engine may set)
    must not move host lengths or device buffers."""
    causal_mask.cache_clear()  # made once per device: let this test decide where it is made
    h = Harness([4], layers=2, policy=FixedPolicy(kernel), tokens_per_request=tpr, dtype=torch.float32)
    h.rt.manager.reset()
    meta = h.random_meta(3)
    q = query_for(h, 4, 0)
    with torch.device("meta"):
        h.capture([4])
        out = h.step(4, {"default": meta}, q)
    h.check(out, q, dict.fromkeys(h.names, meta))


def test_decode_runs_fia_without_a_mask_and_speculation_with_the_causal_one():
    """One query token per request needs no mask (sparse_mode 0); more need the causal one (3)."""
    for tpr, mode in ((1, 0), (2, 3)):
        h = Harness([4], layers=1, policy=FixedPolicy("fia"), tokens_per_request=tpr, dtype=torch.float32)
        (task,) = h.rt.manager.entry("main", 4).tasks
        kw = task.kwargs()
        assert kw["sparse_mode"] == mode
        assert (kw["atten_mask"] is None) == (mode == 0)


@pytest.mark.parametrize(("tpr", "windows"), [(1, {"layer1": 20}), (2, None)])
def test_the_causal_mask_is_made_before_the_first_capture(tpr, windows):
    """A mask made inside the first capture comes from its graph's pool and is written only
    by its replay: a smaller graph replayed first would read it unwritten."""
    causal_mask.cache_clear()  # no earlier test may have made it
    h = Harness([8, 4], layers=2, windows=windows, tokens_per_request=tpr, dtype=torch.float32)
    for size in (4, 8):
        meta = h.random_meta(3)
        q = query_for(h, size, size)
        h.check(h.step(size, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


@pytest.mark.parametrize("kind", ["mla", "gemma-like"])
def test_mla_and_windowed_models_ignore_a_process_wide_default_device(kind):
    causal_mask.cache_clear()  # made once per device: let this test decide where it is made
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128, window=24 if kind == "gemma-like" else None)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    with torch.device("meta"):
        model = (MLADecoder if kind == "mla" else Decoder)(cfg, rt)
        eng = DecodeEngine(rt, model, [4])
        eng.capture()
        for b in Workload(cfg, [4], seed=1).steps(3):
            got = eng.step(b).clone()
    lens = b.meta.seq_lens.tolist()
    ind = model.reference_logits(b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table)
    assert got.device == rt.device.memory, "the runtime's device, not the process's default"
    assert (got - ind).abs().max() < 0.06 * ind.abs().max()


# --- graphs whose layers differ ---------------------------------------------------------------


def test_one_graph_with_pa_and_fia_layers_reading_one_metadata():
    """A windowed layer runs FIA where the others run PA: one metadata, each kernel its own host form."""
    h = Harness([4], layers=3, policy=StaticPolicy(), windows={"layer1": 20})
    assert [t.spec.name for t in h.rt.manager.entry("main", 4).tasks] == ["pa", "fia", "pa"]
    for step in range(3):
        meta = h.random_meta(3)
        q = query_for(h, 4, step)
        h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_each_layer_checks_block_ids_against_its_own_cache():
    h = Harness([4], layers=2, blocks={"layer1": 24})
    meta = h.random_meta(2, [16, 16])
    table = meta.block_table.clone()
    table[:2, 0] = torch.tensor([3, 30], dtype=torch.int32)  # 30: a block of layer0's cache only
    with pytest.raises(
        MetadataError,
        match=r"layer 'layer1': block_table\[1, 0\] = 30 is not a block id of the KV cache \(0 <= id < 24\)",
    ):
        h.rt.update(4, {"default": attrs.evolve(meta, block_table=table)})
    table[1, 0] = 23
    ok = attrs.evolve(meta, block_table=table)
    q = query_for(h, 4, 0)
    h.check(h.step(4, {"default": ok}, q), q, dict.fromkeys(h.names, ok))


def test_more_requests_than_table_columns():
    h = Harness([16], layers=1)
    meta = h.random_meta(12)
    assert meta.block_table.shape[1] < 12
    q = query_for(h, 16, 0)
    h.check(h.step(16, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_a_table_narrower_than_the_captured_buffer():
    h = Harness([4], layers=2)
    meta = h.random_meta(3, [40, 7, 64])  # at most 4 blocks each
    narrow = attrs.evolve(meta, block_table=meta.block_table[:, :4].clone())
    q = query_for(h, 4, 0)
    h.check(h.step(4, {"default": narrow}, q), q, dict.fromkeys(h.names, narrow))


def test_a_deferred_block_id_error_writes_a_postmortem(tmp_path):
    h = Harness([4], order="update-first", defer_block_check=True, postmortem_dir=str(tmp_path))
    h.rt.update(4, {"default": _bad_table(h.random_meta(2))})
    with pytest.raises(MetadataError) as info:
        h.rt.synchronize()
    doc = json.loads(Path(info.value.postmortem).read_text())
    assert doc["error"]["type"] == "MetadataError" and doc["error"]["key"] is None


# --- PA's workspace probes, seen by the device --------------------------------------------------


@attrs.define
class _RecordingOps:
    """The simulator's ops, recording the context lengths PA's workspace helper is asked about."""

    asked: list = attrs.field(factory=list)
    empty: bool = False  # a device whose PA needs no workspace

    def __getattr__(self, name):
        return getattr(sim, name)

    def _npu_paged_attention_get_workspace(self, **kwargs):
        self.asked.append(tuple(kwargs["context_lens"].tolist()))
        ws = sim._npu_paged_attention_get_workspace(**kwargs)
        return ws[:0] if self.empty else ws


@pytest.mark.parametrize("empty", [False, True])
def test_pa_workspace_probes_uniform_and_one_long_batches_at_every_sampled_length(empty):
    ops = _RecordingOps(empty=empty)
    device = attrs.evolve(load_device("sim"), name="recording", ops=ops)
    batch, bs, max_len = 3, 16, 100
    call = AttentionCall(
        query=torch.zeros(batch, 4, 64, dtype=torch.float16),
        key_cache=torch.zeros(24, bs, 2, 64, dtype=torch.float16),
        value_cache=torch.zeros(24, bs, 2, 64, dtype=torch.float16),
        block_table=torch.zeros(batch, 7, dtype=torch.int32),
        out=torch.zeros(batch, 4, 64, dtype=torch.float16),
        num_heads=4,
        num_kv_heads=2,
        scale=0.125,
    )
    got = PA.workspace_bytes(device, PA.arguments(call, pad_lens([1] * batch, None, batch, batch), None), max_len)
    want = [lens for n in _probe_lengths(max_len, bs) for lens in ((n, n, n), (n, 1, 1))]
    assert ops.asked == want
    assert 16 in _probe_lengths(max_len, bs) and 48 in _probe_lengths(max_len, bs), "block boundaries"
    assert got == (0 if empty else max(kernels.pa_workspace_bytes(batch, 4, 2, 64, n) for n in range(max_len + 1)))


# --- the fused (4-in-1) update path ---------------------------------------------------------


@pytest.mark.parametrize("order", ["update-first", "replay-first"])
def test_the_fused_path_skips_unchanged_tasks_and_survives_a_second_update(order):
    h = Harness([4], layers=3, policy=FixedPolicy("fia"), fused_update=True, order=order)
    entry = h.rt.manager.entry("main", 4)
    state = h.rt.updater.state(entry)
    assert all(t.fused for t in h.rt.updater.plan(entry).tasks)
    meta = h.random_meta(3)
    for step in range(3):  # the same lengths: tasks re-issued once, events recorded every step
        q = query_for(h, 4, step)
        h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
        assert state.last_reissued == (3 if step == 0 else 0)
    first, second = h.random_meta(2), h.random_meta(4)
    q = query_for(h, 4, 9)
    h.rt.update(4, {"default": first})
    if order == "update-first":
        # two updates before one replay: the second rewrites tasks whose events are still pending
        h.rt.update(4, {"default": second})
        h.rt.copy_inputs(entry, {"query": q})
        h.rt.replay(4)
    else:
        # an update with no replay before it is stale in this order: the next step consumes it
        h.rt.copy_inputs(entry, {"query": q})
        h.rt.replay(4)
        h.rt.update(4, {"default": second})
    h.rt.synchronize()
    h.check(entry.outputs, q, dict.fromkeys(h.names, second))


# --- ordering, failures and their reports -----------------------------------------------------


@pytest.mark.parametrize(("steps", "seed"), [(2, None), (4, None), (4, 1), (5, 2), (6, 3)])
def test_a_chain_of_steps_behind_a_busy_device_keeps_each_update_after_its_replay(steps, seed):
    """Every update must wait for the previous step's replay, not an older one (no host sync)."""
    if seed is not None:
        sim.configure(adversarial_seed=seed)
    h = Harness([4], layers=2, order="update-first")
    entry = h.rt.manager.entry("main", 4)
    base = h.random_meta(3, [MAX_LEN] * 3)  # one table for every step: its copies are alike
    metas = [
        attrs.evolve(base, seq_lens=torch.tensor([h.rng.randint(1, MAX_LEN) for _ in range(3)], dtype=torch.int32))
        for _ in range(steps)
    ]
    q = query_for(h, 4, 0)
    npu = sim.npu
    main, hold = npu.Stream(), npu.ExternalEvent()
    with npu.stream(main):
        hold.wait(main)  # the device is busy: every replay stays queued
        for m in metas:
            h.rt.copy_inputs(entry, {"query": q})
            h.rt.update(4, {"default": m})
            h.rt.replay(4)
        hold.record(npu.Stream())
        h.rt.synchronize()
    h.check(entry.outputs, q, dict.fromkeys(h.names, metas[-1]))


@pytest.mark.parametrize("size", [1, 4])
def test_speculative_steps_without_query_start_loc(size):
    """Uniform speculative steps may leave query_start_loc out: each request has 2 tokens."""
    h = Harness([size], tokens_per_request=2, dtype=torch.float32)
    for step in range(3):
        meta = attrs.evolve(h.random_meta(size if step else max(1, size - 1)), query_start_loc=None)
        q = query_for(h, size, step)
        h.check(h.step(size, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
    # a request whose every key is new this step (query tokens == key length) is valid
    first = AttentionMetadata(
        seq_lens=torch.full((size,), 2, dtype=torch.int32), block_table=h.random_meta(size).block_table
    )
    q = query_for(h, size, 9)
    h.check(h.step(size, {"default": first}, q), q, dict.fromkeys(h.names, first))


def test_without_validation_nothing_is_checked_on_the_device_either():
    h = Harness([4], order="update-first", validate=False)
    h.rt.update(4, {"default": _bad_table(h.random_meta(2))})
    h.rt.synchronize()  # no deferred check was queued


def test_a_failed_replay_refuses_until_a_complete_update_and_reports_its_graph(tmp_path):
    h = Harness([4], layers=2, order="update-first", validate=False, postmortem_dir=str(tmp_path))
    entry = h.rt.manager.entry("main", 4)
    good = h.random_meta(3)
    h.rt.update(4, {"default": _bad_table(good)})  # unchecked: the kernel meets block 10000
    h.rt.replay(4)  # asynchronous: the fault comes back from the next synchronize
    with pytest.raises(
        ReplayFailed, match=r"^replay of main/4 failed in layer 'layer0' \(task 0, pa\): ValueError: .*block id 10000"
    ) as info:
        h.rt.synchronize()
    assert ".." not in str(info.value).split(" [post-mortem")[0]
    assert json.loads(Path(info.value.postmortem).read_text())["error"]["key"] == "4"
    with pytest.raises(NotReplayableError, match=r"^main/4 is not replayable") as info:
        h.rt.replay(4)
    assert json.loads(Path(info.value.postmortem).read_text())["error"]["key"] == "4"
    q = query_for(h, 4, 0)
    h.rt.copy_inputs(entry, {"query": q})
    h.rt.update(4, {"default": good})
    h.rt.replay(4)
    h.rt.synchronize()
    h.check(entry.outputs, q, dict.fromkeys(h.names, good))


def test_query_start_loc_errors_say_what_was_expected():
    h = Harness([4], tokens_per_request=2, dtype=torch.float32)
    meta = h.random_meta(2)
    with pytest.raises(
        MetadataError,
        match=r"^main/4 layer 'layer0': query_start_loc must have R\+1=3 entries starting at 0, got \[0, 2\]$",
    ):
        h.rt.update(4, {"default": attrs.evolve(meta, query_start_loc=torch.tensor([0, 2], dtype=torch.int32))})
    long = torch.arange(0, 10, dtype=torch.int32)
    with pytest.raises(MetadataError, match=r"entries starting at 0, got \[0, 1, 2, 3, 4, 5, 6, 7\]$"):
        h.rt.update(4, {"default": attrs.evolve(meta, query_start_loc=long)})
    with pytest.raises(
        MetadataError, match=r"^main/4 layer 'layer0': query_start_loc must be non-decreasing, got \[0, 3, 2\]$"
    ):
        h.rt.update(4, {"default": attrs.evolve(meta, query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32))})
    three = h.random_meta(3, [20, 20, 20])
    with pytest.raises(MetadataError, match=r"^main/4 layer 'layer0': 9 query tokens do not fit the captured 8$"):
        h.rt.update(4, {"default": attrs.evolve(three, query_start_loc=torch.tensor([0, 2, 4, 9], dtype=torch.int32))})
    with pytest.raises(MetadataError, match=r"^main/4 layer 'layer0': query_start_loc must be a CPU int32 tensor"):
        h.rt.update(4, {"default": attrs.evolve(meta, query_start_loc=[0, 2, 4])})


def test_a_task_records_arguments_are_its_own():
    h = Harness([4], layers=1, policy=FixedPolicy("fia"))
    (task,) = h.rt.manager.entry("main", 4).tasks
    kw = task.kwargs()
    kw["out"].append("junk")
    assert len(task.kwargs()["out"]) == 2, "the record's lists are copied, never shared"


# --- caches, fast paths and bounds ----------------------------------------------------------------


def test_the_update_plan_is_worked_out_once_per_graph():
    h = Harness([4], layers=2)
    entry = h.rt.manager.entry("main", 4)
    assert h.rt.updater.plan(entry) is h.rt.updater.plan(entry)


def test_each_distinct_metadata_is_converted_once_per_layer_geometry():
    """Counted by the device-side checks each conversion queues: one per distinct metadata."""
    h = Harness([4], layers=3, order="update-first", defer_block_check=True)
    a = _bad_table(h.random_meta(2))
    b = attrs.evolve(a, seq_lens=a.seq_lens + 1)  # the same table, other lengths
    h.rt.update(4, {"layer0": a, "layer1": b, "layer2": a})
    with pytest.raises(MetadataError, match=r"\(and 1 later check\(s\)\)"):
        h.rt.synchronize()


def test_unchanged_per_layer_metadata_reissues_nothing():
    h = Harness([4], layers=3)
    base = h.random_meta(3, [MAX_LEN] * 3)
    metas = {
        n: attrs.evolve(base, seq_lens=torch.tensor([5 + i, 9, 30], dtype=torch.int32)) for i, n in enumerate(h.names)
    }
    state = h.rt.updater.state(h.rt.manager.entry("main", 4))
    for step in range(3):
        q = query_for(h, 4, step)
        h.check(h.step(4, metas, q), q, metas)
        assert state.last_reissued == (3 if step == 0 else 0)


def test_a_group_entry_with_one_layer_overridden():
    """{group: A, layer1: B}: layer 1 gets B, every other layer A."""
    h = Harness([4], layers=3)
    a = h.random_meta(3, [MAX_LEN] * 3)
    b = attrs.evolve(a, seq_lens=torch.tensor([3, 60, 17], dtype=torch.int32))
    q = query_for(h, 4, 0)
    h.check(h.step(4, {"default": a, "layer1": b}, q), q, {"layer0": a, "layer1": b, "layer2": a})


def test_a_request_at_max_model_len_fits():
    h = Harness([4], layers=1)
    meta = h.random_meta(2, [MAX_LEN, MAX_LEN - 1])
    q = query_for(h, 4, 0)
    h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_eager_steps_check_host_block_ids_too():
    h = Harness([4], layers=1)
    with pytest.raises(MetadataError, match=r"^eager main layer 'layer0': block_table\[0, 0\] = 10000"):
        h.forward(query_for(h, 4, 0), [{"default": _bad_table(h.random_meta(2))}])


def test_an_update_failing_at_the_first_layer_names_it(tmp_path):
    h = Harness([4], layers=2, validate=False, postmortem_dir=str(tmp_path))
    bad = attrs.evolve(h.random_meta(2), seq_lens=torch.tensor([9999, 3], dtype=torch.int32))
    with pytest.raises(
        UpdateFailed, match=r"^update of main/4 failed at layer 'layer0' \(task 0\): WorkspaceTooSmall: "
    ) as info:
        h.rt.update(4, {"default": bad})
    assert ".." not in str(info.value).split(" [post-mortem")[0]
    assert json.loads(Path(info.value.postmortem).read_text())["error"]["key"] == "4"


# --- resolution messages, records and capture details -------------------------------------------


def test_a_graph_without_attention_takes_any_metadata():
    rt = Runtime("sim", max_model_len=64)
    rt.capture(lambda: torch.zeros(2), key=2, require_attention=False)
    rt.update(2, {})
    rt.update(2, [{}])  # as a list too: it has no micro-batches to miss
    rt.replay(2)
    rt.synchronize()


def test_a_missing_layer_is_named_with_what_the_step_has():
    h = Harness([4], layers=2, groups={"layer0": "a", "layer1": "b"})
    meta = h.random_meta(2)
    others = {f"x{i}": meta for i in range(7)}
    with pytest.raises(
        MetadataError,
        match=r"^main/4: the step's metadata has no entry for layer 'layer1' nor for its KV-cache group 'b' "
        r"\(it has \['a', 'x0', 'x1', 'x2', 'x3', 'x4'\]\.\.\.\); pass metadata for every captured layer$",
    ):
        h.rt.update(4, {"a": meta, **others})
    with pytest.raises(
        MetadataError,
        match=r"^main/4: the step's metadata of micro-batch 0 has no entry for layer 'layer1' nor for its "
        r"KV-cache group 'b' \(it has \['a'\]\.\.\.\)",
    ):
        h.rt.update(4, [{"a": meta}])


def test_a_task_record_gives_tensors_only_as_tensors():
    h = Harness([4], layers=1)
    (task,) = h.rt.manager.entry("main", 4).tasks
    assert task.tensor("num_heads") is None and task.tensor("query") is not None


def test_every_task_of_a_graph_uses_its_one_shared_workspace():
    h = Harness([4, 8], layers=3, policy=StaticPolicy(), device_lengths=False)  # FIA with host lengths at 8
    for size in (4, 8):
        entry = h.rt.manager.entry("main", size)
        spaces = [t.tensor("workspace") for t in entry.tasks]
        assert all(w is not None for w in spaces), "captured with the graph's workspace, never a kernel's own"
        assert len({w.data_ptr() for w in spaces}) == 1
        assert spaces[0].numel() == entry.workspace_bytes
        assert spaces[0].dtype == torch.uint8, "sized in bytes: any other dtype multiplies the memory"


@pytest.mark.no_serving_check("a replay issued behind the runtime's back hangs the device, as on hardware")
def test_a_hang_names_the_event_of_the_layer_it_waits_for():
    h = Harness([2], layers=2)
    h.rt.entry(2).graph.replay()  # behind the runtime's back: only the device sees the hang
    with pytest.raises(GraphDeadlock, match=r"(?s)namespace 'main', key 2, layer 'layer0'.*\[main/2/layer0\]"):
        h.rt.synchronize()


def test_speculative_tokens_of_a_windowed_layer_see_no_later_key():
    """Each query token sees the window ending at its own position, never the next token's key."""
    h = Harness([4], layers=2, tokens_per_request=2, windows={"layer1": 10}, dtype=torch.float32)
    assert [t.spec.name for t in h.rt.manager.entry("main", 4).tasks] == ["fia", "fia"]
    for step in range(3):
        meta = h.random_meta(3)
        q = query_for(h, 4, step)
        h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_one_metadata_for_two_groups_refreshes_both_tables():
    """The fast path (one metadata, one kernel, one geometry) still copies into every buffer."""
    h = Harness([4], layers=2, groups={"layer0": "a", "layer1": "b"})
    for step in range(2):
        meta = h.random_meta(3)
        q = query_for(h, 4, step)
        h.check(h.step(4, {"a": meta, "b": meta}, q), q, dict.fromkeys(h.names, meta))


def test_query_start_loc_with_every_key_new_and_long_errors_shown_in_part():
    h = Harness([4], tokens_per_request=2, dtype=torch.float32)
    meta = h.random_meta(2)
    first = attrs.evolve(
        meta,
        seq_lens=torch.tensor([2, 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
    )
    q = query_for(h, 4, 0)
    out = h.step(4, {"default": first}, q)  # query tokens == key length: every key is new
    for li, n in enumerate(h.names):
        k, v = h.caches[n]
        ref = paged_attention_reference(q[0, :3], k, v, first.block_table, [2, 1], h.attn[n].scale, [2, 1])
        assert (out[0, li, :3].cpu().double() - ref).abs().max() < 1e-4
    h = Harness([8], layers=1, tokens_per_request=2, dtype=torch.float32)
    eight = h.random_meta(8, [20] * 8)
    bad = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 5], dtype=torch.int32)
    with pytest.raises(MetadataError, match=r"non-decreasing, got \[0, 1, 2, 3, 4, 5, 6, 7\]$"):
        h.rt.update(8, {"default": attrs.evolve(eight, query_start_loc=bad)})


# --- the pieces engines may build themselves ---------------------------------------------------


def _update_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("npugraph-update")}


def test_a_replay_updater_built_by_hand_validates_skips_and_stays_on_one_thread():
    """Engines that drive capture and update themselves get the Runtime's safe defaults:
    block ids checked, unchanged tasks skipped, one host thread."""
    h = Harness([4], layers=3, dtype=torch.float32)
    before = _update_threads()
    updater = ReplayUpdater(h.rt.manager)
    entry = h.rt.manager.entry("main", 4)
    bad = h.random_meta(2)
    bad.block_table[1, 0] = BLOCKS  # one past the cache
    with pytest.raises(MetadataError, match="block"):
        updater.update("main", 4, {"default": bad})
    meta = h.random_meta(3)
    for step in range(2):
        q = query_for(h, 4, step)
        h.query[:, :4].copy_(q)
        updater.step("main", 4, {"default": meta})
        # three tasks re-issued, or (FIA's lengths on the device) their one group written
        first = 1 if entry.lens_groups else 3
        assert updater.state(entry).last_reissued == (first if step == 0 else 0)
        h.rt.synchronize()
        h.check(entry.outputs, q, dict.fromkeys(h.names, meta))
    assert _update_threads() == before, "one update worker runs on the calling thread"


@pytest.mark.no_serving_check("graphs captured by hand, without the harness's static inputs")
def test_a_capture_manager_built_by_hand():
    """Its own defaults and arguments: namespace 'main', the policy given, no progress bar
    unless asked, and a model length of one is a model length."""
    device = load_device("sim")
    fixed = FixedPolicy("fia")
    assert CaptureManager(device, max_model_len=1, policy=fixed).policy is fixed
    assert CaptureManager(device, max_model_len=1).progress is False
    h = Harness([4], layers=1)
    manager = h.rt.manager
    manager.reset()
    meta = {
        "default": AttentionMetadata(seq_lens=torch.ones(4, dtype=torch.int32), block_table=h.tables["default"][0, :4])
    }
    t0 = time.perf_counter()
    manager.capture(h.forward, h.query[:, :4], metas=[meta], key=4)  # keyword arguments reach the callable
    took = time.perf_counter() - t0
    assert manager.keys("main") == [4]
    entry = manager.entry("main", 4)
    assert 0 < entry.capture_seconds <= took
    assert entry.pool == manager.pool == entry.graph.pool(), "every graph allocates from the manager's one pool"
    nested = manager.capture(lambda q, metas: {"out": [h.forward(q, metas)]}, h.query[:, :4], [meta], key=8, tokens=4)
    aliased = manager.entry("main", 8).outputs["out"][0]  # outputs keep their structure, tensors as aliases
    assert aliased.data_ptr() == nested["out"][0].data_ptr() and aliased.shape == nested["out"][0].shape
    with pytest.raises(CaptureFailed, match="made no attention call"):
        manager.capture(lambda: torch.zeros(2, device="cpu"), key=2)
    manager.capture(lambda: torch.zeros(2, device="cpu"), key=2, require_attention=False)
    plain = manager.entry("main", 2)
    assert (plain.batch, plain.workspace_bytes, plain.tasks) == (0, 0, ())
    assert plain.choice == KernelChoice(kernel="none", reason="no attention in this graph")

    def broken():
        raise ValueError("bad shape.")

    with pytest.raises(CaptureFailed, match=r"ValueError: bad shape\. Nothing was registered for this key\.$"):
        manager.capture(broken, key=1)


@pytest.mark.parametrize("progress", [True, False])
def test_a_progress_bar_only_when_asked(progress, capsys):
    h = Harness([4], layers=1, progress=progress)
    h.rt.manager.reset()
    h.capture([4, 2])
    err = capsys.readouterr().err
    assert ("capturing main" in err) == progress


@pytest.mark.parametrize("fused", [None, True, False])
def test_the_simulator_updates_through_the_four_in_one_only_on_request(fused, monkeypatch):
    """On hardware the 4-in-1 is the default (C++ without the GIL); the simulator's is the
    same Python calls, so by default it runs begin / op / end / record, as hand-written
    vllm-ascend code does."""
    real = sim._C._npu_fused_infer_attention_score_out_graph
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sim._C, "_npu_fused_infer_attention_score_out_graph", counted)
    h = Harness([4], layers=2, policy=FixedPolicy("fia"), fused_update=fused, dtype=torch.float32)
    meta = h.random_meta(3)
    q = query_for(h, 4, 0)
    h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
    assert len(calls) == (2 if fused else 0)


# --- the device-side block-id check ---------------------------------------------------------


def _first_bad_in_use(table: torch.Tensor, kv: list[int], block_size: int, num_blocks: int) -> tuple[int, int] | None:
    """The host oracle: the first (request, column), row by row, that a request reads and
    that holds an id outside [0, num_blocks)."""
    for i, n in enumerate(kv):
        for j in range(-(-n // block_size)):
            if not 0 <= int(table[i, j]) < num_blocks:
                return i, j
    return None


@settings(max_examples=60, deadline=None)
@given(
    kv=st.lists(st.integers(1, 64), min_size=1, max_size=6),
    bad=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7), st.sampled_from([-1, -7, 12, 99])), max_size=4),
    seed=st.integers(0, 2**31),
)
def test_the_device_block_id_check_finds_exactly_the_first_id_in_use_outside_the_cache(kv, bad, seed):
    """Against a host oracle: an id outside [0, num_blocks) counts only in the columns a
    request reads (ceil(len / block_size)); whatever lies beside them does not, and the
    first request and column reading one are named."""
    block_size, num_blocks, rows, cols = 8, 12, 8, 8
    table = torch.randint(0, num_blocks, (rows, cols), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    for i, j, v in bad:
        table[i, j] = v
    check = BlockIdCheck.on(torch.device("cpu"), cols)
    one_block = check.flag(table, [1] * rows, block_size, num_blocks)
    assert BadColumns.locate([check.flag(table, kv, block_size, num_blocks)]) == [
        _first_bad_in_use(table, kv, block_size, num_blocks)
    ]
    assert BadColumns.locate([one_block]) == [_first_bad_in_use(table, [1] * rows, block_size, num_blocks)]


def test_the_device_block_id_check_sends_nothing_from_the_host():
    """Four device ops on the table, whatever the lengths: no copy from the host (which
    would need page-locked memory not to wait for the stream, behind the previous replay),
    no host tensor, nothing kept from the step before."""
    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    check = BlockIdCheck.on(torch.device("cpu"), 16)
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[1, 2] = 40
    found = []
    for kv in ([9, 16], [10, 24], [10, 9], [3, 100]):
        ops.clear()
        with Ops():
            found.append(check.flag(table, kv, 8, 32))
        assert [op for op in ops if op not in ("slice", "alias")] == ["clamp", "ne", "where", "amax"], kv
    assert BadColumns.locate(found) == [None, (1, 2), None, (1, 2)]


@pytest.mark.parametrize(("length", "expected"), [(1, None), (8, None), (9, (0, 1)), (16, (0, 1)), (17, (0, 1))])
def test_a_request_reads_the_block_its_last_token_lies_in_and_none_after(length, expected):
    """Block size 8: a request of 8 tokens reads column 0 only; of 9 to 16, column 1 too
    (the other request reads four columns, so the check looks at all four in each row)."""
    table = torch.zeros(2, 4, dtype=torch.int32)
    table[0, 1] = -1
    found = BlockIdCheck.on(torch.device("cpu"), 4).flag(table, [length, 32], 8, 12)
    assert BadColumns.locate([found]) == [expected]


def test_checks_read_together_are_each_compared_with_their_own_cache():
    """Flags are read in one host read for every check since the last synchronize; each
    is compared with the cache of its own layer (KV-cache groups may differ in size)."""
    table = torch.full((2, 4), 20, dtype=torch.int32)
    small = BlockIdCheck.on(torch.device("cpu"), 4).flag(table, [8, 8], 8, 12)
    large = BlockIdCheck.on(torch.device("cpu"), 4).flag(table, [8, 8], 8, 40)
    negative = BlockIdCheck.on(torch.device("cpu"), 4).flag(table.neg(), [8, 1], 8, 40)
    beside = BlockIdCheck.on(torch.device("cpu"), 4).flag(table, [8, 8], 8, 21)  # 20 < 21: fine
    assert BadColumns.locate([small, large, negative, beside]) == [(0, 0), None, (0, 0), None]
    assert BadColumns.locate([]) == []


# lengths whose blocks in use (block size 8) repeat, change width, or change under the same width
_CHECK_KVS = ([3], [8], [9], [16, 3], [17, 3], [9, 3], [64, 1, 1], [1, 64], [57, 2, 2, 2])


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(_CHECK_KVS),
            st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7), st.sampled_from([-1, 12, 99])), max_size=3),
            st.integers(0, 2**31),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_one_check_over_a_sequence_of_steps_matches_the_oracle_at_each(steps):
    """One check over a sequence of steps (as the updater uses it), read together as at a
    synchronize: each step's finding matches the host oracle on that step's table."""
    block_size, num_blocks, rows, cols = 8, 12, 8, 8
    check = BlockIdCheck.on(torch.device("cpu"), cols)
    found, expected = [], []
    for kv, bad, seed in steps:
        gen = torch.Generator().manual_seed(seed)
        table = torch.randint(0, num_blocks, (rows, cols), dtype=torch.int32, generator=gen)
        for i, j, v in bad:
            table[i, j] = v
        found.append(check.flag(table, kv, block_size, num_blocks))
        expected.append(_first_bad_in_use(table, list(kv), block_size, num_blocks))
    assert BadColumns.locate(found) == expected


@settings(max_examples=12, deadline=None)
@given(
    start=st.lists(st.integers(1, MAX_LEN - 12), min_size=1, max_size=4),
    bad_step=st.integers(1, 10),
    bad_row=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_decode_steps_name_the_step_whose_table_holds_a_bad_id(start, bad_step, bad_row, seed):
    """Decode: each request grows by one token a step, so most steps reuse the check's
    limits and mask. A bad id in a block in use is named by its step, wherever that step
    falls; the good steps, before and after it, match the reference."""
    h = Harness([4], order="update-first", defer_block_check=True, seed=seed)
    base = h.random_meta(len(start), lens=[n + 10 for n in start])  # blocks for every step's length
    q = query_for(h, 4, 0)
    bad_row %= len(start)
    for step in range(1, 11):
        lens = [n + step for n in start]
        meta = attrs.evolve(base, seq_lens=torch.tensor(lens, dtype=torch.int32))
        if step != bad_step:
            h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
            continue
        table = base.block_table.clone()
        table[bad_row, (lens[bad_row] - 1) // BLOCK] = 10_000  # its last block in use
        h.rt.step(4, {"default": attrs.evolve(meta, block_table=table)}, inputs={"query": q})
        # the kernel read the bad block (the simulator faults where hardware reads garbage):
        # the replay fails, and the check names the step
        with pytest.raises(ReplayFailed, match=rf"check also failed: step {bad_step} of main/4 layer 'layer0': a"):
            h.rt.synchronize()


@settings(max_examples=10, deadline=None)
@given(adversarial=st.sampled_from([3, 8, 11]), bad_step=st.integers(2, 7), good_after=st.booleans())
def test_deferred_checks_queued_behind_device_work_name_their_step(adversarial, bad_step, good_after):
    """Adversarial scheduling defers the check's copy and ops behind queued work; the
    limits and mask reused from earlier steps are still read in order. No synchronize
    until the end: the step whose table was bad is named, and serving goes on."""
    sim.configure(adversarial_seed=adversarial)
    try:
        h = Harness([4], order="update-first", defer_block_check=True)
        base = h.random_meta(3, lens=[20, 40, 60])
        q = query_for(h, 4, 0)
        for step in range(1, 9):
            meta = attrs.evolve(base, seq_lens=torch.tensor([20 + step, 40 + step, 60 + step], dtype=torch.int32))
            if step == bad_step:
                table = base.block_table.clone()
                table[1, (40 + step - 1) // BLOCK] = -3  # request 1's last block in use
                h.rt.update(4, {"default": attrs.evolve(meta, block_table=table)})  # replaced before any replay
            else:
                h.rt.step(4, {"default": meta}, inputs={"query": q})
        with pytest.raises(MetadataError, match=rf"^step {bad_step} of main/4 layer 'layer0': a block id in use"):
            h.rt.synchronize()
        last = attrs.evolve(base, seq_lens=torch.tensor([30, 50, 70], dtype=torch.int32)) if good_after else base
        h.check(h.step(4, {"default": last}, q), q, dict.fromkeys(h.names, last))
    finally:
        sim.configure()


def _device_table(h: Harness, captured: bool) -> torch.Tensor:
    """A device-resident block table of the engine: the captured buffer itself (vLLM's
    persistent table), or another tensor of device memory (a kernel argument of a graph)."""
    if captured:
        return h.tables["default"][0]
    table = torch.zeros(4, MAX_LEN // BLOCK, dtype=torch.int32)
    g, s = sim.npu.NPUGraph(), sim.npu.Stream()
    with sim.npu.graph(g, stream=s):
        table.add_(0)  # device memory from now on
    return table


@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("order", ["update-first", "replay-first"])
def test_the_update_reads_the_table_the_engine_wrote_before_the_step(order, captured, manual):
    """The engine writes its device table on its stream (a non-blocking copy from pinned
    memory, queued behind earlier work) and then calls step(). The block-id check and the
    copy into the captured buffer must read what it wrote, not the table before: here the
    engine pads unused columns with -1, so a stale read flags a good step, and a stale
    copy runs the step on the previous step's blocks. ``manual``: replay() and update()
    called by hand, in the runtime's order. Adversarial scheduling runs whichever stream
    it likes first, so a missing order shows in some of the seeds."""
    for adversarial in range(16):
        _engine_writes_then_steps(adversarial, order, captured, manual)


def _engine_writes_then_steps(adversarial: int, order: str, captured: bool, manual: bool) -> None:
    sim.configure(adversarial_seed=adversarial)
    try:
        h = Harness([4], order=order)
        table = _device_table(h, captured)
        q = query_for(h, 4, 0)
        rng = random.Random(adversarial)
        blocks = rng.sample(range(BLOCKS), MAX_LEN // BLOCK)
        for step in range(1, 7):
            lens = [16 * step + 1, 8 * step + 1, 5]
            host = torch.full((4, MAX_LEN // BLOCK), -1, dtype=torch.int32)
            for i, n in enumerate(lens):
                used = -(-n // BLOCK)
                host[i, :used] = torch.tensor(rng.sample(blocks, used), dtype=torch.int32)
            table.copy_(sim.pin_memory(host), non_blocking=True)  # on the engine's (current) stream
            meta = AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table[:3])
            if not manual:
                out = h.rt.step(4, {"default": meta}, inputs={"query": q})
                continue
            h.rt.copy_inputs(h.rt.entry(4), {"query": q})
            if order == "replay-first":
                out = h.rt.replay(4)
                h.rt.update(4, {"default": meta})
            else:
                h.rt.update(4, {"default": meta})
                out = h.rt.replay(4)
        h.rt.synchronize()  # no good step is flagged
        h.check(out, q, dict.fromkeys(h.names, attrs.evolve(meta, block_table=host[:3].clone())))
    finally:
        sim.configure()


@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("order", ["update-first", "replay-first"])
def test_a_failure_while_checking_block_tables_leaves_the_runtime_serving(order, manual):
    """The device refuses an op of the block-id check (here: its reduction): the step fails
    with a typed error before any task is re-issued, a replay already queued for it is
    released, and the next good step is right, whichever half came first."""

    class RangeFails(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.amax.default:
                raise RuntimeError("the device refused amax")
            return func(*args, **(kwargs or {}))

    h = Harness([4], order=order)
    table = _device_table(h, captured=True)
    q = query_for(h, 4, 0)
    good = h.random_meta(3)
    table[:3].copy_(sim.pin_memory(good.block_table), non_blocking=True)
    meta = attrs.evolve(good, block_table=table[:3])
    with RangeFails(), pytest.raises(UpdateFailed, match=r"^update of main/4 failed at checking or copying block"):
        if not manual:
            h.rt.step(4, {"default": meta}, inputs={"query": q})
        elif order == "replay-first":
            h.rt.replay(4)
            h.rt.update(4, {"default": meta})
        else:
            h.rt.update(4, {"default": meta})
    h.rt.synchronize()
    h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, good))
