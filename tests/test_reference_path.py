"""npugraph's runtime path (padding, conversion, update, op declarations) against a reference
that runs none of it.

The test owns the KV caches (it writes them itself, so it knows every request's history)
and builds each step's lengths and block tables; the reference
(:func:`npugraph.reference.paged_attention_reference`) gathers each real request's keys
position by position from those and computes attention in float64.  Replayed outputs
are compared with it, per layer, on every step, and padding rows must be zeros.
"""

from __future__ import annotations

import pytest
import torch

import npusim as sim
from npugraph import AttentionMetadata
from npugraph.errors import MetadataError, UpdateFailed
from npugraph.policy import FixedPolicy, StaticPolicy
from npugraph.reference import paged_attention_reference
from npusim import kernels
from tests.helpers import HEAD, HEADS, KV_HEADS, MAX_LEN, TOL, Harness, query_for


@pytest.mark.parametrize("order", ["update-first", "replay-first"])
@pytest.mark.parametrize("kernel", ["pa", "fia"])
def test_decode_against_the_reference(kernel, order):
    h = Harness([4, 8], policy=FixedPolicy(kernel), order=order)
    for step in range(12):
        size = 8 if step % 3 else 4
        meta = h.random_meta(h.rng.randint(0, size))
        q = query_for(h, size, step)
        out = h.step(size, {"default": meta}, q)
        h.check(out, q, dict.fromkeys(h.names, meta))


