"""PA and FIA against an independent oracle: float64 SDPA on K/V gathered per request.

Tolerances (max abs error, inputs ~N(0, 1), outputs are convex mixes of V rows):
float32 1e-4, float16 4e-3, bfloat16 3e-2 — the kernels cast probabilities to the
input dtype before the V product, as the NPU kernels do.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu
from tests.helpers import close_on_host, equal_on_host

DEVICE = "npu"  # device memory: the simulator's npu device


TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _visible(sq, sk, causal):
    """[Sq, Sk] bool: which keys each query row sees (bottom-right causal anchor)."""
    i = torch.arange(sq, device="cpu").unsqueeze(1)
    j = torch.arange(sk, device="cpu").unsqueeze(0)
    return (j <= i + (sk - sq)) if causal else torch.ones(sq, sk, dtype=torch.bool, device="cpu")


def _oracle(q, k, v, scale, causal=False):
    """q [N, Sq, D], k/v [KVN, Sk, D] → [N, Sq, Dv] in float64, on the host; a row that sees no key → zeros."""
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    n, kvn = q.shape[0], k.shape[0]
    sq, sk = q.shape[1], k.shape[1]
    out = torch.zeros(n, sq, v.shape[-1], dtype=torch.float64, device="cpu")
    if sk == 0:
        return out
    k = k.double().repeat_interleave(n // kvn, 0)
    v = v.double().repeat_interleave(n // kvn, 0)
    mask = _visible(sq, sk, causal)
    rows = mask.any(-1)
    if rows.any():
        ref = F.scaled_dot_product_attention(q.double()[:, rows], k, v, attn_mask=mask[rows], scale=scale)
        out[:, rows] = ref
    return out


def _gather(cache, table_row, length, bs):
    """cache [NB, BS, KVN, D] → [KVN, length, D] by an independent per-position loop, on the host."""
    cache, table_row = cache.cpu(), table_row.cpu()
    rows = [cache[int(table_row[p // bs]), p % bs] for p in range(length)]
    if not rows:
        return cache.new_zeros(cache.shape[2], 0, cache.shape[3])
    return torch.stack(rows, 0).transpose(0, 1)


@settings(max_examples=40, deadline=None)
@given(
    dtype=DTYPES,
    t=st.integers(1, 5),
    kvn=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([8, 32, 64, 128]),  # 64 and 128: the head sizes npugraph sends to PA
    bs=st.sampled_from([16, 32]),  # ATB PagedAttention: a multiple of 16
    data=st.data(),
)
def test_pa_matches_oracle(dtype, t, kvn, group, d, bs, data):
    n = kvn * group
    cols = data.draw(st.integers(1, 6))
    nb = data.draw(st.integers(cols, 3 * cols + 2))
    lens = data.draw(st.lists(st.integers(0, cols * bs), min_size=t, max_size=t))
    q = torch.randn(t, n, d, dtype=dtype, device=DEVICE)
    kc = torch.randn(nb, bs, kvn, d, dtype=dtype, device=DEVICE)
    vc = torch.randn(nb, bs, kvn, d, dtype=dtype, device=DEVICE)
    bt = torch.stack([torch.randperm(nb, device=DEVICE)[:cols] for _ in range(t)]).to(torch.int32)
    out = torch.empty(t, n, d, dtype=dtype, device=DEVICE)
    scale = 1 / math.sqrt(d)
    cl = torch.tensor(lens, dtype=torch.int32)
    torch_npu._npu_paged_attention(q, kc, vc, kvn, n, scale, bt, cl, out)
    npu.synchronize()
    for i in range(t):
        k = _gather(kc, bt[i], lens[i], bs)
        v = _gather(vc, bt[i], lens[i], bs)
        ref = _oracle(q[i].unsqueeze(1), k, v, scale).squeeze(1)
        err = (out[i].cpu().double() - ref).abs().max().item()
        assert err <= TOL[dtype], (i, lens[i], err)


@settings(max_examples=30, deadline=None)
@given(
    dtype=DTYPES,
    kvn=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    bs=st.sampled_from([2, 8]),
    qper=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    causal=st.booleans(),
    data=st.data(),
)
def test_fia_tnd_paged_matches_oracle(dtype, kvn, group, bs, qper, causal, data):
    n, d = kvn * group, data.draw(st.sampled_from([16, 64, 128]))
    b = len(qper)
    if sum(qper) == 0:
        qper[0] = 1
    cols = 4
    nb = 12
    # keys may be fewer than the queries, or none: npugraph's padding rows have a query and no key
    kvl = [data.draw(st.integers(0, cols * bs)) for _ in qper]
    t = sum(qper)
    ends = [sum(qper[: i + 1]) for i in range(b)]
    q = torch.randn(t, n, d, dtype=dtype, device=DEVICE)
    kc = torch.randn(nb, bs, kvn * d, dtype=dtype, device=DEVICE)
    vc = torch.randn(nb, bs, kvn * d, dtype=dtype, device=DEVICE)
    bt = torch.stack([torch.randperm(nb, device=DEVICE)[:cols] for _ in range(b)]).to(torch.int32)
    scale = 0.3
    kw = dict(
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kvl,
        block_table=bt,
        num_heads=n,
        num_key_value_heads=kvn,
        scale=scale,
        input_layout="TND",
        block_size=bs,
        softmax_lse_flag=True,
    )
    if causal:
        kw.update(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=DEVICE), 1))
    out, lse = torch_npu.npu_fused_infer_attention_score(q, kc, vc, **kw)
    npu.synchronize()
    assert out.shape == (t, n, d) and lse.shape == (t, n, 1) and lse.dtype == torch.float32
    start = 0
    for i in range(b):
        qi = q.cpu()[start : ends[i]].transpose(0, 1)  # [N, Sq, D]
        k = _gather(kc.view(nb, bs, kvn, d), bt[i], kvl[i], bs)
        v = _gather(vc.view(nb, bs, kvn, d), bt[i], kvl[i], bs)
        ref = _oracle(qi, k, v, scale, causal=causal).transpose(0, 1)
        if ends[i] > start:
            err = (out[start : ends[i]].cpu().double() - ref).abs().max().item()
            assert err <= TOL[dtype]
            if kvl[i]:
                s = qi.double() @ k.double().repeat_interleave(group, 0).transpose(-1, -2) * scale
                s = s.masked_fill(~_visible(qi.shape[1], kvl[i], causal), float("-inf"))
                ref_lse = torch.logsumexp(s, -1).transpose(0, 1)  # -inf where a row sees no key
                got = lse.cpu()[start : ends[i], :, 0].double()
                seen = torch.isfinite(ref_lse)
                assert close_on_host(got[seen], ref_lse[seen], atol=1e-3)
                assert not torch.isfinite(got[~seen]).any() or not got[~seen].ne(0).any()
        start = ends[i]


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("sq", [1, 3])
def test_fia_dense_layouts_match_oracle(layout, sq):
    b, n, kvn, d, sk = 3, 4, 2, 16, 7
    qb = torch.randn(b, n, sq, d, device=DEVICE)
    kb = torch.randn(b, kvn, sk, d, device=DEVICE)
    vb = torch.randn(b, kvn, sk, d, device=DEVICE)
    kv_lens = [7, 3, 0]
    conv = {
        "BNSD": lambda x: x,
        "BSND": lambda x: x.transpose(1, 2).contiguous(),
        "BSH": lambda x: x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1).contiguous(),
    }[layout]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        conv(qb),
        conv(kb),
        conv(vb),
        num_heads=n,
        num_key_value_heads=kvn,
        scale=0.25,
        input_layout=layout,
        actual_seq_lengths_kv=kv_lens,
    )
    npu.synchronize()
    for i in range(b):
        ref = _oracle(qb[i], kb[i, :, : kv_lens[i]], vb[i, :, : kv_lens[i]], 0.25)
        assert close_on_host(out[i].double(), conv(ref.unsqueeze(0))[0], atol=1e-4)


def test_actual_seq_lengths_ignored_when_query_length_is_one():
    q = torch.randn(1, 4, 1, 8, device=DEVICE)
    k = torch.randn(1, 4, 5, 8, device=DEVICE)
    a, _ = torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=4, input_layout="BNSD", actual_seq_lengths=[29])
    b, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=4, input_layout="BNSD", actual_seq_lengths=[100]
    )
    npu.synchronize()
    assert equal_on_host(a, b)


def test_pa_bad_inputs_name_the_argument():
    q = torch.randn(2, 4, 8, dtype=torch.float16, device=DEVICE)
    kc = torch.randn(4, 16, 2, 8, dtype=torch.float16, device=DEVICE)
    out = torch.empty_like(q)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    ok = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="'block_table' must be int32"):
        torch_npu._npu_paged_attention(q, kc, kc, 2, 4, 1.0, bt.long(), ok, out)
    with pytest.raises(ValueError, match=r"'context_lens\[1\]' = 33 is outside \[0, 32\]"):
        torch_npu._npu_paged_attention(q, kc, kc, 2, 4, 1.0, bt, torch.tensor([3, 33], dtype=torch.int32), out)
    small = torch.randn(4, 4, 2, 8, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="block size 4 is not a multiple of 16 \\(ATB PagedAttention requires it\\)"):
        torch_npu._npu_paged_attention(q, small, small, 2, 4, 1.0, bt, ok, out)
    with pytest.raises(ValueError, match="'num_kv_heads' is 1 but key_cache has 2"):
        torch_npu._npu_paged_attention(q, kc, kc, 1, 4, 1.0, bt, ok, out)
    bad = torch.tensor([[0, 1], [7, 0]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block id 7, outside"):
        torch_npu._npu_paged_attention(q, kc, kc, 2, 4, 1.0, bad, ok, out)
    npu.synchronize()  # the failed launch left the device usable


def test_pa_runs_unequal_head_sizes_as_atb_documents():
    """torch_npu's own PA graph-update test (Ascend910B): block size 128, key head size 288,
    value head size 96 (MLA-style).  ATB PagedAttention (CANN 9.0, ascendtb_01_0198): key and
    value head sizes may differ, each in (0, 576], with block_size <= 128 when one is over 256;
    the 128 x 128 product binds only its quantized, compressed and parallel-decoding cases."""
    g = torch.Generator().manual_seed(0)
    t, n, kvn, bs, dk, dv, nb = 2, 4, 1, 128, 288, 96, 4
    q = torch.randn(t, n, dk, generator=g, device=DEVICE).to(torch.float16)
    kc = torch.randn(nb, bs, kvn, dk, generator=g, device=DEVICE).to(torch.float16)
    vc = torch.randn(nb, bs, kvn, dv, generator=g, device=DEVICE).to(torch.float16)
    bt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=DEVICE)
    lens = [200, 77]
    out = torch.empty(t, n, dv, dtype=torch.float16, device=DEVICE)
    scale = 1 / math.sqrt(dk)
    torch_npu._npu_paged_attention(q, kc, vc, kvn, n, scale, bt, torch.tensor(lens, dtype=torch.int32), out)
    npu.synchronize()
    for i in range(t):
        ref = _oracle(q[i].unsqueeze(1), _gather(kc, bt[i], lens[i], bs), _gather(vc, bt[i], lens[i], bs), scale)
        assert (out[i].cpu().double() - ref.squeeze(1)).abs().max().item() <= TOL[torch.float16]
    # and what ATB refuses: a block over 128 with a head over 256, a head over 576
    big = torch.randn(2, 144, kvn, dk, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match=r"needs block_size <= 128 when a head size is over 256"):
        torch_npu._npu_paged_attention(
            q, big, big[..., :dv], kvn, n, scale, bt, torch.tensor([3, 4], dtype=torch.int32), out
        )
    wide = torch.randn(2, 16, kvn, 600, device=DEVICE).to(torch.float16)
    with pytest.raises(ValueError, match=r"head size 600 is outside ATB PagedAttention's \(0, 576\]"):
        torch_npu._npu_paged_attention(
            torch.randn(t, n, 600, device=DEVICE).to(torch.float16),
            wide,
            vc[:2, :16],
            kvn,
            n,
            scale,
            bt,
            torch.tensor([3, 4], dtype=torch.int32),
            out,
        )


def test_fia_bad_layout_and_heads():
    q = torch.randn(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="'input_layout' must be one of"):
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=4, input_layout="NTD")
    with pytest.raises(ValueError, match="'num_heads' is 3 but query has 4 heads"):
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=3, input_layout="TND", actual_seq_lengths=[2])


def test_fia_takes_a_4_dim_paged_cache_only_as_cann_documents_it():
    """(blocknum, KV_N, blocksize, D) with a BNSD or TND query; a BSND or BSH query takes only
    (blocknum, blocksize, H) (CANN's FIA v2 document, page attention)."""
    nb, bs, kvn, d = 4, 16, 2, 32
    cache = torch.randn(nb, kvn, bs, d, device=DEVICE)
    bt = torch.arange(2, dtype=torch.int32, device=DEVICE).view(2, 1)
    kw = dict(num_heads=4, num_key_value_heads=kvn, block_table=bt, block_size=bs, actual_seq_lengths_kv=[5, 16])
    q = torch.randn(2, 4, d, device=DEVICE)
    tnd, _ = torch_npu.npu_fused_infer_attention_score(
        q, cache, cache, input_layout="TND", actual_seq_lengths=[1, 2], **kw
    )
    three = cache.permute(0, 2, 1, 3).reshape(nb, bs, kvn * d)  # the same cache as (blocknum, blocksize, H)
    flat, _ = torch_npu.npu_fused_infer_attention_score(
        q, three, three, input_layout="TND", actual_seq_lengths=[1, 2], **kw
    )
    npu.synchronize()
    assert torch.equal(tnd.cpu(), flat.cpu())
    with pytest.raises(ValueError, match="with input_layout BSND CANN takes only"):
        torch_npu.npu_fused_infer_attention_score(q.view(2, 1, 4, d), cache, cache, input_layout="BSND", **kw)


@settings(max_examples=40, deadline=None)
@given(bs=st.sampled_from([1, 4, 16]), four=st.booleans(), data=st.data())
def test_a_paged_gather_reads_each_length_then_block_zero(bs, four, data):
    """Positions inside a request's length read its table's blocks; past it, block 0 at the
    same offset (what the kernels mask), whatever the table holds there (a stale id, -1)."""
    from npusim.kernels.numerics import gather_paged

    nb, kvn, d, cols = 9, 2, 3, 4
    b = data.draw(st.integers(1, 5))
    lens = [data.draw(st.integers(0, cols * bs)) for _ in range(b)]
    max_len = data.draw(st.integers(max(lens), cols * bs))
    table = [
        [data.draw(st.integers(0, nb - 1)) if c * bs < n else data.draw(st.integers(-1, 3 * nb)) for c in range(cols)]
        for n in lens
    ]
    cache = torch.arange(nb * bs * kvn * d, dtype=torch.float32).view(nb, bs, kvn, d)
    if four:  # the [blocks, KV heads, block size, D] cache's view, as FIA's gather sees it
        cache = cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    got = gather_paged(cache, torch.tensor(table, dtype=torch.int32), torch.tensor(lens), max_len, bs, "t")
    want = torch.stack(
        [
            torch.stack([cache[table[r][p // bs] if p < lens[r] else 0, p % bs] for p in range(max_len)])
            if max_len
            else cache.new_zeros(0, kvn, d)
            for r in range(b)
        ]
    )
    assert torch.equal(got, want)


@settings(max_examples=15, deadline=None)
@given(four=st.booleans(), data=st.data())
def test_fia_over_a_batch_in_runs_gives_one_runs_bits(four, data):
    """A paged FIA gathers its requests in runs that fit this host's caches (the simulator's
    speed); each run gathers the batch's longest context, so the bits are one run's."""
    import npusim.kernels.fia as fia

    b, kvn, n, d, bs, cols, nb = data.draw(st.integers(2, 6)), 2, 4, 32, 8, 4, 30
    kvl = [data.draw(st.integers(0, cols * bs)) for _ in range(b)]
    q = torch.randn(b, n, d, dtype=torch.bfloat16, device=DEVICE)
    shape = (nb, kvn, bs, d) if four else (nb, bs, kvn * d)
    kc, vc = (torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE) for _ in "kv")
    bt = torch.randperm(nb, device=DEVICE)[: b * cols].view(b, cols).to(torch.int32)
    kw = dict(
        actual_seq_lengths=list(range(1, b + 1)),
        actual_seq_lengths_kv=kvl,
        block_table=bt,
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        block_size=bs,
        softmax_lse_flag=True,
    )
    outs = []
    for chunk in (1, 1 << 40):  # every request a run of its own; the whole batch one run
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fia, "_CHUNK_BYTES", chunk)
            outs.append(torch_npu.npu_fused_infer_attention_score(q, kc, vc, **kw))
    assert equal_on_host(outs[0][0], outs[1][0]) and equal_on_host(outs[0][1], outs[1][1])


def _band_visible(sq, sk, pre, nxt):
    i = torch.arange(sq, device="cpu").unsqueeze(1)  # the oracle's: on the host
    j = torch.arange(sk, device="cpu").unsqueeze(0)
    off = j - (i + (sk - sq))
    return (off >= -pre) & (off <= nxt)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(["TND", "BNSD"]),
    dtype=DTYPES,
    heads=st.sampled_from([1, 4]),
    dr=st.sampled_from([4, 16]),
    qper=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_fia_with_rope_is_absorbed_mla(layout, dtype, heads, dr, qper, data):
    """score = scale * (q_nope.k_nope + q_rope.k_rope), values = the latent cache, one KV head."""
    b, d, bs, cols, nb = 3, 32, 4, 4, 16
    kvl = [data.draw(st.integers(qper, cols * bs)) for _ in range(b)]
    bt = torch.stack([torch.randperm(nb, device=DEVICE)[:cols] for _ in range(b)]).to(torch.int32)
    latent = torch.randn(nb, bs, 1, d, dtype=dtype, device=DEVICE)
    rope = torch.randn(nb, bs, 1, dr, dtype=dtype, device=DEVICE)
    t = b * qper
    qn, qr = torch.randn(t, heads, d, dtype=dtype, device=DEVICE), torch.randn(t, heads, dr, dtype=dtype, device=DEVICE)
    kw = dict(
        num_heads=heads, num_key_value_heads=1, scale=0.2, block_table=bt, block_size=bs, actual_seq_lengths_kv=kvl
    )
    if qper > 1:
        kw.update(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=DEVICE), 1))
    if layout == "TND":
        kw.update(input_layout="TND", actual_seq_lengths=[qper * (i + 1) for i in range(b)])
        out, _ = torch_npu.npu_fused_infer_attention_score(
            qn, latent.view(nb, bs, d), latent.view(nb, bs, d), query_rope=qr, key_rope=rope.view(nb, bs, dr), **kw
        )
    else:  # BNSD: query [B, N, S, D], paged caches [NB, KVN, BS, D]
        q4 = qn.view(b, qper, heads, d).transpose(1, 2)
        r4 = qr.view(b, qper, heads, dr).transpose(1, 2)
        lat4 = latent.permute(0, 2, 1, 3).contiguous()
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q4, lat4, lat4, query_rope=r4, key_rope=rope.permute(0, 2, 1, 3).contiguous(), input_layout="BNSD", **kw
        )
        out = out.transpose(1, 2).reshape(t, heads, d)
    npu.synchronize()
    for i in range(b):
        rows = slice(i * qper, (i + 1) * qper)
        k = torch.cat([_gather(latent, bt[i], kvl[i], bs), _gather(rope, bt[i], kvl[i], bs)], -1)
        v = _gather(latent, bt[i], kvl[i], bs)
        q = torch.cat([qn[rows], qr[rows]], -1).transpose(0, 1)
        ref = _oracle(q, k, v, 0.2, causal=qper > 1).transpose(0, 1)
        assert (out[rows].cpu().double() - ref).abs().max() <= TOL[dtype]


