"""Runtime behaviour: errors, atomicity, ordering, call counts, references."""

from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref
from typing import NamedTuple
from unittest import mock

import pytest
import torch

import npusim as sim
from npugraph import AttentionMetadata, Runtime
from npugraph.errors import (
    CaptureFailed,
    GraphDeadlock,
    MetadataError,
    NotReplayableError,
    UnknownKeyError,
    UpdateFailed,
)
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.replay import StepPhase
from npugraph.replay import prepare as prepare_mod

from .helpers import build, run


def _batch(cfg, size, seed=0, steps=3):
    wl = Workload(cfg, [size], seed=seed, max_batch=size)
    b = None
    for b in wl.steps(steps):
        pass
    return b


def _inputs(b):
    return {"input_ids": b.input_ids, "positions": b.positions, "slot_mapping": b.slot_mapping}


def test_uncaptured_key_lists_the_captured_keys():
    cfg, rt, _, eng = build(sizes=[2, 8])
    with pytest.raises(
        UnknownKeyError, match=r"no graph captured for key 4 in namespace 'main'; captured keys: \[2, 8\]"
    ):
        rt.replay(4)


def test_uncaptured_key_runs_the_eager_fallback_when_configured():
    cfg, rt, model, eng = build(sizes=[2, 8])
    b = _batch(cfg, 4)
    seen = []

    def fallback(key, metadata, inputs):
        seen.append(key)
        dev = rt.device.memory  # an engine's fallback runs the model on its device buffers
        ids, pos, slots = (inputs[k].to(dev) for k in ("input_ids", "positions", "slot_mapping"))
        return model(ids, pos, slots, b.padded_meta)

    rt.eager_fallback = fallback
    out = rt.step(4, {"default": b.meta}, inputs=_inputs(b))
    assert seen == [4] and out.shape[0] == 4
    b2 = _batch(cfg, 2)
    ref = eng.eager(b2).clone()
    assert torch.equal(eng.step(b2), ref), "captured keys still replay, not through the fallback"
    assert seen == [4]


def test_missing_layer_is_named():
    cfg, rt, _, eng = build(sizes=[4], layers=3)
    b = _batch(cfg, 4)
    meta = {f"main.layers.{i}.attn": b.meta for i in (0, 2)}
    with pytest.raises(
        MetadataError, match=r"no entry for layer 'main.layers.1.attn' nor for its KV-cache group 'default'"
    ):
        rt.update(4, meta)
    with pytest.raises(NotReplayableError, match=r"main/4 is not replayable"):
        rt.replay(4)


def test_metadata_resolved_by_layer_name_not_order():
    """Each layer gets other lengths; the mapping lists them out of capture order."""
    cfg, rt, model, eng = build(sizes=[4], layers=3)
    b = _batch(cfg, 4)
    per_layer = {}
    for i in (2, 0, 1):  # not capture order
        lens = (b.meta.seq_lens - i).clamp(min=1)
        per_layer[f"main.layers.{i}.attn"] = AttentionMetadata(seq_lens=lens, block_table=b.meta.block_table)
    out = rt.step(4, per_layer, inputs=_inputs(b))
    rt.synchronize()
    ref = _eager_per_layer(model, b, per_layer)
    assert torch.equal(out[: b.num_reqs], ref)
    same = rt.step(4, {"default": b.meta}, inputs=_inputs(b))
    rt.synchronize()
    assert not torch.equal(same[: b.num_reqs], ref), "the per-layer lengths made a difference"


def _eager_per_layer(model, b, per_layer):
    """The decoder run eagerly with each layer's own (padded) metadata."""
    size = b.size
    padded = {}
    for name, m in per_layer.items():
        lens = torch.zeros(size, dtype=torch.int32)
        lens[: m.num_reqs] = m.seq_lens
        padded[name] = AttentionMetadata(seq_lens=lens, block_table=b.padded_meta.block_table)
    dev = model.embed.weight.device
    ids, pos, slots = b.input_ids.to(dev), b.positions.to(dev), b.slot_mapping.to(dev)
    x = model.embed(ids)
    cos, sin = model.cos[pos], model.sin[pos]
    with torch.no_grad():
        for layer in model.layers:
            x = layer(x, cos, sin, slots, padded[layer.attn.layer_name])
        out = model.lm_head(model.norm(x)).float()
    rt = model.layers[0].attn.runtime
    rt.synchronize()
    return out[: b.num_reqs]


