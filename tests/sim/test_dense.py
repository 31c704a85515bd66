"""The simulator's dense kernels (RMSNorm, SwiGLU, rotary, MatmulAdd) against float64 references.

Each reference is written here from the kernel's definition, element by element where that
is clearer, in float64 on the host: no simulator code is on the reference's path.  The
kernels run on npu tensors, eagerly and inside a captured graph that is replayed with new
inputs (vllm-ascend's FULL graph captures the whole layer, these kernels included).
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


def _rms_ref(x, gamma, eps):
    x, gamma = x.double(), gamma.double()
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        ms = sum(float(v) ** 2 for v in x[i]) / x.shape[1]
        out[i] = x[i] / math.sqrt(ms + eps) * gamma
    return out


def _rotary_ref(pos, x, cache, head_size, neox):
    """Rotate each head's first ``rot`` dims by the angle pairs of ``cache[pos]``."""
    x = x.double().view(x.shape[0], -1, head_size).clone()
    rot = cache.shape[1]
    half = rot // 2
    for t in range(x.shape[0]):
        cos, sin = cache[pos[t], :half].double(), cache[pos[t], half:].double()
        for h in range(x.shape[1]):
            for i in range(half):
                a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                xa, xb = float(x[t, h, a]), float(x[t, h, b])
                x[t, h, a] = xa * cos[i] - xb * sin[i]
                x[t, h, b] = xb * cos[i] + xa * sin[i]
    return x.view(x.shape[0], -1)


def _rand(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 6), hidden=st.sampled_from([8, 32, 96]), seed=st.integers(0, 99))
def test_rms_norm_and_add_rms_norm_match_the_definition(tokens, hidden, seed):
    x1, x2 = _rand(tokens, hidden, seed=seed), _rand(tokens, hidden, seed=seed + 1)
    gamma = _rand(hidden, seed=seed + 2)
    y, rstd = torch_npu.npu_rms_norm(x1.npu(), gamma.npu(), 1e-6)
    assert y.device.type == "npu" and y.dtype == x1.dtype and rstd.dtype == torch.float32
    assert list(rstd.shape) == [tokens, 1]
    assert (y.cpu().double() - _rms_ref(x1, gamma, 1e-6)).abs().max() < 2e-2
    y2, _, s = torch_npu.npu_add_rms_norm(x1.npu(), x2.npu(), gamma.npu(), 1e-5)
    total = x1.double() + x2.double()
    assert (s.cpu().double() - total).abs().max() < 1e-2
    assert (y2.cpu().double() - _rms_ref(total, gamma, 1e-5)).abs().max() < 2e-2


def test_swiglu_is_silu_of_the_first_half_times_the_second():
    x = _rand(3, 16)
    out = torch_npu.npu_swiglu(x.npu())
    a, b = x.double()[:, :8], x.double()[:, 8:]
    ref = a / (1 + torch.exp(-a)) * b
    assert out.shape == (3, 8) and (out.cpu().double() - ref).abs().max() < 1e-2
    with pytest.raises(ValueError, match="odd size"):
        torch_npu.npu_swiglu(_rand(2, 5).npu())


