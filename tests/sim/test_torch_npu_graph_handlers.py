"""torch_npu's NPU-graph update machinery on the simulator: the op-handler registry
(``torch_npu.npu._npugraph_handlers``), the graph dispatch mode and ``NPUGraph.update``, as
torch_npu v26.1 has them (what SGLang, MindIE and lmdeploy replay through).

Restates what torch_npu's own ``test/npu/test_npugraph_handler.py`` and the auto-dispatch
cases of ``test_aclgraph_update.py`` check (those files, run as written, pass on the
simulator: docs/simulator.md), plus the semantics a user of ``update`` meets: the records,
keys an op does not have, lengths FIA was not given at capture, a replay no update
preceded, and SGLang's update from a worker thread beside the replay.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys

import pytest
import torch

import npusim as sim
from npusim import npu
from tests.helpers import equal_on_host

DEVICE = "npu"


@pytest.fixture
def registry():
    from npusim.surfaces.npugraph_handlers.npugraph_handler import _NPU_GRAPH_OP_HANDLERS

    saved = dict(_NPU_GRAPH_OP_HANDLERS)
    yield _NPU_GRAPH_OP_HANDLERS
    _NPU_GRAPH_OP_HANDLERS.clear()
    _NPU_GRAPH_OP_HANDLERS.update(saved)


def test_the_registry_is_at_torch_npus_paths_with_its_built_in_handlers(torch_npu, registry):
    from torch_npu.npu import NpuGraphOpHandler, register_npu_graph_handler
    from torch_npu.npu._npugraph_handlers.npugraph_handler import _NPU_GRAPH_OP_HANDLERS

    assert _NPU_GRAPH_OP_HANDLERS is registry and torch.npu.register_npu_graph_handler is register_npu_graph_handler
    for name in (
        "npu_fused_infer_attention_score",
        "npu_fused_infer_attention_score.default",
        "npu_fused_infer_attention_score.out",
        "npu_fused_infer_attention_score_v2",
        "npu_fused_infer_attention_score_v2.default",
        "npu_fused_infer_attention_score_v2.out",
        "_npu_paged_attention.default",
        "npu_multi_head_latent_attention.out",
    ):
        assert name in registry, name
    for name in ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score.out"):
        specs = registry[name].get_update_specs(name)
        assert ("arg", 5, "actual_seq_lengths") in specs and ("arg", 6, "actual_seq_lengths_kv") in specs
    specs = registry["npu_fused_infer_attention_score_v2.default"].get_update_specs(
        "npu_fused_infer_attention_score_v2.default"
    )
    assert ("arg", 7, "actual_seq_qlen") in specs and ("arg", 8, "actual_seq_kvlen") in specs

    @register_npu_graph_handler(["test_op_a", "test_op_a.default"])
    class _H(NpuGraphOpHandler):
        pass

    assert registry["test_op_a"] is _H and registry["test_op_a.default"] is _H


def test_registering_over_a_handler_says_so(torch_npu, registry, caplog):
    from torch_npu.npu import NpuGraphOpHandler, register_npu_graph_handler

    with caplog.at_level(logging.WARNING):

        @register_npu_graph_handler("_npu_paged_attention.default")
        class _Mine(NpuGraphOpHandler):
            pass

    assert "is being overridden: _SimpleGraphHandler -> _Mine" in caplog.text
    assert registry["_npu_paged_attention.default"] is _Mine


def test_every_graph_shares_one_update_stream():
    g1, g2 = npu.NPUGraph(), npu.NPUGraph()
    assert g1.graph_dispatch_mode.update_stream is g2.graph_dispatch_mode.update_stream
    assert g1.graph_dispatch_mode.graph_dispatch_records == [] and not g1.auto_dispatch_capture


def _bnsd(s_kv=128):
    q = torch.randn(1, 8, 1, 64, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 8, s_kv, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn(1, 8, s_kv, 64, dtype=torch.float16, device=DEVICE)
    return q, k, v


FIA_ARGS = dict(num_heads=8, input_layout="BNSD", scale=0.125, softmax_lse_flag=False)


def test_fia_default_is_captured_as_out_and_updated_through_its_kwargs():
    q, k, v = _bnsd()
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        out = sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[7], **FIA_ARGS)
    assert isinstance(out, list) and len(out) == 2, "the caller gets the handler's out list"
    (record,) = g.graph_dispatch_mode.graph_dispatch_records
    assert record.op_cache_entry is sim.npu_fused_infer_attention_score.out
    assert len(record.args) == 3 and set(record.kwargs) >= {"workspace", "out", "actual_seq_lengths_kv"}
    # the records hold non-owning aliases of device memory; host values are copies
    assert record.args[0] is not q and record.args[0].data_ptr() == q.data_ptr()
    assert record.kwargs["actual_seq_lengths_kv"] == [7]
    for lens in ([100], [3], [128]):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": lens}])
        g.replay()
        npu.synchronize()
        want = sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **FIA_ARGS)[0]
        assert equal_on_host(out[0], want), lens
    assert record.kwargs["actual_seq_lengths_kv"] == [128], "an update stays in the record"


def test_a_length_fia_was_not_given_at_capture_cannot_be_updated():
    """FIA's lengths are keyword-only: a record holds one only if the capture passed it, and
    the ("arg", 6) spec never matches; the update re-issues the op as captured."""
    q, k, v = _bnsd(16)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        out = sim.npu_fused_infer_attention_score(q, k, v, **FIA_ARGS)
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [3]}])
    g.replay()
    npu.synchronize()
    full = sim.npu_fused_infer_attention_score(q, k, v, **FIA_ARGS)[0]
    short = sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[3], **FIA_ARGS)[0]
    assert equal_on_host(out[0], full) and not equal_on_host(out[0], short)


def test_fia_v2_ignores_a_key_it_does_not_have_and_takes_its_own():
    q, k, v = _bnsd(32)
    args = dict(num_query_heads=8, input_layout="BNSD", softmax_scale=0.125)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        out = sim.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_kvlen=[32], **args)
    g.update(cpu_update_input=[{"actual_seq_lengths": [5]}])  # v1's name: ignored, silently
    g.replay()
    npu.synchronize()
    assert equal_on_host(out[0], sim.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_kvlen=[32], **args)[0])
    g.update(cpu_update_input=[{"actual_seq_kvlen": [5]}])
    g.replay()
    npu.synchronize()
    assert equal_on_host(out[0], sim.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_kvlen=[5], **args)[0])


def test_update_needs_auto_dispatch_capture_and_one_dict_or_one_per_op():
    q, k, v = _bnsd(8)
    g = npu.NPUGraph()
    with npu.graph(g):
        sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[8], **FIA_ARGS)
    with pytest.raises(RuntimeError, match="does not support update,Try to capture by setting auto_dispatch_capture"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [2]}])
    g2 = npu.NPUGraph()
    with npu.graph(g2, auto_dispatch_capture=True):
        for _ in range(2):
            sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[8], **FIA_ARGS)
    with pytest.raises(
        RuntimeError, match="there are 2 operators that need to be updated by capture, and there are only 3"
    ):
        g2.update(cpu_update_input=[{}, {}, {}])


def test_a_replay_no_update_preceded_waits_for_ever_and_the_simulator_says_so():
    q, k, v = _bnsd(8)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[8], **FIA_ARGS)
    g.replay()
    with pytest.raises(sim.DeadlockError):
        npu.synchronize()


def test_a_handler_of_ones_own_replaces_the_built_in_and_its_specs_drive_the_update(torch_npu, registry):
    from torch_npu.npu import NpuGraphOpHandler, register_npu_graph_handler

    @register_npu_graph_handler("_npu_paged_attention.default")
    class _SeqLens(NpuGraphOpHandler):
        UPDATE_SPECS = {"_npu_paged_attention.default": [("arg", 7, "seq_lens")]}

    q = torch.randn(2, 4, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.randn(8, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    pa = dict(query=q, key_cache=cache, value_cache=cache, num_kv_heads=2, num_heads=4, scale_value=0.125)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        torch_npu._npu_paged_attention(
            **pa, block_table=table, context_lens=torch.tensor([1, 1], dtype=torch.int32), out=out
        )
    (record,) = g.graph_dispatch_mode.graph_dispatch_records
    assert len(record.args) == 9, "PA's arguments are positional: context_lens is args[7]"
    lens = torch.tensor([20, 9], dtype=torch.int32)
    g.update(cpu_update_input=[{"seq_lens": lens}])
    g.replay()
    npu.synchronize()
    want = torch.empty_like(q)
    torch_npu._npu_paged_attention(**pa, block_table=table, context_lens=lens, out=want)
    assert equal_on_host(out, want)


def test_sglangs_update_on_a_worker_thread_beside_the_replay():
    """SGLang 0.5.23's replay_with_input_update: the update runs on a one-thread executor
    while the calling thread replays; the replay waits on the device for the update's
    events; the next update waits for the previous replay's fence."""
    q, k, v = _bnsd(64)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        out = sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[64], **FIA_ARGS)
    fence = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for lens in ([10], [64], [33]):
            if fence is not None:
                fence.synchronize()
            done = pool.submit(g.update, cpu_update_input=[{"actual_seq_lengths_kv": lens}])
            g.replay()
            done.result()
            fence = npu.Event()
            fence.record()
            npu.synchronize()
            want = sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **FIA_ARGS)[0]
            assert equal_on_host(out[0], want), lens


