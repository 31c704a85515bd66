"""The kernels SGLang's Ascend path calls, against float64 references written here from each
kernel's definition (element by element where that is clearer; no simulator code on the
reference's path): torch_npu's ``npu_gemma_rms_norm``, ``npu_rotary_mul``, ``npu_mrope`` and
``_npu_flash_attention_qlens``, and sgl_kernel_npu's ``split_qkv_rmsnorm_rope`` and
``alloc_extend_kernel``.  Each runs on npu tensors, and the decode-path ones inside a captured
graph too (SGLang captures its whole decode layer)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu
from npusim.kernels.dense import split_qkv_rmsnorm_rope


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _turn_pair(xa, xb, c, s):
    return xa * c - xb * s, xb * c + xa * s


def _rope_head(h, cos, sin, neox):
    """Rotate one head (a list of floats) by per-pair angles ``cos``/``sin`` (lists of rot/2)."""
    out, half = list(h), len(cos)
    for i in range(half):
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        out[a], out[b] = _turn_pair(h[a], h[b], cos[i], sin[i])
    return out


def test_gemma_rms_norm_scales_by_one_plus_gamma():
    x, gamma = _rand(3, 16), _rand(16, seed=1)
    y, rstd = torch_npu.npu_gemma_rms_norm(x.npu(), gamma.npu(), 1e-6)
    for i in range(3):
        row = [float(v) for v in x[i]]
        r = 1 / math.sqrt(sum(v * v for v in row) / 16 + 1e-6)
        want = [v * r * (1 + float(g)) for v, g in zip(row, gamma)]
        assert max(abs(float(a) - b) for a, b in zip(y.cpu()[i], want)) < 3e-2
        assert abs(float(rstd.cpu()[i, 0]) - r) < 1e-4


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_is_x_r1_plus_rotated_x_r2(mode):
    x, r1, r2 = _rand(2, 3, 8), _rand(2, 1, 8, seed=1), _rand(2, 1, 8, seed=2)
    out = torch_npu.npu_rotary_mul(x.npu(), r1.npu(), r2.npu(), rotary_mode=mode).cpu().double()
    for b in range(2):
        for h in range(3):
            v = [float(t) for t in x[b, h]]
            if mode == "half":
                turned = [-v[i + 4] for i in range(4)] + [v[i] for i in range(4)]
            else:
                turned = [(-v[i + 1] if i % 2 == 0 else v[i - 1]) for i in range(8)]
            want = [v[i] * float(r1[b, 0, i]) + turned[i] * float(r2[b, 0, i]) for i in range(8)]
            assert max(abs(float(out[b, h, i]) - want[i]) for i in range(8)) < 3e-2
    with pytest.raises(ValueError, match="'r1'"):
        torch_npu.npu_rotary_mul(x.npu(), _rand(5, 1, 8).npu(), r2.npu())


def _cache(positions, rot):
    angles = torch.arange(positions).double()[:, None] * (1e-1 ** (torch.arange(rot // 2).double() / (rot // 2)))
    return torch.cat((angles.cos(), angles.sin()), dim=1)


@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("rot", [16, 8])
def test_mrope_with_plain_positions_is_rope(mode, rot):
    head, heads, kv_heads, tokens = 16, 4, 2, 5
    cache = _cache(64, rot)
    pos = torch.tensor([0, 3, 7, 7, 63])
    q, k = _rand(tokens, heads * head), _rand(tokens, kv_heads * head, seed=1)
    qo, ko = torch_npu.npu_mrope(
        pos.npu(), q.npu(), k.npu(), cache.to(torch.bfloat16).npu(), head, mrope_section=[0, 0, 0], rotary_mode=mode
    )
    for x, got in ((q, qo), (k, ko)):
        assert got.shape == x.shape and got.dtype == x.dtype
        for t in range(tokens):
            c16 = cache.to(torch.bfloat16).double()[pos[t]]
            cos, sin = c16[: rot // 2].tolist(), c16[rot // 2 :].tolist()
            for h in range(x.shape[1] // head):
                v = [float(u) for u in x[t, h * head : (h + 1) * head]]
                want = _rope_head(v[:rot], cos, sin, mode == "half") + v[rot:]
                assert max(abs(float(a) - b) for a, b in zip(got.cpu()[t, h * head : (h + 1) * head], want)) < 3e-2


def test_mrope_sections_take_their_angles_from_their_own_position_rows():
    head, rot, tokens = 16, 16, 3
    cache = _cache(32, rot)
    pos = torch.tensor([[1, 2, 3], [10, 11, 12], [20, 21, 22]])
    section = [2, 3, 3]
    q, k = _rand(tokens, head), _rand(tokens, head, seed=1)
    qo, _ = torch_npu.npu_mrope(pos.npu(), q.npu(), k.npu(), cache.to(torch.float32).npu(), head, mrope_section=section)
    for t in range(tokens):
        row = [0] * section[0] + [1] * section[1] + [2] * section[2]  # pair i's angle: its section's row
        cos = [float(cache[pos[row[i], t], i]) for i in range(rot // 2)]
        sin = [float(cache[pos[row[i], t], rot // 2 + i]) for i in range(rot // 2)]
        want = _rope_head([float(u) for u in q[t]], cos, sin, True)
        assert max(abs(float(a) - b) for a, b in zip(qo.cpu()[t], want)) < 3e-2
    with pytest.raises(ValueError, match="'mrope_section'"):
        torch_npu.npu_mrope(pos.npu(), q.npu(), k.npu(), cache.float().npu(), head, mrope_section=[1, 1, 1])


def _split_ref(x, sin, cos, qs, kvs, hd, eps, qw, kw, qb, kb, neox):
    """q, k, v in float64: per head, RMS-normalise (when eps), then rotate the first rot dims."""
    rot = sin.shape[-1]
    outs = []
    for part, w, b in ((x[:, :qs], qw, qb), (x[:, qs : qs + kvs], kw, kb)):
        res = torch.empty(part.shape, dtype=torch.float64)
        for t in range(part.shape[0]):
            s_row = [float(v) for v in sin[t].reshape(-1)]
            c_row = [float(v) for v in cos[t].reshape(-1)]
            # NeoX reads the rows' halves; otherwise each pair uses the first half's value
            half_s, half_c = s_row[: rot // 2], c_row[: rot // 2]
            for h in range(part.shape[1] // hd):
                v = [float(u) for u in part[t, h * hd : (h + 1) * hd]]
                if eps is not None:
                    r = 1 / math.sqrt(sum(u * u for u in v) / hd + eps)
                    v = [u * r * float(w[i]) + (float(b[i]) if b is not None else 0.0) for i, u in enumerate(v)]
                res[t, h * hd : (h + 1) * hd] = torch.tensor(_rope_head(v[:rot], half_c, half_s, neox) + v[rot:])
        outs.append(res)
    outs.append(x[:, qs + kvs :].double())
    return outs


@settings(max_examples=10, deadline=None)
@given(
    tokens=st.integers(1, 4),
    neox=st.booleans(),
    norm=st.booleans(),
    bias=st.booleans(),
    rot=st.sampled_from([16, 8]),
    seed=st.integers(0, 50),
)
def test_split_qkv_rmsnorm_rope_matches_the_definition(tokens, neox, norm, bias, rot, seed):
    hd, q_heads, kv_heads = 16, 4, 2
    qs, kvs = q_heads * hd, kv_heads * hd
    x = _rand(tokens, qs + 2 * kvs, seed=seed)
    angles = torch.rand(tokens, rot // 2, generator=torch.Generator().manual_seed(seed)).double() * 3
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(torch.bfloat16).view(tokens, 1, 1, rot)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16).view(tokens, 1, 1, rot)
    qw, kw = _rand(hd, seed=seed + 1), _rand(hd, seed=seed + 2)
    qb, kb = (_rand(hd, seed=seed + 3), _rand(hd, seed=seed + 4)) if bias else (None, None)
    eps = 1e-6 if norm else None

    def dev(t):
        return None if t is None else t.npu()

    got = split_qkv_rmsnorm_rope(
        x.npu(), sin.npu(), cos.npu(), qs, kvs, hd, eps, dev(qw), dev(kw), dev(qb), dev(kb), is_neox_style=neox
    )
    want = _split_ref(x, sin.view(tokens, rot), cos.view(tokens, rot), qs, kvs, hd, eps, qw, kw, qb, kb, neox)
    for g, w in zip(got, want):
        assert g.dtype == x.dtype
        assert (g.cpu().double() - w).abs().max() < 6e-2


def test_split_qkv_rmsnorm_rope_refuses_a_malformed_call():
    x = _rand(2, 8 * 16).npu()
    sin = _rand(2, 16).npu()
    with pytest.raises(ValueError, match="'input'"):
        split_qkv_rmsnorm_rope(x, sin, sin, 64, 16, 16)
    with pytest.raises(ValueError, match="'q_weight'"):
        split_qkv_rmsnorm_rope(_rand(2, 96).npu(), sin, sin, 64, 16, 16, eps=1e-6)


def test_split_qkv_rmsnorm_rope_replays_in_a_graph_with_new_inputs():
    hd, qs, kvs, rot = 16, 32, 16, 16
    x = _rand(2, qs + 2 * kvs).npu()
    angles = torch.rand(2, rot // 2, generator=torch.Generator().manual_seed(1)).double() * 3
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(torch.bfloat16).npu()  # SGLang's rows: halves repeated
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16).npu()
    g = npu.NPUGraph()
    s = npu.Stream()
    with npu.stream(s), npu.graph(g, stream=s):
        q, k, v = split_qkv_rmsnorm_rope(x, sin, cos, qs, kvs, hd)
    fresh = _rand(2, qs + 2 * kvs, seed=7)
    x.copy_(fresh.npu())
    g.replay()
    npu.synchronize()
    want = _split_ref(fresh, sin.cpu(), cos.cpu(), qs, kvs, hd, None, None, None, None, None, True)
    for got, w in zip((q, k, v), want):
        assert (got.cpu().double() - w).abs().max() < 6e-2


def _paged(cache_rows, table, length, page):
    """Positions [0, length) of one request through its page table."""
    return [cache_rows[int(table[p // page]) * page + p % page] for p in range(length)]


@settings(max_examples=8, deadline=None)
@given(
    q_lens=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    prefix=st.lists(st.integers(0, 9), min_size=3, max_size=3),
    seed=st.integers(0, 50),
)
def test_flash_attention_qlens_is_causal_attention_over_a_prefix(q_lens, prefix, seed):
    page, heads, kv_heads, d = 4, 4, 2, 8
    b = len(q_lens)
    kv_lens = [q + p for q, p in zip(q_lens, prefix)]
    pages = 5
    table = torch.randperm(b * pages, generator=torch.Generator().manual_seed(seed))[: b * pages].view(b, pages)
    kc, vc = _rand(b * pages, page, kv_heads, d, seed=seed), _rand(b * pages, page, kv_heads, d, seed=seed + 1)
    q = _rand(sum(q_lens), heads * d, seed=seed + 2)
    out = torch.empty_like(q).npu()
    mask = torch.triu(torch.ones(128, 128), 1).to(torch.bfloat16)
    torch_npu._npu_flash_attention_qlens(
        query=q.npu(),
        key_cache=kc.npu(),
        value_cache=vc.npu(),
        block_table=table.int().npu(),
        mask=mask.npu(),
        seq_len=torch.tensor(q_lens, dtype=torch.int32),
        context_lens=torch.tensor(kv_lens, dtype=torch.int32),
        num_kv_heads=kv_heads,
        num_heads=heads,
        scale_value=0.3,
        out=out,
    )
    got = out.cpu().double().view(-1, heads, d)
    row = 0
    for r in range(b):
        keys = _paged(kc.double().view(-1, kv_heads, d), table[r], kv_lens[r], page)
        values = _paged(vc.double().view(-1, kv_heads, d), table[r], kv_lens[r], page)
        for i in range(q_lens[r]):
            position = kv_lens[r] - q_lens[r] + i  # the new token's own position: it sees up to it
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                qv = q.double().view(-1, heads, d)[row, h]
                scores = [0.3 * float(qv @ keys[j][kvh]) for j in range(position + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                want = sum(w * values[j][kvh] for j, w in enumerate(weights)) / sum(weights)
                assert (got[row, h] - want).abs().max() < 5e-2
            row += 1


def test_flash_attention_qlens_refuses_lengths_and_masks_it_cannot_take():
    kc = _rand(2, 4, 1, 8).npu()
    args = dict(
        query=_rand(3, 8).npu(),
        key_cache=kc,
        value_cache=kc,
        block_table=torch.tensor([[0, 1]], dtype=torch.int32).npu(),
        mask=torch.triu(torch.ones(128, 128), 1).to(torch.bfloat16).npu(),
        seq_len=torch.tensor([3], dtype=torch.int32),
        context_lens=torch.tensor([9], dtype=torch.int32),
        num_kv_heads=1,
        num_heads=1,
        scale_value=1.0,
        out=_rand(3, 8).npu(),
    )
    with pytest.raises(ValueError, match=r"context_lens\[0\]"):  # 9 tokens in 2 pages of 4
        torch_npu._npu_flash_attention_qlens(**args)
    with pytest.raises(ValueError, match="'seq_len'"):
        torch_npu._npu_flash_attention_qlens(**{**args, "seq_len": torch.tensor([3])})
    bad_mask = {**args, "context_lens": torch.tensor([5], dtype=torch.int32), "mask": torch.zeros(128, 128).npu()}
    with pytest.raises(ValueError, match="_npu_flash_attention_qlens: argument 'mask' is not the compressed causal"):
        torch_npu._npu_flash_attention_qlens(**bad_mask)
        npu.synchronize()


def _slots_ref(pre, seq, last, free, page):
    """Each new token's slot: on in the request's last page, then its new pages in turn."""
    out, taken = [], 0
    for r in range(len(pre)):
        new_pages = []
        for p in range(pre[r], seq[r]):
            if pre[r] and p // page == (pre[r] - 1) // page:  # the page the prefix ends in
                out.append(last[r] + (p - (pre[r] - 1)))
                continue
            if p % page == 0 or not new_pages:
                new_pages.append(free[taken])
                taken += 1
            out.append(new_pages[-1] * page + p % page)
    return out


@settings(max_examples=15, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20)), min_size=1, max_size=4),
    seed=st.integers(0, 50),
)
def test_alloc_extend_kernel_takes_the_last_page_then_free_pages(data, seed):
    page = 4
    pre = [p for p, _ in data]
    seq = [p + n for p, n in data]
    # each request's prefix ends in a page of its own (slot = page id * page + offset)
    last = [(100 + 10 * r) * page + (p - 1) % page if p else -1 for r, p in enumerate(pre)]
    free = torch.randperm(40, generator=torch.Generator().manual_seed(seed)) + 1
    want = _slots_ref(pre, seq, last, free.tolist(), page)
    out = torch.full((len(want),), -7, dtype=torch.int64).npu()
    alloc = importlib.import_module("npusim.surfaces.sgl_kernel_npu.mem_cache.allocator").alloc_extend_kernel
    alloc[(len(data),)](
        torch.tensor(pre).npu(),
        torch.tensor(seq).npu(),
        torch.tensor(last).npu(),
        free.npu(),
        out,
        8,
        page,
        64,
    )
    assert out.cpu().tolist() == want


def test_format_cast_keeps_the_values_in_new_storage_and_nd_in_place():
    w = _rand(4, 6).npu()
    nz = torch_npu.npu_format_cast(w, 29)  # FRACTAL_NZ: what MLA and quantised weights are cast to
    assert torch.equal(nz.cpu(), w.cpu()) and nz.data_ptr() != w.data_ptr()
    nz.zero_()
    assert not torch.equal(nz.cpu(), w.cpu()), "a cast makes new storage: writing it leaves the source"
    assert torch_npu.npu_format_cast(w, 2) is w, "ND: the tensor is in that format already"
    with pytest.raises(ValueError, match="'acl_format'"):
        torch_npu.npu_format_cast(w, "NZ")
