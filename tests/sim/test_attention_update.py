"""``npu_attention_update`` (vllm-ascend 0.30's MLA prefill over context chunks, its context
parallelism) against a float64 reference written here from CANN's formula, element by
element: no simulator code is on its path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu

DEVICE = "npu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _reference(lses, outs):
    """CANN's formula, row by row in float64: (O, lse_m)."""
    sp, rows, head_dim = len(lses), lses[0].shape[0], outs[0].shape[1]
    o = torch.zeros(rows, head_dim, dtype=torch.float64)
    lse_m = torch.empty(rows, dtype=torch.float64)
    for r in range(rows):
        values = [float(lses[i][r]) for i in range(sp)]
        top = max(values)
        if top == -math.inf:
            lse_m[r] = -math.inf
            continue
        lse_m[r] = top + math.log(sum(math.exp(v - top) for v in values))
        for i in range(sp):
            o[r] += outs[i][r].double() * math.exp(values[i] - lse_m[r])
    return o, lse_m


@settings(max_examples=15, deadline=None)
@given(
    sp=st.integers(1, 4),
    rows=st.integers(1, 6),
    head_dim=st.sampled_from([8, 64, 512]),
    dtype=st.sampled_from(list(TOL)),
    update_type=st.sampled_from([0, 1]),
    seed=st.integers(0, 99),
)
def test_attention_update_merges_shards_by_their_log_sum_exp(sp, rows, head_dim, dtype, update_type, seed):
    g = torch.Generator().manual_seed(seed)
    lses = [torch.randn(rows, generator=g) * 3 for _ in range(sp)]
    outs = [torch.randn(rows, head_dim, generator=g).to(dtype) for _ in range(sp)]
    out, lse_out = torch_npu.npu_attention_update([x.npu() for x in lses], [x.npu() for x in outs], update_type)
    npu.synchronize()
    want, want_lse = _reference(lses, outs)
    assert out.dtype == dtype and out.device.type == DEVICE and tuple(out.shape) == (rows, head_dim)
    assert (out.cpu().double() - want).abs().max() <= TOL[dtype] * max(1.0, float(want.abs().max()))
    if update_type == 0:
        assert lse_out is None
    else:
        assert lse_out.dtype == torch.float32
        assert (lse_out.cpu().double() - want_lse).abs().max() <= 1e-5


def test_attention_update_gives_zero_where_no_shard_attended():
    lses = [torch.tensor([-math.inf, 0.5]), torch.tensor([-math.inf, -math.inf])]
    outs = [torch.ones(2, 8), torch.full((2, 8), 3.0)]
    out, _ = torch_npu.npu_attention_update([x.npu() for x in lses], [x.npu() for x in outs], 0)
    assert torch.equal(out.cpu()[0], torch.zeros(8))
    assert torch.allclose(out.cpu()[1], torch.ones(8))


def test_attention_update_refuses_what_cann_refuses():
    lse = torch.zeros(4, device=DEVICE)
    out = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="17 shards; the kernel takes 1 to 16"):
        torch_npu.npu_attention_update([lse] * 17, [out] * 17, 0)
    with pytest.raises(ValueError, match="head_dim is 12"):
        torch_npu.npu_attention_update([lse], [torch.zeros(4, 12, device=DEVICE)], 0)
    with pytest.raises(ValueError, match="'update_type' must be 0"):
        torch_npu.npu_attention_update([lse], [out], 2)
    with pytest.raises(ValueError, match=r"'lse\[0\]' must be a float32"):
        torch_npu.npu_attention_update([lse.half()], [out], 0)
    with pytest.raises(ValueError, match=r"'local_out\[0\]' must be contiguous"):
        torch_npu.npu_attention_update([lse], [torch.zeros(8, 4, device=DEVICE).t()], 0)
    with pytest.raises(ValueError, match=r"'local_out\[1\]' is a cpu tensor"):
        torch_npu.npu_attention_update([lse, lse], [out, out.cpu()], 0)
