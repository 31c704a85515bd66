from __future__ import annotations

import torch

from npugraph import Runtime
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine

SIZES = [1, 2, 4, 8, 16]


def build(sizes=SIZES, layers=4, order="update-first", policy=None, **rt_kwargs):
    cfg = DecoderConfig(layers=layers, num_blocks=160, max_model_len=256)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, order=order, policy=policy, **rt_kwargs)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, sizes)
    eng.capture()
    return cfg, rt, model, eng


def run(eng, cfg, steps, seed=0, adversarial=False):
    """Replay ``steps`` continuous-batching steps; return the number of mismatches vs eager."""
    wl = Workload(cfg, eng.sizes, seed=seed, adversarial=adversarial)
    mismatches = 0
    for batch in wl.steps(steps):
        ref = eng.eager(batch).clone()
        out = eng.step(batch).clone()
        if not torch.equal(ref, out):
            mismatches += 1
        wl.feedback(batch.rids, out.argmax(-1).tolist())
    return mismatches


def reference_logits(decoder, input_ids, positions, slot_mapping, seq_lens, query_lens, block_table):
    """The decoder's logits for the real tokens, with attention from the float64 reference.

    Written without npugraph's runtime path (no padding, no conversion, no op
    declarations, no simulator kernel): the step's keys and values go into *copies* of
    the caches, and each request attends over its own history gathered position by
    position (``npugraph.reference``).  Only the real tokens (``sum(query_lens)``) are used.
    """
    from npugraph.models.llama import _rope
    from npugraph.reference import paged_attention_reference

    cfg = decoder.cfg
    n = sum(query_lens)
    ids, pos, slots = input_ids[:n], positions[:n], slot_mapping[:n]
    with torch.no_grad():
        x = decoder.embed(ids)
        cos, sin = decoder.cos[pos], decoder.sin[pos]
        for layer in decoder.layers:
            qkv = layer.qkv(layer.norm1(x))
            q, k, v = qkv.split(
                [cfg.heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.kv_heads * cfg.head_size], dim=-1
            )
            q = _rope(q.reshape(n, cfg.heads, cfg.head_size), cos, sin)
            k = _rope(k.reshape(n, cfg.kv_heads, cfg.head_size), cos, sin)
            v = v.reshape(n, cfg.kv_heads, cfg.head_size)
            kc, vc = layer.k_cache.clone(), layer.v_cache.clone()
            for i in range(n):
                s = int(slots[i])
                kc[s // cfg.block_size, s % cfg.block_size] = k[i]
                vc[s // cfg.block_size, s % cfg.block_size] = v[i]
            a = paged_attention_reference(q, kc, vc, block_table, seq_lens, layer.attn.scale, query_lens)
            x = x + layer.o(a.to(x.dtype).reshape(n, -1))
            gate, up = layer.gate_up(layer.norm2(x)).chunk(2, dim=-1)
            x = x + layer.down(torch.nn.functional.silu(gate) * up)
        head = decoder.lm_head
        head = getattr(head, "inner", head)
        return head(decoder.norm(x)).float()
