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

from npusim.runtime.launch import SimOp, fail, launch

__all__ = [
    "npu_rms_norm",
    "npu_gemma_rms_norm",
    "npu_add_rms_norm",
    "npu_add_rms_norm_bias",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_mrope",
    "npu_format_cast",
    "split_qkv_rmsnorm_rope",
    "_npu_rotary_embedding",
    "_npu_matmul_add_fp32",
]


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


def _gemma_rms_norm(p: dict[str, Any]) -> None:
    # Gemma's weights are stored as an offset from 1: the scale is (1 + gamma)
    _rms(p["x"].float(), 1.0 + p["gamma"].float(), float(p["epsilon"]), p["y"], p["rstd"])


def check_residual_norm(op: str, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor) -> None:
    """The arguments every residual add + RMSNorm kernel shares (the quantising ones too)."""
    if x1.shape != x2.shape:
        raise fail(op, "x2", f"shape {list(x2.shape)} differs from x1 {list(x1.shape)}")
    _check_gamma(op, x1, gamma)


def residual_norm(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x1 + x2`` (in float32) written to ``p["x"]``, and its RMSNorm by ``gamma`` (plus
    ``beta`` where given): ``(normed, rstd)`` in float32, what the fused kernels go on from."""
    s = p["x1"].float() + p["x2"].float()
    p["x"].copy_(s)
    n, r = rms_normalize(s, p["gamma"], float(p["epsilon"]))
    beta = p.get("beta")
    return (n + beta.float() if beta is not None else n), r


def _add_rms_norm(p: dict[str, Any]) -> None:
    n, r = residual_norm(p)
    p["rstd"].copy_(r)
    p["y"].copy_(n)


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


def _turned(x: torch.Tensor, halves: bool) -> torch.Tensor:
    """``x`` turned a quarter for rotary embedding by multiplication: its halves ``(x1, x2)``
    to ``(-x2, x1)``, or (``halves=False``) each adjacent pair ``(a, b)`` to ``(-b, a)``."""
    if halves:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotary_mul(p: dict[str, Any]) -> None:
    x = p["input"].float()
    p["out"].copy_(x * p["r1"].float() + _turned(x, p["rotary_mode"] == "half") * p["r2"].float())


def _matmul_add(p: dict[str, Any]) -> None:
    p["c"].add_(p["x"].float().transpose(0, 1) @ p["weight"].float())


_RMS_NORM = _kernel("npu_rms_norm", "x", ("y", "rstd"), _rms_norm)
_GEMMA_RMS_NORM = _kernel("npu_gemma_rms_norm", "x", ("y", "rstd"), _gemma_rms_norm)
_ADD_RMS_NORM = _kernel("npu_add_rms_norm", "x1", ("y", "rstd", "x"), _add_rms_norm)
_ADD_RMS_NORM_BIAS = _kernel("npu_add_rms_norm_bias", "x1", ("y", "rstd", "x"), _add_rms_norm)
_SWIGLU = _kernel("npu_swiglu", "x", ("out",), _swiglu)
_ROTARY = _kernel("_npu_rotary_embedding", "query", ("query", "key"), _rotary)
_ROTARY_MUL = _kernel("npu_rotary_mul", "input", ("out",), _rotary_mul)
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


def npu_gemma_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm: ``(x * rstd * (1 + gamma), rstd)``, otherwise as :func:`npu_rms_norm`."""
    _check_gamma("npu_gemma_rms_norm", self, gamma)
    y = torch.empty_like(self)
    rstd = torch.empty(_rstd_shape(self, gamma), dtype=torch.float32, device=self.device)
    launch(_GEMMA_RMS_NORM, {"x": self, "gamma": gamma, "epsilon": epsilon, "y": y, "rstd": rstd})
    return y, rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``(rms_norm(x1 + x2), rstd, x1 + x2)`` (the sum in float32)."""
    check_residual_norm("npu_add_rms_norm", x1, x2, gamma)
    y, x = torch.empty_like(x1), torch.empty_like(x1)
    rstd = torch.empty(_rstd_shape(x1, gamma), dtype=torch.float32, device=x1.device)
    params = {"x1": x1, "x2": x2, "gamma": gamma, "epsilon": epsilon, "y": y, "rstd": rstd, "x": x}
    launch(_ADD_RMS_NORM, params)
    return y, rstd, x


def npu_add_rms_norm_bias(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None = None, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vllm-ascend's own kernel (its ``_C_ascend`` ops): :func:`npu_add_rms_norm` then ``+ beta``
    (the norm's bias, where the layer has one): ``(rms_norm(x1 + x2) + beta, rstd, x1 + x2)``."""
    op = "npu_add_rms_norm_bias"
    check_residual_norm(op, x1, x2, gamma)
    if beta is not None and (beta.shape != gamma.shape or beta.dtype != gamma.dtype):
        raise fail(
            op, "beta", f"must be {gamma.dtype} {list(gamma.shape)} like gamma, got {beta.dtype} {list(beta.shape)}"
        )
    y, x = torch.empty_like(x1), torch.empty_like(x1)
    rstd = torch.empty(_rstd_shape(x1, gamma), dtype=torch.float32, device=x1.device)
    params = {"x1": x1, "x2": x2, "gamma": gamma, "beta": beta, "epsilon": epsilon, "y": y, "rstd": rstd, "x": x}
    launch(_ADD_RMS_NORM_BIAS, params)
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


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """Rotary position embedding by multiplication: ``input * r1 + rotate(input) * r2``, with
    ``rotate`` turning halves (``"half"``: ``cat(-x2, x1)``) or adjacent pairs
    (``"interleave"``); ``r1``/``r2`` (cos, sin) broadcast to ``input``."""
    op = "npu_rotary_mul"
    if rotary_mode not in ("half", "interleave"):
        raise fail(op, "rotary_mode", f"{rotary_mode!r} is not 'half' or 'interleave'")
    if input.shape[-1] % 2:
        raise fail(op, "input", f"last dim {input.shape[-1]} is odd; it must split into rotated pairs")
    for name, r in (("r1", r1), ("r2", r2)):
        try:
            shape = torch.broadcast_shapes(tuple(r.shape), tuple(input.shape))
        except RuntimeError:
            shape = None
        if shape != tuple(input.shape):
            raise fail(op, name, f"shape {list(r.shape)} does not broadcast to input {list(input.shape)}")
    out = torch.empty_like(input)
    launch(_ROTARY_MUL, {"input": input, "r1": r1, "r2": r2, "rotary_mode": rotary_mode, "out": out})
    return out


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


def _split_qkv_rmsnorm_rope(p: dict[str, Any]) -> None:
    x = p["input"].float()
    qs, kvs, hd = int(p["q_hidden_size"]), int(p["kv_hidden_size"]), int(p["head_dim"])
    rot = p["sin"].shape[-1]
    sin, cos = p["sin"].reshape(-1, rot).float(), p["cos"].reshape(-1, rot).float()
    if not p["is_neox_style"]:  # the first half of each row, each value used for a pair
        sin = sin[:, : rot // 2].repeat_interleave(2, dim=-1)
        cos = cos[:, : rot // 2].repeat_interleave(2, dim=-1)
    sin, cos = sin[:, None, :], cos[:, None, :]
    parts = (("q", x[:, :qs], p["q_weight"], p["q_bias"]), ("k", x[:, qs : qs + kvs], p["k_weight"], p["k_bias"]))
    for name, part, weight, bias in parts:
        h = part.reshape(part.shape[0], -1, hd)
        if p["eps"] is not None:
            h, _ = rms_normalize(h, weight, float(p["eps"]))
            if bias is not None:
                h = h + bias.float()
        r = h[..., :rot]
        h = torch.cat((_turned(r, bool(p["is_neox_style"])) * sin + r * cos, h[..., rot:]), dim=-1)
        p[f"{name}_out"].copy_(h.reshape(part.shape))
    p["v_out"].copy_(x[:, qs + kvs :])


_SPLIT_QKV = _kernel("split_qkv_rmsnorm_rope", "input", ("q_out", "k_out", "v_out"), _split_qkv_rmsnorm_rope)


def split_qkv_rmsnorm_rope(
    input: torch.Tensor,
    sin: torch.Tensor,
    cos: torch.Tensor,
    q_hidden_size: int,
    kv_hidden_size: int,
    head_dim: int,
    eps: float | None = None,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sgl_kernel_npu's fused QKV split: ``input`` ``[T, q + 2 kv]`` split into q, k, v; with
    ``eps``, q and k RMS-normalised per head (times their weight, plus their bias); then the
    first ``rot = sin.shape[-1]`` dims of every q and k head rotated by the per-token
    ``sin``/``cos`` ``[T, rot]`` (NeoX: halves; otherwise adjacent pairs, each value of the
    rows' first halves used for a pair).  Float32 inside; outputs in ``input``'s dtype."""
    op = "split_qkv_rmsnorm_rope"
    tokens = input.shape[0] if input.dim() == 2 else -1
    if input.dim() != 2 or input.shape[1] != q_hidden_size + 2 * kv_hidden_size:
        raise fail(op, "input", f"shape {list(input.shape)} is not [tokens, {q_hidden_size} + 2 * {kv_hidden_size}]")
    if head_dim <= 0 or kv_hidden_size % head_dim or q_hidden_size % kv_hidden_size:
        raise fail(op, "head_dim", f"{head_dim} does not divide the kv size {kv_hidden_size} (nor kv the q size)")
    rot = sin.shape[-1]
    # the kernel reads row i's angles at i * rot: any contiguous [tokens, ..., rot] of tokens * rot values
    for name, t in (("sin", sin), ("cos", cos)):
        if t.dim() < 2 or t.shape[0] != tokens or t.numel() != tokens * rot or rot % 2 or rot > head_dim:
            raise fail(op, name, f"shape {list(t.shape)} is not [{tokens} tokens, an even rotary dim <= {head_dim}]")
        if not t.is_contiguous():
            raise fail(op, name, "must be contiguous (the kernel reads row i at i * rotary dim)")
    if eps is not None:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w is None or tuple(w.shape) != (head_dim,):
                raise fail(
                    op, name, f"must be [{head_dim}] when eps is given, got {None if w is None else list(w.shape)}"
                )
    q = torch.empty(tokens, q_hidden_size, dtype=input.dtype, device=input.device)
    k = torch.empty(tokens, kv_hidden_size, dtype=input.dtype, device=input.device)
    v = torch.empty(tokens, kv_hidden_size, dtype=input.dtype, device=input.device)
    launch(
        _SPLIT_QKV,
        {
            "input": input,
            "sin": sin,
            "cos": cos,
            "q_hidden_size": q_hidden_size,
            "kv_hidden_size": kv_hidden_size,
            "head_dim": head_dim,
            "eps": eps,
            "q_weight": q_weight,
            "k_weight": k_weight,
            "q_bias": q_bias,
            "k_bias": k_bias,
            "is_neox_style": is_neox_style,
            "q_out": q,
            "k_out": k,
            "v_out": v,
        },
    )
    return q, k, v


def _mrope(p: dict[str, Any]) -> None:
    hs = int(p["head_size"])
    cache = p["cos_sin_cache"].float()
    rot = cache.shape[-1]
    pos = p["positions"].long()
    if pos.dim() == 1:
        cos, sin = cache[pos].chunk(2, dim=-1)
    else:  # [3, T]: section i of the rotary half takes its angles from position row i
        cos_rows, sin_rows = cache[pos].chunk(2, dim=-1)  # [3, T, rot/2]
        at, cos_parts, sin_parts = 0, [], []
        for i, width in enumerate(p["mrope_section"]):
            cos_parts.append(cos_rows[i, :, at : at + width])
            sin_parts.append(sin_rows[i, :, at : at + width])
            at += width
        cos, sin = torch.cat(cos_parts, dim=-1), torch.cat(sin_parts, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for name in ("query", "key"):
        t = p[name]
        x = t.reshape(t.shape[0], -1, hs).float()
        x[..., :rot] = _rotate(x[..., :rot], cos, sin, p["rotary_mode"] == "half")
        p[f"{name}_out"].copy_(x.reshape(t.shape))


_MROPE = _kernel("npu_mrope", "query", ("query_out", "key_out"), _mrope)


def npu_mrope(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    *,
    mrope_section: list[int] | None = None,
    rotary_mode: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``query``/``key`` ``[T, heads * head_size]`` into new tensors.

    ``cos_sin_cache`` ``[max_position, rot]`` holds cos then sin per position; the first
    ``rot`` dims of each head rotate (``"half"``: NeoX halves; ``"interleave"``: adjacent
    pairs).  ``positions`` ``[T]``, or ``[3, T]`` with ``mrope_section`` (widths summing to
    ``rot / 2``: multimodal RoPE, each section's angles from its own position row); an
    all-zero section with ``[T]`` positions is plain RoPE."""
    op = "npu_mrope"
    rot = int(cos_sin_cache.shape[-1]) if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot % 2 or rot > head_size:
        raise fail(op, "cos_sin_cache", f"shape {list(cos_sin_cache.shape)} is not [positions, rot <= {head_size}]")
    if rotary_mode not in ("half", "interleave"):
        raise fail(op, "rotary_mode", f"{rotary_mode!r} is not 'half' or 'interleave'")
    tokens = positions.shape[-1]
    if positions.dim() == 2:
        section = list(mrope_section or [])
        if positions.shape[0] != 3 or len(section) != 3 or sum(section) != rot // 2:
            raise fail(
                op, "mrope_section", f"{section} does not split {rot // 2} over positions {list(positions.shape)}"
            )
    elif positions.dim() != 1:
        raise fail(op, "positions", f"shape {list(positions.shape)} is not [tokens] or [3, tokens]")
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 2 or t.shape[0] != tokens or t.shape[1] % head_size:
            raise fail(op, name, f"shape {list(t.shape)} is not [{tokens} tokens, heads * {head_size}]")
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    params = {
        "positions": positions,
        "query": query,
        "key": key,
        "cos_sin_cache": cos_sin_cache,
        "head_size": head_size,
        "mrope_section": mrope_section,
        "rotary_mode": rotary_mode,
        "query_out": q_out,
        "key_out": k_out,
    }
    launch(_MROPE, params)
    return q_out, k_out


ACL_FORMAT_ND = 2  # CANN's aclFormat: the plain row-major order every simulated tensor has


def npu_format_cast(
    self: torch.Tensor, acl_format: int, *, customize_dtype: int | None = None, input_dtype: int | None = None
) -> torch.Tensor:
    """``self`` in CANN storage format ``acl_format`` (29: FRACTAL_NZ, 2: ND, ...).

    A format is the device's internal tiling of the same values, which torch_npu's kernels
    and ops read transparently; the simulator keeps every tensor in ND order.  So a cast to
    ND returns ``self`` (it is in that format already, as on a device), and a cast to any
    other format a new tensor with the same values (a device's cast makes new storage, so
    writing one afterwards does not change the other)."""
    if isinstance(acl_format, bool) or not isinstance(acl_format, int) or acl_format < 0:
        raise fail("npu_format_cast", "acl_format", f"must be a CANN aclFormat number, got {acl_format!r}")
    if acl_format == ACL_FORMAT_ND:
        return self
    return self.clone()
