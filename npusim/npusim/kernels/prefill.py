"""Prefill attention: ``npu_fusion_attention`` (FlashAttention; layouts BSH, BSND, BNSD, TND)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from npusim.kernels import numerics as K
from npusim.kernels.fia import INT_MAX, check_compressed_mask
from npusim.runtime.launch import SimOp, brief_host, fail, host_copy, launch, need_tensor

__all__ = ["npu_fusion_attention", "_npu_flash_attention_qlens"]

_OP = "npu_fusion_attention"


def _ends(name: str, v: Any, total: int) -> list[int]:
    ends = list(v) if v is not None else None
    if not ends or any(b < a for a, b in itertools.pairwise(ends)) or ends[-1] != total or ends[0] < 0:
        raise fail(
            _OP, name, f"must be non-decreasing cumulative ends whose last entry is {total}, got {brief_host(v)}"
        )
    return ends


def _check(p: dict[str, Any]) -> dict[str, Any]:
    for name in ("pse", "padding_mask", "prefix"):
        if p.get(name) is not None:
            raise NotImplementedError(f"{_OP}: the simulator does not model {name!r}")
    if float(p["keep_prob"]) != 1.0:
        raise NotImplementedError(f"{_OP}: the simulator does not model dropout (keep_prob must be 1.0)")
    layout, n = p["input_layout"], int(p["head_num"])
    q, k, v = p["query"], p["key"], p["value"]
    sparse = int(p["sparse_mode"])
    if sparse not in (0, 3):
        raise fail(_OP, "sparse_mode", f"{sparse} is not modelled (0 and 3, causal from the bottom right, are)")
    if sparse == 3 and p.get("atten_mask") is None:
        raise fail(_OP, "atten_mask", "is required with sparse_mode=3 (the 2048x2048 compressed mask)")
    if layout == "TND":
        need_tensor(_OP, "query", q, 3)
        need_tensor(_OP, "key", k, 3)
        need_tensor(_OP, "value", v, 3)
        qe = _ends("actual_seq_qlen", p.get("actual_seq_qlen"), q.shape[0])
        ke = _ends("actual_seq_kvlen", p.get("actual_seq_kvlen"), k.shape[0])
        if len(qe) != len(ke):
            raise fail(_OP, "actual_seq_kvlen", f"has {len(ke)} entries, actual_seq_qlen {len(qe)}")
        q_per = [b - a for a, b in zip([0, *qe], qe)]
        kv_per = [b - a for a, b in zip([0, *ke], ke)]
        qn, d, kvn, dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
        batch, sq, sk = len(qe), max(q_per), max(kv_per)
    elif layout in ("BSH", "BSND", "BNSD"):
        dims = 3 if layout == "BSH" else 4
        for name, t in (("query", q), ("key", k), ("value", v)):
            need_tensor(_OP, name, t, dims)
        if layout == "BSH":
            batch, sq, h = q.shape
            qn, d = n, h // n
            kvn = k.shape[2] // d
            sk, dv = k.shape[1], v.shape[2] // kvn
        elif layout == "BSND":
            batch, sq, qn, d = q.shape
            sk, kvn, dv = k.shape[1], k.shape[2], v.shape[3]
        else:
            batch, qn, sq, d = q.shape
            kvn, sk, dv = k.shape[1], k.shape[2], v.shape[3]
        q_per, kv_per = [sq] * batch, [sk] * batch
        qe = ke = []
    else:
        raise fail(_OP, "input_layout", f"must be one of ('BSH', 'BSND', 'BNSD', 'TND'), got {layout!r}")
    if qn != n:
        raise fail(_OP, "head_num", f"is {n} but query has {qn} heads")
    if kvn <= 0 or n % kvn:
        raise fail(_OP, "key", f"has {kvn} heads; head_num={n} must be a multiple")
    return {
        "layout": layout,
        "batch": batch,
        "heads": n,
        "kv_heads": kvn,
        "d": d,
        "dv": dv,
        "sq": sq,
        "sk": sk,
        "q_per": q_per,
        "kv_per": kv_per,
        "q_ends": qe,
        "kv_ends": ke,
        "max_q": sq,
        "max_kv": sk,
    }


def _batched(
    t: torch.Tensor, info: dict[str, Any], ends: list[int], per: list[int], s: int, heads: int
) -> torch.Tensor:
    """``t`` as ``[B, heads, S, D]`` (TND rows gathered per request, zero past its length)."""
    layout, b, dev = info["layout"], info["batch"], t.device
    if layout == "TND":
        starts = torch.tensor([0, *ends[:-1]], dtype=torch.int64, device=dev)
        pos = torch.arange(s, device=dev).unsqueeze(0)
        idx = torch.where(pos < torch.tensor(per, device=dev).unsqueeze(1), starts.unsqueeze(1) + pos, 0)
        return t[idx].permute(0, 2, 1, 3)
    if layout == "BSH":
        return t.reshape(b, t.shape[1], heads, -1).permute(0, 2, 1, 3)
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    return t


def _tnd_rows(t: torch.Tensor, per: list[int]) -> torch.Tensor:
    """``t`` ``[B, N, S, ...]`` back as TND rows ``[T, N, ...]``: request ``b``'s first ``per[b]``."""
    rows = torch.tensor([b for b, n in enumerate(per) for _ in range(n)], dtype=torch.int64, device=t.device)
    cols = torch.tensor([i for n in per for i in range(n)], dtype=torch.int64, device=t.device)
    return t[rows, :, cols]