@settings(max_examples=20, deadline=None)
@given(layout=st.sampled_from(["BNSD_NBSD", "BSND_NBSD", "TND_NTD"]), heads=st.sampled_from([1, 4]), data=st.data())
def test_fia_v2_writes_mla_output_in_the_layout_after_the_underscore(layout, heads, data):
    """vllm-ascend's MLA decode: FIA v2 with rope arguments, the query in one layout and the
    output in another (``BNSD_NBSD``: the output [N, B, S, Dv]), by ``.out`` and by the default
    overload; each head's rows are the float64 oracle's."""
    b, d, dr, bs, cols, nb = 3, 32, 16, 4, 4, 16
    dtype = torch.bfloat16
    kvl = [data.draw(st.integers(1, cols * bs)) for _ in range(b)]
    bt = torch.stack([torch.randperm(nb, device=DEVICE)[:cols] for _ in range(b)]).to(torch.int32)
    latent = torch.randn(nb, bs, 1, d, dtype=dtype, device=DEVICE)
    rope = torch.randn(nb, bs, 1, dr, dtype=dtype, device=DEVICE)
    qn, qr = torch.randn(b, heads, d, dtype=dtype, device=DEVICE), torch.randn(b, heads, dr, dtype=dtype, device=DEVICE)
    kw = dict(num_query_heads=heads, num_key_value_heads=1, softmax_scale=0.2, block_table=bt, block_size=bs)
    if layout == "BNSD_NBSD":  # the caches viewed [NB, KVN, BS, D], as vllm-ascend views them
        args = (qn.view(b, heads, 1, d), latent.view(nb, 1, bs, d), latent.view(nb, 1, bs, d))
        kw.update(query_rope=qr.view(b, heads, 1, dr), key_rope=rope.view(nb, 1, bs, dr))
    elif layout == "BSND_NBSD":
        args = (qn.view(b, 1, heads, d), latent.view(nb, bs, d), latent.view(nb, bs, d))
        kw.update(query_rope=qr.view(b, 1, heads, dr), key_rope=rope.view(nb, bs, dr))
    else:  # TND with the caches 4-dim, (blocknum, KV_N, blocksize, D), as vllm-ascend's speculative decode passes them
        args = (qn, latent.view(nb, 1, bs, d), latent.view(nb, 1, bs, d))
        kw.update(query_rope=qr, key_rope=rope.view(nb, 1, bs, dr), actual_seq_qlen=list(range(1, b + 1)))
    kw.update(input_layout=layout, actual_seq_kvlen=kvl)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(*args, **kw)
    into = torch.full_like(out, float("nan"))
    torch_npu.npu_fused_infer_attention_score_v2.out(
        *args, **kw, out=[into, torch.empty(b, dtype=dtype, device=DEVICE)]
    )
    npu.synchronize()
    assert list(out.shape) == ([heads, b, 1, d] if layout.endswith("NBSD") else [heads, b, d])
    for got in (out, into):
        rows = got.view(heads, b, d).cpu().double()
        for i in range(b):
            k = torch.cat([_gather(latent, bt[i], kvl[i], bs), _gather(rope, bt[i], kvl[i], bs)], -1)
            q = torch.cat([qn[i], qr[i]], -1).unsqueeze(1)  # [N, 1, D + Dr]
            ref = _oracle(q, k, _gather(latent, bt[i], kvl[i], bs), 0.2)[:, 0]
            assert (rows[:, i] - ref).abs().max() <= TOL[dtype]


