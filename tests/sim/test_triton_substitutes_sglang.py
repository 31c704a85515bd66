"""SGLang's Triton kernels the simulator computes with torch (npusim/npusim/kernels/triton_substitutes.py)
against Triton's interpreter running the real kernel, from the installed SGLang, on random
inputs and shapes: bit for bit; and where the interpreter cannot run a kernel's branch (the
softcap's libdevice tanh), against float64.

Needs Triton and SGLang: ``make sglang-check`` runs it in SGLang's environment.
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
pytest.importorskip("triton", reason="needs Triton (SGLang's environment: release/sglang/env.sh)")
softcap = pytest.importorskip("sglang.kernels.ops.activation.softcap", reason="needs SGLang (release/sglang/env.sh)")

import torch_npu  # noqa: E402, F401 - the simulator, with its npu device

from npusim.kernels import triton_substitutes  # noqa: E402
from npusim.surfaces.triton_ascend import SUBSTITUTES_ENV  # noqa: E402


def test_the_release_kernel_is_a_checked_source() -> None:
    """The installed SGLang's logits kernel is one whose substitute this file checks."""
    kernel = softcap.softcap_inplace_logits_kernel
    source = inspect.getsource(getattr(kernel, "fn", kernel))
    found = triton_substitutes.substitute_for("softcap_inplace_logits_kernel", source)
    assert found is not None, "SGLang's softcap_inplace_logits_kernel changed: check and register a substitute for it"


def _run(substituted: bool, fn: str, full: torch.Tensor, cols: int, *extra: object) -> torch.Tensor:
    """``fn`` on the first ``cols`` columns of a copy of ``full`` (the rows of a wider buffer
    where ``full`` is wider: the kernel's strided-row path)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SUBSTITUTES_ENV, "1" if substituted else "0")
        x = full.clone()[:, :cols]
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in extra]
        out = getattr(softcap, fn)(x, *args)
        torch.npu.synchronize()
    return out.cpu()


@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.generate])
@given(
    rows=st.integers(1, 9),
    cols=st.sampled_from([1, 7, 1000, 1024, 1025, 3001]),
    padded=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_logits_to_float32_equals_the_interpreter(
    rows: int, cols: int, padded: bool, dtype: torch.dtype, seed: int
) -> None:
    """``cast_to_float32_logits`` (what SGLang's graphs do to each step's logits) with the torch
    substitute and in Triton's interpreter: the same float32 rows, bit for bit, and each the
    logit itself (a widening is exact); rows of a wider buffer (a vocabulary slice) too."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, cols + (5 if padded else 0), generator=g) * 30).to(dtype)
    output = torch.full((rows, cols), float("nan")).npu()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the release's kernel is a checked source: no fallback said
        got = _run(True, "cast_to_float32_logits", full.npu(), cols, output)
    want = _run(False, "cast_to_float32_logits", full.npu(), cols, output)
    assert torch.equal(got, want)
    assert torch.equal(got.double(), full[:, :cols].double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_softcap_matches_float64_where_the_interpreter_cannot_run_it(dtype: torch.dtype) -> None:
    """A softcap (``APPLY_SOFTCAP``, Gemma's final logits), in place and into float32: Triton's
    interpreter cannot run libdevice's tanh (it raises, with or without the simulator), so
    the substitute is held to ``cap * tanh(x / cap)`` in float64, within the stored dtype."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 1000, generator=g) * 40).to(dtype).npu()
    reference = 30.0 * torch.tanh(logits.cpu().double() / 30.0)  # from the definition
    output = torch.empty(3, 1000).npu()
    into = _run(True, "softcap_to_float32_logits", logits, 1000, 30.0, output)
    assert into.dtype == torch.float32 and torch.allclose(into.double(), reference, atol=1e-4)
    in_place = _run(True, "softcap_inplace_logits", logits, 1000, 30.0)
    assert in_place.dtype == dtype
    assert torch.equal(in_place, reference.to(dtype)) or torch.allclose(
        in_place.double(), reference, atol=float(torch.finfo(dtype).eps) * 32, rtol=0
    )
    with pytest.raises(Exception, match="NoneType"):  # what would run without it
        _run(False, "softcap_inplace_logits", logits, 1000, 30.0)
