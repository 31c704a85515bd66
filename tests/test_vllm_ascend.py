"""vllm-ascend's own attention backends, captured through npugraph's plugin, as thin clients.

Stand-ins of vllm-ascend (``tests/standin/{aug,sept}``: its module names, class names,
signatures and torch_npu calls, for its Aug and Sept 2026 generations; bodies of our own)
run over ``npusim.install_torch_npu()``, driven through real vLLM classes.  Each step
goes through the wrapper and then the runner's own per-step update (which the plugin must
have made a no-op): one npugraph task per layer, exactly one event record per layer per
step, replays bitwise equal to the backends' own eager path and within tolerance of the
float64 reference, under both padding conventions.  With ``NPUGRAPH_VLLM_ASCEND_SRC``
pointing at a vllm-ascend checkout, the same checks run on its real files.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import random
import sys
import types
from pathlib import Path

import pytest
import torch

if not os.environ.get("NPUGRAPH_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context

import npusim as sim
from npugraph import Runtime
from npugraph.errors import ConfigError
from npugraph.integrations import vllm as integ
from npugraph.integrations.vllm import kv_budget, plugin
from npugraph.integrations.vllm import vllm_ascend as ascend
from npugraph.reference import paged_attention_reference

pytestmark = pytest.mark.vllm

HEADS, KV_HEADS, HEAD, BLOCK, BLOCKS, LAYERS = 4, 2, 64, 16, 40, 3
MAX_LEN = 128
COLS = MAX_LEN // BLOCK
SIZES = [8, 4, 2]  # FIA at 8, PA at 4 and 2 (vllm-ascend's pa_shape_list and npugraph's default)
STANDIN = Path(__file__).parent / "standin"
CAUSAL = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
NPU = "npu"  # the device memory vllm-ascend's runner allocates in


def _purge() -> None:
    for name in [n for n in sys.modules if n == "vllm_ascend" or n.startswith("vllm_ascend.")]:
        del sys.modules[name]


@pytest.fixture(params=["aug"])
def generation(request, monkeypatch):
    yield from _installed(request.param, monkeypatch)


@pytest.fixture
def sept(monkeypatch):
    yield from _installed("sept", monkeypatch)


def _installed(which, monkeypatch):
    """vllm-ascend of one generation installed (a stand-in), npugraph's plugin on top."""
    from vllm.platforms import current_platform

    sim.install_torch_npu()
    _purge()
    monkeypatch.syspath_prepend(str(STANDIN / which))
    import vllm_ascend.attention.attention_v1
    import vllm_ascend.worker.model_runner_v1  # noqa: F401

    try:
        integ.install(current_platform)
        yield which
    finally:
        integ.uninstall(current_platform)
        _purge()
        sim.uninstall_torch_npu()


class AscendModel(torch.nn.Module):
    """Layers whose attention is vllm-ascend's backend impl, called as vLLM's Attention layer does."""

    def __init__(self, vllm_config, seed=0):
        super().__init__()
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl

        gen = torch.Generator().manual_seed(seed)
        self.layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(LAYERS)]
        self.caches = [
            (
                torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD, generator=gen).half().to(NPU),  # the runner's KV caches
                torch.randn(BLOCKS, BLOCK, KV_HEADS, HEAD, generator=gen).half().to(NPU),
            )
            for _ in range(LAYERS)
        ]
        self.impls = [
            AscendAttentionBackendImpl(
                HEADS, HEAD, HEAD**-0.5, KV_HEADS, None, None, "auto", None, "decoder", None, vllm_config=vllm_config
            )
            for _ in range(LAYERS)
        ]

    def forward(self, query):
        md = get_forward_context().attn_metadata
        outs = []
        for layer, impl, cache in zip(self.layers, self.impls, self.caches):
            out = torch.empty(query.shape[0], HEADS * HEAD, dtype=query.dtype, device=query.device)
            outs.append(impl.forward(layer, query, None, None, cache, md[layer.layer_name], out))
        return torch.stack(outs)


def ascend_metadata(lens, tables, size, convention, buffer):
    """``AscendMetadata`` the way the runners pad a FULL batch to ``size`` requests; the block
    table is a view of the runner's persistent ``buffer`` (as vLLM's input batch keeps it).

    ``"vllm"``: padding requests have ``seq_len`` 0 and no query tokens (vLLM 0.32's
    model runner: query_start_loc repeats its last value); ``"vllm-ascend"``: padding
    requests have ``seq_len`` 0 and one query token each (vllm-ascend's graph path).
    """
    from vllm_ascend.attention.attention_v1 import AscendAttentionState, AscendMetadata

    r = len(lens)
    seq = list(lens) + [0] * (size - r)
    ends = list(range(1, r + 1)) + ([r] * (size - r) if convention == "vllm" else list(range(r + 1, size + 1)))
    table = buffer[:size]
    table.zero_()
    table[:r] = tables
    seq_cpu = torch.tensor(seq, dtype=torch.int32)
    return AscendMetadata(
        attn_mask=CAUSAL.to(buffer.device),  # vllm-ascend's AttentionMaskBuilder: the compressed causal mask
        attn_state=AscendAttentionState.DecodeOnly,
        num_actual_tokens=r,
        seq_lens=seq_cpu,
        seq_lens_cpu=seq_cpu,
        seq_lens_list=seq,
        actual_seq_lengths_q=ends,
        query_start_loc=torch.tensor([0, *ends], dtype=torch.int32),  # device-resident on a real NPU
        max_query_len=1,
        block_tables=table,
    )