@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 12), qper=st.sampled_from([1, 3]), data=st.data())
def test_fia_band_mode_is_a_sliding_window(window, qper, data):
    b, n, d, bs, cols, nb = 2, 2, 16, 4, 4, 12
    kvl = [data.draw(st.integers(qper, cols * bs)) for _ in range(b)]
    bt = torch.stack([torch.randperm(nb, device=DEVICE)[:cols] for _ in range(b)]).to(torch.int32)
    kc, vc = torch.randn(nb, bs, n * d, device=DEVICE), torch.randn(nb, bs, n * d, device=DEVICE)
    q = torch.randn(b * qper, n, d, device=DEVICE)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q,
        kc,
        vc,
        num_heads=n,
        num_key_value_heads=n,
        scale=0.3,
        input_layout="TND",
        block_table=bt,
        block_size=bs,
        actual_seq_lengths=[qper * (i + 1) for i in range(b)],
        actual_seq_lengths_kv=kvl,
        sparse_mode=4,
        pre_tokens=window - 1,
        next_tokens=0,
        atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=DEVICE), 1),
    )
    npu.synchronize()
    for i in range(b):
        k = _gather(kc.view(nb, bs, n, d), bt[i], kvl[i], bs).double()
        v = _gather(vc.view(nb, bs, n, d), bt[i], kvl[i], bs).double()
        qi = q.cpu()[i * qper : (i + 1) * qper].transpose(0, 1).double()
        mask = _band_visible(qper, kvl[i], window - 1, 0)
        s = (qi @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
        ref = (torch.softmax(s, -1) @ v).transpose(0, 1)
        assert (out[i * qper : (i + 1) * qper].cpu().double() - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("sparse_mode", [3, 4])
def test_fia_reads_the_compressed_mask_it_is_given(sparse_mode):
    """Modes 3 and 4 read the 2048x2048 mask as it is: the causal one (bool or int8, as
    vllm-ascend makes it) runs; anything else (not yet written, all ones, all zeros) is refused."""
    b, n, d, bs, nb = 2, 2, 16, 4, 8
    kc, vc = torch.randn(nb, bs, n * d, device=DEVICE), torch.randn(nb, bs, n * d, device=DEVICE)
    bt = torch.arange(nb, dtype=torch.int32, device=DEVICE).view(b, nb // b)
    q = torch.randn(b * 2, n, d, device=DEVICE)
    causal = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=DEVICE), 1)

    def run(mask):
        torch_npu.npu_fused_infer_attention_score(
            q, kc, vc, num_heads=n, num_key_value_heads=n, scale=0.3, input_layout="TND",
            block_table=bt, block_size=bs, actual_seq_lengths=[2, 4], actual_seq_lengths_kv=[5, 9],
            sparse_mode=sparse_mode, pre_tokens=3, next_tokens=0, atten_mask=mask,
        )  # fmt: skip
        npu.synchronize()

    run(causal)
    run(causal.to(torch.int8))
    for bad in (torch.ones_like(causal), torch.zeros_like(causal), causal.T.contiguous()):
        with pytest.raises(ValueError, match="atten_mask.*compressed causal mask.*before any capture"):
            run(bad)


# --- FIA v2 with attention sinks ----------------------------------------------------------


def _oracle_sink(q, k, v, scale, sink):
    """q [N, Sq, D], k/v [KVN, Sk, D], sink [N]: softmax over the keys plus one sink logit per
    head (which adds to the denominator only), in float64, written out by hand."""
    n, kvn = q.shape[0], k.shape[0]
    k = k.double().repeat_interleave(n // kvn, 0)
    v = v.double().repeat_interleave(n // kvn, 0)
    s = q.double() @ k.transpose(-1, -2) * scale  # [N, Sq, Sk]
    sk = sink.double().view(n, 1, 1).expand(n, s.shape[1], 1)
    full = torch.cat([s, sk], -1)
    w = torch.softmax(full, -1)[..., :-1]
    return w @ v


@settings(max_examples=30, deadline=None)
@given(
    dtype=DTYPES,
    kvn=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    qper=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    data=st.data(),
)
def test_fia_v2_learnable_sink_matches_oracle(dtype, kvn, group, qper, data):
    n, d, bs, cols, nb = kvn * group, 32, 4, 4, 10
    b = len(qper)
    kvl = [data.draw(st.integers(q, cols * bs)) for q in qper]
    t = sum(qper)
    ends = [sum(qper[: i + 1]) for i in range(b)]
    q = torch.randn(t, n, d, dtype=dtype, device=DEVICE)
    kc = torch.randn(nb, bs, kvn * d, dtype=dtype, device=DEVICE)
    vc = torch.randn(nb, bs, kvn * d, dtype=dtype, device=DEVICE)
    bt = torch.stack([torch.randperm(nb, device=DEVICE)[:cols] for _ in range(b)]).to(torch.int32)
    sink = torch.randn(n, dtype=torch.float32, device=DEVICE) * 2
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        q,
        kc,
        vc,
        actual_seq_qlen=ends,
        actual_seq_kvlen=kvl,
        block_table=bt,
        num_query_heads=n,
        num_key_value_heads=kvn,
        softmax_scale=0.25,
        input_layout="TND",
        block_size=bs,
        learnable_sink=sink,  # a tensor: never tested for truth
    )
    npu.synchronize()
    start = 0
    for i in range(b):
        qi = q.cpu()[start : ends[i]].transpose(0, 1)
        k = _gather(kc.view(nb, bs, kvn, d), bt[i], kvl[i], bs)
        v = _gather(vc.view(nb, bs, kvn, d), bt[i], kvl[i], bs)
        ref = _oracle_sink(qi, k, v, 0.25, sink.cpu()).transpose(0, 1)
        assert (out[start : ends[i]].cpu().double() - ref).abs().max().item() <= TOL[dtype]
        start = ends[i]


def test_fia_v2_refuses_an_unmodelled_tensor_argument_by_name():
    q = torch.randn(1, 2, 8, device=DEVICE)
    with pytest.raises(NotImplementedError, match="does not model 'dequant_scale_query'"):
        torch_npu.npu_fused_infer_attention_score_v2(
            q,
            q,
            q,
            num_query_heads=2,
            input_layout="TND",
            actual_seq_qlen=[1],
            actual_seq_kvlen=[1],
            dequant_scale_query=torch.ones(2, device=DEVICE),
        )
    with pytest.raises(ValueError, match=r"learnable_sink' must be a float tensor \[num_heads=2\]"):
        torch_npu.npu_fused_infer_attention_score_v2(
            q,
            q,
            q,
            num_query_heads=2,
            input_layout="TND",
            actual_seq_qlen=[1],
            actual_seq_kvlen=[1],
            learnable_sink=torch.ones(3, device=DEVICE),
        )


# --- npu_fusion_attention (prefill) -----------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    dtype=DTYPES,
    kvn=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    reqs=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 4)), min_size=1, max_size=3),
    causal=st.booleans(),
)
def test_npu_fusion_attention_tnd_matches_oracle(dtype, kvn, group, reqs, causal):
    """Prefill with a cached prefix: request i has q_i new tokens and q_i + c_i keys."""
    n, d = kvn * group, 16
    q_per = [q for q, _ in reqs]
    kv_per = [q + c for q, c in reqs]
    q = torch.randn(sum(q_per), n, d, dtype=dtype, device=DEVICE)
    k = torch.randn(sum(kv_per), kvn, d, dtype=dtype, device=DEVICE)
    v = torch.randn(sum(kv_per), kvn, d, dtype=dtype, device=DEVICE)
    qe = [sum(q_per[: i + 1]) for i in range(len(reqs))]
    ke = [sum(kv_per[: i + 1]) for i in range(len(reqs))]
    kw = dict(scale=0.3, actual_seq_qlen=qe, actual_seq_kvlen=ke)
    if causal:
        kw.update(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=DEVICE), 1))
    out, smax, ssum, _, _, _, _ = torch_npu.npu_fusion_attention(q, k, v, n, "TND", **kw)
    npu.synchronize()
    assert out.shape == q.shape and smax.shape == (q.shape[0], n, 8)
    qs, ks = 0, 0
    q, k, v, smax, ssum = (t.cpu() for t in (q, k, v, smax, ssum))  # the oracle's side: the host
    for i in range(len(reqs)):
        ref = _oracle(
            q[qs : qe[i]].transpose(0, 1), k[ks : ke[i]].transpose(0, 1), v[ks : ke[i]].transpose(0, 1), 0.3, causal
        ).transpose(0, 1)
        assert (out[qs : qe[i]].cpu().double() - ref).abs().max().item() <= TOL[dtype]
        s = (
            q[qs : qe[i]].double().transpose(0, 1)
            @ k[ks : ke[i]].double().transpose(0, 1).repeat_interleave(group, 0).transpose(-1, -2)
            * 0.3
        )
        s = s.masked_fill(~_visible(q_per[i], kv_per[i], causal), float("-inf"))
        lse = torch.logsumexp(s, -1).transpose(0, 1)
        got = (smax[qs : qe[i], :, 0] + torch.log(ssum[qs : qe[i], :, 0])).double()
        assert close_on_host(got, lse, atol=1e-3), "max + log(sum) is the row's log-sum-exp"
        qs, ks = qe[i], ke[i]