def _compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    sparse = int(p["sparse_mode"])
    if sparse == 3:
        check_compressed_mask(p["atten_mask"])
    q = _batched(p["query"], info, info["q_ends"], info["q_per"], info["sq"], info["heads"])
    k = _batched(p["key"], info, info["kv_ends"], info["kv_per"], info["sk"], info["kv_heads"])
    v = _batched(p["value"], info, info["kv_ends"], info["kv_per"], info["sk"], info["kv_heads"])
    mask = p.get("atten_mask") if sparse == 0 else None
    pre, nxt = int(p["pre_tockens"]), int(p["next_tockens"])
    band = (pre, nxt) if sparse == 0 and (pre, nxt) != (INT_MAX, INT_MAX) else None
    dev = q.device
    q_per, kv_per = torch.tensor(info["q_per"], device=dev), torch.tensor(info["kv_per"], device=dev)
    o, lse = K.attention(q, k, v, q_per, kv_per, float(p["scale"]), causal=sparse == 3, mask=mask, band=band)
    out, smax, ssum = p["out"]
    if info["layout"] == "TND":
        out.copy_(_tnd_rows(o, info["q_per"]))
        lse_rows = _tnd_rows(lse, info["q_per"])  # [T, N]
    elif info["layout"] == "BSH":
        out.copy_(o.permute(0, 2, 1, 3).reshape(out.shape))
        lse_rows = lse.permute(0, 2, 1)
    elif info["layout"] == "BSND":
        out.copy_(o.permute(0, 2, 1, 3))
        lse_rows = lse.permute(0, 2, 1)
    else:
        out.copy_(o)
        lse_rows = lse
    # softmax_max / softmax_sum: the row's normaliser as (max, sum) with max + log(sum) = lse;
    # the simulator keeps the whole log-sum-exp in max and sum = 1 (eight copies, as the kernel)
    smax.copy_(lse_rows.unsqueeze(-1).expand(smax.shape))
    ssum.fill_(1.0)


_FA = SimOp(
    _OP,
    "default",
    host_args=("actual_seq_qlen", "actual_seq_kvlen"),
    output_args=("out",),
    check=_check,
    compute=_compute,
    workspace=lambda p, info: 0,
)


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = INT_MAX,
    next_tockens: int = INT_MAX,
    inner_precise: int = 0,
    prefix: Any = None,
    actual_seq_qlen: Any = None,
    actual_seq_kvlen: Any = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """FlashAttention forward (prefill): ``(attention_out, softmax_max, softmax_sum,
    softmax_in, seed, offset, numels)``; TND takes cumulative ``actual_seq_qlen`` and
    ``actual_seq_kvlen`` (host lists); ``sparse_mode=3`` is causal from the bottom right."""
    p = {k: v for k, v in locals().items()}
    for name in _FA.host_args:
        p[name] = host_copy(name, p.get(name))
    info = _FA.check(p)
    rows = query.shape[0] if input_layout == "TND" else info["batch"]
    if input_layout == "TND":
        out_shape: list[int] = [query.shape[0], info["heads"], info["dv"]]
        stat = [rows, info["heads"], 8]
    elif input_layout == "BSH":
        out_shape = [info["batch"], info["sq"], info["heads"] * info["dv"]]
        stat = [info["batch"], info["heads"], info["sq"], 8]
    elif input_layout == "BSND":
        out_shape = [info["batch"], info["sq"], info["heads"], info["dv"]]
        stat = [info["batch"], info["heads"], info["sq"], 8]
    else:
        out_shape = [info["batch"], info["heads"], info["sq"], info["dv"]]
        stat = [info["batch"], info["heads"], info["sq"], 8]
    out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    smax = torch.empty(stat, dtype=torch.float32, device=query.device)
    ssum = torch.empty(stat, dtype=torch.float32, device=query.device)
    p["out"] = [out, smax, ssum]
    launch(_FA, p)
    return out, smax, ssum, torch.empty(0, dtype=query.dtype, device=query.device), 0, 0, 0


