"""PA: ``_npu_paged_attention`` (one query token per request, lengths as a CPU int32 tensor)."""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels import numerics as K
from npusim.kernels.schemas import PA_SCHEMA
from npusim.runtime import state as rt
from npusim.runtime.launch import OpPacket, SimOp, fail, host_copy, launch, need_tensor

__all__ = ["_npu_paged_attention", "_npu_paged_attention_get_workspace"]

_NAME = "_npu_paged_attention"  # the op's name, in its errors and its declaration


def _pa_check(p: dict[str, Any]) -> dict[str, Any]:
    op = _NAME
    q = need_tensor(op, "query", p["query"], 3)
    kc = need_tensor(op, "key_cache", p["key_cache"], 4)
    vc = need_tensor(op, "value_cache", p["value_cache"], 4)
    bt = need_tensor(op, "block_table", p["block_table"], 2)
    need_tensor(op, "context_lens", p["context_lens"], 1)  # its values: _pa_lengths
    out = need_tensor(op, "out", p["out"], 3)
    t, n, d = q.shape
    _, bs, kvn, dk = kc.shape
    num_heads, num_kv_heads = int(p["num_heads"]), int(p["num_kv_heads"])
    if n != num_heads:
        raise fail(op, "num_heads", f"is {num_heads} but query has {n} heads")
    if kvn != num_kv_heads:
        raise fail(op, "num_kv_heads", f"is {num_kv_heads} but key_cache has {kvn} kv heads")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise fail(op, "num_heads", f"({num_heads}) must be a multiple of num_kv_heads")
    if dk != d:
        raise fail(op, "key_cache", f"head size {dk} differs from the query's {d}")
    # ATB PagedAttention's constraints (CANN 9.0, ascendtb_01_0198), for what torch_npu's
    # _npu_paged_attention runs (decode, not quantized, no head compression or parallel
    # decoding, Atlas A2/A3): "block_size % 16 == 0"; key and value head sizes may differ,
    # each in (0, 576], and block_size <= 128 when either is over 256.  (Equal head sizes
    # within (0, 256] and block_size * head_size <= 128 * 128 bind only the quantized,
    # compressed, parallel-decoding and Atlas 300I cases, which torch_npu's PA is not.)
    dv = int(vc.shape[3])
    if bs % 16:
        raise fail(op, "key_cache", f"block size {bs} is not a multiple of 16 (ATB PagedAttention requires it)")
    for name, size in (("key_cache", d), ("value_cache", dv)):
        if not 0 < size <= 576:
            raise fail(op, name, f"head size {size} is outside ATB PagedAttention's (0, 576]")
    if max(d, dv) > 256 and bs > 128:
        raise fail(
            op,
            "key_cache",
            f"block size {bs} with head sizes {d}/{dv}: ATB PagedAttention needs block_size <= 128 when a "
            "head size is over 256",
        )
    if vc.shape[:3] != kc.shape[:3]:
        raise fail(op, "value_cache", f"shape {list(vc.shape)} does not match key_cache")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise fail(op, "query", f"dtype {q.dtype} is not supported (float16/bfloat16)")
    if kc.dtype != q.dtype or vc.dtype != q.dtype or out.dtype != q.dtype:
        raise fail(op, "key_cache", "query, caches and out must share one dtype")
    if bt.dtype != torch.int32:
        raise fail(op, "block_table", f"must be int32, got {bt.dtype}")
    if bt.shape[0] != t:
        raise fail(op, "block_table", f"has {bt.shape[0]} rows for {t} query tokens")
    if list(out.shape) != [t, n, vc.shape[3]]:
        raise fail(op, "out", f"must have shape {[t, n, vc.shape[3]]}, got {list(out.shape)}")
    return _pa_lengths(p, {"max_kv": bt.shape[1] * bs, "max_q": 1, "block_size": bs, "tokens": t})


def _pa_lengths(p: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """The check of ``context_lens`` (its values, read on the host), given the rest's ``info``."""
    op, t = _NAME, info["tokens"]
    cl = need_tensor(op, "context_lens", p["context_lens"], 1)
    if cl.dtype != torch.int32 or cl.device.type != "cpu":
        raise fail(op, "context_lens", f"must be an int32 CPU tensor, got {cl.dtype}")
    if cl.shape[0] != t:
        raise fail(op, "context_lens", f"has {cl.shape[0]} entries for {t} query tokens")
    lens = cl.tolist()
    return info | {"max_len": max(lens, default=0), "lens": lens}


def _pa_bounds(p: dict[str, Any], info: dict[str, Any]) -> None:
    cap, blocks = info["max_kv"], p["block_table"].shape[1]
    for i, length in enumerate(info["lens"]):
        if length < 0 or length > cap:
            raise fail(
                _NAME,
                f"context_lens[{i}]",
                f"= {length} is outside [0, {cap}] (block_table has {blocks} blocks of {info['block_size']} per "
                "request): the kernel would read past the table",
            )


def _pa_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    q, kc, vc = p["query"], p["key_cache"], p["value_cache"]
    bt, cl, out = p["block_table"], p["context_lens"], p["out"]
    t = q.shape[0]
    lmax = info["max_len"]
    if lmax == 0 or t == 0:
        out.zero_()
        return
    k = K.gather_paged(kc, bt, cl, lmax, kc.shape[1], f"{_NAME}: block_table")
    v = K.gather_paged(vc, bt, cl, lmax, kc.shape[1], f"{_NAME}: block_table")
    o, _ = K.attention(
        q.unsqueeze(2),
        k.permute(0, 2, 1, 3),
        v.permute(0, 2, 1, 3),
        torch.ones(t, dtype=torch.int32, device=q.device),
        cl,
        float(p["scale_value"]),
    )
    out.copy_(o.squeeze(2))


def _pa_workspace(p: dict[str, Any], info: dict[str, Any]) -> int:
    q, vc = p["query"], p["value_cache"]
    return K.pa_workspace_bytes(q.shape[0], q.shape[1], vc.shape[2], vc.shape[3], int(info["max_len"]))


def _pa_max_workspace(p: dict[str, Any], info: dict[str, Any]) -> int:
    # The simulator knows its own model: the short (split-KV) path peaks anywhere up to
    # 1024 tokens, the long path grows with the length.
    return max(_pa_workspace(p, {"max_len": length}) for length in {1, min(1024, info["max_kv"]), info["max_kv"]})


_PA = SimOp(
    _NAME,
    "default",
    host_args=("context_lens",),
    output_args=("out",),
    check=_pa_check,
    compute=_pa_compute,
    workspace=_pa_workspace,
    max_workspace=_pa_max_workspace,
    bounds=_pa_bounds,
    lengths=_pa_lengths,
)


def _paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    workspace: torch.Tensor | None = None,
) -> None:
    """Paged decode attention: one query token per request, lengths on the host."""
    launch(_PA, dict(locals()))


# torch_npu's is the ATB op (an op with one overload, .default)
_npu_paged_attention = OpPacket(_paged_attention, None, "_npu_paged_attention", schemas=(PA_SCHEMA, ""))


def _npu_paged_attention_get_workspace(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Return a workspace sized for *these* arguments (not a maximum over lengths)."""
    st = rt.get_state()
    st.charge("workspace_query")
    p = dict(locals())
    p.pop("st")
    p["context_lens"] = host_copy("context_lens", context_lens)
    size = _PA.workspace_bytes(p)
    return torch.empty(size, dtype=torch.uint8, device=query.device)
