"""triton-ascend's language extension on the simulator (``extract_slice``, ``insert_slice``,
``get_element``), inside kernels run by Triton's interpreter on ``npu`` tensors, each checked
against numpy indexing of float64 copies written here (not the functions under test).

Needs Triton (the release and SGLang environments have it; ``make test``'s does not).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("NPUGRAPH_SIM_TORCH_NPU") != "1":
    pytest.skip("needs the simulator as torch_npu in the process (NPUGRAPH_SIM_TORCH_NPU=1)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="needs Triton (release/env.sh's or release/sglang/env.sh's environment)")
tl = pytest.importorskip("triton.language")


import torch_npu  # noqa: E402, F401 - the simulator, with its npu device

# as vllm-ascend's kernels import them (vllm_ascend/ops/triton/triton_utils.py): the
# simulator's stand-in, wired in by npusim_hook when Triton loads
from triton.language.extra.cann.extension import extract_slice, get_element, insert_slice  # noqa: E402


@triton.jit
def rotate_halves(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    # the shape of vllm-ascend's split_qkv_rmsnorm_rope: halves out, swapped back in
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + rows * COLS + cols)
    x1 = extract_slice(x, offsets=(0, 0), sizes=(ROWS, HALF), strides=(1, 1))
    x2 = extract_slice(x, offsets=(0, HALF), sizes=(ROWS, HALF), strides=(1, 1))
    y = tl.zeros((ROWS, COLS), dtype=x.dtype)
    y = insert_slice(y, -x2, offsets=(0, 0), sizes=(ROWS, HALF), strides=(1, 1))
    y = insert_slice(y, x1, offsets=(0, HALF), sizes=(ROWS, HALF), strides=(1, 1))
    tl.store(out_ptr + rows * COLS + cols, y)


@triton.jit
def pick(x_ptr, idx_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr):  # type: ignore[no-untyped-def]
    # a runtime offset (a loaded scalar), a strided slice, and get_element at a loaded index
    x = tl.load(x_ptr + tl.arange(0, N))
    start = tl.load(idx_ptr)
    part = extract_slice(x, offsets=(start,), sizes=(K,), strides=(STRIDE,))
    tl.store(out_ptr + tl.arange(0, K), part)
    tl.store(out_ptr + K, get_element(x, (tl.load(idx_ptr + 1),)))


@triton.jit
def scale_rows(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):  # type: ignore[no-untyped-def]
    # 21 rows: a range that is not a power of two, as vllm-ascend sizes its blocks by the
    # vector core's buffer (triton-ascend allows it; PyPI Triton refuses)
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + rows * COLS + cols)
    tl.store(out_ptr + rows * COLS + cols, x * (rows + 1).to(tl.float32))


def test_a_block_that_is_not_a_power_of_two_as_triton_ascend_allows() -> None:
    x = torch.randn(21, 8, dtype=torch.float32)
    out = torch.empty(21, 8, dtype=torch.float32, device="npu")
    scale_rows[(1,)](x.to("npu"), out, ROWS=21, COLS=8)
    expected = x.double().numpy() * np.arange(1, 22, dtype=np.float64)[:, None]
    np.testing.assert_allclose(out.cpu().double().numpy(), expected, rtol=1e-6)


@triton.jit
def bf16_ops(a_ptr, b_ptr, o_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i)
    b = tl.load(b_ptr + i)
    tl.store(o_ptr + i, a * b)
    tl.store(o_ptr + N + i, a + b)
    tl.store(o_ptr + 2 * N + i, -a - b)
    tl.store(o_ptr + 3 * N + i, tl.where(a < b, a, b))  # a compare on values, not bit patterns
    tl.store(o_ptr + 4 * N + i, tl.maximum(tl.abs(a), b))


def test_bfloat16_arithmetic_is_on_values_rounded_to_bfloat16() -> None:
    # PyPI Triton's interpreter runs bfloat16 math on the raw 16-bit patterns (1.5 * 2.0 gave 0)
    a = torch.randn(64, dtype=torch.bfloat16) * 3
    b = torch.randn(64, dtype=torch.bfloat16)
    out = torch.empty(5 * 64, dtype=torch.bfloat16, device="npu")
    bf16_ops[(1,)](a.to("npu"), b.to("npu"), out, N=64)
    x, y = a.double(), b.double()  # float64, each result rounded to bfloat16 once
    expected = torch.cat([x * y, x + y, -(x + y), torch.minimum(x, y), torch.maximum(x.abs(), y)]).to(torch.bfloat16)
    got = out.cpu()
    # one bfloat16 rounding apart at most (-a - b rounds twice)
    assert torch.allclose(got.double(), expected.double(), rtol=2**-7, atol=0), (got - expected).abs().max()
    assert torch.equal(got[:64], expected[:64]) and torch.equal(got[192:256], expected[192:256])


@triton.jit
def masked_by_a_scalar(x_ptr, s_ptr, o_ptr, N: tl.constexpr, VALID: tl.constexpr):  # type: ignore[no-untyped-def]
    # vllm-ascend 0.30's v2 sampler's shape: a block's mask and a loaded scalar's comparison
    i = tl.arange(0, N)
    mask = i < VALID
    s = tl.load(s_ptr).to(tl.float32)
    x = tl.load(x_ptr + i)
    tl.store(o_ptr + i, tl.where(mask & (s != 0.0) & (x > 0.0), x, -1.0))


@pytest.mark.parametrize("scalar", [0.0, 2.0])
def test_a_scalar_comparison_is_boolean_where_it_meets_a_block_mask(scalar: float) -> None:
    # Triton's interpreter typed a comparison's booleans as its left operand: the scalar
    # ``s != 0.0``, splat to the block, came out float, and ``mask & ...`` failed in numpy
    x = torch.randn(16, dtype=torch.float32)
    out = torch.empty(16, dtype=torch.float32, device="npu")
    masked_by_a_scalar[(1,)](x.to("npu"), torch.tensor([scalar], device="npu"), out, N=16, VALID=11)
    keep = (torch.arange(16) < 11) & (x > 0) & (scalar != 0.0)
    assert torch.equal(out.cpu(), torch.where(keep, x, torch.full_like(x, -1.0)))


def test_extract_and_insert_slice_rotate_halves_as_numpy_does() -> None:
    x = torch.randn(4, 16, dtype=torch.float32)
    out = torch.empty(4, 16, dtype=torch.float32, device="npu")
    rotate_halves[(1,)](x.to("npu"), out, ROWS=4, COLS=16, HALF=8)
    ref = x.double().numpy()
    expected = np.concatenate([-ref[:, 8:], ref[:, :8]], axis=1)
    np.testing.assert_allclose(out.cpu().double().numpy(), expected, rtol=0, atol=0)


def test_a_runtime_offset_a_stride_and_get_element() -> None:
    x = torch.arange(32, dtype=torch.float32) * 0.5
    out = torch.empty(5, dtype=torch.float32, device="npu")
    pick[(1,)](x.to("npu"), torch.tensor([3, 30], dtype=torch.int32, device="npu"), out, N=32, K=4, STRIDE=3)
    ref = x.double().numpy()
    np.testing.assert_array_equal(out.cpu().double().numpy(), [ref[3], ref[6], ref[9], ref[12], ref[30]])


@triton.jit
def finite_parts(x_ptr, o_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    # as vLLM's v2 NaN metric reads it (vllm-ascend 0.26.0rc1 points it at triton-ascend's)
    from triton.language.extra.cann import libdevice

    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(o_ptr + i, libdevice.isnan(x).to(tl.float32))
    tl.store(o_ptr + N + i, libdevice.isinf(x).to(tl.float32))
    tl.store(o_ptr + 2 * N + i, libdevice.exp(tl.where(libdevice.isnan(x) | libdevice.isinf(x), 0.0, x)))


@triton.jit
def nan_of_ints(x_ptr, o_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    from triton.language.extra.cann import libdevice

    i = tl.arange(0, N)
    tl.store(o_ptr + i, libdevice.isnan(tl.load(x_ptr + i)).to(tl.int32))


def test_libdevice_read_off_triton_ascends_package_gives_nan_inf_and_its_math() -> None:
    import triton.language.extra.cann as cann

    assert cann.libdevice.exp is tl.math.exp, "triton-ascend points libdevice.exp at triton.language.math"
    x = torch.tensor([0.5, float("nan"), float("inf"), -float("inf"), -2.0, 0.0, 88.0, -0.0])
    out = torch.empty(3 * 8, dtype=torch.float32, device="npu")
    finite_parts[(1,)](x.to("npu"), out, N=8)
    ref = x.double().numpy()  # numpy on float64 copies, not the functions under test
    nan, inf = np.isnan(ref), np.isinf(ref)
    expected = np.concatenate([nan, inf, np.exp(np.where(nan | inf, 0.0, ref))]).astype(np.float64)
    np.testing.assert_allclose(out.cpu().double().numpy(), expected, rtol=1e-6)
    with pytest.raises(Exception, match=r"libdevice.isnan takes fp32, fp16, bf16 .*not int32"):
        nan_of_ints[(1,)](
            torch.zeros(8, dtype=torch.int32, device="npu"), torch.empty(8, dtype=torch.int32, device="npu"), N=8
        )
    with pytest.raises(AttributeError, match=r"libdevice.ilogb is one of CANN's device-library externs"):
        cann.libdevice.ilogb  # noqa: B018


def test_a_slice_past_the_block_is_refused_not_clipped() -> None:
    x = torch.zeros(32, dtype=torch.float32, device="npu")
    out = torch.empty(5, dtype=torch.float32, device="npu")
    with pytest.raises(Exception, match=r"extract_slice: dimension 0 reads elements 25\.\.34 of a block of 32"):
        pick[(1,)](x, torch.tensor([25, 0], dtype=torch.int32, device="npu"), out, N=32, K=4, STRIDE=3)
        torch.npu.synchronize()
    with pytest.raises(Exception, match="get_element: index 40 of dimension 0 is outside the block's 32"):
        pick[(1,)](x, torch.tensor([0, 40], dtype=torch.int32, device="npu"), out, N=32, K=4, STRIDE=3)
        torch.npu.synchronize()
    # and the device serves on
    pick[(1,)](x + 1, torch.tensor([0, 1], dtype=torch.int32, device="npu"), out, N=32, K=4, STRIDE=3)
    assert out.cpu().tolist() == [1.0] * 5


def test_a_launch_inside_a_capture_is_one_node_replayed_on_the_memory_of_the_moment() -> None:
    # every hook on Triton's interpreter at once: launches as simulator kernels (captured),
    # bfloat16 on values, triton-ascend's slices
    x = torch.zeros(4, 16, dtype=torch.bfloat16, device="npu")
    out = torch.empty(4, 16, dtype=torch.bfloat16, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        rotate_halves[(1,)](x, out, ROWS=4, COLS=16, HALF=8)
    for scale in (1.0, 3.0):
        src = torch.randn(4, 16, dtype=torch.bfloat16) * scale
        x.copy_(src.to("npu"))
        g.replay()
        torch.npu.synchronize()
        assert torch.equal(out.cpu(), torch.cat([-src[:, 8:], src[:, :8]], dim=1))


@triton.jit
def int_sums(a_ptr, b_ptr, o_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(a_ptr + i) + tl.load(b_ptr + i))


def test_an_integer_overflow_wraps_as_on_a_device_unchecked_without_debug() -> None:
    # the interpreter's overflow checks assert nothing unless debug is on; they are left out
    # then (a third of the time of vllm-ascend's rope kernel), and the sum wraps as an NPU's
    from triton.runtime import interpreter

    assert not interpreter.interpreter_builder.options.debug
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    a = torch.tensor([2**31 - 1, -(2**31), 5, -7], dtype=torch.int32)
    b = torch.tensor([1, -1, 6, 7], dtype=torch.int32)
    out = torch.empty(4, dtype=torch.int32, device="npu")
    int_sums[(1,)](a.to("npu"), b.to("npu"), out, N=4)
    wrapped = ((a.long() + b.long() + 2**31) % 2**32 - 2**31).tolist()  # two's complement, by hand
    assert out.cpu().tolist() == wrapped == [-(2**31), 2**31 - 1, 11, 0]


def test_the_kept_numpy_types_are_tritons_answers_for_every_type() -> None:
    from triton.runtime import interpreter

    kept = interpreter._get_np_dtype
    triton_own = kept.triton
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64]
    scalars += [tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = [*scalars, tl.pointer_type(tl.bfloat16), tl.pointer_type(tl.int32)]
    types += [tl.block_type(t, [4, 8]) for t in types]
    for _ in range(2):  # asked, then kept
        for t in types:
            assert kept(t) == triton_own(t), t
    assert kept(tl.block_type(tl.bfloat16, [2])) == np.dtype(np.uint16)  # patterns, as Triton keeps them


def test_an_interpreted_kernel_runs_where_a_program_stubbed_out_tritons_gluon(monkeypatch) -> None:
    """vllm-ascend 0.27.1rc1 replaces triton.experimental.gluon by empty modules at import
    (triton-ascend has none); Triton's interpreter imports gluon's nvidia module to specialize a
    kernel's arguments.  The launch puts Triton's own back; whoever took a stand-in keeps it."""
    import sys
    import types

    for name in [n for n in sys.modules if n.startswith("triton.experimental")]:
        monkeypatch.delitem(sys.modules, name)
    experimental = types.ModuleType("triton.experimental")
    experimental.__path__ = []
    stand_in = types.ModuleType("triton.experimental.gluon")
    monkeypatch.setitem(sys.modules, "triton.experimental", experimental)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", stand_in)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon.language", types.ModuleType("x"))
    x = torch.arange(21 * 8, dtype=torch.float32).view(21, 8)
    out = torch.empty(21, 8, device="npu")
    scale_rows[(1,)](x.to("npu"), out, ROWS=21, COLS=8)
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), x * torch.arange(1, 22, dtype=torch.float32)[:, None])
    assert hasattr(sys.modules["triton.experimental.gluon"], "__path__")  # Triton's own again
    assert "triton.experimental.gluon.nvidia" in sys.modules and stand_in.__dict__.get("__path__") is None
