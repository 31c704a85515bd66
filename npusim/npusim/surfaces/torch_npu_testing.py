"""torch_npu's test helpers (``torch_npu.testing``), for running torch_npu's own tests as written.

``testcase.TestCase`` (a ``unittest.TestCase`` with torch_npu's ``assertRtolEqual`` and a
tensor-aware ``assertEqual``), ``testcase.run_tests`` and ``common_utils.SupportedDevices``
(skips a test unless the card's name matches, read as torch_npu reads it: the simulated
card is an Ascend910B1, so ``['Ascend910B', ...]`` runs).  Only what those tests use.
"""

from __future__ import annotations

import functools
import unittest
from collections.abc import Callable
from typing import Any

import torch

from npusim.surfaces.torch_npu_modules import module

__all__ = ["submodules"]


def _as_float64(x: Any) -> torch.Tensor:
    """A host float64 tensor of a tensor, a NumPy array or a number."""
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(x, device="cpu")
    return t.to(torch.float64)


def _is_array(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or type(x).__module__ == "numpy"


class TestCase(unittest.TestCase):
    """torch_npu's test base: relative-tolerance comparisons of tensors and arrays."""

    def assertRtolEqual(self, x: Any, y: Any, prec: float = 1.0e-4, prec16: float = 1.0e-3, **kwargs: Any) -> None:
        half = any(str(getattr(t, "dtype", "")).endswith(("float16", "bfloat16")) for t in (x, y))
        tol = prec16 if half else prec
        a, b = _as_float64(x), _as_float64(y)
        super().assertEqual(tuple(a.shape), tuple(b.shape))
        bad = int(((a - b).abs() > tol * b.abs().clamp(min=1.0)).sum())
        super().assertEqual(bad, 0, f"{bad} of {a.numel()} elements differ by more than {tol} (relative)")

    def assertEqual(self, x: Any, y: Any, prec: float | None = None, message: str = "", **kwargs: Any) -> None:  # type: ignore[override]
        if _is_array(x) or _is_array(y):
            a, b = _as_float64(x), _as_float64(y)
            if prec is None:
                self.assertTrue(torch.equal(a, b), message or f"{a} != {b}")
            else:
                self.assertTrue(torch.allclose(a, b, atol=prec, rtol=0), message or f"{a} != {b} within {prec}")
            return
        super().assertEqual(x, y, message or None)


def run_tests() -> None:
    unittest.main()


def SupportedDevices(devices: list[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Skip the test unless the card is one of ``devices`` (by its name's prefix, as torch_npu)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            name = torch.npu.get_device_name(0)  # type: ignore[attr-defined]
            short = name[:12] if name[:10] == "Ascend910_" else name[:9] if name.startswith("Ascend950") else name[:10]
            if short not in devices:
                raise unittest.SkipTest(f"Only run on {devices}, current device is {short}.")
            return fn(*args, **kwargs)

        return run

    return decorate


def submodules() -> dict[str, Any]:
    testcase = module("torch_npu.testing.testcase", TestCase=TestCase, run_tests=run_tests)
    common_utils = module("torch_npu.testing.common_utils", SupportedDevices=SupportedDevices)
    testing = module("torch_npu.testing", testcase=testcase, common_utils=common_utils)
    return {
        "torch_npu.testing": testing,
        "torch_npu.testing.testcase": testcase,
        "torch_npu.testing.common_utils": common_utils,
    }
