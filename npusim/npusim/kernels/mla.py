"""The kernels of multi-head latent attention (DeepSeek's MLA) besides FIA itself.

vllm-ascend's MLA backend (``attention/mla_v1.py``) calls, around FIA with rope arguments:

* ``npu_interleave_rope``: the rope of the query's rope part.  DeepSeek's rope dims come
  in interleaved pairs; the kernel gathers the even then the odd dims into halves and
  rotates the halves (``y = q cos + rotate_half(q) sin``).  Its output is in that halved
  order, and so is the key's (below): their dot product is the one of the pairs.
* ``npu_kv_rmsnorm_rope_cache``: the latent KV of each token (``[.., 512 + 64]``): an
  RMSNorm of its first 512 dims, the interleaved rope of its last 64, both written into
  the paged caches at the token's slot, and (``is_output_kv``) returned.
* ``npu_transpose_batchmatmul``: a batched matmul whose output is transposed, the up
  projection of FIA's latent output into each head's values.

Numerics follow CANN's kernels: float32 inside, results in the input's dtype.  Shapes and
sizes are checked as CANN documents them (the rope part is 64 dims, the norm part 512).
"""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels.cache import PAD_SLOT_ID
from npusim.kernels.dense import rms_normalize
from npusim.runtime.launch import SimOp, fail, launch, need_tensor

__all__ = ["npu_interleave_rope", "npu_kv_rmsnorm_rope_cache", "npu_transpose_batchmatmul"]