def test_lengths_over_max_model_len_and_bad_block_ids_are_refused():
    cfg, rt, _, eng = build(sizes=[4])
    b = _batch(cfg, 4)
    too_long = AttentionMetadata(
        seq_lens=torch.tensor([cfg.max_model_len + 1], dtype=torch.int32), block_table=b.meta.block_table[:1]
    )
    with pytest.raises(
        MetadataError, match=r"main/4 layer 'main.layers.0.attn': seq_lens\[0\] = 257 exceeds max_model_len=256"
    ):
        rt.update(4, {"default": too_long})
    bt = b.meta.block_table.clone()
    bt[0, 0] = cfg.num_blocks + 5
    with pytest.raises(
        MetadataError, match=r"block_table\[0, 0\] = 165 is not a block id of the KV cache \(0 <= id < 160\)"
    ):
        rt.update(4, {"default": AttentionMetadata(seq_lens=b.meta.seq_lens, block_table=bt)})
    too_many = AttentionMetadata(
        seq_lens=torch.ones(5, dtype=torch.int32), block_table=torch.ones(5, 16, dtype=torch.int32)
    )
    with pytest.raises(MetadataError, match="5 requests do not fit the captured batch of 4"):
        rt.update(4, {"default": too_many})
    # the runtime stays usable
    ref = eng.eager(b).clone()
    assert torch.equal(eng.step(b), ref)


class _FailsWhileCapturing(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if sim.npu.is_current_stream_capturing():
            raise RuntimeError("boom")
        return self.inner(x)


def test_exception_during_capture_registers_nothing():
    cfg = DecoderConfig(layers=3, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [2])
    layer = model.layers[1]
    inner = layer.o
    layer.o = _FailsWhileCapturing(inner)
    # named where it was raised (the o-projection after layer 1's attention), and by the last
    # attention layer recorded before it
    with pytest.raises(
        CaptureFailed,
        match=r"capture of main/2 failed after layer 'main.layers.1.attn' \(the last attention call recorded\) "
        r"at .*test_runtime.py:\d+ in forward: RuntimeError: boom",
    ):
        eng.capture()
    assert rt.manager.keys() == []
    assert not sim.npu.is_current_stream_capturing()
    layer.o = inner
    eng.capture()  # the same key captures fine afterwards
    assert rt.manager.keys() == [2]


def test_failed_capture_names_key_and_layer():
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [2])
    model.layers[1].attn.num_kv_heads = 3  # wrong head count: the kernel refuses it
    with pytest.raises(CaptureFailed, match=r"capture of main/2 failed in layer 'main.layers.1.attn' at ") as info:
        eng.capture()
    assert "num_kv_heads" in str(info.value) and "Nothing was registered" in str(info.value)
    assert rt.manager.keys() == []


def test_half_way_update_failure_blocks_replay_until_a_full_update():
    cfg, rt, _, eng = build(sizes=[4], layers=4, validate=False)
    b = _batch(cfg, 4)
    ref = eng.eager(b).clone()
    bad = AttentionMetadata(seq_lens=torch.full((4,), 9999, dtype=torch.int32), block_table=b.meta.block_table)
    meta = {f"main.layers.{i}.attn": (b.meta if i < 2 else bad) for i in range(4)}
    with pytest.raises(
        UpdateFailed,
        # the device takes lengths past the table at update (it reads them when the kernel
        # runs); the simulator's workspace check for them is what fails, at layer 2
        match=r"update of main/4 failed at layer 'main.layers.2.attn' \(task 2\): WorkspaceTooSmall: .*context_lens",
    ):
        rt.update(4, meta)
    with pytest.raises(NotReplayableError, match="main/4 is not replayable"):
        rt.replay(4)
    assert torch.equal(eng.step(b), ref), "a complete update makes it replayable again"


def test_a_replay_waiting_for_an_update_that_never_comes_is_released_and_reported():
    _, rt, _, _ = build(sizes=[2], layers=2, order="replay-first")
    rt.replay(2)  # replay-first, and the update never comes
    with pytest.raises(GraphDeadlock, match=r"the replay of main/2 \(first layer 'main.layers.0.attn'\) waited"):
        rt.synchronize()  # the simulator would raise DeadlockError if anything were left blocked
    assert rt.graph_state(2).phase is StepPhase.IDLE, "released: nothing waits any more"
    assert not rt.entry(2).outputs.isnan().any()
    rt.synchronize()


