"""Each Triton kernel the simulator computes with torch (npusim/npusim/kernels/triton_substitutes.py)
against Triton's interpreter running the real kernel, from the installed release, on random
inputs and shapes: bit for bit.  And a kernel of a substituted name whose source differs runs
in the interpreter, said once.

Needs Triton and vllm-ascend: ``make release-check`` runs it in each release's environment.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

if os.environ.get("NPUGRAPH_SIM_TORCH_NPU") != "1":
    pytest.skip("needs the simulator as torch_npu in the process (NPUGRAPH_SIM_TORCH_NPU=1)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="needs Triton (a release environment: release/env.sh)")
tl = pytest.importorskip("triton.language")
rope = pytest.importorskip("vllm_ascend.ops.triton.rope", reason="needs vllm-ascend (release/env.sh)")

import torch_npu  # noqa: E402, F401 - the simulator, with its npu device

from npusim.kernels import triton_substitutes  # noqa: E402
from npusim.surfaces.triton_ascend import SUBSTITUTES_ENV  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _device_properties() -> None:
    # what vllm-ascend's worker does at start (0.30 sizes its rope tiles by the device's buffer)
    from vllm_ascend.ops.triton import triton_utils

    init = getattr(triton_utils, "init_device_properties_triton", None)
    if init is not None:
        init()


def _kernel_source(kernel: object) -> str:
    return inspect.getsource(getattr(kernel, "fn", kernel))


def test_the_release_kernel_is_a_checked_source() -> None:
    """The installed release's rope kernel is one whose substitute this file checks (a release
    that changed it would run in the interpreter: right, but slow; add its substitute)."""
    found = triton_substitutes.substitute_for("_triton_rope", _kernel_source(rope._triton_rope))
    assert found is not None, "vllm-ascend's _triton_rope changed: check and register a substitute for it"


def _run(substituted: bool, call: dict[str, object]) -> list[torch.Tensor]:
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SUBSTITUTES_ENV, "1" if substituted else "0")
        q, k = rope.rope_forward_triton(**args)
        torch.npu.synchronize()
    return [q.cpu(), k.cpu()]


@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.generate])
@given(
    tokens=st.integers(1, 37),
    heads=st.sampled_from([(4, 2), (8, 8), (3, 1), (16, 4)]),
    dims=st.sampled_from([(64, 64), (128, 128), (128, 64), (64, 48), (128, 96)]),
    neox=st.booleans(),
    cache=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_rope_substitute_equals_the_interpreter(
    tokens: int,
    heads: tuple[int, int],
    dims: tuple[int, int],
    neox: bool,
    cache: bool,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """vllm-ascend's ``rope_forward_triton`` (its ``_triton_rope``) with the torch substitute
    and in Triton's interpreter: the same q and k, bit for bit; and a float64 rotation agrees."""
    hd, rd = dims
    if not neox and rd != hd:
        rd = hd  # partial non-neox rotation: vllm-ascend's callers pass the whole head
    g = torch.Generator().manual_seed(seed)
    n_qh, n_kh = heads
    q = torch.randn(tokens, n_qh, hd, generator=g).to(dtype).npu()
    k = torch.randn(tokens, n_kh, hd, generator=g).to(dtype).npu()
    call: dict[str, object] = {"q": q, "k": k, "is_neox_style": neox}
    if cache:
        # rows to spare after the last position: 0.23.0.post1's kernel reads sin from
        # pad_rope_dim/2 on, past the row where rope_dim is not a power of two
        positions = torch.randint(0, 290, (tokens,), generator=g)
        table = torch.randn(300, rd, generator=g).to(dtype)
        call |= {"cos_sin_cache": table.npu(), "positions": positions.npu(), "rope_dim": rd}
        cos, sin = table[positions, : rd // 2], table[positions, rd // 2 : rd]
    else:
        cos, sin = (
            torch.randn(tokens, rd // 2, generator=g).to(dtype),
            torch.randn(tokens, rd // 2, generator=g).to(dtype),
        )
        call |= {"cos": cos.npu(), "sin": sin.npu()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the release's kernel is a checked source: no fallback said
        torch_ = _run(True, call)
    interpreted = _run(False, call)
    for got, want in zip(torch_, interpreted):
        assert torch.equal(got, want), (
            f"substitute differs from the interpreter by {(got.float() - want.float()).abs().max()}"
        )
    if not cache or rd & (rd - 1) == 0:  # 0.23.0.post1's reads sin from the padded half on
        for got, x in zip(torch_, (q.cpu(), k.cpu())):
            want = _reference(x.double(), cos.double(), sin.double(), rd, neox)
            assert torch.allclose(got.double(), want, atol=0.05, rtol=0.02)


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, neox: bool) -> torch.Tensor:
    """Rotary embedding in float64, written from its definition (not the substitute's code)."""
    out = x.clone()
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        out[..., : rd // 2], out[..., rd // 2 : rd] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2], out[..., 1:rd:2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


@triton.jit
def _triton_rope(x_ptr, n: tl.constexpr):  # type: ignore[no-untyped-def]
    # a kernel of a substituted name, not a checked source: the interpreter runs it
    offsets = tl.arange(0, n)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * 2)


def test_a_kernel_of_another_source_runs_in_the_interpreter_said_once() -> None:
    x = torch.arange(8, dtype=torch.float32).npu()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _triton_rope[(1,)](x, 8)
        _triton_rope[(1,)](x, 8)
    torch.npu.synchronize()
    assert torch.equal(x.cpu(), torch.arange(8, dtype=torch.float32) * 4)
    lines = [str(w.message) for w in said if "Triton kernel _triton_rope" in str(w.message)]
    assert len(lines) == 1, lines
    assert "runs in Triton's interpreter" in lines[0]