def test_the_fused_update_path_against_the_reference():
    h = Harness([8], policy=FixedPolicy("fia"), fused_update=True)
    assert h.rt.updater.plan(h.rt.manager.entry("main", 8)).tasks[0].fused
    for step in range(6):
        meta = h.random_meta(h.rng.randint(1, 8))
        q = query_for(h, 8, step)
        h.check(h.step(8, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_adversarial_scheduling_against_the_reference():
    sim.configure(adversarial_seed=5)
    h = Harness([4, 8], order="replay-first")
    for step in range(8):
        size = (4, 8)[step % 2]
        meta = h.random_meta(h.rng.randint(1, size))
        q = query_for(h, size, step)
        h.check(h.step(size, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_speculative_steps_against_the_reference():
    """Two tokens per request, causal; padding requests take the spare tokens, never a real one."""
    h = Harness([4], tokens_per_request=2, dtype=torch.float32)
    assert h.rt.manager.entry("main", 4).choice.kernel == "fia_sink"  # causal (sparse_mode=3), lengths on the device
    for step, r in enumerate([4, 3, 1, 2, 4]):
        meta = h.random_meta(r)
        q = query_for(h, 4, step)
        h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_a_short_last_request_is_not_padded_into_a_shifted_causal_window():
    """One request, 2 tokens per request captured, 1 real token: refused, never attention over 19 keys."""
    h = Harness([1], tokens_per_request=2, dtype=torch.float32)
    meta = AttentionMetadata(
        seq_lens=torch.tensor([20], dtype=torch.int32),
        block_table=h.random_meta(1, [20]).block_table,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
    )
    with pytest.raises(
        MetadataError, match=r"all 1 captured request rows are real but the step has 1 of 2 query tokens"
    ):
        h.rt.update(1, {"default": meta})


def test_an_empty_step_gives_zeros_on_both_kernels():
    for kernel in ("pa", "fia"):
        h = Harness([4], policy=FixedPolicy(kernel))
        empty = h.random_meta(0)
        q = query_for(h, 4, 0)
        out = h.step(4, {"default": empty}, q)
        assert not out.any(), kernel
        meta = h.random_meta(3)  # and the next step is right again
        h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_per_layer_metadata_that_differs_between_layers():
    """Keyed by layer name, each layer gets its own lengths (sharing one table), never another's
    (FIA updated per layer: a tiling-sink graph takes one set of lengths per KV-cache group)."""
    h = Harness([8], layers=3, policy=StaticPolicy(), device_lengths=False)
    for step in range(4):
        base = h.random_meta(6, [MAX_LEN] * 6)
        metas = {}
        for i, n in enumerate(h.names):
            lens = torch.tensor([h.rng.randint(1, MAX_LEN) for _ in range(6)], dtype=torch.int32)
            metas[n] = AttentionMetadata(seq_lens=lens, block_table=base.block_table)
        metas_in = dict(metas)
        metas_in["default"] = h.random_meta(6)  # a group entry that must lose to the layer names
        q = query_for(h, 8, step)
        h.check(h.step(8, metas_in, q), q, metas)
    doc = h.rt.manifest()
    (key,) = doc["namespaces"]["main"]["keys"]
    for task, n in zip(key["tasks"], h.names):
        host = task["last_update"]["host"]
        assert host["actual_seq_lengths_kv"][:6] == metas[n].seq_lens.tolist(), (
            "the manifest shows each layer's own lengths"
        )


def test_layers_with_other_block_tables_on_one_buffer_are_refused():
    h = Harness([8], layers=2)
    a, b = h.random_meta(4), h.random_meta(4)
    with pytest.raises(
        MetadataError, match=r"layer 'layer1': its metadata has another block table than layer 'layer0'"
    ):
        h.rt.update(8, {"layer0": a, "layer1": b})


def test_several_kv_cache_groups():
    groups = {"layer0": "window", "layer1": "global", "layer2": "window"}
    h = Harness([4, 8], layers=3, groups=groups)
    # FIA's lengths on the device: one length buffer and plan per group (the first capture's
    # arena held one: the capture ran again with room for two)
    assert [g.slot for g in h.rt.entry(8).lens_groups] == ["window", "global"]
    for step in range(6):
        size = 8 if step % 2 else 4
        r = h.rng.randint(1, size)
        by_group = {"window": h.random_meta(r, [h.rng.randint(1, 32) for _ in range(r)]), "global": h.random_meta(r)}
        q = query_for(h, size, step)
        h.check(h.step(size, by_group, q), q, {n: by_group[g] for n, g in groups.items()})


@pytest.mark.parametrize("size", [4, 8])  # PA; FIA with its lengths on the device
def test_micro_batches_each_from_their_own_metadata(size):
    groups = {"layer0": "a", "layer1": "b"}
    h = Harness([size], layers=2, groups=groups, ubatches=2)
    if size == 8:  # a length buffer and plan per group and micro-batch
        assert [g.slot for g in h.rt.entry(8).lens_groups] == ["a", "b", "a#ubatch1", "b#ubatch1"]
    for step in range(4):
        per = []
        for _ in range(2):
            r = h.rng.randint(1, size)
            per.append({"a": h.random_meta(r), "b": h.random_meta(r)})
        q = query_for(h, size, step)
        out = h.step(size, per, q)
        for u in range(2):
            h.check(out, q, {n: per[u][g] for n, g in groups.items()}, ubatch=u)


def test_unchanged_lengths_still_record_events_and_stay_right():
    h = Harness([4])
    meta = h.random_meta(3)
    for step in range(4):  # the same lengths every step: tasks are skipped, events recorded
        q = query_for(h, 4, step)
        h.check(h.step(4, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
    assert h.rt.updater.state(h.rt.manager.entry("main", 4)).last_reissued == 0


def test_uneven_spare_tokens_go_to_padding_requests_only():
    """Real requests of 1 and 2 tokens in a 4 x 2-token graph: 5 spare tokens over 2 padding rows."""
    h = Harness([4], tokens_per_request=2, dtype=torch.float32)
    for step in range(3):
        base = h.random_meta(2)
        meta = AttentionMetadata(
            seq_lens=base.seq_lens,
            block_table=base.block_table,
            query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        )
        q = query_for(h, 4, step)
        out = h.step(4, {"default": meta}, q)
        for li, n in enumerate(h.names):
            k, v = h.caches[n]
            ref = paged_attention_reference(
                q[0, :3], k, v, meta.block_table, meta.seq_lens.tolist(), h.attn[n].scale, [1, 2]
            )
            assert (out[0, li, :3].cpu().double() - ref).abs().max() < TOL[h.dtype]
            assert not out[0, li, 3:].any(), "the 5 spare tokens are padding: zeros"


@pytest.mark.parametrize(("kernel", "fused"), [("pa", False), ("fia", True), ("fia", False)])
def test_one_updater_against_the_reference_re_issues_only_changed_tasks(kernel, fused):
    h = Harness([4, 8], layers=6, policy=FixedPolicy(kernel), fused_update=fused)
    for step in range(10):
        size = 8 if step % 2 else 4
        meta = h.random_meta(h.rng.randint(1, size))
        q = query_for(h, size, step)
        h.check(h.step(size, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
        state = h.rt.graph_state(size)
        assert state.last_reissued == 6, "every task is re-issued and counted"
        h.check(h.step(size, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
        assert state.last_reissued == 0, "unchanged lengths: no task is re-issued"


def test_updates_under_adversarial_scheduling_against_the_reference():
    sim.configure(adversarial_seed=11)
    h = Harness([8], layers=6, fused_update=True, order="replay-first")
    for step in range(8):
        meta = h.random_meta(h.rng.randint(1, 8))
        q = query_for(h, 8, step)
        h.check(h.step(8, {"default": meta}, q), q, dict.fromkeys(h.names, meta))


def test_a_failure_part_way_names_its_layer_and_the_next_step_is_right():
    h = Harness([8], layers=4, policy=FixedPolicy("fia"), validate=False)
    good = h.random_meta(3)
    bad = AttentionMetadata(seq_lens=torch.full((3,), 10**6, dtype=torch.int32), block_table=good.block_table)
    with pytest.raises(UpdateFailed, match=r"failed at layer 'layer1' \(task 1\)"):
        h.rt.update(8, {"layer0": good, "layer1": bad, "layer2": good, "layer3": bad})
    q = query_for(h, 8, 0)
    h.check(h.step(8, {"default": good}, q), q, dict.fromkeys(h.names, good))


def test_workspaces_cover_every_length_by_the_kernels_own_model():
    """The shared workspace, checked against the simulator's workspace model directly."""
    h = Harness([8], policy=FixedPolicy("fia"))
    entry = h.rt.manager.entry("main", 8)
    assert entry.workspace_bytes == kernels.fia_workspace_bytes(8, HEADS, HEAD, MAX_LEN), (
        "FIA: the maximum at max_model_len"
    )
    h = Harness([4], policy=FixedPolicy("pa"))
    entry = h.rt.manager.entry("main", 4)
    need = max(kernels.pa_workspace_bytes(4, HEADS, KV_HEADS, HEAD, length) for length in range(0, MAX_LEN + 1))
    assert entry.workspace_bytes >= need, "PA: every length up to max_model_len (its model is not monotonic)"


@pytest.mark.parametrize("order", ["replay-first", "update-first"])
@pytest.mark.parametrize("adversarial", [None, 5])
@pytest.mark.parametrize("kernel", ["pa", "fia"])
def test_event_groups_against_the_reference(order, adversarial, kernel):
    """Runtime(event_group=3): the graph waits once per group and the update records once
    per group (the last task alone), so a step records fewer events; results unchanged."""
    sim.configure(adversarial_seed=adversarial)
    h = Harness([4, 8], layers=7, order=order, event_group=3, policy=FixedPolicy(kernel), fused_update=True)
    tasks = h.rt.entry(8).tasks
    assert [(t.waits, t.records) for t in tasks] == [
        (True, False),
        (False, False),
        (False, True),
        (True, False),
        (False, False),
        (False, True),
        (True, True),
    ]
    assert len({id(t.event) for t in tasks}) == 3, "one ExternalEvent per group"
    counters = sim.counters()
    for step in range(8):
        size = 8 if step % 2 else 4
        meta = h.random_meta(h.rng.randint(1, size))
        q = query_for(h, size, step)
        before = counters["event_record"]
        h.check(h.step(size, {"default": meta}, q), q, dict.fromkeys(h.names, meta))
        assert counters["event_record"] - before == 3, "one record per group"


def test_event_groups_count_a_namespace_first_and_fall_back_for_another_task_count():
    calls = []
    h = Harness([8], layers=5, event_group=2, capture=False, device_lengths=False)  # FIA updated per layer
    real = h.forward

    def counted(query, metas):
        calls.append(1)
        return real(query, metas)

    h.forward = counted
    h.capture([8])
    assert len(calls) == 2, "the first capture of a namespace counts its tasks, then captures grouped"
    assert [t.records for t in h.rt.entry(8).tasks] == [False, True, False, True, True]
    h.names = h.names[:3]  # a graph of the namespace with fewer attention layers
    with pytest.warns(UserWarning, match=r"3 attention calls, but the first graph of namespace 'main' had 5"):
        h.capture([4])
    assert len(calls) == 4, "its grouping would not fit: captured again with one event per task"
    assert all(t.waits and t.records for t in h.rt.entry(4).tasks)
    meta = h.random_meta(3)
    q = query_for(h, 4, 0)
    out = h.step(4, {"default": meta}, q)
    h.check(out[:, :3], q, dict.fromkeys(h.names, meta))


@pytest.mark.parametrize("order", ["update-first", "replay-first"])
@pytest.mark.parametrize("seed", [2, 7, 13])
def test_steps_chained_without_a_synchronize_against_the_reference(order, seed):
    """Steps of two graphs of one pool issued back to back, a new host block table each,
    every output copied out of the pool before the next step; one synchronize at the end.
    The updater's table copies, the input copies and the output clones are device work
    in stream order, and the two graphs' outputs share memory."""
    sim.configure(adversarial_seed=seed)
    h = Harness([4, 8], layers=3, order=order)
    a, b = h.rt.entry(4), h.rt.entry(8)
    assert a.graph.pool() == b.graph.pool(), "one pool: the sizes' outputs may share memory"
    kept = []
    for step in range(6):
        size = (8, 4)[step % 2]
        meta = h.random_meta(h.rng.randint(1, size - 1))
        q = query_for(h, size, step)
        out = h.rt.step(size, {"default": meta}, inputs={"query": q})
        kept.append((out.clone(), q, meta))
    h.rt.synchronize()
    for out, q, meta in kept:
        h.check(out, q, dict.fromkeys(h.names, meta))