@pytest.mark.no_serving_check("a replay issued behind the runtime's back hangs the device, as on hardware")
def test_missing_event_record_is_a_deadlock_naming_namespace_key_and_layer():
    _, rt, _, _ = build(sizes=[2], layers=2)
    rt.entry(2).graph.replay()  # behind the runtime's back: only the device sees the hang
    with pytest.raises(GraphDeadlock, match=r"namespace 'main', key 2, layer 'main.layers.0.attn'"):
        rt.synchronize()


def test_steady_state_device_calls_per_layer():
    cfg, rt, _, eng = build(sizes=[4, 8], layers=3)
    wl = Workload(cfg, [4, 8], seed=2)
    steps = list(wl.steps(12))
    for b in steps[:2]:
        eng.step(b)
    counters = sim.counters()
    for b in steps[2:]:
        entry = rt.manager.entry("main", b.size)
        before = dict(counters)
        rt.step(b.size, {"default": b.meta}, inputs=_inputs(b))
        delta = {k: counters[k] - before.get(k, 0) for k in counters}
        n = len(entry.tasks)
        op = "op:_npu_paged_attention" if entry.choice.kernel == "pa" else "op:npu_fused_infer_attention_score"
        assert delta.get("update_begin") == n and delta.get("update_end") == n
        assert delta.get(op) == n and delta.get("event_record") == n
        assert delta.get("workspace_query", 0) == 0, "no workspace query per step"
        assert delta.get("synchronize", 0) == 0, "no host synchronize per step"
        assert delta.get("replay") == 1
        rt.synchronize()


def test_unchanged_lengths_skip_the_reissue_but_record_events():
    cfg, rt, _, eng = build(sizes=[4], layers=3)
    b = _batch(cfg, 4)
    ref = eng.eager(b).clone()
    assert torch.equal(eng.step(b), ref)
    counters = sim.counters()
    before = dict(counters)
    assert torch.equal(eng.step(b), ref)
    assert counters["update_begin"] == before["update_begin"], "nothing re-issued"
    assert counters["event_record"] == before["event_record"] + 3, "events still recorded"
    recs = rt.trace.records("main", 4)
    assert [r.reissued for r in recs[-2:]] == [3, 0]


def test_each_distinct_metadata_is_converted_once_per_step():
    cfg, rt, _, eng = build(sizes=[4], layers=4)
    b = _batch(cfg, 4)
    with mock.patch.object(prepare_mod, "convert", wraps=prepare_mod.convert) as spy:
        rt.update(4, {f"main.layers.{i}.attn": b.meta for i in range(4)})
        assert spy.call_count == 1
        rt.replay(4)
        rt.synchronize()
        rt.update(4, {"default": b.meta})
        assert spy.call_count == 2


def test_no_strong_reference_to_model_tensors():
    cfg, rt, model, eng = build(sizes=[2], layers=2)
    run(eng, cfg, 5)  # update plans and traces exist too
    cache = weakref.ref(model.layers[0].k_cache)
    entry = rt.manager.entry("main", 2)
    alias = entry.tasks[0].tensor("key_cache")
    assert alias is not model.layers[0].k_cache and alias.data_ptr() == model.layers[0].k_cache.data_ptr()
    del alias, entry, model, eng  # the graph stays captured: it holds addresses, not tensors
    gc.collect()
    assert cache() is None, "the runtime must not keep model tensors alive"


def test_update_waits_for_the_previous_replay_without_host_sync():
    """Two steps issued back to back while the device is held: no race, right output."""
    cfg, rt, _, eng = build(sizes=[4], layers=2)
    wl = Workload(cfg, [4], seed=9, max_batch=4)
    b1, b2 = list(wl.steps(2))
    npu = sim.npu
    main = npu.Stream()
    hold = npu.ExternalEvent()
    ref1 = eng.eager(b1).clone()
    eng.buffers["input_ids"][:4].copy_(b1.input_ids)
    eng.buffers["positions"][:4].copy_(b1.positions)
    eng.buffers["slot_mapping"][:4].copy_(b1.slot_mapping)
    bt = eng.block_table[:4]
    bt.copy_(b1.padded_meta.block_table)
    m1 = AttentionMetadata(seq_lens=b1.meta.seq_lens, block_table=bt[: b1.num_reqs])
    lens2 = b1.meta.seq_lens + 1
    m2 = AttentionMetadata(seq_lens=lens2, block_table=bt[: b1.num_reqs])
    syncs = sim.counters()["synchronize"]
    with npu.stream(main):
        hold.wait(main)  # the device is busy: the first replay stays queued
        rt.update(4, {"default": m1})
        out = rt.replay(4)
        rt.update(4, {"default": m2})  # must not overtake the queued replay
        assert sim.counters()["synchronize"] == syncs, "no host synchronize on the step path"
        hold.record(npu.Stream())
        rt.synchronize()
    assert torch.equal(out[: b1.num_reqs], ref1)