class AscendRunner:
    """What vllm-ascend's model runner does per FULL step: dispatch, wrapper, then its update."""

    def __init__(self):
        from vllm_ascend.compilation import acl_graph

        vc = VllmConfig()
        vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
        self.vc = vc
        self.rt = integ.attach_runtime(vc, Runtime("sim", max_model_len=MAX_LEN))
        acl_graph.set_graph_params(SIZES)
        self.model = AscendModel(vc)
        # the runner builds its wrapper through vllm-ascend's name, which now is npugraph's
        self.wrapper = acl_graph.ACLGraphWrapper(self.model, vc, CUDAGraphMode.FULL)
        self.query = torch.zeros(max(SIZES), HEADS, HEAD, dtype=torch.float16, device=NPU)
        self.table = torch.zeros(max(SIZES), COLS, dtype=torch.int32, device=NPU)  # the input batch's block table
        self.update_stream = torch.npu.Stream()
        self.rng = random.Random(0)

    def forward(self, size, meta, mode=CUDAGraphMode.FULL):
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackend
        from vllm_ascend.worker import model_runner_v1

        md = {layer.layer_name: meta for layer in self.model.layers}
        with set_forward_context(
            md, self.vc, num_tokens=size, cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(num_tokens=size)
        ):
            out = self.wrapper(self.query[:size])
            if mode == CUDAGraphMode.FULL:
                model_runner_v1._update_full_graph_params_if_needed(
                    AscendAttentionBackend, self.update_stream, get_forward_context(), size, self.vc
                )
        return out

    def capture(self):
        for size in SIZES:
            ones = [1] * size
            self.forward(size, self.metadata(ones, torch.zeros(size, COLS, dtype=torch.int32), size, "vllm-ascend"))

    def metadata(self, lens, tables, size, convention):
        return ascend_metadata(lens, tables, size, convention, self.table)

    def batch(self, size):
        r = self.rng.randint(1, size)
        lens = [self.rng.randint(1, MAX_LEN) for _ in range(r)]
        tables = torch.zeros(r, COLS, dtype=torch.int32)
        for i, n in enumerate(lens):
            used = -(-n // BLOCK)
            tables[i, :used] = torch.tensor(self.rng.sample(range(BLOCKS), used), dtype=torch.int32)
        return lens, tables


def test_the_generation_is_detected_and_every_name_replaced(generation):
    assert ascend.detect() == "aug-2026"
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl
    from vllm_ascend.compilation import acl_graph
    from vllm_ascend.worker import model_runner_v1

    assert acl_graph.ACLGraphWrapper is integ.NpuGraphWrapper
    assert model_runner_v1.update_full_graph_params is ascend._noop, "the runner's own imported copy too"
    assert acl_graph.update_full_graph_params is ascend._noop
    assert AscendAttentionBackendImpl.update_graph_params is ascend._noop
    assert AscendAttentionBackendImpl.full_graph_pa.__module__ == "npugraph.integrations.vllm.vllm_ascend"


@pytest.mark.parametrize("convention", ["vllm", "vllm-ascend"])
def test_ascend_backends_replay_through_npugraph_with_both_padding_conventions(generation, convention):
    runner = AscendRunner()
    runner.capture()
    entries = {e.key.num_tokens: e for e in runner.rt.entries()}
    assert sorted(entries) == sorted(SIZES)
    for size, e in entries.items():
        assert [t.layer for t in e.tasks] == [layer.layer_name for layer in runner.model.layers], "one task per layer"
        assert e.choice.kernel == ("pa" if size <= 4 else "fia_sink")  # FIA: lengths on the device
    counters = sim.counters()
    for step in range(12):
        size = SIZES[step % len(SIZES)]
        lens, tables = runner.batch(size)
        r = len(lens)
        meta = runner.metadata(lens, tables, size, convention)
        q = torch.randn(size, HEADS, HEAD, generator=torch.Generator().manual_seed(step)).half()
        runner.query[:size].copy_(q)
        records = counters["event_record"]
        out = runner.forward(size, meta)
        runner.rt.synchronize()
        # one ExternalEvent per layer updated per layer, one per step with FIA's lengths on the device
        expected = 1 if next(e for e in runner.rt.entries() if e.tokens == size).lens_groups else LAYERS
        assert counters["event_record"] - records == expected, "exactly one update per layer: none twice, none lost"
        got = out[:, :r].clone()
        eager = runner.forward(size, meta, mode=CUDAGraphMode.NONE)  # the backend's own eager path
        assert torch.equal(got, eager[:, :r]), f"step {step}: replay differs from vllm-ascend's eager"
        for li, (k, v) in enumerate(runner.model.caches):
            ref = paged_attention_reference(q[:r], k, v, tables, lens, HEAD**-0.5)
            err = (got[li].view(r, HEADS, HEAD).cpu().double() - ref).abs().max().item()
            assert err < 4e-3, f"step {step} layer {li}: {err} from the float64 reference"


def test_a_draft_models_graphs_live_beside_the_targets_under_the_same_batch_descriptors(generation):
    """vllm-ascend's MTP proposer wraps its draft in ``ACLGraphWrapper`` and captures it under
    the target's batch descriptors: under the plugin it gets npugraph's draft wrapper (its
    own namespace), and each step updates and replays both graphs from their own metadata."""
    from vllm_ascend.spec_decode import llm_base_proposer

    assert llm_base_proposer.ACLGraphWrapper is integ.DraftNpuGraphWrapper
    runner = AscendRunner()
    draft_model = AscendModel(runner.vc, seed=1)  # its own layers and KV caches
    proposer = llm_base_proposer.AscendSpecDecodeBaseProposer(draft_model, runner.vc)
    draft_table = torch.zeros_like(runner.table)  # the draft's own block-table buffer

    def draft_forward(size, meta):
        md = {layer.layer_name: meta for layer in draft_model.layers}
        with set_forward_context(
            md,
            runner.vc,
            num_tokens=size,
            cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=BatchDescriptor(num_tokens=size),
        ):
            return proposer._runnable(runner.query[:size])

    runner.capture()
    for size in SIZES:  # the same descriptors: before the draft wrapper, "already captured"
        draft_forward(
            size,
            ascend_metadata([1] * size, torch.zeros(size, COLS, dtype=torch.int32), size, "vllm-ascend", draft_table),
        )
    spaces = sorted((e.namespace, e.key.num_tokens) for e in runner.rt.entries())
    assert spaces == sorted([("main", s) for s in SIZES] + [("draft", s) for s in SIZES])
    for step in range(6):
        size = SIZES[step % len(SIZES)]
        q = torch.randn(size, HEADS, HEAD, generator=torch.Generator().manual_seed(step)).half()
        runner.query[:size].copy_(q)
        lens, tables = runner.batch(size)
        draft_lens = [n + 1 for n in lens]  # the draft attends to one token more: its own lengths
        r = len(lens)
        out = runner.forward(size, runner.metadata(lens, tables, size, "vllm-ascend")).clone()
        draft_out = draft_forward(size, ascend_metadata(draft_lens, tables, size, "vllm-ascend", draft_table))
        runner.rt.synchronize()
        for model, got, n in ((runner.model, out, lens), (draft_model, draft_out, draft_lens)):
            for li, (k, v) in enumerate(model.caches):
                ref = paged_attention_reference(q[:r], k, v, tables, n, HEAD**-0.5)
                err = (got[li, :r].view(r, HEADS, HEAD).cpu().double() - ref).abs().max().item()
                assert err < 4e-3, f"step {step} layer {li}: {err} from the float64 reference"


def test_uninstall_gives_the_proposer_vllm_ascends_own_wrapper_back(generation):
    from vllm_ascend.compilation import acl_graph
    from vllm_ascend.spec_decode import llm_base_proposer

    own = acl_graph._npugraph_original_ACLGraphWrapper
    assert llm_base_proposer._npugraph_original_ACLGraphWrapper is own, "not the NpuGraphWrapper it imported"
    integ.uninstall()
    assert llm_base_proposer.ACLGraphWrapper is own and acl_graph.ACLGraphWrapper is own


def test_a_draft_of_several_tokens_other_than_mtp_on_mla_is_refused_at_model_load_naming_the_setting():
    """Several draft tokens are recorded as vllm-ascend's MTP on MLA serves them (its later
    steps one query token per row); any other draft of several tokens is refused."""
    for method, mla in (("eagle", True), ("mtp", False)):
        config = types.SimpleNamespace(
            speculative_config=types.SimpleNamespace(num_speculative_tokens=2, method=method),
            model_config=types.SimpleNamespace(is_deepseek_mla=mla),
        )
        with pytest.raises(ConfigError, match="num_speculative_tokens=2"):
            integ.DraftNpuGraphWrapper(lambda: None, config, CUDAGraphMode.FULL)


def test_a_later_draft_step_is_captured_one_query_token_per_row_in_the_wrappers_buffer():
    """vllm-ascend captures its MTP draft's later steps with the first step's metadata
    (requests of 3 tokens) but serves them as one token per row: the task is captured so,
    its block table a buffer the wrapper made before the capture."""
    made = torch.zeros(9, 6, dtype=torch.int32, device=NPU)
    table = torch.arange(6, dtype=torch.int32, device=NPU).view(3, 2)
    meta = ascend.AttentionMetadata(
        seq_lens=torch.tensor([4, 7, 9], dtype=torch.int32),
        block_table=table,
        query_start_loc=torch.tensor([0, 3, 6, 9], dtype=torch.int32),
    )
    rows = ascend._one_token_rows(meta, 9, [made])
    assert rows.query_start_loc is None and rows.seq_lens.tolist() == [4, 4, 4, 7, 7, 7, 9, 9, 9]
    assert rows.block_table.data_ptr() == made.data_ptr() and tuple(rows.block_table.shape) == (9, 2)
    # none made before the capture: one made inside it would share the graph's pool
    with pytest.raises(ascend.CaptureFailed, match="made before the capture"):
        ascend._one_token_rows(meta, 9, [])


def test_a_release_lacking_a_replaced_name_gets_nothing_replaced_and_one_error_line(generation, caplog):
    """As if vllm-ascend renamed a recorder: half a replacement would leave its kernel recorded by
    vllm-ascend and updated by nobody (stale lengths), so npugraph refuses whole: every name is
    put back, vLLM's wrapper class included, and one ERROR line names what is missing."""
    from vllm.platforms import current_platform
    from vllm_ascend.attention import attention_v1
    from vllm_ascend.compilation import acl_graph

    impl = attention_v1.AscendAttentionBackendImpl
    integ.uninstall(current_platform)
    own = {n: vars(impl)[n] for n in ("forward", "full_graph_pa", "update_graph_params")}
    own_wrapper = acl_graph.ACLGraphWrapper
    del impl.full_graph_fia_v2
    with caplog.at_level("INFO", logger="vllm.npugraph"):
        said = integ.install(current_platform)
    name = "vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl.full_graph_fia_v2"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == [said]
    assert said.startswith("npugraph: vllm-ascend ") and f"has no {name}, which npugraph replaces" in said
    assert "vLLM serves with vllm-ascend's own graphs" in said
    assert not [r for r in caplog.records if "installed; replaced" in r.getMessage()]
    assert {n: vars(impl)[n] for n in own} == own and acl_graph.ACLGraphWrapper is own_wrapper
    assert "_npugraph_original_wrapper_cls" not in vars(type(current_platform))
    assert not [n for n in vars(impl) if n.startswith("_npugraph_original_")]


def test_a_release_of_neither_known_generation_is_refused_by_name(generation, caplog):
    """No generation's mark at all (neither the Aug recorders nor the Sept UpdatableGraph): refused
    in one ERROR line that names both marks, nothing left replaced."""
    from vllm.platforms import current_platform
    from vllm_ascend.attention import attention_v1

    integ.uninstall(current_platform)
    del attention_v1.AscendAttentionBackendImpl.full_graph_pa
    assert ascend.detect() is None
    with caplog.at_level("ERROR", logger="vllm.npugraph"):
        said = integ.install(current_platform)
    assert said is not None and "AscendAttentionBackendImpl.full_graph_pa (Aug 2026) or " in said
    assert "updatable_graph.register_task (Sept 2026)" in said
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [said]
    assert "_npugraph_original_wrapper_cls" not in vars(type(current_platform))


def test_install_replaces_the_runners_copy_of_update_full_graph_params(generation):
    result = ascend.install()
    assert result is not None and result.missing == ()
    assert "vllm_ascend.worker.model_runner_v1.update_full_graph_params" in result.replaced


# --- MLA (vllm-ascend's mla_v1): its decode as npugraph's mla task ------------------------------

MLA_HEADS, LATENT, ROPE, V_HEAD = 4, 512, 64, 128  # DeepSeek's latent and rope sizes


class MlaModel(torch.nn.Module):
    """Layers whose attention is vllm-ascend's MLA impl, called as its MLA layer does
    (``forward(layer_name, ...)``), over paged latent and rope caches."""

    def __init__(self, enable_kv_nz=False, seed=0):
        super().__init__()
        from vllm_ascend.attention.mla_v1 import AscendMLAImpl

        gen = torch.Generator().manual_seed(seed)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.caches = [
            (
                torch.randn(BLOCKS, BLOCK, 1, LATENT, generator=gen).bfloat16().to(NPU),
                torch.randn(BLOCKS, BLOCK, 1, ROPE, generator=gen).bfloat16().to(NPU),
            )
            for _ in range(LAYERS)
        ]
        self.impls = [
            AscendMLAImpl(
                MLA_HEADS,
                (LATENT + ROPE) ** -0.5,
                LATENT,
                ROPE,
                (torch.randn(MLA_HEADS, LATENT, V_HEAD, generator=gen) * 0.05).bfloat16().to(NPU),
                layer_name=name,
                enable_kv_nz=enable_kv_nz,
            )
            for name in self.names
        ]

    def forward(self, query):
        md = get_forward_context().attn_metadata
        outs = []
        for name, impl, cache in zip(self.names, self.impls, self.caches):
            out = torch.empty(query.shape[0], MLA_HEADS * V_HEAD, dtype=query.dtype, device=query.device)
            outs.append(impl.forward(name, query, cache, md[name], output=out))
        return torch.stack(outs)


def _mla_metadata(lens, tables, size, buffer):
    """vllm-ascend's MLA metadata of a FULL decode step padded to ``size`` requests: its
    decode part holds the host lengths (padding: 0) and the block table."""
    from vllm_ascend.attention.mla_v1 import AscendMLADecodeMetadata, AscendMLAMetadata

    table = buffer[:size]
    table.zero_()
    table[: len(lens)] = tables
    decode = AscendMLADecodeMetadata(block_table=table, seq_lens_list=list(lens) + [0] * (size - len(lens)))
    return AscendMLAMetadata(num_decodes=size, num_decode_tokens=size, num_actual_tokens=size, decode=decode)


def _mla_reference(q, latent, rope, table, length, scale, w_uv):
    """One request's absorbed MLA in float64 on the host: scores over the latent and rope
    parts of its keys, the latent values, each head's up projection."""
    pos = range(length)
    k_lat = torch.stack([latent.cpu()[int(table[p // BLOCK]), p % BLOCK, 0] for p in pos]).double()
    k_rope = torch.stack([rope.cpu()[int(table[p // BLOCK]), p % BLOCK, 0] for p in pos]).double()
    q = q.cpu().double()  # [N, latent + rope]
    scores = (q[:, :LATENT] @ k_lat.T + q[:, LATENT:] @ k_rope.T) * scale
    o = torch.softmax(scores, -1) @ k_lat  # [N, latent]
    return torch.einsum("nl,nlv->nv", o, w_uv.cpu().double())


def _mla_runner(enable_kv_nz=False):
    from vllm_ascend.compilation import acl_graph

    vc = VllmConfig()
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    rt = integ.attach_runtime(vc, Runtime("sim", max_model_len=MAX_LEN))
    acl_graph.set_graph_params(SIZES)
    model = MlaModel(enable_kv_nz=enable_kv_nz)
    wrapper = acl_graph.ACLGraphWrapper(model, vc, CUDAGraphMode.FULL)
    query = torch.zeros(max(SIZES), MLA_HEADS, LATENT + ROPE, dtype=torch.bfloat16, device=NPU)
    buffer = torch.zeros(max(SIZES), COLS, dtype=torch.int32, device=NPU)

    def forward(size, meta, mode=CUDAGraphMode.FULL):
        md = dict.fromkeys(model.names, meta)
        with set_forward_context(
            md, vc, num_tokens=size, cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(num_tokens=size)
        ):
            return wrapper(query[:size])

    return rt, model, query, buffer, forward


def test_mla_decode_replays_as_npugraphs_mla_task(generation):
    """vllm-ascend's MLA layers captured under the plugin: one npugraph ``mla`` task per layer
    at every size (PA cannot run MLA), one event record per layer per step (vllm-ascend's own
    recording would leave its events unrecorded: a deadlock), replays equal to the layer's
    own eager path and within tolerance of the float64 reference."""
    rt, model, query, buffer, forward = _mla_runner()
    for size in SIZES:
        forward(size, _mla_metadata([1] * size, torch.zeros(size, COLS, dtype=torch.int32), size, buffer))
    for e in rt.entries():
        assert [t.layer for t in e.tasks] == model.names and e.choice.kernel == "mla"
    counters = sim.counters()
    rng = random.Random(2)
    for step in range(9):
        size = SIZES[step % len(SIZES)]
        r = rng.randint(1, size)
        lens = [rng.randint(1, MAX_LEN) for _ in range(r)]
        tables = torch.zeros(r, COLS, dtype=torch.int32)
        for i, n in enumerate(lens):
            tables[i, : -(-n // BLOCK)] = torch.tensor(rng.sample(range(BLOCKS), -(-n // BLOCK)), dtype=torch.int32)
        q = torch.randn(size, MLA_HEADS, LATENT + ROPE, generator=torch.Generator().manual_seed(step)).bfloat16()
        query[:size].copy_(q)
        records = counters["event_record"]
        out = forward(size, _mla_metadata(lens, tables, size, buffer))
        rt.synchronize()
        assert counters["event_record"] - records == LAYERS, "exactly one update per layer: none twice, none lost"
        got = out[:, :r].clone()
        eager = forward(size, _mla_metadata(lens, tables, size, buffer), mode=CUDAGraphMode.NONE)
        assert torch.equal(got, eager[:, :r]), f"step {step}: replay differs from vllm-ascend's eager MLA"
        for li, (impl, (latent, rope)) in enumerate(zip(model.impls, model.caches)):
            for i in range(r):
                ref = _mla_reference(q[i], latent, rope, tables[i], lens[i], impl.scale, impl.W_UV)
                err = (got[li, i].view(MLA_HEADS, V_HEAD).cpu().double() - ref).abs().max().item()
                assert err <= 0.03 * max(1.0, ref.abs().max().item()), f"step {step} layer {li} request {i}: {err}"


class MtpDraft(torch.nn.Module):
    """vllm-ascend's merged MTP draft of two tokens: its MLA layers run once per draft step
    inside one graph, the forward context pointed at each step's metadata in turn."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, query):
        ctx = get_forward_context()
        outs = []
        for step in ctx.draft_attn_metadatas:
            ctx.attn_metadata = step
            outs.append(self.model(query))
        return torch.stack(outs)


def test_an_mtp_draft_of_two_tokens_replays_each_step_from_its_own_metadata(generation):
    """Captured as vllm-ascend captures it (both steps with the first step's metadata: 2
    requests of 3 tokens), served as it serves it (the second step one token per row, 6 rows,
    a block table of 6 rows in a tensor of its own): each step's attention is right against
    the float64 reference, the first causal over each request's 3 tokens."""
    from vllm_ascend.attention.mla_v1 import AscendMLADecodeMetadata, AscendMLAMetadata

    vc = VllmConfig()
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    rt = integ.attach_runtime(vc, Runtime("sim", max_model_len=MAX_LEN))
    model = MlaModel()
    config = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=2, method="mtp"),
        model_config=types.SimpleNamespace(is_deepseek_mla=True, max_model_len=MAX_LEN),
        cache_config=types.SimpleNamespace(block_size=BLOCK),
    )
    draft = integ.DraftNpuGraphWrapper(MtpDraft(model), config, CUDAGraphMode.FULL, runtime=rt)
    tokens, reqs = 6, 2
    query = torch.zeros(tokens, MLA_HEADS, LATENT + ROPE, dtype=torch.bfloat16, device=NPU)
    table = torch.zeros(reqs, COLS, dtype=torch.int32, device=NPU)  # the runner's (step 0)

    def meta(decode):
        return dict.fromkeys(
            model.names,
            AscendMLAMetadata(num_decodes=reqs, num_decode_tokens=tokens, num_actual_tokens=tokens, decode=decode),
        )

    def forward(steps):
        with set_forward_context(
            steps[0],
            vc,
            num_tokens=tokens,
            cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=BatchDescriptor(num_tokens=tokens),
        ):
            get_forward_context().draft_attn_metadatas = steps
            return draft(query)

    first = AscendMLADecodeMetadata(block_table=table, seq_lens_list=[3, 3], actual_seq_lengths_q=[3, 6])
    forward([meta(first), meta(first)])  # the capture: every step with the first step's metadata
    (entry,) = rt.entries()
    assert entry.namespace == "draft" and sorted({t.ubatch for t in entry.tasks}) == [0, 1]
    rng = random.Random(3)
    for step in range(4):
        lens = [rng.randint(4, MAX_LEN - 1) for _ in range(reqs)]
        tables = torch.zeros(reqs, COLS, dtype=torch.int32)
        for i, n in enumerate(lens):
            used = -(-(n + 1) // BLOCK)
            tables[i, :used] = torch.tensor(rng.sample(range(BLOCKS), used), dtype=torch.int32)
        table.copy_(tables)
        rows = torch.zeros(tokens, COLS, dtype=torch.int32, device=NPU)  # vllm-ascend pads it anew each step
        rows[:reqs] = tables
        later = [n + 1 for n in lens]  # the second step's key lengths: one token more
        steps = [
            meta(AscendMLADecodeMetadata(block_table=table, seq_lens_list=lens, actual_seq_lengths_q=[3, 6])),
            meta(
                AscendMLADecodeMetadata(
                    block_table=rows,
                    seq_lens_list=later + [0] * (tokens - reqs),
                    actual_seq_lengths_q=list(range(1, 7)),
                )
            ),
        ]
        q = torch.randn(tokens, MLA_HEADS, LATENT + ROPE, generator=torch.Generator().manual_seed(step)).bfloat16()
        query.copy_(q)
        out = forward(steps)
        rt.synchronize()
        for li, (impl, (latent, rope)) in enumerate(zip(model.impls, model.caches)):
            for i in range(reqs):
                cases = [(0, 3 * i + j, lens[i] - 2 + j) for j in range(3)] + [(1, i, later[i])]
                for s, row, n in cases:
                    ref = _mla_reference(q[row], latent, rope, tables[i], n, impl.scale, impl.W_UV)
                    got = out[s, li, row].view(MLA_HEADS, V_HEAD).cpu().double()
                    err = (got - ref).abs().max().item()
                    assert err <= 0.03 * max(1.0, ref.abs().max().item()), (
                        f"step {step} draft step {s} row {row}: {err}"
                    )


def test_an_mla_variant_without_a_declaration_stops_the_capture_naming_the_layer(generation):
    from npugraph.errors import CaptureFailed

    _, _, _, buffer, forward = _mla_runner(enable_kv_nz=True)
    meta = _mla_metadata([1, 1], torch.zeros(2, COLS, dtype=torch.int32), 2, buffer)
    with pytest.raises(CaptureFailed, match=r"MLA layer 'model.layers.0.self_attn.attn': its KV cache is in the NZ"):
        forward(2, meta)


# --- Sept 2026: UpdatableGraph, register_task -------------------------------------------------


def _sept_metadata(lens, tables, size, convention, buffer):
    """The V2 runner's AscendMetadata: host lists, padded as in ``ascend_metadata``."""
    from vllm_ascend.attention.attention_v1 import AscendMetadata

    r = len(lens)
    ends = list(range(1, r + 1)) + ([r] * (size - r) if convention == "vllm" else list(range(r + 1, size + 1)))
    table = buffer[:size]
    table.zero_()
    table[:r] = tables
    return AscendMetadata(
        attn_mask=CAUSAL.to(buffer.device),
        num_actual_tokens=r,
        seq_lens=list(lens) + [0] * (size - r),
        query_start_loc=ends,
        block_table=table,
    )


def test_the_sept_generation_is_detected_and_register_task_replaced(sept):
    assert ascend.detect() == "sept-2026"
    from vllm_ascend.attention import attention_v1
    from vllm_ascend.compilation import acl_graph, updatable_graph

    assert attention_v1.register_task is ascend._register_task, "the backend's imported copy"
    assert updatable_graph.get_capture_resource is ascend._get_capture_resource
    assert updatable_graph.UpdatableGraph.update is ascend._noop_method
    assert acl_graph.ACLGraphWrapper is integ.NpuGraphWrapper


@pytest.mark.parametrize("convention", ["vllm", "vllm-ascend"])
def test_register_task_backends_replay_through_npugraph(sept, convention):
    from vllm_ascend.compilation import acl_graph

    vc = VllmConfig()
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    rt = integ.attach_runtime(vc, Runtime("sim", max_model_len=MAX_LEN))
    model = AscendModel(vc)
    wrapper = acl_graph.ACLGraphWrapper(model, vc, CUDAGraphMode.FULL)
    query = torch.zeros(max(SIZES), HEADS, HEAD, dtype=torch.float16, device=NPU)
    buffer = torch.zeros(max(SIZES), COLS, dtype=torch.int32, device=NPU)

    def forward(size, meta, mode=CUDAGraphMode.FULL):
        md = {layer.layer_name: meta for layer in model.layers}
        with set_forward_context(
            md, vc, num_tokens=size, cudagraph_runtime_mode=mode, batch_descriptor=BatchDescriptor(num_tokens=size)
        ):
            return wrapper(query[:size])

    for size in SIZES:
        forward(
            size, _sept_metadata([1] * size, torch.zeros(size, COLS, dtype=torch.int32), size, "vllm-ascend", buffer)
        )
    assert all([t.layer for t in e.tasks] == [m.layer_name for m in model.layers] for e in rt.entries())
    counters = sim.counters()
    rng = random.Random(1)
    for step in range(10):
        size = SIZES[step % len(SIZES)]
        r = rng.randint(1, size)
        lens = [rng.randint(1, MAX_LEN) for _ in range(r)]
        tables = torch.zeros(r, COLS, dtype=torch.int32)
        for i, n in enumerate(lens):
            tables[i, : -(-n // BLOCK)] = torch.tensor(rng.sample(range(BLOCKS), -(-n // BLOCK)), dtype=torch.int32)
        q = torch.randn(size, HEADS, HEAD, generator=torch.Generator().manual_seed(step)).half()
        query[:size].copy_(q)
        records = counters["event_record"]
        out = forward(size, _sept_metadata(lens, tables, size, convention, buffer))
        rt.synchronize()
        expected = 1 if next(e for e in rt.entries() if e.tokens == size).lens_groups else LAYERS
        assert counters["event_record"] - records == expected, "exactly one update per layer"
        got = out[:, :r].clone()
        for li, (k, v) in enumerate(model.caches):
            ref = paged_attention_reference(q[:r], k, v, tables, lens, HEAD**-0.5)
            assert (got[li].view(r, HEADS, HEAD).cpu().double() - ref).abs().max().item() < 4e-3, (
                f"step {step} layer {li}"
            )
        if convention == "vllm-ascend":  # its eager path needs one query row per padding request
            eager = forward(size, _sept_metadata(lens, tables, size, convention, buffer), mode=CUDAGraphMode.NONE)
            assert torch.equal(got, eager[:, :r]), f"step {step}: replay differs from the backend's eager path"


# --- the real thing, when a checkout is at hand --------------------------------------------------


def test_real_vllm_ascend_sources_have_every_name_npugraph_replaces(monkeypatch):
    """With ``NPUGRAPH_VLLM_ASCEND_SRC`` pointing at a vllm-ascend checkout (and a vLLM it
    imports with), its real modules are imported over the simulator and every name the
    plugin replaces must be found (none missing)."""
    src = os.environ.get("NPUGRAPH_VLLM_ASCEND_SRC")
    if not src:
        pytest.skip("set NPUGRAPH_VLLM_ASCEND_SRC to a vllm-ascend checkout to run its real files")
    sim.install_torch_npu()
    _purge()
    monkeypatch.syspath_prepend(src)
    try:
        try:
            # only the package, as when vLLM loads the plugin: install() imports the rest in
            # an order that works (0.23.0.post1's attention_v1 alone closes an import cycle)
            importlib.import_module("vllm_ascend")
            importlib.import_module("vllm.platforms")
        except Exception as exc:  # its vLLM pin differs from the one installed here
            if os.environ.get("NPUGRAPH_REQUIRE_VLLM_ASCEND") == "1":  # release/run.sh: the pair must import
                raise
            pytest.skip(f"vllm-ascend at {src} does not import over this vLLM: {type(exc).__name__}: {exc}")
        result = ascend.install()
        assert result is not None, "no vllm-ascend generation detected"
        assert result.missing == (), f"expected names not found: {result.missing}"
        # the Aug 2026 generation (0.23.0.post1): the backend's recorders and update, and the
        # runner's update_full_graph_params wherever it was imported
        impl = "vllm_ascend.attention.attention_v1.AscendAttentionBackendImpl"
        wanted = {f"{impl}.{n}" for n in ("forward", "full_graph_pa", "full_graph_fia", "update_graph_params")}
        wanted.add("vllm_ascend.compilation.acl_graph.update_full_graph_params")
        # the MLA backend's decode (DeepSeek's layers) and the forward that names its layer
        mla = "vllm_ascend.attention.mla_v1.AscendMLAImpl"
        wanted |= {f"{mla}.forward", f"{mla}._forward_decode"}
        if result.generation == "sept-2026":
            # 0.30.0rc2: FIA and PA through UpdatableGraph's tasks (the backend imports
            # register_task by value), MLA's updates still in update_full_graph_params
            updatable = "vllm_ascend.compilation.updatable_graph"
            wanted = {f"{impl}.forward", f"{mla}.forward", f"{mla}._forward_decode"}
            wanted |= {f"{updatable}.{n}" for n in ("register_task", "get_capture_resource")}
            wanted |= {f"{updatable}.UpdatableGraph.{n}" for n in ("resolve_tasks", "update")}
            wanted |= {"vllm_ascend.attention.attention_v1.register_task"}
            if hasattr(importlib.import_module("vllm_ascend.compilation.acl_graph"), "update_full_graph_params"):
                wanted.add("vllm_ascend.compilation.acl_graph.update_full_graph_params")
        assert wanted <= set(result.replaced), f"not replaced: {sorted(wanted - set(result.replaced))}"
        # the speculative proposer's draft wrapper (MTP), which npugraph's vLLM plugin replaces
        for module_name, names in plugin._PATCHED_DRAFT:
            module = importlib.import_module(module_name)
            assert all(hasattr(module, n) for n in names), f"{module_name} has no {names}"
        # what the KV-cache budget's profiling capture runs on (the worker, the runner's helpers)
        for module_name, _ in kv_budget._KV_BUDGET_NAMES:
            importlib.import_module(module_name)
        assert integ.kv_budget_missing() == []
        # vLLM's model runner v2: served where vllm-ascend's manager updates through
        # UpdatableGraph (0.30 on); elsewhere its capture is refused by name, whether the user
        # or vLLM's per-model default chose the v2 runner; every name found, and put back
        from npugraph.integrations.vllm import runner_v2

        served = result.generation == "sept-2026"
        assert runner_v2.available() == served
        base = importlib.import_module("vllm.v1.worker.gpu.cudagraph_utils").CudaGraphManager
        try:
            manager_cls = importlib.import_module("vllm_ascend.worker.v2.aclgraph_utils").ModelAclGraphManager
        except (ImportError, AttributeError):  # a release without the v2 runner's manager
            manager_cls = None
        replays = ("_updatable_graph_replay", "_graph_relay") if served else ()
        before = (base.capture, *(getattr(manager_cls, n) for n in replays))
        replaced = runner_v2.install()
        assert len(replaced) == 1 + len(replays), replaced
        assert base.capture is not before[0]
        assert all(getattr(manager_cls, n) is not was for n, was in zip(replays, before[1:]))
        if manager_cls is not None and not served:
            # vllm-ascend's own manager, uninitialised: refused before it captures anything
            with pytest.raises(ConfigError, match=r"runner v2.*VLLM_USE_V2_MODEL_RUNNER=0"):
                base.capture(object.__new__(manager_cls), lambda *_: None)
        runner_v2.uninstall()
        assert (base.capture, *(getattr(manager_cls, n) for n in replays)) == before
        # uninstall() puts every name back: none is npugraph's, no kept original is left behind
        ascend.uninstall()
        still = [label for label in result.replaced if _npugraphs(pkgutil.resolve_name(label))]
        assert still == [], f"not put back: {still}"
        kept = [
            f"{owner.__name__}.{n}"
            for m in list(sys.modules.values())
            if getattr(m, "__name__", "").startswith("vllm_ascend")
            for owner in (m, *(v for v in vars(m).values() if isinstance(v, type)))
            for n in list(vars(owner))
            if n.startswith("_npugraph_original_")
        ]
        assert kept == []
    finally:
        ascend.uninstall()
        _purge()
        sim.uninstall_torch_npu()


def _npugraphs(obj: object) -> bool:
    return getattr(obj, "__module__", "").startswith("npugraph")