ROPE_SIZE = 64  # CANN: the rope part of MLA's key and query (both kernels take only 64)
RMS_SIZE = 512  # CANN: the latent (RMSNorm) part of MLA's KV
_HALF_TYPES = (torch.float16, torch.bfloat16)


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float32 ``x [.., D]``'s interleaved pairs gathered into halves, then rotated:
    ``q cos + rotate_half(q) sin`` with ``q = cat(x[..., ::2], x[..., 1::2])``."""
    q = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    q1, q2 = q.chunk(2, dim=-1)
    return q * cos.float() + torch.cat((-q2, q1), dim=-1) * sin.float()


def _check_cos_sin(op: str, x: torch.Tensor, cos: Any, sin: Any) -> None:
    b, _, s, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        need_tensor(op, name, t, 4)
        if t.dtype != x.dtype:
            raise fail(op, name, f"must have the input's dtype {x.dtype}, got {t.dtype}")
        if t.shape[0] != b or t.shape[1] != 1 or t.shape[2] not in (1, s) or t.shape[3] != d:
            raise fail(op, name, f"shape {list(t.shape)} is not [{b}, 1, {s} or 1, {d}]")


def _interleave_rope(p: dict[str, Any]) -> None:
    p["y"].copy_(interleaved_rope(p["x"].float(), p["cos"], p["sin"]))


_INTERLEAVE_ROPE = SimOp(
    "npu_interleave_rope",
    "default",
    host_args=(),
    output_args=("y",),
    check=lambda p: {},
    compute=lambda p, info: _interleave_rope(p),
    workspace=lambda p, info: 0,
    anchor="x",
)


def npu_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope of ``x [B, N, S, 64]`` whose dims are interleaved pairs, by ``cos``/``sin``
    ``[B, 1, S or 1, 64]`` (halves: the pairs' order after gathering); a new tensor.

    CANN reads a strided ``x`` through its strides (vllm-ascend passes the rope slice of
    a query projection), so ``x`` need not be contiguous."""
    op = "npu_interleave_rope"
    need_tensor(op, "x", x, 4)
    if x.dtype not in _HALF_TYPES:
        raise fail(op, "x", f"must be float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] != ROPE_SIZE:
        raise fail(op, "x", f"last dim is {x.shape[-1]}; the kernel takes D = {ROPE_SIZE}")
    _check_cos_sin(op, x, cos, sin)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(_INTERLEAVE_ROPE, {"x": x, "cos": cos, "sin": sin, "y": y})
    return y


_PAGED_MODES = ("PA", "PA_BNSD")


def _kv_cache_check(p: dict[str, Any]) -> dict[str, Any]:
    op = "npu_kv_rmsnorm_rope_cache"
    kv = need_tensor(op, "kv", p["kv"], 4)
    b, n, s, hidden = kv.shape
    if kv.dtype not in _HALF_TYPES:
        raise fail(op, "kv", f"must be float16 or bfloat16, got {kv.dtype}")
    if n != 1 or hidden != RMS_SIZE + ROPE_SIZE:
        raise fail(op, "kv", f"shape {list(kv.shape)} is not [batch, 1, seq, {RMS_SIZE + ROPE_SIZE}]")
    gamma = need_tensor(op, "gamma", p["gamma"], 1)
    if gamma.shape[0] != RMS_SIZE or gamma.dtype != kv.dtype:
        raise fail(op, "gamma", f"must be {kv.dtype} [{RMS_SIZE}], got {gamma.dtype} {list(gamma.shape)}")
    rope_shape = torch.empty((b, 1, s, ROPE_SIZE), device="meta")
    _check_cos_sin(op, rope_shape.to(kv.dtype), p["cos"], p["sin"])
    for name in ("k_rope_scale", "c_kv_scale", "k_rope_offset", "c_kv_offset", "v"):
        if p.get(name) is not None:
            raise NotImplementedError(f"{op}: the simulator does not model {name!r} (quantised caches, V2)")
    mode = p["cache_mode"]
    if mode not in _PAGED_MODES:
        raise NotImplementedError(f"{op}: cache_mode {mode!r} is not simulated ({', '.join(_PAGED_MODES)} are)")
    index = need_tensor(op, "index", p["index"], 1)
    if index.dtype != torch.int64:
        raise fail(op, "index", f"must be int64, got {index.dtype}")
    if index.shape[0] != b * s:
        raise fail(op, "index", f"has {index.shape[0]} entries for {b * s} tokens (batch * seq)")
    kc = need_tensor(op, "k_cache", p["k_cache"], 4)
    ckv = need_tensor(op, "ckv_cache", p["ckv_cache"], 4)
    nb, bs = kc.shape[0], kc.shape[1]
    if tuple(kc.shape) != (nb, bs, 1, ROPE_SIZE):
        raise fail(op, "k_cache", f"shape {list(kc.shape)} is not [blocks, block_size, 1, {ROPE_SIZE}]")
    if tuple(ckv.shape) != (nb, bs, 1, RMS_SIZE):
        raise fail(op, "ckv_cache", f"shape {list(ckv.shape)} is not [{nb}, {bs}, 1, {RMS_SIZE}]")
    for name, t in (("k_cache", kc), ("ckv_cache", ckv)):
        if t.dtype != kv.dtype:
            raise fail(op, name, f"must have kv's dtype {kv.dtype} (unquantised), got {t.dtype}")
    return {"slots": nb * bs}


def _kv_cache_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    op = "npu_kv_rmsnorm_rope_cache"
    kv = p["kv"].float()
    latent, _ = rms_normalize(kv[..., :RMS_SIZE], p["gamma"], float(p["epsilon"]))
    rope = interleaved_rope(kv[..., RMS_SIZE:], p["cos"], p["sin"])
    slots = p["index"].long()
    if bool((slots >= info["slots"]).any()) or bool((slots < PAD_SLOT_ID).any()):
        i = int(((slots >= info["slots"]) | (slots < PAD_SLOT_ID)).nonzero()[0])
        raise fail(op, "index", f"[{i}] = {int(slots[i])} is outside the caches' {info['slots']} slots")
    keep = slots >= 0  # vLLM's padding tokens (slot -1) write nowhere
    kc, ckv = p["k_cache"], p["ckv_cache"]
    kc.view(-1, ROPE_SIZE)[slots[keep]] = rope.reshape(-1, ROPE_SIZE)[keep].to(kc.dtype)
    ckv.view(-1, RMS_SIZE)[slots[keep]] = latent.reshape(-1, RMS_SIZE)[keep].to(ckv.dtype)
    if p["is_output_kv"]:
        p["k_rope"].copy_(rope)
        p["c_kv"].copy_(latent)


_KV_CACHE = SimOp(
    "npu_kv_rmsnorm_rope_cache",
    "default",
    host_args=(),
    output_args=("k_cache", "ckv_cache", "k_rope", "c_kv"),
    check=_kv_cache_check,
    compute=_kv_cache_compute,
    workspace=lambda p, info: 0,
    anchor="kv",
)


def npu_kv_rmsnorm_rope_cache(
    kv: torch.Tensor,
    gamma: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    index: torch.Tensor,
    k_cache: torch.Tensor,
    ckv_cache: torch.Tensor,
    *,
    k_rope_scale: torch.Tensor | None = None,
    c_kv_scale: torch.Tensor | None = None,
    k_rope_offset: torch.Tensor | None = None,
    c_kv_offset: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    epsilon: float = 1e-5,
    cache_mode: str = "Norm",
    is_output_kv: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's KV of each token, ``kv [B, 1, S, 512 + 64]``: RMSNorm (``gamma [512]``) of the
    first 512 dims into ``ckv_cache``, the interleaved rope of the last 64 into ``k_cache``
    (paged: ``[blocks, block_size, 1, D]``, token ``i`` at slot ``index[i]``, -1 skipped).

    Returns ``(k_cache, ckv_cache, k_rope [B, 1, S, 64], c_kv [B, 1, S, 512])``: the caches
    (written in place), and with ``is_output_kv`` the rope and norm results (else
    allocated and not written, as torch_npu's)."""
    b, n, s = kv.shape[:3] if kv.dim() == 4 else (0, 0, 0)
    k_rope = torch.empty((b, n, s, ROPE_SIZE), dtype=kv.dtype, device=kv.device)
    c_kv = torch.empty((b, n, s, RMS_SIZE), dtype=kv.dtype, device=kv.device)
    params = {
        "kv": kv,
        "gamma": gamma,
        "cos": cos,
        "sin": sin,
        "index": index,
        "k_cache": k_cache,
        "ckv_cache": ckv_cache,
        "k_rope_scale": k_rope_scale,
        "c_kv_scale": c_kv_scale,
        "k_rope_offset": k_rope_offset,
        "c_kv_offset": c_kv_offset,
        "v": v,
        "epsilon": epsilon,
        "cache_mode": cache_mode,
        "is_output_kv": is_output_kv,
        "k_rope": k_rope,
        "c_kv": c_kv,
    }
    launch(_KV_CACHE, params)
    return k_cache, ckv_cache, k_rope, c_kv


def _bmm_check(p: dict[str, Any]) -> dict[str, Any]:
    op = "npu_transpose_batchmatmul"
    x, w = need_tensor(op, "input", p["input"], 3), need_tensor(op, "weight", p["weight"], 3)
    for name, t in (("input", x), ("weight", w)):
        if t.dtype not in (*_HALF_TYPES, torch.float32):
            raise fail(op, name, f"must be float16, bfloat16 or float32, got {t.dtype}")
    perm_x1, perm_x2, perm_y = (list(p[k]) for k in ("perm_x1", "perm_x2", "perm_y"))
    if perm_x1 not in ([0, 1, 2], [1, 0, 2]):
        raise fail(op, "perm_x1", f"is {perm_x1}; CANN takes [0, 1, 2] or [1, 0, 2]")
    if perm_x2 != [0, 1, 2]:
        raise fail(op, "perm_x2", f"is {perm_x2}; CANN takes only [0, 1, 2]")
    if perm_y != [1, 0, 2]:
        raise fail(op, "perm_y", f"is {perm_y}; CANN takes only [1, 0, 2]")
    for name in ("bias", "scale"):
        if p.get(name) is not None:
            raise NotImplementedError(f"{op}: the simulator does not model {name!r}")
    xb = x.permute(*perm_x1)  # [B, M, K]
    batch, m, k = xb.shape
    if tuple(w.shape[:2]) != (batch, k):
        raise fail(op, "weight", f"shape {list(w.shape)} is not [{batch} batches, K = {k}, N]")
    n = w.shape[2]
    if k % 128 or n % 128:
        raise fail(op, "weight", f"K = {k} and N = {n} must both be multiples of 128 (CANN's constraint)")
    split = int(p["batch_split_factor"])
    if split < 1 or (batch * n) % split:
        raise fail(op, "batch_split_factor", f"{split} does not divide B * N = {batch * n}")
    shape = [m, batch, n] if split == 1 else [split, m, batch * n // split]
    return {"shape": shape}


def _bmm_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    x = p["input"].float().permute(*p["perm_x1"])
    y = torch.bmm(x, p["weight"].float()).permute(1, 0, 2)  # [M, B, N]
    if int(p["batch_split_factor"]) > 1:
        m = y.shape[0]
        y = y.reshape(m, int(p["batch_split_factor"]), -1).transpose(0, 1)
    p["y"].copy_(y)


_TRANSPOSE_BMM = SimOp(
    "npu_transpose_batchmatmul",
    "default",
    host_args=(),
    output_args=("y",),
    check=_bmm_check,
    compute=_bmm_compute,
    workspace=lambda p, info: 0,
    anchor="input",
)


def npu_transpose_batchmatmul(
    input: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    perm_x1: list[int] | tuple[int, ...] | None = (0, 1, 2),
    perm_x2: list[int] | tuple[int, ...] | None = (0, 1, 2),
    perm_y: list[int] | tuple[int, ...] | None = (1, 0, 2),
    batch_split_factor: int | None = 1,
) -> torch.Tensor:
    """``bmm(input.permute(perm_x1), weight)`` (``[B, M, K] x [B, K, N]``) transposed to
    ``[M, B, N]`` (``perm_y``); with ``batch_split_factor`` f > 1, ``[f, M, B * N / f]``."""
    params: dict[str, Any] = {
        "input": input,
        "weight": weight,
        "bias": bias,
        "scale": scale,
        "perm_x1": list(perm_x1) if perm_x1 is not None else [0, 1, 2],
        "perm_x2": list(perm_x2) if perm_x2 is not None else [0, 1, 2],
        "perm_y": list(perm_y) if perm_y is not None else [1, 0, 2],
        "batch_split_factor": 1 if batch_split_factor is None else batch_split_factor,
    }
    info = _bmm_check(params)  # the output's shape, before anything is allocated
    params["y"] = torch.empty(info["shape"], dtype=input.dtype, device=input.device)
    launch(_TRANSPOSE_BMM, params)
    return params["y"]
