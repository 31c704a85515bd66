"""FIA's decode mask (``sparse_mode=0``, one query token a request) against float64, and
the shapes, types and layouts CANN refuses, refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu

DEVICE = "npu"
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(b, n, kvn, d, bs, cols, nb, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    table = torch.stack([torch.randperm(nb, generator=g)[:cols] for _ in range(b)]).to(torch.int32)
    kc = torch.randn(nb, bs, kvn * d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvn * d, generator=g).to(dtype)
    q = torch.randn(b, 1, n, d, generator=g).to(dtype)
    return table, kc, vc, q


def _run(q, kc, vc, table, mask, width, *, n, kvn, bs, layout="BSND", **extra):
    dev = [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (q, kc, vc, table, mask)]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        dev[0],
        dev[1],
        dev[2],
        num_heads=n,
        num_key_value_heads=kvn,
        scale=0.25,
        input_layout=layout,
        block_table=dev[3],
        block_size=bs,
        actual_seq_lengths_kv=[width] * q.shape[0],
        atten_mask=dev[4],
        sparse_mode=0,
        **extra,
    )
    npu.synchronize()
    return out.cpu()


def _oracle(q, kc, vc, table, keep, width, *, n, kvn, bs):
    """float64 attention of each request over the kept keys among its first ``width``, each key
    found by a per-position loop over its table row."""
    b, d = q.shape[0], q.shape[-1]
    out = torch.zeros(b, 1, n, d, dtype=torch.float64)
    for i in range(b):
        pos = [p for p in range(width) if keep[i, p]]
        k = torch.stack([kc[int(table[i, p // bs]), p % bs].view(kvn, d) for p in pos], 1).double()
        v = torch.stack([vc[int(table[i, p // bs]), p % bs].view(kvn, d) for p in pos], 1).double()
        k, v = k.repeat_interleave(n // kvn, 0), v.repeat_interleave(n // kvn, 0)
        qi = q[i, 0].double().unsqueeze(1)  # [N, 1, D]
        out[i, 0] = F.scaled_dot_product_attention(qi, k, v, scale=0.25).squeeze(1)
    return out


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    mask_dtype=st.sampled_from([torch.bool, torch.int8, torch.uint8]),
    rank=st.sampled_from([2, 3, 4]),
    b=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_a_decode_mask_hides_exactly_its_keys(dtype, mask_dtype, rank, b, seed, data):
    n, kvn, d, bs, cols, nb = 4, 2, 16, 4, 5, 24
    table, kc, vc, q = _case(b, n, kvn, d, bs, cols, nb, dtype, seed)
    width = data.draw(st.integers(1, cols * bs), label="width")
    lens = [data.draw(st.integers(1, width), label="len") for _ in range(b)]
    keep = torch.arange(cols * bs).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    mask = (~keep).to(mask_dtype).view(b, *([1] * (rank - 2)), cols * bs)
    got = _run(q, kc, vc, table, mask, width, n=n, kvn=kvn, bs=bs)
    ref = _oracle(q, kc, vc, table, keep, width, n=n, kvn=kvn, bs=bs)
    assert (got.double() - ref).abs().max() <= TOL[dtype]


def test_a_row_whose_keys_are_all_masked_averages_them():
    """CANN's decode kernel sets a masked score to -1e12, not minus infinity: a fully masked
    row weighs its keys alike (its documentation says only that precision is lost)."""
    n, kvn, d, bs, cols, nb, width = 2, 2, 8, 4, 2, 6, 6
    table, kc, vc, q = _case(2, n, kvn, d, bs, cols, nb, torch.float32, 3)
    keep = torch.ones(2, cols * bs, dtype=torch.bool)
    keep[1] = False
    got = _run(q, kc, vc, table, ~keep, width, n=n, kvn=kvn, bs=bs)
    v = torch.stack([vc[int(table[1, p // bs]), p % bs].view(kvn, d) for p in range(width)]).double()
    assert torch.allclose(got[1, 0].double(), v.mean(0), atol=1e-5)
    ref = _oracle(q[:1], kc, vc, table[:1], keep[:1], width, n=n, kvn=kvn, bs=bs)
    assert torch.allclose(got[0].double(), ref[0], atol=1e-4)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layout": "TND"}, "'atten_mask' is refused with input_layout 'TND'"),
        ({"mask_dtype": torch.float16}, "must be bool, int8 or uint8"),
        ({"mask_rows": 1}, r"has shape \[1, 1, 1, 8\].*B = 2"),
        ({"mask_cols": 7}, "is 7 keys wide; CANN needs at least 8"),
        ({"mask_value": 2}, "values other than 0 and 1"),
    ],
)
def test_what_cann_refuses_in_a_decode_mask_is_refused_by_name(change, match):
    n, kvn, d, bs, cols, nb = 2, 1, 8, 4, 2, 6
    table, kc, vc, q = _case(2, n, kvn, d, bs, cols, nb, torch.float16, 1)
    mask = torch.zeros(change.get("mask_rows", 2), 1, 1, change.get("mask_cols", cols * bs), dtype=torch.int8)
    mask[..., -1] = change.get("mask_value", 1)
    mask = mask.to(change.get("mask_dtype", torch.int8))
    layout = change.get("layout", "BSND")
    if layout == "TND":
        q = q.view(2, n, d)
    extra = {"actual_seq_lengths": [1, 2]} if layout == "TND" else {}
    with pytest.raises(ValueError, match=match):
        _run(q, kc, vc, table, mask, 6, n=n, kvn=kvn, bs=bs, layout=layout, **extra)


def test_the_hbm_model_charges_every_key_a_kernel_is_told_to_read():
    """With lengths frozen to a width, FIA reads that width for every request, masked keys
    and the mask included: the device time is those bytes over the bandwidth."""
    import npusim as sim

    n, kvn, d, bs, cols, nb, b = 4, 2, 16, 4, 4, 12, 3
    table, kc, vc, q = _case(b, n, kvn, d, bs, cols, nb, torch.float16, 5)
    mask = torch.zeros(b, 1, 1, cols * bs, dtype=torch.bool)
    model = sim.HbmTimeModel(bytes_per_s=1e9)
    per_token = 2 * kvn * d * 2  # key and value, fp16
    times = {}
    for width in (4, 16):
        sim.configure(kernel_time_model=model)
        start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
        start.record()
        _run(q, kc, vc, table, mask, width, n=n, kvn=kvn, bs=bs)
        end.record()
        end.synchronize()
        times[width] = start.elapsed_time(end) / 1e3  # ms
        moved = b * width * (per_token + 1) + b * -(-width // bs) * 4 + 2 * q.numel() * 2
        assert times[width] == pytest.approx(moved / 1e9)
    sim.configure()
    assert times[16] > 3 * times[4]
