"""Attention beyond GQA decode: MLA, FIA v2 and sliding windows through the same path.

Each form runs captured and replayed, bitwise against the same step run eagerly and
against the float64-attention reference (``Decoder.reference_logits``), in both update
orders and under adversarial scheduling.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import npusim as sim
from npugraph import AttentionMetadata, MLAAttention, Runtime
from npugraph.cli import main
from npugraph.dump.cli import inspect
from npugraph.errors import ConfigError
from npugraph.models import Decoder, DecoderConfig, MLADecoder, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.policy import StaticPolicy
from npugraph.reference import paged_attention_reference

SIZES = [1, 4, 8]
REF_TOL = 0.06  # bf16 logits, relative to the largest


def _engine(kind, order="update-first", policy=None, layers=4):
    cfg = DecoderConfig(layers=layers, num_blocks=128, max_model_len=256, window=24 if kind == "gemma-like" else None)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, order=order, policy=policy)
    model = (MLADecoder if kind == "mla" else Decoder)(cfg, rt)
    eng = DecodeEngine(rt, model, SIZES)
    eng.capture()
    return cfg, rt, model, eng


def _run(cfg, eng, steps, seed=0, adversarial=False):
    for i, b in enumerate(Workload(cfg, SIZES, seed=seed, adversarial=adversarial).steps(steps)):
        ref = eng.eager(b).clone()
        got = eng.step(b).clone()
        assert torch.equal(got, ref), f"step {i} differs from eager"
        if i % 4 == 0:
            lens = b.meta.seq_lens.tolist()
            ind = eng.model.reference_logits(
                b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table
            )
            assert (got - ind).abs().max() < REF_TOL * ind.abs().max(), f"step {i} from the float64 reference"


@pytest.mark.parametrize("order", ["update-first", "replay-first"])
@pytest.mark.parametrize("kind", ["mla", "gemma-like"])
def test_model_replays_like_eager_and_the_reference(kind, order):
    cfg, rt, model, eng = _engine(kind, order)
    kernels = {e.key: e.choice.kernel for e in rt.manager.entries()}
    assert set(kernels.values()) == ({"mla"} if kind == "mla" else {"fia"}), kernels
    _run(cfg, eng, 16)


@pytest.mark.parametrize("kind", ["mla", "gemma-like"])
def test_model_under_adversarial_scheduling(kind):
    sim.configure(adversarial_seed=7)
    cfg, rt, model, eng = _engine(kind, "replay-first")
    _run(cfg, eng, 10, seed=3, adversarial=True)


def test_gemma_like_layers_are_windowed_in_their_own_group():
    cfg, rt, model, eng = _engine("gemma-like")
    assert model.groups == ("window", "global")
    entry = rt.manager.entry("main", 8)
    assert [t.group for t in entry.tasks] == ["window", "window", "window", "global"]
    args = entry.tasks[0].args
    assert args["sparse_mode"] == 4 and args["pre_tokens"] == 23 and args["next_tokens"] == 0
    assert entry.tasks[3].args["sparse_mode"] == 0
    assert "sliding window" in entry.choice.reason, "the policy says why PA is not used"


def test_the_window_changes_the_result():
    """A windowed layer over long sequences must not equal the same layer without the window."""
    cfg, rt, model, eng = _engine("gemma-like", layers=1)
    b = next(b for b in Workload(cfg, SIZES, seed=1).steps(40) if int(b.meta.seq_lens.max()) > 40)
    got = eng.step(b).clone()
    lens = b.meta.seq_lens.tolist()
    ind = model.reference_logits(b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table)
    window, model.layers[0].attn.window = model.layers[0].attn.window, None
    full = model.reference_logits(b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table)
    model.layers[0].attn.window = window
    assert (got - ind).abs().max() < REF_TOL * ind.abs().max()
    assert (got - full).abs().max() > REF_TOL * full.abs().max()


def test_fia_v2_declaration_with_windows():
    policy = StaticPolicy(frozenset(), fia="fia_v2")
    cfg, rt, model, eng = _engine("gemma-like", policy=policy)
    entry = rt.manager.entry("main", 4)
    assert {t.spec.name for t in entry.tasks} == {"fia_v2"}
    assert set(entry.tasks[0].spec.host_args) == {"actual_seq_qlen", "actual_seq_kvlen"}
    _run(cfg, eng, 10)
    text = inspect(rt.manifest(), "4")
    assert "actual_seq_kvlen (last)" in text and "npu_fused_infer_attention_score_v2" in json.dumps(rt.manifest())


def test_mla_manifest_shows_the_rope_arguments_and_host_lengths():
    cfg, rt, model, eng = _engine("mla")
    _run(cfg, eng, 8)
    doc = rt.manifest()
    used = next(k["key"] for k in doc["namespaces"]["main"]["keys"] if k["steps"])
    text = inspect(doc, used)
    assert "query_rope" in text and "key_rope" in text and "actual_seq_lengths_kv (last)" in text
    key = rt.manifest()["namespaces"]["main"]["keys"][-1]
    assert key["kernel"] == "mla" and "PA cannot run MLA" in key["kernel_reason"]


def test_speculative_mla_against_the_reference():
    """Two tokens per request (MTP verification), causal within each request; padding requests give zeros."""
    rt = Runtime("sim", max_model_len=128)
    r, dr, heads, bs, nb = 32, 8, 4, 16, 40
    gen = torch.Generator().manual_seed(0)
    dev = rt.device.memory
    latent = torch.randn(nb, bs, 1, r, generator=gen).half().to(dev)
    rope = torch.randn(nb, bs, 1, dr, generator=gen).half().to(dev)
    attn = MLAAttention(rt, "mla", num_heads=heads, kv_lora_rank=r, rope_dim=dr, tokens_per_request=2)
    q_lat = torch.zeros(8, heads, r, dtype=torch.float16, device=dev)
    q_pe = torch.zeros(8, heads, dr, dtype=torch.float16, device=dev)
    table = torch.zeros(4, 8, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(seq_lens=torch.full((4,), 2, dtype=torch.int32), block_table=table)
    rt.capture(
        lambda: attn(q_lat, q_pe, latent, rope, meta), key=4, tokens=8, static_inputs={"q_lat": q_lat, "q_pe": q_pe}
    )
    for step, reqs in enumerate([3, 4, 1]):
        lens = [int(x) for x in torch.randint(2, 128, (reqs,), generator=gen)]
        tab = torch.stack([torch.randperm(nb, generator=gen)[:8] for _ in range(reqs)]).int()
        m = AttentionMetadata(
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=tab,
            query_start_loc=torch.arange(0, 2 * reqs + 1, 2, dtype=torch.int32),
        )
        ql, qp = torch.randn(8, heads, r, generator=gen).half(), torch.randn(8, heads, dr, generator=gen).half()
        out = rt.step(4, {"default": m}, inputs={"q_lat": ql, "q_pe": qp})
        rt.synchronize()
        ref = paged_attention_reference(
            torch.cat([ql, qp], -1), torch.cat([latent, rope], -1), latent, tab, lens, attn.scale, [2] * reqs
        )
        assert (out[: 2 * reqs].cpu().double() - ref).abs().max() < 4e-3, step
        assert not out[2 * reqs :].any(), "padding requests give zeros"


@pytest.mark.parametrize("model", ["mla", "gemma-like"])
def test_demo_runs_each_model_with_no_mismatch(model, tmp_path, capsys):
    path = tmp_path / "s.json"
    argv = ["demo", "--model", model, "--steps", "60", "--layers", "2", "--sizes", "1,4,8", "--no-progress"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "60 steps, 0 mismatches" in out and "0 beyond tolerance" in out
    doc = json.loads(path.read_text())
    assert doc["model"] == model and doc["mismatches"] == 0 and doc["steps"] == 60 and "kernel_by_size" in doc


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_padding_tokens_write_no_kv_slot_not_even_in_block_0(kind):
    """After padded, replayed steps the KV caches equal those of the same steps run eagerly
    on the real tokens alone (no padding at all), and every slot no real token owns keeps
    its value.  Requests own block 0 here; inputs are passed unpadded, so the runtime's own
    padding of ``slot_mapping`` is what is checked."""
    cfg = DecoderConfig(layers=2, num_blocks=24, max_model_len=128, dtype=torch.float32)
    make = MLADecoder if kind == "mla" else Decoder
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    model = make(cfg, rt)
    eng = DecodeEngine(rt, model, [4, 8])
    eng.capture()
    ref_rt = Runtime("sim", max_model_len=cfg.max_model_len)
    ref = make(cfg, ref_rt)  # the same seed: the same weights
    names = ("latent_cache", "rope_cache") if kind == "mla" else ("k_cache", "v_cache")
    caches = [getattr(layer, n) for layer in model.layers for n in names]
    ref_caches = [getattr(layer, n) for layer in ref.layers for n in names]
    assert len(caches) == 2 * cfg.layers
    for c in caches + ref_caches:
        c.fill_(7.0)  # a value no write produces
    written: set[int] = set()
    padded = 0
    for b in Workload(cfg, [4, 8], seed=3, max_batch=6).steps(40):
        r = b.num_reqs
        real = b.slot_mapping[:r]
        written.update(real.tolist())
        padded += b.size > r
        inputs = {"input_ids": b.input_ids[:r], "positions": b.positions[:r], "slot_mapping": real}
        rt.step(b.size, eng.metadata(b.meta), inputs=inputs)  # padded by the runtime
        rt.synchronize()
        dev = ref_rt.device.memory
        ref(b.input_ids[:r].to(dev), b.positions[:r].to(dev), real.to(dev), b.meta)  # eager, real tokens only
        ref_rt.synchronize()
    assert padded > 20 and any(s < cfg.block_size for s in written), "padded steps; block 0 belonged to a request"
    for c, want in zip(caches, ref_caches):
        assert torch.allclose(c, want, atol=1e-4), "a padding token overwrote a real token's key or value"
        flat = c.view(-1, *c.shape[2:])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[sorted(written)] = False
        assert (flat[untouched] == 7.0).all(), "a padding token wrote a slot no real token owns"


@pytest.mark.parametrize(
    ("model", "cfg", "says"),
    [
        (Decoder, DecoderConfig(head_size=3), "head_size must be even"),
        (MLADecoder, DecoderConfig(rope_dim=5), "rope_dim must be even"),
        (Decoder, DecoderConfig(heads=4, kv_heads=3), "num_heads (4) must be a positive multiple of num_kv_heads (3)"),
    ],
)
def test_models_refuse_shapes_they_cannot_run_when_built(model, cfg, says):
    rt = Runtime("sim", max_model_len=cfg.max_model_len)
    with pytest.raises(ConfigError, match=re.escape(says)):
        model(cfg, rt)
    assert not rt.manager.entries(), "nothing captured"


def test_mla_keeps_any_head_size():
    # MLA's rotary part is rope_dim wide; head_size plays no part in it
    MLADecoder(DecoderConfig(layers=1, head_size=3), Runtime("sim", max_model_len=512))


def test_workload_refuses_a_max_model_len_no_request_fits():
    with pytest.raises(ConfigError, match="max_model_len must be at least 3"):
        Workload(DecoderConfig(max_model_len=2), [1])
    Workload(DecoderConfig(max_model_len=3), [1])  # the least it runs