def test_npu_fusion_attention_refuses_what_it_does_not_model():
    q = torch.randn(2, 2, 8, device=DEVICE)
    with pytest.raises(NotImplementedError, match="dropout"):
        torch_npu.npu_fusion_attention(q, q, q, 2, "TND", keep_prob=0.9, actual_seq_qlen=[2], actual_seq_kvlen=[2])
    with pytest.raises(
        ValueError, match=r"actual_seq_qlen' must be non-decreasing cumulative ends whose last entry is 2"
    ):
        torch_npu.npu_fusion_attention(q, q, q, 2, "TND", actual_seq_qlen=[1], actual_seq_kvlen=[2])


# --- KV-cache writes ----------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    dtype=DTYPES,
    t=st.integers(1, 8),
    dk=st.sampled_from([8, 16]),
    dv=st.sampled_from([8, 12]),
    which=st.sampled_from(["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"]),
    data=st.data(),
)
def test_kv_cache_writes_skip_pad_slots_and_match_a_loop(dtype, t, dk, dv, which, data):
    nb, bs, n = 4, 4, 2
    free = data.draw(st.permutations(range(nb * bs)))
    slots = [free[i] if data.draw(st.booleans()) else torch_npu.PAD_SLOT_ID for i in range(t)]
    key = torch.randn(t, n, dk, dtype=dtype, device=DEVICE)
    value = torch.randn(t, n, dv, dtype=dtype, device=DEVICE)
    kc = torch.randn(nb, bs, n, dk, dtype=dtype, device=DEVICE)
    vc = torch.randn(nb, bs, n, dv, dtype=dtype, device=DEVICE)
    ref_k, ref_v = kc.clone(), vc.clone()
    for i, s in enumerate(slots):  # the reference: one token at a time, padding skipped
        if s >= 0:
            ref_k[s // bs, s % bs] = key[i]
            ref_v[s // bs, s % bs] = value[i]
    sm = torch.tensor(slots, dtype=torch.int32, device=DEVICE)  # the kernel reads it in device memory
    if which == "npu_scatter_pa_kv_cache":
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, sm)
    else:
        torch_npu._npu_reshape_and_cache(key=key, value=value, key_cache=kc, value_cache=vc, slot_indices=sm)
    npu.synchronize()
    assert equal_on_host(kc, ref_k) and equal_on_host(vc, ref_v)
    with pytest.raises(ValueError, match="is a cpu tensor, but the kernel reads it in device memory"):
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, sm.cpu())  # a host slot mapping: a device faults


def test_a_kv_write_past_the_cache_is_the_kernels_error_and_inside_a_graph_a_replay_fault():
    key = torch.randn(2, 1, 8, device=DEVICE)
    kc = torch.zeros(2, 4, 1, 8, device=DEVICE)
    vc = torch.zeros(2, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping' \[1\] = 8 is outside the cache's 8 slots"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, kc, vc, torch.tensor([0, 8], dtype=torch.int32, device=DEVICE))
    slots = torch.tensor([3, -1], dtype=torch.int64, device=DEVICE)  # device memory the replay reads
    g = npu.NPUGraph()
    with npu.graph(g):
        torch_npu.npu_scatter_pa_kv_cache(key, key, kc, vc, slots)
    assert not kc.any(), "a capture writes nothing"
    g.replay()
    npu.synchronize()
    assert equal_on_host(kc[0, 3], key[0]) and kc.count_nonzero() == 8, "slot 3 written, the padding slot skipped"
    slots[1] = 99
    g.replay()
    with pytest.raises(torch_npu.ReplayFault, match="outside the cache"):
        npu.synchronize()