def test_the_dispatch_mode_leaves_unhandled_ops_to_the_capture():
    x = torch.zeros(4, device=DEVICE)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        y = x + 1
    assert g.graph_dispatch_mode.graph_dispatch_records == []
    g.replay()
    npu.synchronize()
    assert y.cpu().tolist() == [1.0] * 4
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is not None


def test_a_failed_update_leaves_the_shared_update_stream_updating_for_every_graph():
    """torch_npu's update_capture_record has no cleanup: an op that fails inside an update
    session leaves the one update stream (shared by every NPUGraph) inside it, so every
    later update of every graph is refused. What npugraph's recovery exists for."""
    q, k, v = _bnsd(64)
    graphs = []
    for _ in range(2):
        g = npu.NPUGraph()
        with npu.graph(g, auto_dispatch_capture=True):
            sim.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[64], **FIA_ARGS)
        graphs.append(g)
    stream = graphs[0].graph_dispatch_mode.update_stream
    try:
        with pytest.raises(ValueError, match="actual_seq_lengths_kv"):
            graphs[0].update(cpu_update_input=[{"actual_seq_lengths_kv": [1000]}])
        for g in graphs:
            with pytest.raises(RuntimeError, match="is already updating"):
                g.update(cpu_update_input=[{"actual_seq_lengths_kv": [10]}])
    finally:  # what a caller must know to do: finish the session with a good op (the record kept the bad length)
        record = graphs[0].graph_dispatch_mode.graph_dispatch_records[0]
        assert record.kwargs["actual_seq_lengths_kv"] == [1000]
        record.kwargs["actual_seq_lengths_kv"] = [64]
        with npu.stream(stream):
            record.op_cache_entry(*record.args, **record.kwargs)
            npu.graph_task_update_end(stream)
            record.event.record(stream)
    graphs[1].update(cpu_update_input=[{"actual_seq_lengths_kv": [10]}])
    graphs[1].replay()
    npu.synchronize()