def test_pa_workspace_covers_every_length_not_one_fake_length():
    from npugraph.models.stack import AttentionStack
    from npusim.kernels import pa_workspace_bytes

    rt = Runtime("sim", max_model_len=4096)
    stack = AttentionStack(rt, layers=2, heads=4, kv_heads=1, head_size=64, block_size=128, num_blocks=32)
    dev = rt.device.memory
    table = torch.zeros(2, 32, dtype=torch.int32, device=dev)
    for key in (2, 1):
        meta = AttentionMetadata(seq_lens=torch.ones(key, dtype=torch.int32), block_table=table[:key])
        rt.capture(stack, torch.zeros(key, 4, 64, dtype=torch.float16, device=dev), meta, key=key)
        entry = rt.manager.entry("main", key)
        assert entry.choice.kernel == "pa"
        need = [pa_workspace_bytes(key, 4, 1, 64, n) for n in range(1, 4097)]
        assert entry.workspace_bytes >= max(need), "every length up to max_model_len fits"
        one_fake = pa_workspace_bytes(key, 4, 1, 64, 4096)
        assert one_fake < max(need), "sizing with one long fake length would be too small"


class _Out(NamedTuple):
    logits: torch.Tensor
    extra: dict


@dataclasses.dataclass(frozen=True)
class _DataOut:
    logits: torch.Tensor
    note: str


@pytest.mark.no_serving_check("the graphs return structures, not the engine's logits")
@pytest.mark.parametrize("shape", ["namedtuple", "dataclass"])
def test_outputs_of_any_pytree_shape_are_kept_as_aliases(shape):
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, order="update-first")
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [4])
    inner = model.forward

    def forward(*args):
        logits = inner(*args)
        if shape == "namedtuple":
            return _Out(logits=logits, extra={"twice": [logits * 2]})
        return _DataOut(logits=logits, note="kept")

    model.forward = forward
    eng.capture()
    out = rt.entry(4).outputs
    assert type(out) is (_Out if shape == "namedtuple" else _DataOut)
    b = _batch(cfg, 4)
    got = rt.step(4, {"default": b.meta}, inputs=_inputs(b))
    rt.synchronize()
    model.forward = inner
    ref = eng.eager(b)
    assert torch.equal(got.logits[: b.num_reqs], ref)
    if shape == "namedtuple":
        assert torch.equal(got.extra["twice"][0][: b.num_reqs], ref * 2)
    else:
        assert got.note == "kept"


def test_a_capture_failing_half_way_registers_nothing_and_the_key_captures_again_at_once():
    cfg = DecoderConfig(layers=3, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [4])
    inner = model.layers[2].o
    model.layers[2].o = _FailsWhileCapturing(inner)  # after two attention layers were recorded
    with pytest.raises(CaptureFailed, match=r"capture of main/4 failed after layer 'main.layers.2.attn'"):
        eng.capture()
    assert not rt.has(4) and rt.entries() == []
    model.layers[2].o = inner
    eng.capture()
    b = _batch(cfg, 4)
    assert torch.equal(eng.step(b), eng.eager(b))


def test_a_ctrl_c_during_capture_stays_a_keyboard_interrupt_and_registers_nothing():
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [2])

    def interrupted(*args):
        raise KeyboardInterrupt

    real = model.forward
    model.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        eng.capture()
    assert not rt.has(2) and not sim.npu.is_current_stream_capturing()
    model.forward = real
    eng.capture()
    assert rt.has(2)


def test_an_input_of_another_dtype_is_refused_not_cast():
    cfg, rt, _, eng = build(sizes=[4], layers=2)
    b = _batch(cfg, 4)
    ids = b.input_ids.to(torch.int32)
    with pytest.raises(
        MetadataError, match=r"main/4: input 'input_ids' is torch.int32, the captured buffer torch.int64"
    ):
        rt.step(4, {"default": b.meta}, inputs={**_inputs(b), "input_ids": ids})
    assert torch.equal(eng.step(b), eng.eager(b)), "the same runtime serves the next step"


