"""The simulator's MLA kernels besides FIA (vllm-ascend's ``mla_v1``) against float64 references.

Each reference is written here from CANN's documented formula, element by element, in
float64 on the host: no simulator code is on its path.  DeepSeek's rope dims come in
interleaved pairs (Hugging Face's ``apply_rotary_emb`` rotates each pair as a complex
number); the kernels rotate them gathered into halves, so the references check both what
CANN documents and that a query's and a key's dot product is the pairwise rotation's.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu

DEVICE = "npu"
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _angles(tokens, dim=64, seed=0):
    """Per-token angles [T, dim/2], and cos/sin [T, 1, 1, dim] as vllm-ascend's MLA cache
    holds them (each angle twice: once per half)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(tokens, dim // 2, generator=g, dtype=torch.float64) * 6.0
    both = torch.cat([theta, theta], -1)
    return theta, both.cos().view(tokens, 1, 1, dim), both.sin().view(tokens, 1, 1, dim)


def _pairs_rotated(x, theta):
    """x [.., 64] rotated pair by pair, (x[2i], x[2i+1]) by theta[i], then gathered: the
    even results first, the odd after (the kernel's output order), in float64."""
    x = x.double()
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    for i in range(half):
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        c, s = math.cos(float(theta[i])), math.sin(float(theta[i]))
        out[..., i] = a * c - b * s
        out[..., half + i] = b * c + a * s
    return out


@settings(max_examples=10, deadline=None)
@given(
    tokens=st.integers(2, 4), heads=st.sampled_from([1, 4]), dtype=st.sampled_from(list(TOL)), seed=st.integers(0, 99)
)
def test_interleave_rope_rotates_each_pair_and_gathers_them_into_halves(tokens, heads, dtype, seed):
    theta, cos, sin = _angles(tokens, seed=seed)
    # the rope slice of a wider projection, as vllm-ascend passes it: strided, not contiguous
    wide = _rand(tokens, heads, 192, dtype=dtype, seed=seed)
    x = wide.npu()[..., 128:].view(tokens, heads, 1, 64)
    assert not x.is_contiguous()
    y = torch_npu.npu_interleave_rope(x, cos.to(dtype).npu(), sin.to(dtype).npu())
    npu.synchronize()
    assert y.shape == x.shape and y.dtype == dtype
    for t in range(tokens):
        ref = _pairs_rotated(wide[t, :, 128:], theta[t].to(dtype).double())
        assert (y[t, :, 0].cpu().double() - ref).abs().max() <= TOL[dtype] * 4


def test_interleave_rope_keeps_the_dot_product_of_pairwise_rotation():
    """q.k after the kernel on both equals q.k after rotating each pair as a complex number
    (Hugging Face's DeepSeek rope), the reason the order of the halves does not matter."""
    theta, cos, sin = _angles(1, seed=3)
    q, k = _rand(1, 1, 1, 64, dtype=torch.float16, seed=1), _rand(1, 1, 1, 64, dtype=torch.float16, seed=2)
    qr = torch_npu.npu_interleave_rope(q.npu(), cos.half().npu(), sin.half().npu()).cpu().double()
    kr = torch_npu.npu_interleave_rope(k.npu(), cos.half().npu(), sin.half().npu()).cpu().double()
    rot = torch.polar(torch.ones(32, dtype=torch.float64), theta[0].half().double())
    qc = torch.view_as_complex(q.double().view(32, 2).contiguous()) * rot
    kc = torch.view_as_complex(k.double().view(32, 2).contiguous()) * rot
    want = float((torch.view_as_real(qc) * torch.view_as_real(kc)).sum())
    assert abs(float((qr * kr).sum()) - want) <= 0.05


def test_interleave_rope_refuses_what_cann_refuses():
    x = torch.zeros(2, 1, 1, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="'x' last dim is 32; the kernel takes D = 64"):
        torch_npu.npu_interleave_rope(x, x, x)
    x = torch.zeros(2, 1, 1, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="'cos' shape"):
        torch_npu.npu_interleave_rope(x, torch.zeros(2, 2, 1, 64, dtype=torch.float16, device=DEVICE), x)
    with pytest.raises(ValueError, match="'x' must be float16 or bfloat16"):
        torch_npu.npu_interleave_rope(x.float(), x.float(), x.float())


@pytest.mark.parametrize("is_output_kv", [False, True])
def test_kv_rmsnorm_rope_cache_writes_each_tokens_norm_and_rope_at_its_slot(is_output_kv):
    tokens, nb, bs, eps = 5, 4, 8, 1e-6
    dtype = torch.bfloat16
    kv = _rand(tokens, 1, 1, 576, dtype=dtype, seed=4)
    gamma = _rand(512, dtype=dtype, seed=5)
    theta, cos, sin = _angles(tokens, seed=6)
    slots = torch.tensor([9, 0, -1, 31, 17], dtype=torch.int64)  # -1: vLLM's padding token
    kc = torch.full((nb, bs, 1, 64), 7.0, dtype=dtype, device=DEVICE)
    ckv = torch.full((nb, bs, 1, 512), 7.0, dtype=dtype, device=DEVICE)
    out = torch_npu.npu_kv_rmsnorm_rope_cache(
        kv.npu(),
        gamma.npu(),
        cos.to(dtype).npu(),
        sin.to(dtype).npu(),
        slots.npu(),
        kc,
        ckv,
        epsilon=eps,
        cache_mode="PA",
        is_output_kv=is_output_kv,
    )
    npu.synchronize()
    assert out[0] is kc and out[1] is ckv
    assert list(out[2].shape) == [tokens, 1, 1, 64] and list(out[3].shape) == [tokens, 1, 1, 512]
    flat_k, flat_c = kc.cpu().view(-1, 64).double(), ckv.cpu().view(-1, 512).double()
    written = set()
    for t in range(tokens):
        x = kv[t, 0, 0].double()
        ms = sum(float(v) ** 2 for v in x[:512]) / 512
        norm = x[:512] / math.sqrt(ms + eps) * gamma.double()
        rope = _pairs_rotated(x[512:], theta[t].to(dtype).double())
        if is_output_kv:
            assert (out[3][t, 0, 0].cpu().double() - norm).abs().max() <= 0.05 * max(1.0, float(norm.abs().max()))
            assert (out[2][t, 0, 0].cpu().double() - rope).abs().max() <= 0.1
        if int(slots[t]) < 0:
            continue
        written.add(int(slots[t]))
        assert (flat_c[int(slots[t])] - norm).abs().max() <= 0.05 * max(1.0, float(norm.abs().max()))
        assert (flat_k[int(slots[t])] - rope).abs().max() <= 0.1
    untouched = [s for s in range(nb * bs) if s not in written]
    assert bool((flat_k[untouched] == 7).all()) and bool((flat_c[untouched] == 7).all())


def test_kv_rmsnorm_rope_cache_refuses_what_cann_refuses():
    dtype = torch.float16
    kv = torch.zeros(2, 1, 1, 576, dtype=dtype, device=DEVICE)
    cs = torch.zeros(2, 1, 1, 64, dtype=dtype, device=DEVICE)
    gamma = torch.zeros(512, dtype=dtype, device=DEVICE)
    kc = torch.zeros(2, 4, 1, 64, dtype=dtype, device=DEVICE)
    ckv = torch.zeros(2, 4, 1, 512, dtype=dtype, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="'index' must be int64"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cs, cs, slots.int(), kc, ckv, cache_mode="PA")
    with pytest.raises(ValueError, match="'kv' shape"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv[..., :320], gamma, cs, cs, slots, kc, ckv, cache_mode="PA")
    with pytest.raises(NotImplementedError, match="cache_mode 'Norm' is not simulated"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cs, cs, slots, kc, ckv)
    with pytest.raises(ValueError, match=r"'index' \[1\] = 8 is outside the caches' 8 slots"):
        torch_npu.npu_kv_rmsnorm_rope_cache(
            kv, gamma, cs, cs, torch.tensor([0, 8], device=DEVICE), kc, ckv, cache_mode="PA"
        )
        npu.synchronize()


@settings(max_examples=8, deadline=None)
@given(heads=st.integers(1, 4), tokens=st.integers(1, 5), transposed=st.booleans(), seed=st.integers(0, 99))
def test_transpose_batchmatmul_is_each_heads_product_transposed(heads, tokens, transposed, seed):
    """vllm-ascend's up projection: x [N, T, 512] (per head) times W [N, 512, 128] → [T, N, 128]."""
    x = _rand(heads, tokens, 512, seed=seed)
    w = _rand(heads, 512, 128, seed=seed + 1)
    if transposed:  # perm_x1 (1, 0, 2): the input is [T, N, K]
        y = torch_npu.npu_transpose_batchmatmul(x.transpose(0, 1).contiguous().npu(), w.npu(), perm_x1=(1, 0, 2))
    else:
        y = torch_npu.npu_transpose_batchmatmul(x.npu(), w.npu(), perm_y=(1, 0, 2))
    npu.synchronize()
    assert list(y.shape) == [tokens, heads, 128] and y.dtype == torch.bfloat16
    for h in range(heads):
        ref = x[h].double() @ w[h].double()
        assert (y[:, h].cpu().double() - ref).abs().max() <= 0.02 * float(ref.abs().max())


def test_transpose_batchmatmul_refuses_what_cann_refuses():
    x = torch.zeros(2, 3, 512, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="'perm_y' is \\[0, 1, 2\\]; CANN takes only \\[1, 0, 2\\]"):
        torch_npu.npu_transpose_batchmatmul(
            x, torch.zeros(2, 512, 128, dtype=torch.float16, device=DEVICE), perm_y=(0, 1, 2)
        )
    with pytest.raises(ValueError, match="multiples of 128"):
        torch_npu.npu_transpose_batchmatmul(x, torch.zeros(2, 512, 96, dtype=torch.float16, device=DEVICE))


def test_mla_kernels_replay_in_a_graph_with_new_inputs():
    """Captured once, replayed on new values written into the same buffers."""
    dtype = torch.bfloat16
    x = _rand(2, 4, 1, 64, dtype=dtype, seed=1).npu()
    _, cos, sin = _angles(2, seed=2)
    cos, sin = cos.to(dtype).npu(), sin.to(dtype).npu()
    w = _rand(4, 512, 128, dtype=dtype, seed=3).npu()
    lat = _rand(4, 2, 512, dtype=dtype, seed=4).npu()
    g = npu.NPUGraph()
    with npu.graph(g):
        y = torch_npu.npu_interleave_rope(x, cos, sin)
        z = torch_npu.npu_transpose_batchmatmul(lat, w, perm_y=(1, 0, 2))
    x.copy_(_rand(2, 4, 1, 64, dtype=dtype, seed=9).npu())
    lat.copy_(_rand(4, 2, 512, dtype=dtype, seed=8).npu())
    g.replay()
    npu.synchronize()
    assert torch.equal(y.cpu(), torch_npu.npu_interleave_rope(x, cos, sin).cpu())
    assert torch.equal(z.cpu(), torch_npu.npu_transpose_batchmatmul(lat, w).cpu())


@pytest.mark.parametrize("name", ["npu_mla_prolog", "npu_mla_prolog_v2", "npu_mla_prolog_v3"])
def test_the_fused_mla_prolog_is_a_name_that_refuses_when_called(name):
    """torch_npu has it, vllm-ascend's tests patch it by name (``patch("torch_npu.npu_mla_prolog_v3")``,
    0.29.0rc1's test_mla_v1.py), and the simulator does not compute it: the name exists and a
    call says so."""
    op = getattr(torch_npu, name)
    with pytest.raises(RuntimeError, match=f"torch_npu.{name} is not simulated by npusim"):
        op(torch.empty(1))