def test_dense_kernels_refuse_host_memory_as_a_device_does():
    x, gamma = _rand(2, 8), _rand(8, seed=1)
    with pytest.raises(ValueError, match="'gamma' is a cpu tensor"):
        torch_npu.npu_rms_norm(x.npu(), gamma, 1e-6)
    with pytest.raises(ValueError, match="'x2' is a cpu tensor"):
        torch_npu.npu_add_rms_norm(x.npu(), x, gamma.npu())


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_embedding_rotates_in_place(neox, rot):
    head_size, heads, kv_heads, tokens = 16, 4, 2, 5
    angles = torch.arange(64).double()[:, None] * (1e-1 ** (torch.arange(rot // 2).double() / (rot // 2)))
    cache = torch.cat((angles.cos(), angles.sin()), dim=1).to(torch.float16)
    pos = torch.tensor([0, 3, 7, 7, 63])
    q, k = _rand(tokens, heads * head_size), _rand(tokens, kv_heads * head_size, seed=1)
    qn, kn = q.npu(), k.npu()
    torch_npu._npu_rotary_embedding(pos.npu(), qn, kn, head_size, cache.npu(), neox)
    assert (qn.cpu().double() - _rotary_ref(pos, q, cache, head_size, neox)).abs().max() < 1e-2
    assert (kn.cpu().double() - _rotary_ref(pos, k, cache, head_size, neox)).abs().max() < 1e-2
    if rot < head_size:  # the dims past rot pass through
        assert torch.equal(
            qn.cpu().view(tokens, heads, head_size)[..., rot:], q.view(tokens, heads, head_size)[..., rot:]
        )


def test_matmul_add_accumulates_x_transposed_times_weight():
    x, w = _rand(2, 4), _rand(2, 3, seed=1)
    c0 = _rand(4, 3, dtype=torch.float32, seed=2)
    c = c0.npu()
    torch_npu._npu_matmul_add_fp32(x.npu(), w.npu(), c)
    ref = c0.double() + x.double().T @ w.double()
    assert (c.cpu().double() - ref).abs().max() < 1e-3
    with pytest.raises(ValueError, match="'c'"):
        torch_npu._npu_matmul_add_fp32(x.npu(), w.npu(), c.half())


def test_dense_kernels_replay_in_a_graph_with_new_inputs():
    """Captured like attention: a replay computes on whatever the inputs hold then."""
    hidden = 32
    x, gamma = _rand(4, hidden).npu(), _rand(hidden, seed=3).npu()
    g = npu.NPUGraph()
    s = npu.Stream()
    with npu.stream(s), npu.graph(g, stream=s):
        y, _ = torch_npu.npu_rms_norm(x, gamma, 1e-6)
        out = torch_npu.npu_swiglu(y)
    for seed in (5, 6):
        fresh = _rand(4, hidden, seed=seed)
        x.copy_(fresh.npu())
        g.replay()
        npu.synchronize()
        normed = _rms_ref(fresh, gamma.cpu(), 1e-6).to(torch.float16).double()
        a, b = normed[:, :16], normed[:, 16:]
        assert (out.cpu().double() - a / (1 + torch.exp(-a)) * b).abs().max() < 3e-2


def _quant_ref(x):
    """Per-row int8: scale = max|x| / 127, y = round(x / scale), element by element in float64."""
    x = x.double()
    ys, scales = torch.empty(x.shape, dtype=torch.float64), torch.empty(x.shape[0], dtype=torch.float64)
    for i in range(x.shape[0]):
        m = max(abs(float(v)) for v in x[i])
        scales[i] = m / 127.0
        for j in range(x.shape[1]):
            ys[i, j] = 0.0 if m == 0 else max(-128.0, min(127.0, round(float(x[i, j]) / (m / 127.0))))
    return ys, scales


def _assert_quantized(y, scale, want_y, want_scale):
    assert y.dtype == torch.int8 and scale.dtype == torch.float32
    # one step either way where float32 and float64 land on either side of a .5
    assert (y.cpu().double() - want_y).abs().max() <= 1
    assert (y.cpu().double() - want_y).abs().sum() <= 2
    assert torch.allclose(scale.cpu().double(), want_scale, rtol=1e-6, atol=0)


@settings(max_examples=10)
@given(rows=st.integers(1, 5), hidden=st.sampled_from([4, 16, 64]), seed=st.integers(0, 99))
def test_dynamic_quant_is_per_row_symmetric_int8(rows, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * 3
    x[0] = 0.0 if rows > 1 else x[0]  # a zero row: scale 0, zeros
    y, scale = torch.ops.npu.npu_dynamic_quant(x.to(DEVICE))
    _assert_quantized(y, scale, *_quant_ref(x))


@settings(max_examples=10)
@given(rows=st.integers(1, 4), hidden=st.sampled_from([8, 32]), seed=st.integers(0, 99))
def test_add_rms_norm_dynamic_quant_is_the_add_the_norm_and_the_quant(rows, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x1, x2 = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    gamma = torch.rand(hidden, generator=g) + 0.5
    y1, y2, s, scale1, scale2 = torch.ops.npu.npu_add_rms_norm_dynamic_quant(
        x1.to(DEVICE), x2.to(DEVICE), gamma.to(DEVICE), epsilon=1e-6, output_mask=[True, False]
    )
    total = x1.double() + x2.double()
    assert torch.allclose(s.cpu().double(), total, atol=1e-6)
    _assert_quantized(y1, scale1, *_quant_ref(_rms_ref(total, gamma, 1e-6)))
    assert y2.numel() == 0 and scale2.numel() == 0, "output_mask: the second quantisation is not computed"


def test_vllm_ascends_fusion_pattern_traces_on_npu_tensors_as_it_registers():
    """AddRMSNormQuantFusionPass traces its pattern with make_fx on real npu tensors."""
    from torch._inductor.pattern_matcher import fwd_only

    def pattern(x, residual, weight):
        out = torch.ops.npu.npu_add_rms_norm(x, residual, weight, 1e-6)
        q = torch.ops.npu.npu_dynamic_quant(out[0])
        return q[0], q[1], out[2]

    args = [torch.randn(2, 4, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    gm = fwd_only(pattern, [*args, torch.randn(4, device=DEVICE, dtype=torch.bfloat16)])
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"npu.npu_add_rms_norm.default", "npu.npu_dynamic_quant.default"} <= targets


def _static_ref(x, scales, zeros, div):
    """round(x / s + z) (or x * s + z) into int8's range, element by element in float64 (the
    scales one per column, the last axis)."""
    x = x.double()
    y = torch.empty(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            s = float(scales[j if scales.numel() > 1 else 0])
            v = float(x[i, j]) / s if div else float(x[i, j]) * s
            v += float(zeros[j if zeros.numel() > 1 else 0]) if zeros is not None else 0.0
            y[i, j] = max(-128.0, min(127.0, round(v)))
    return y


@settings(max_examples=10)
@given(
    rows=st.integers(1, 4),
    hidden=st.sampled_from([8, 32]),
    per_column=st.booleans(),
    div=st.booleans(),
    zero=st.booleans(),
    seed=st.integers(0, 99),
)
def test_quantize_is_static_int8_by_scales_along_the_axis(rows, hidden, per_column, div, zero, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * 4
    scales = torch.rand(hidden if per_column else 1, generator=g) * 0.2 + 0.02
    zeros = torch.randint(-3, 4, (hidden if per_column else 1,), generator=g).float() if zero else None
    y = torch.ops.npu.npu_quantize(
        x.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE) if zeros is not None else None, torch.qint8, -1, div
    )
    assert y.dtype == torch.int8
    want = _static_ref(x, scales, zeros, div)
    assert (y.cpu().double() - want).abs().max() <= 1  # float32 and float64 either side of a .5


@settings(max_examples=10)
@given(rows=st.integers(1, 4), hidden=st.sampled_from([8, 32]), seed=st.integers(0, 99))
def test_add_rms_norm_quant_is_the_add_the_norm_and_the_static_quant(rows, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    x1, x2 = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    gamma = torch.rand(hidden, generator=g) + 0.5
    scales = torch.rand(hidden, generator=g) * 0.05 + 0.01
    y1, y2, s = torch.ops.npu.npu_add_rms_norm_quant(
        x1.to(DEVICE), x2.to(DEVICE), gamma.to(DEVICE), scales.to(DEVICE), None, epsilon=1e-6
    )
    total = x1.double() + x2.double()
    assert torch.allclose(s.cpu().double(), total, atol=1e-6)
    want = _static_ref(_rms_ref(total, gamma, 1e-6), scales, None, True)
    assert (y1.cpu().double() - want).abs().max() <= 1 and y2.numel() == 0


@settings(max_examples=10)
@given(rows=st.integers(1, 4), hidden=st.sampled_from([8, 32]), bias=st.booleans(), seed=st.integers(0, 99))
def test_add_rms_norm_bias_is_the_add_the_norm_and_the_bias(rows, hidden, bias, seed):
    """vllm-ascend 0.30's own kernel (its RMSNorm with a residual), as ``torch.ops._C_ascend``."""
    from npusim.surfaces import vllm_ascend_c  # noqa: F401  (registers the _C_ascend ops)

    g = torch.Generator().manual_seed(seed)
    x1, x2 = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    gamma = torch.rand(hidden, generator=g) + 0.5
    beta = torch.randn(hidden, generator=g) if bias else None
    y, rstd, s = torch.ops._C_ascend.npu_add_rms_norm_bias(
        x1.to(DEVICE), x2.to(DEVICE), gamma.to(DEVICE), beta.to(DEVICE) if bias else None, 1e-6
    )
    total = x1.double() + x2.double()
    want = _rms_ref(total, gamma, 1e-6) + (beta.double() if bias else 0.0)
    assert torch.allclose(s.cpu().double(), total, atol=1e-6)
    assert (y.cpu().double() - want).abs().max() < 1e-5
    assert rstd.shape == (rows, 1) and rstd.dtype == torch.float32


def test_loras_ops_are_defined_with_the_extensions_schemas_and_refuse_when_called():
    """vllm-ascend 0.29's start-up gives bgmv_expand and sgmv_expand a meta kernel, which needs the
    ops defined (every build of its extension defines them): defined, no meta of their own, and
    a call on the device refuses naming the op."""
    from npusim.surfaces import vllm_ascend_c  # noqa: F401  (registers the _C_ascend ops)

    registered = torch._C._dispatch_get_registrations_for_dispatch_key("Meta")
    for name in ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand"):
        assert hasattr(torch.ops._C_ascend, name) and f"_C_ascend::{name}" not in registered
    x = torch.zeros(2, 4, device="npu")
    with pytest.raises(RuntimeError, match="torch.ops._C_ascend.bgmv_expand is not simulated by npusim .LoRA."):
        torch.ops._C_ascend.bgmv_expand(x, x, torch.zeros(2, dtype=torch.long, device="npu"), x, 0, 4)
