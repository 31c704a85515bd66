"""The dense torch_npu kernels a decoder layer calls besides attention, with real math.

vllm-ascend's dense path (Llama, Qwen) calls ``npu_rms_norm`` / ``npu_add_rms_norm``
(``AscendRMSNorm``), ``npu_swiglu`` (``SiluAndMul``) and ``_npu_rotary_embedding``
(``rope_forward_oot`` where Triton is absent).  Each is a kernel here, like the attention
kernels: launched on the current stream, recorded into a graph being captured, and run on
the host over the device's memory.  Numerics follow CANN's kernels: the arithmetic in
float32, the results cast to the input's dtype (``rstd`` stays float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from npugraph.sim.runtime.launch import SimOp, fail, launch

__all__ = ["npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "_npu_rotary_embedding", "_npu_matmul_add_fp32"]


def _kernel(name: str, anchor: str, outputs: tuple[str, ...], compute: Callable[[dict[str, Any]], None]) -> SimOp:
    return SimOp(
        name,
        "default",
        host_args=(),
        output_args=outputs,
        check=lambda p: {},
        compute=lambda p, info: compute(p),
        workspace=lambda p, info: 0,
        anchor=anchor,
    )


def _check_gamma(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    if gamma.dim() == 0 or tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise fail(op, "gamma", f"shape {list(gamma.shape)} is not the trailing shape of x {list(x.shape)}")


def rms_normalize(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * rstd * gamma, rstd)`` of float32 ``x`` over ``gamma``'s trailing dims, in float32."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    r = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    return x * r * gamma.float(), r


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float, y: torch.Tensor, rstd: torch.Tensor) -> None:
    n, r = rms_normalize(x, gamma, eps)
    rstd.copy_(r)
    y.copy_(n)


def _rms_norm(p: dict[str, Any]) -> None:
    _rms(p["x"].float(), p["gamma"], float(p["epsilon"]), p["y"], p["rstd"])


def _add_rms_norm(p: dict[str, Any]) -> None:
    s = p["x1"].float() + p["x2"].float()
    p["x"].copy_(s)
    _rms(s, p["gamma"], float(p["epsilon"]), p["y"], p["rstd"])


def _swiglu(p: dict[str, Any]) -> None:
    a, b = p["x"].float().chunk(2, dim=int(p["dim"]))
    p["out"].copy_(torch.nn.functional.silu(a) * b)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate ``x`` ``[T, N, rot]`` by per-token ``cos``/``sin`` ``[T, 1, rot/2]``."""
    if neox:  # halves: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # GPT-J: interleaved pairs
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _rotary(p: dict[str, Any]) -> None:
    hs = int(p["head_size"])
    cache = p["cos_sin_cache"].float()
    rot = cache.shape[-1]
    cos, sin = cache[p["positions"].long()].unsqueeze(1).chunk(2, dim=-1)
    for name in ("query", "key"):
        t = p[name]
        x = t.view(t.shape[0], -1, hs)
        x[..., :rot] = _rotate(x[..., :rot].float(), cos, sin, bool(p["is_neox_style"])).to(t.dtype)


def _matmul_add(p: dict[str, Any]) -> None:
    p["c"].add_(p["x"].float().transpose(0, 1) @ p["weight"].float())


_RMS_NORM = _kernel("npu_rms_norm", "x", ("y", "rstd"), _rms_norm)
_ADD_RMS_NORM = _kernel("npu_add_rms_norm", "x1", ("y", "rstd", "x"), _add_rms_norm)
_SWIGLU = _kernel("npu_swiglu", "x", ("out",), _swiglu)
_ROTARY = _kernel("_npu_rotary_embedding", "query", ("query", "key"), _rotary)
_MATMUL_ADD = _kernel("_npu_matmul_add_fp32", "x", ("c",), _matmul_add)


def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list[int]:
    return [*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim())]


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm: ``(x * rstd * gamma, rstd)`` with ``rstd = 1/sqrt(mean(x^2) + epsilon)`` over
    ``gamma``'s trailing dims (float32 inside; ``y`` in x's dtype, ``rstd`` float32)."""
    _check_gamma("npu_rms_norm", self, gamma)
    y = torch.empty_like(self)
    rstd = torch.empty(_rstd_shape(self, gamma), dtype=torch.float32, device=self.device)
    launch(_RMS_NORM, {"x": self, "gamma": gamma, "epsilon": epsilon, "y": y, "rstd": rstd})
    return y, rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``(rms_norm(x1 + x2), rstd, x1 + x2)`` (the sum in float32)."""
    if x1.shape != x2.shape:
        raise fail("npu_add_rms_norm", "x2", f"shape {list(x2.shape)} differs from x1 {list(x1.shape)}")
    _check_gamma("npu_add_rms_norm", x1, gamma)
    y, x = torch.empty_like(x1), torch.empty_like(x1)
    rstd = torch.empty(_rstd_shape(x1, gamma), dtype=torch.float32, device=x1.device)
    params = {"x1": x1, "x2": x2, "gamma": gamma, "epsilon": epsilon, "y": y, "rstd": rstd, "x": x}
    launch(_ADD_RMS_NORM, params)
    return y, rstd, x


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: ``silu(a) * b`` for ``a, b = input.chunk(2, dim)``."""
    if input.shape[dim] % 2:
        raise fail("npu_swiglu", "input", f"dim {dim} has odd size {input.shape[dim]}; it must split in two halves")
    shape = list(input.shape)
    shape[dim] //= 2
    out = torch.empty(shape, dtype=input.dtype, device=input.device)
    launch(_SWIGLU, {"x": input, "dim": dim, "out": out})
    return out


def _npu_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> None:
    """Rotary embedding in place on ``query``/``key`` ``[T, heads * head_size]``.

    ``cos_sin_cache`` ``[max_position, rot]``: cos in the first half of each row, sin in
    the second (vLLM's layout); the first ``rot`` dims of each head rotate, NeoX-style
    (halves) or GPT-J-style (interleaved pairs)."""
    op = "_npu_rotary_embedding"
    rot = int(cos_sin_cache.shape[-1]) if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot % 2 or rot > head_size:
        raise fail(op, "cos_sin_cache", f"shape {list(cos_sin_cache.shape)} is not [positions, rot <= {head_size}]")
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 2 or t.shape[0] != positions.shape[0] or t.shape[1] % head_size:
            raise fail(op, name, f"shape {list(t.shape)} is not [{positions.shape[0]} tokens, heads * {head_size}]")
        if not t.is_contiguous():
            raise fail(op, name, "must be contiguous (the kernel rotates it in place)")
    launch(
        _ROTARY,
        {
            "query": query,
            "key": key,
            "positions": positions,
            "cos_sin_cache": cos_sin_cache,
            "head_size": head_size,
            "is_neox_style": is_neox_style,
        },
    )


def _npu_matmul_add_fp32(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> None:
    """ATB's MatmulAdd: ``c += x^T @ weight`` in float32, in place (a weight-gradient
    accumulation; vllm-ascend's worker runs one at start-up to warm ATB up)."""
    op = "_npu_matmul_add_fp32"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] != weight.shape[0]:
        raise fail(
            op, "weight", f"shape {list(weight.shape)} does not pair with x {list(x.shape)} as [k, n] and [k, m]"
        )
    if tuple(c.shape) != (x.shape[1], weight.shape[1]) or c.dtype != torch.float32:
        raise fail(op, "c", f"must be float32 [{x.shape[1]}, {weight.shape[1]}], got {c.dtype} {list(c.shape)}")
    launch(_MATMUL_ADD, {"x": x, "weight": weight, "c": c})