def test_lengths_on_an_unusable_device_are_refused_by_name():
    cfg, rt, _, eng = build(sizes=[4], layers=2)
    b = _batch(cfg, 4)
    bad = AttentionMetadata(seq_lens=b.meta.seq_lens.to("meta"), block_table=b.meta.block_table)
    with pytest.raises(MetadataError, match=r"seq_lens must be on the host \(CPU\), got a tensor on meta"):
        rt.step(4, {"default": bad}, inputs=_inputs(b))
    assert torch.equal(eng.step(b), eng.eager(b))


def test_capturing_smaller_first_warns_once_and_the_report_says_what_was_captured(caplog):
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [2, 4, 8])
    with caplog.at_level("INFO", logger="npugraph"):
        eng.capture()  # largest first: no warning
    (line,) = [r.getMessage() for r in caplog.records if "graphs captured" in r.getMessage()]
    assert "3 graphs captured in namespace 'main' (6 attention tasks; 1 fia_sink, 2 pa) in" in line
    # what was chosen, and why
    assert "kernels: fia_sink at [8] (lengths on the device, no per-layer update), pa at [2, 4]" in line
    assert (
        "ExternalEvents: one per step for graphs with their lengths on the device, 'main': one per layer (auto, 2 tasks)"
        in line
    )
    assert "graph pool" in line and "MiB" in line
    rt.reset()
    views = {k: v[:2] for k, v in eng.buffers.items()}

    def capture(size):
        ins = {k: v[:size] for k, v in eng.buffers.items()}
        meta = AttentionMetadata(seq_lens=torch.ones(size, dtype=torch.int32), block_table=eng.block_table[:size])
        rt.capture(model, *ins.values(), meta, key=size, static_inputs=ins)

    capture(2)
    with pytest.warns(
        UserWarning, match=r"captured main/4 \(4 tokens\) after smaller graphs \(\[2\]\): capture the largest first"
    ):
        capture(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(8)  # said once per namespace
    assert views and rt.capture_report("main").startswith("3 graphs captured in namespace 'main'")


def test_key_for_picks_the_smallest_graph_that_holds_the_batch_and_step_pads_to_it():
    cfg, rt, _, eng = build(sizes=[2, 4, 8], layers=2)
    assert [rt.key_for(n) for n in (1, 2, 3, 5, 8)] == [2, 2, 4, 8, 8]
    with pytest.raises(
        UnknownKeyError,
        match=r"no graph in namespace 'main' holds 9 tokens and 9 requests \(captured token counts: \[2, 4, 8\]; "
        r"the largest, 8: 9 requests do not fit the captured batch of 8",
    ):
        rt.key_for(9)
    b = _batch(cfg, 8, steps=5)
    key = rt.key_for(b.num_reqs)
    r = b.num_reqs
    got = rt.step(key, {"default": b.meta}, inputs={k: v[:r] for k, v in _inputs(b).items()})[:r]
    rt.synchronize()
    assert torch.equal(got, eng.eager(b))


@pytest.mark.parametrize(
    ("device_error", "advice"),
    [
        (
            "ACL error 207008: stream resource exhausted",
            r"capture fewer sizes \(vLLM: compilation_config.cudagraph_capture_sizes, or a lower",
        ),
        ("Failed to find function aclmdlRICaptureBegin", r"needs CANN >= 8.2.RC1 and Ascend HDK >= 25.0.RC1"),
        # the signatures vllm-ascend's ACLGraphWrapper recognises, in any case
        ("EE9999: Stream resources are insufficient", r"ran out of stream resources"),
        ("rtStreamCreate failed: INSUFFICIENT_STREAM_RESOURCES", r"ran out of stream resources"),
        ("drvError: Alloc sq cq fail", r"upgrade the Ascend HDK to 25.5.1 or later"),
    ],
)
def test_a_device_capture_error_comes_with_advice(device_error, advice):
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [2])

    def fails(*args):
        raise RuntimeError(device_error)

    real = model.forward
    model.forward = fails
    with pytest.raises(CaptureFailed, match=advice):
        eng.capture()
    model.forward = real
    eng.capture()  # and the key captures at once afterwards