# --- ATB's paged prefill with a prefix: _npu_flash_attention_qlens ---------------------------------

_QLENS = "_npu_flash_attention_qlens"


def _qlens_check(p: dict[str, Any]) -> dict[str, Any]:
    q, kc, vc, bt, out = p["query"], p["key_cache"], p["value_cache"], p["block_table"], p["out"]
    n, kvn = int(p["num_heads"]), int(p["num_kv_heads"])
    need_tensor(_QLENS, "key_cache", kc, 4)
    need_tensor(_QLENS, "value_cache", vc, 4)
    need_tensor(_QLENS, "block_table", bt, 2)
    _, bs, kh, d = kc.shape
    if kh != kvn or n % kvn:
        raise fail(_QLENS, "num_kv_heads", f"{kvn} does not match the cache's {kh} heads or divide {n} query heads")
    t = q.shape[0]
    if q.numel() != t * n * d:
        raise fail(_QLENS, "query", f"shape {list(q.shape)} is not [tokens, {n} heads x {d}]")
    if out.numel() != t * n * vc.shape[3] or out.dtype != q.dtype:
        raise fail(_QLENS, "out", f"must hold [{t}, {n} x {vc.shape[3]}] in {q.dtype}, got {list(out.shape)}")
    if bt.dtype != torch.int32:
        raise fail(_QLENS, "block_table", f"must be int32, got {bt.dtype}")
    m = p["mask"]
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[0] != m.shape[1]:
        raise fail(_QLENS, "mask", "must be the square compressed causal mask (MASK_TYPE_NORM_COMPRESS)")
    q_lens = [int(x) for x in p["seq_len"].tolist()]
    kv_lens = [int(x) for x in p["context_lens"].tolist()]
    if len(q_lens) != bt.shape[0] or len(kv_lens) != bt.shape[0]:
        raise fail(_QLENS, "seq_len", f"{len(q_lens)} and {len(kv_lens)} lengths for {bt.shape[0]} block-table rows")
    if sum(q_lens) != t:
        raise fail(_QLENS, "seq_len", f"sums to {sum(q_lens)}, not the query's {t} tokens")
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        if ql < 0 or kl < ql or kl > bt.shape[1] * bs:
            raise fail(_QLENS, f"context_lens[{i}]", f"= {kl} with seq_len {ql}: not in [seq_len, {bt.shape[1] * bs}]")
    return {"q_lens": q_lens, "kv_lens": kv_lens, "heads": n, "block_size": bs, "dim": d}


def _qlens_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    check_compressed_mask(p["mask"], _QLENS, "mask", "triu(ones(128, 128), 1) (MASK_TYPE_NORM_COMPRESS)")
    q_lens, kv_lens, n, d = info["q_lens"], info["kv_lens"], info["heads"], info["dim"]
    q, out = p["query"].reshape(-1, n, d), p["out"]
    sq, sk = max(q_lens, default=0), max(kv_lens, default=0)
    if sq == 0:
        return
    dev = q.device
    kvl = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
    k = K.gather_paged(p["key_cache"], p["block_table"], kvl, sk, info["block_size"], f"{_QLENS}: block_table")
    v = K.gather_paged(p["value_cache"], p["block_table"], kvl, sk, info["block_size"], f"{_QLENS}: block_table")
    ends = list(itertools.accumulate(q_lens))
    qb = _batched(q, {"layout": "TND", "batch": len(q_lens)}, ends, q_lens, sq, n)  # [B, N, Sq, D]
    q_per = torch.tensor(q_lens, device=dev)
    o, _ = K.attention(
        qb, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), q_per, kvl, float(p["scale_value"]), causal=True
    )
    out.copy_(_tnd_rows(o, q_lens).reshape(out.shape))


_FA_QLENS = SimOp(
    _QLENS,
    "default",
    host_args=("seq_len", "context_lens"),
    output_args=("out",),
    check=_qlens_check,
    compute=_qlens_compute,
    workspace=lambda p, info: 0,
)


def _npu_flash_attention_qlens(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    seq_len: torch.Tensor,
    context_lens: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    out: torch.Tensor,
) -> None:
    """ATB's prefill over a paged cache with a prefix (``PREFIX_ENCODER``): request ``b`` has
    ``seq_len[b]`` new query tokens, the last of its ``context_lens[b]`` tokens, whose keys
    and values are already in the cache through ``block_table[b]``; each new token sees its
    request's keys up to its own position (causal from the bottom right; ``mask`` is the
    compressed causal mask).  ``seq_len``/``context_lens`` are host int32 tensors."""
    p = {k: v for k, v in locals().items()}
    for name in ("seq_len", "context_lens"):
        value = p[name]
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.dtype != torch.int32:
            raise fail(_QLENS, name, "must be an int32 host tensor")
    launch(_FA_QLENS, p)
