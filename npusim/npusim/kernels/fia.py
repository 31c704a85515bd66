"""FIA: ``npu_fused_infer_attention_score`` (layouts BSH/BSND/BNSD/TND, paged or dense)."""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels import numerics as K
from npusim.kernels.schemas import FIA_OUT_SCHEMA, FIA_SCHEMA
from npusim.runtime import state as rt
from npusim.runtime.launch import OpPacket, SimOp, brief_host, fail, host_copy, launch, max_workspace, need_tensor

__all__ = [
    "npu_fused_infer_attention_score",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "fia_check",
    "fia_compute",
    "fia_workspace",
    "alloc_outputs",
    "check_compressed_mask",
]

INT_MAX = 2147483647


_LAYOUTS = ("BSH", "BSND", "BNSD", "TND")
# "IN_OUT": the query in one layout, the output written in another (CANN's FIA: MLA's
# decode writes NBSD, so that the up projection reads each head's rows with no transpose)
_OUT_LAYOUTS = {"BSH_NBSD": "NBSD", "BSND_NBSD": "NBSD", "BNSD_NBSD": "NBSD", "TND_NTD": "NTD", "BNSD_BSND": "BSND"}


def split_layout(p: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``p`` with ``input_layout`` the query's layout, and the output's layout."""
    layout = p["input_layout"]
    out = _OUT_LAYOUTS.get(layout)
    if out is None:
        return p, layout
    return {**p, "input_layout": layout.split("_")[0]}, out


_UNSUPPORTED_FIA = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "key_rope_antiquant_scale",
)


def _with_rope(p: dict[str, Any], *, shapes_only: bool = False) -> dict[str, Any]:
    """MLA: fold ``query_rope``/``key_rope`` into query and key along the head dim.

    score = scale * (q_nope . k_nope + q_rope . k_rope) is the dot product of the
    concatenations; the values stay ``value`` (the latent cache when paged: one KV head;
    the decompressed values in a prefill).  Layouts TND, BNSD, BSND.
    """
    qr, kr = p.get("query_rope"), p.get("key_rope")
    if qr is None and kr is None:
        return p
    op = "npu_fused_infer_attention_score"
    if qr is None or kr is None:
        raise fail(op, "query_rope" if qr is None else "key_rope", "must be given with the other rope argument")
    kvn = int(p["num_key_value_heads"]) or int(p["num_heads"])
    # paged, the cache is MLA's latent one (one KV head); unpaged, vllm-ascend's MLA prefill
    # passes each head's decompressed key and its rope part (as many KV heads as heads)
    if kvn != 1 and p.get("block_table") is not None:
        raise fail(
            op, "num_key_value_heads", f"is {kvn}; query_rope/key_rope with a paged cache (MLA) need one KV head"
        )
    if p["input_layout"] not in ("TND", "BNSD", "BSND"):
        raise fail(op, "input_layout", f"{p['input_layout']!r} with query_rope: use TND, BNSD or BSND")
    q, k = p["query"], p["key"]
    for name, x, base in (("query_rope", qr, q), ("key_rope", kr, k)):
        need_tensor(op, name, x, base.dim())
        if list(x.shape[:-1]) != list(base.shape[:-1]):
            raise fail(op, name, f"shape {list(x.shape)} must match {list(base.shape[:-1])} before the last dim")
    out = dict(p)
    if shapes_only:  # checks read shapes, not data: nothing is computed (or recorded in a capture)
        out["query"] = torch.empty((*q.shape[:-1], q.shape[-1] + qr.shape[-1]), dtype=q.dtype, device="meta")
        out["key"] = torch.empty((*k.shape[:-1], k.shape[-1] + kr.shape[-1]), dtype=k.dtype, device="meta")
    elif p.get("block_table") is not None:
        # a paged key is a whole cache: its rope part is gathered beside it (fia_compute),
        # not concatenated here, which would copy (and touch) every block of both caches
        out["query"] = torch.cat([q, qr], dim=-1)
        return out
    else:
        out["query"] = torch.cat([q, qr], dim=-1)
        out["key"] = torch.cat([k, kr], dim=-1)
    out["query_rope"] = out["key_rope"] = None
    return out


def _host_lengths(v: Any) -> Any:
    """A host length argument as Python ints (a CPU tensor is read on the host, as hardware does)."""
    return v.tolist() if isinstance(v, torch.Tensor) else v


def per_batch(op: str, name: str, lens: Any, batch: int) -> list[int]:
    """A per-batch length list as CANN reads it: one entry is every batch's; with at least
    ``batch`` entries the first ``batch`` are read (vllm-ascend's MLA update passes its key
    lengths padded to the token count); fewer is refused."""
    lens = list(lens)
    if len(lens) == 1:
        return lens * batch
    if len(lens) < batch:
        raise fail(op, name, f"has {len(lens)} entries for batch {batch} (one, or at least one per batch)")
    return lens[:batch]


def fia_check(p: dict[str, Any]) -> dict[str, Any]:
    """Normalise an FIA call: layouts to [B, N, S, D], lengths per batch."""
    op = "npu_fused_infer_attention_score"
    if p["input_layout"] not in _LAYOUTS and p["input_layout"] not in _OUT_LAYOUTS:
        raise fail(op, "input_layout", f"must be one of {_LAYOUTS + tuple(_OUT_LAYOUTS)}, got {p['input_layout']!r}")
    p, out_layout = split_layout(p)
    p = _with_rope(p, shapes_only=True)
    for name in _UNSUPPORTED_FIA:
        if p.get(name) is not None:
            raise NotImplementedError(f"{op}: the simulator does not model {name!r}")
    layout = p["input_layout"]
    q = p["query"]
    n = int(p["num_heads"])
    kvn = int(p["num_key_value_heads"]) or n
    if n <= 0 or n % kvn:
        raise fail(op, "num_heads", f"({n}) must be a positive multiple of num_key_value_heads ({kvn})")
    # lengths are host values, read on the host at the call (also inside a capture): a CPU
    # int tensor gives its ints here, never aten ops a capture would record
    qlens = _host_lengths(p.get("actual_seq_lengths"))
    kvlens = _host_lengths(p.get("actual_seq_lengths_kv"))
    _check_mask(op, p)
    batch, qn, sq, d, q_per, starts = _query_geometry(op, q, layout, n, qlens)
    if qn != n:
        raise fail(op, "num_heads", f"is {n} but query has {qn} heads")
    if p.get("block_table") is not None:
        dk, dv, kv_per, max_kv = _paged_keys(op, p, layout, kvn, batch, kvlens)
    else:
        dk, dv, kv_per, max_kv = _dense_keys(op, p, layout, kvn, batch, d, kvlens)
    if dk != d:
        raise fail(op, "key", f"head size {dk} differs from the query's {d}")
    _kv_within(op, kv_per, max_kv)
    if sq == 1 and int(p["sparse_mode"]) == 0 and p.get("atten_mask") is not None:
        _check_decode_mask(op, p, layout, batch, max_kv if p.get("block_table") is not None else max(kv_per, default=0))
    sink = p.get("learnable_sink")
    if sink is not None and not (
        isinstance(sink, torch.Tensor) and sink.dim() == 1 and sink.shape[0] == n and sink.is_floating_point()
    ):
        shape = list(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
        raise fail(op, "learnable_sink", f"must be a float tensor [num_heads={n}], got {shape}")
    return {
        "layout": layout,
        "out_layout": out_layout,
        "batch": batch,
        "heads": n,
        "kv_heads": kvn,
        "sq": sq,
        "d": d,
        "dv": dv,
        "q_per": q_per,
        "kv_per": kv_per,
        "starts": starts,
        "max_kv": max_kv,
        "max_q": sq,
        "rows": q.shape[0] if layout == "TND" else batch * sq,
        "paged": p.get("block_table") is not None,
    }


def fia_lengths(p: dict[str, Any], info: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`fia_check` of new host lengths, given ``info`` from a check of the same device
    arguments (a paged cache: decode's; ``None`` otherwise, for the whole check)."""
    if not info["paged"]:
        return None
    op = "npu_fused_infer_attention_score"
    qlens = _host_lengths(p.get("actual_seq_lengths"))
    if info["layout"] == "TND":
        q_per, starts = _tnd_queries(op, qlens, info["rows"])
        batch, sq = len(q_per), max(q_per)
    else:
        batch, sq, starts = info["batch"], info["sq"], []
        q_per = _padded_queries(op, qlens, batch, sq)
    _table_rows(op, p["block_table"], batch)
    kv_per = _paged_kv_lengths(op, _host_lengths(p.get("actual_seq_lengths_kv")), batch)
    _kv_within(op, kv_per, info["max_kv"])
    return info | {"batch": batch, "sq": sq, "max_q": sq, "q_per": q_per, "starts": starts, "kv_per": kv_per}


def _check_mask(op: str, p: dict[str, Any]) -> None:
    """The masking modes CANN takes (and the simulator models): 0, 3 and 4, a mask with 3 and 4."""
    sparse = int(p["sparse_mode"])
    if sparse not in (0, 3, 4):
        raise fail(op, "sparse_mode", f"{sparse} is not modelled (0, 3 and 4 are)")
    if sparse in (3, 4) and p.get("atten_mask") is None:
        raise fail(op, "atten_mask", f"is required with sparse_mode={sparse} (the 2048x2048 compressed mask)")
    if sparse == 4 and int(p["pre_tokens"]) < 0 and int(p["next_tokens"]) < 0:
        raise fail(op, "pre_tokens", "and next_tokens cannot both be negative (an empty band)")


_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


def _check_decode_mask(op: str, p: dict[str, Any], layout: str, batch: int, width: int) -> None:
    """A decode call's own mask (``sparse_mode=0``, one query token a request), as CANN's
    IncreFlashAttention tiling checks it (ops-transformer ``incre_flash_attention_tiling_check.cpp``,
    ``ProcessAttenMask``, ``CheckTndMaskShapeWithSparseMode``; torch_npu's FIA documentation 7.2+):
    bool, int8 or uint8; (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B the query's batch;
    KV_S at least the block table's columns times the block size (paged: the width the kernel
    may read, whatever the lengths), else the longest key length; TND and the rope
    arguments take none (TND: no mask with sparse_mode 0, the compressed causal one with 3)."""
    m = p["atten_mask"]
    if layout == "TND":
        raise fail(
            op,
            "atten_mask",
            "is refused with input_layout 'TND' and sparse_mode=0 (CANN: TND takes no mask there, only "
            "sparse_mode=3 with the 2048x2048 compressed causal mask); pass a decode mask with BSH, BSND or BNSD",
        )
    if p.get("query_rope") is not None:
        raise fail(op, "atten_mask", "is refused in decode with query_rope/key_rope and sparse_mode=0 (CANN: no mask)")
    if not isinstance(m, torch.Tensor) or m.dtype not in _MASK_DTYPES:
        got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
        raise fail(op, "atten_mask", f"must be bool, int8 or uint8 (1 = masked), got {got}")
    shape = list(m.shape)
    if m.dim() not in (2, 3, 4) or shape[0] != batch or any(x != 1 for x in shape[1:-1]):
        raise fail(
            op,
            "atten_mask",
            f"has shape {shape}; in decode CANN takes (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B = {batch}, "
            "the query's batch",
        )
    if shape[-1] < width:
        what = "block_table's columns times block_size" if p.get("block_table") is not None else "the longest key"
        raise fail(op, "atten_mask", f"is {shape[-1]} keys wide; CANN needs at least {width} ({what})")


def _query_geometry(
    op: str, q: Any, layout: str, n: int, qlens: Any
) -> tuple[int, int, int, int, list[int], list[int]]:
    """The query as [B, N, S, D]: batch, heads, longest query, head size, each request's query
    tokens and (TND) where each starts."""
    if layout == "TND":
        need_tensor(op, "query", q, 3)
        t, qn, d = q.shape
        q_per, starts = _tnd_queries(op, qlens, t)
        return len(q_per), qn, max(q_per), d, q_per, starts
    need_tensor(op, "query", q, 3 if layout == "BSH" else 4)
    if layout == "BSH":
        batch, sq, h = q.shape
        if h % n:
            raise fail(op, "query", f"hidden size {h} is not a multiple of num_heads={n}")
        qn, d = n, h // n
    elif layout == "BSND":
        batch, sq, qn, d = q.shape
    else:
        batch, qn, sq, d = q.shape
    return batch, qn, sq, d, _padded_queries(op, qlens, batch, sq), []


def _tnd_queries(op: str, qlens: Any, t: int) -> tuple[list[int], list[int]]:
    """TND's query lengths (cumulative ends, the last ``t``): each request's tokens and start."""
    if qlens is None:
        raise fail(op, "actual_seq_lengths", "is required with input_layout='TND' (cumulative ends)")
    ends = list(qlens)
    if any(b > a for a, b in zip(ends[1:], ends)) or (ends and ends[-1] != t) or not ends:
        raise fail(
            op,
            "actual_seq_lengths",
            f"must be non-decreasing cumulative query ends whose last entry equals T={t}, got {brief_host(ends)}",
        )
    starts = [0, *ends[:-1]]
    return [e - s for s, e in zip(starts, ends)], starts


def _padded_queries(op: str, qlens: Any, batch: int, sq: int) -> list[int]:
    """Each request's query tokens in a padded layout (BSH, BSND, BNSD) of ``sq`` a request."""
    if qlens is None or sq == 1:  # ignored when the query length is 1
        return [sq] * batch
    q_per = per_batch(op, "actual_seq_lengths", qlens, batch)
    if any(x < 0 or x > sq for x in q_per):
        raise fail(op, "actual_seq_lengths", f"entries must lie in [0, {sq}]")
    return q_per


def _paged_keys(
    op: str, p: dict[str, Any], layout: str, kvn: int, batch: int, kvlens: Any
) -> tuple[int, int, list[int], int]:
    """A paged key and value cache read through ``block_table``: key and value head sizes, each
    request's key length, and the most keys a request's table holds."""
    bt, k, v = p["block_table"], p["key"], p["value"]
    block_size = int(p["block_size"])
    need_tensor(op, "block_table", bt, 2)
    if bt.dtype != torch.int32:
        raise fail(op, "block_table", f"must be int32, got {bt.dtype}")
    _table_rows(op, bt, batch)
    if k.dim() == 3:
        kvh = k.shape[2]
        if kvh % kvn:
            raise fail(op, "key", f"cache hidden size {kvh} is not a multiple of {kvn} kv heads")
        dk = kvh // kvn
    elif k.dim() == 4:
        # CANN: a 4-dim paged cache is (blocknum, KV_N, blocksize, D), with a BNSD or TND
        # query only; a BSH or BSND query takes only (blocknum, blocksize, H)
        if layout not in ("BNSD", "TND"):
            raise fail(
                op,
                "key",
                f"is a 4-dim paged cache {list(k.shape)}; with input_layout {layout} CANN takes only "
                "(blocknum, blocksize, H)",
            )
        _, kh, _, dk = k.shape
        if kh != kvn:
            raise fail(op, "key", f"has {kh} kv heads, num_key_value_heads is {kvn}")
    else:
        raise fail(op, "key", f"paged cache must have 3 or 4 dims, got {list(k.shape)}")
    cache_bs = k.shape[2] if k.dim() == 4 else k.shape[1]
    if block_size != cache_bs:
        raise fail(op, "block_size", f"is {block_size} but the cache blocks hold {cache_bs}")
    dv = v.shape[-1] if v.dim() == 4 else v.shape[2] // kvn
    return dk, dv, _paged_kv_lengths(op, kvlens, batch), bt.shape[1] * block_size


def _table_rows(op: str, bt: torch.Tensor, batch: int) -> None:
    if bt.shape[0] != batch:
        raise fail(op, "block_table", f"has {bt.shape[0]} rows for batch {batch}")


def _paged_kv_lengths(op: str, kvlens: Any, batch: int) -> list[int]:
    if kvlens is None:
        raise fail(op, "actual_seq_lengths_kv", "is required with a block_table")
    return per_batch(op, "actual_seq_lengths_kv", kvlens, batch)


def _kv_within(op: str, kv_per: list[int], max_kv: int) -> None:
    for i, x in enumerate(kv_per):
        if x < 0 or x > max_kv:
            raise fail(op, "actual_seq_lengths_kv", f"[{i}] = {x} is outside [0, {max_kv}]")


def _dense_keys(
    op: str, p: dict[str, Any], layout: str, kvn: int, batch: int, d: int, kvlens: Any
) -> tuple[int, int, list[int], int]:
    """Keys and values laid out as the query is (no block table): key and value head sizes,
    each request's key length, and the most keys a request has."""
    q, k, v = p["query"], p["key"], p["value"]
    if layout == "TND":
        need_tensor(op, "key", k, 3)
        _, kh, dk = k.shape
        dv = v.shape[2]
        kends = list(kvlens) if kvlens is not None else None
        if kends is None or len(kends) != batch or (kends and kends[-1] != k.shape[0]):
            raise fail(
                op,
                "actual_seq_lengths_kv",
                "must list cumulative key ends (last = key T) per batch with a non-paged TND key",
            )
        kstarts = [0, *kends[:-1]]
        kv_per = [e - s for s, e in zip(kstarts, kends)]
        max_kv = max(kv_per)
    else:
        need_tensor(op, "key", k, q.dim())
        if layout == "BSH":
            skv, kh = k.shape[1], k.shape[2] // (d or 1)
            dk = d
            dv = v.shape[2] // kh if kh else d
        elif layout == "BSND":
            skv, kh, dk = k.shape[1], k.shape[2], k.shape[3]
            dv = v.shape[3]
        else:
            kh, skv, dk = k.shape[1], k.shape[2], k.shape[3]
            dv = v.shape[3]
        max_kv = skv
        if k.shape[0] != batch:
            raise fail(op, "key", f"batch {k.shape[0]} differs from the query's {batch}")
        kv_per = per_batch(op, "actual_seq_lengths_kv", kvlens, batch) if kvlens is not None else [skv] * batch
    if kh != kvn:
        raise fail(op, "num_key_value_heads", f"is {kvn} but key has {kh} kv heads")
    return dk, dv, kv_per, max_kv


def _fia_out_shapes(p: dict[str, Any], info: dict[str, Any]) -> tuple[list[int], list[int]]:
    q = p["query"]
    layout, n, dv = info["layout"], info["heads"], info["dv"]
    out_layout = info.get("out_layout", layout)
    if out_layout == "NTD":
        out = [n, q.shape[0], dv]
        lse = [q.shape[0], n, 1]
    elif out_layout == "NBSD":
        out = [n, info["batch"], info["sq"], dv]
        lse = [info["batch"], n, info["sq"], 1]
    elif out_layout == "BSND" and layout == "BNSD":
        out = [info["batch"], info["sq"], n, dv]
        lse = [info["batch"], n, info["sq"], 1]
    elif layout == "TND":
        out = [q.shape[0], n, dv]
        lse = [q.shape[0], n, 1]
    elif layout == "BSH":
        out = [q.shape[0], q.shape[1], n * dv]
        lse = [info["batch"], n, info["sq"], 1]
    elif layout == "BSND":
        out = [q.shape[0], q.shape[1], n, dv]
        lse = [info["batch"], n, info["sq"], 1]
    else:
        out = [q.shape[0], n, q.shape[2], dv]
        lse = [info["batch"], n, info["sq"], 1]
    if not p["softmax_lse_flag"]:
        lse = [1]
    return out, lse


def check_compressed_mask(
    mask: torch.Tensor,
    op: str = "npu_fused_infer_attention_score",
    arg: str = "atten_mask",
    form: str = "triu(ones(2048, 2048), 1) that sparse_mode 3 and 4 read",
) -> None:
    """Sparse modes 3 and 4 read the compressed mask as it is: garbage there is garbage out.

    Sampled (its diagonal, first row and first column), not compared in full: cheap enough
    for every run, and a mask not written yet (a pool block: NaN, read as 1) fails it.
    ``op``/``arg``/``form``: the kernel and argument reading it, and the mask it expects.
    """
    m = mask.reshape(-1, *mask.shape[-2:])[0] if mask.dim() >= 2 else mask
    ok = (
        m.dim() == 2
        and min(m.shape) >= 2
        and not bool((m.diagonal() != 0).any())
        and bool((m[0, 1:] != 0).all())
        and not bool((m[1:, 0] != 0).any())
    )
    if not ok:
        raise ValueError(
            f"{op}: argument '{arg}' is not the compressed causal mask {form} (hardware computes wrong rows "
            "from it). A mask made inside a capture is written only by that graph's replay: make it before "
            "any capture."
        )


def fia_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    p, out_layout = split_layout(p)
    p = _with_rope(p)
    q, out_pair = p["query"], p["out"]
    b, sq = info["batch"], info["sq"]
    dev = q.device
    q_per = torch.tensor(info["q_per"], dtype=torch.int64, device=dev)
    kv_per = torch.tensor(info["kv_per"], dtype=torch.int64, device=dev)
    qb = _query_bnsd(q, info, q_per)
    mask = None
    sparse = int(p["sparse_mode"])
    if sparse in (3, 4):
        check_compressed_mask(p["atten_mask"])
    decode_mask = sparse == 0 and p.get("atten_mask") is not None and sq == 1 and info["layout"] != "TND"
    if decode_mask:
        mask = _decode_mask(p["atten_mask"], b, max(info["kv_per"], default=0))
    elif sparse == 0 and p.get("atten_mask") is not None:
        mask = p["atten_mask"]
    # sparse_mode 4 (band): anchored bottom-right like 3, key j of query i visible iff
    # -pre_tokens <= j - (i + Lk - Lq) <= next_tokens (a sliding window: pre = W - 1, next = 0)
    band = (int(p["pre_tokens"]), int(p["next_tokens"])) if sparse == 4 else None
    # every run gathers the batch's longest context, as one run would: a request's sums then
    # run over the same length whatever the runs, and the output is bit for bit the same
    parts, lkv = [], max(info["kv_per"], default=0)
    for lo, hi in _request_chunks(p, info, None if decode_mask else mask):
        sub = slice(lo, hi)
        kb, vb = _keys_bnsd(
            p if hi - lo == b else p | {"block_table": p["block_table"][sub]},
            info | {"batch": hi - lo},
            kv_per[sub],
            lkv,
        )
        parts.append(
            K.attention(
                qb[sub],
                kb,
                vb,
                q_per[sub],
                kv_per[sub],
                float(p["scale"]),
                causal=sparse == 3,
                mask=mask[sub] if decode_mask and mask is not None else mask,
                band=band,
                sink=p.get("learnable_sink"),
                mask_fill=_MASKED_SCORE if decode_mask else None,
            )
        )
    o, lse = parts[0] if len(parts) == 1 else (torch.cat([x[i] for x in parts]) for i in (0, 1))
    # o: [B, N, Sq, Dv]; rows past a request's query length are zero
    valid_q = (torch.arange(sq, device=dev).view(1, 1, sq, 1) < q_per.view(b, 1, 1, 1)) if b else None
    if valid_q is not None:
        o = torch.where(valid_q, o, torch.zeros((), dtype=o.dtype, device=dev))
    _write_out(o, lse, q, info, out_layout, out_pair, bool(p["softmax_lse_flag"]))


_CHUNK_BYTES = 8 << 20
# what CANN's decode kernel sets a masked score to (ops-transformer's incre_flash_attention
# kernels, BOOL_ATTEN_MASK_SCALAR_VALUE): -1e12, not minus infinity, so a row whose keys are
# all masked averages them (the documentation says only that precision is lost there)
_MASKED_SCORE = -1e12


def _decode_mask(m: torch.Tensor, batch: int, lkv: int) -> torch.Tensor:
    """A decode mask (checked by :func:`_check_decode_mask`) as [B, 1, 1, Lkv] bool: the keys
    the gather reads.  An int8 or uint8 mask holds 0 and 1 only (CANN: other values are not
    defined); the simulated device refuses others where the hardware would compute something."""
    if m.dtype != torch.bool:
        if bool(((m != 0) & (m != 1)).any()):
            raise ValueError(
                "npu_fused_infer_attention_score: argument 'atten_mask' holds values other than 0 and 1 "
                f"({m.dtype}; CANN defines only 0 = attend, 1 = masked)"
            )
        m = m != 0
    return m.reshape(batch, 1, 1, -1)[..., :lkv]


def _request_chunks(p: dict[str, Any], info: dict[str, Any], mask: Any) -> list[tuple[int, int]]:
    """The requests of a paged call in runs whose gathered keys and values (their dtype and
    float32) take about 8 MiB: the device's work then stays in this host's caches, and the
    host's next call (a re-issue while a replay is pending) finds its own there.  One run
    for a dense call or a mask (its rows are the batch's)."""
    b = info["batch"]
    if p.get("block_table") is None or mask is not None or b <= 1:
        return [(0, b)]
    per = max(info["kv_per"], default=0) * info["kv_heads"] * (info["d"] + info["dv"]) * 6
    n = max(1, _CHUNK_BYTES // max(per, 1))
    return [(lo, min(b, lo + n)) for lo in range(0, b, n)]


def _query_bnsd(q: torch.Tensor, info: dict[str, Any], q_per: torch.Tensor) -> torch.Tensor:
    """The query as [B, N, Sq, D] (TND: each request's tokens gathered, padded with token 0)."""
    layout, b, n, sq, d = (info[x] for x in ("layout", "batch", "heads", "sq", "d"))
    if layout == "TND":
        dev = q.device
        starts = torch.tensor(info["starts"], dtype=torch.int64, device=dev)
        idx = starts.unsqueeze(1) + torch.arange(sq, device=dev).unsqueeze(0)  # [B, Sq]
        idx = torch.where(torch.arange(sq, device=dev).unsqueeze(0) < q_per.unsqueeze(1), idx, 0)
        return q[idx].permute(0, 2, 1, 3)
    if layout == "BSH":
        return q.reshape(b, sq, n, d).permute(0, 2, 1, 3)
    if layout == "BSND":
        return q.permute(0, 2, 1, 3)
    return q


def _keys_bnsd(
    p: dict[str, Any], info: dict[str, Any], kv_per: torch.Tensor, lkv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as [B, KVN, Lkv, D]: gathered through the block table from a paged cache
    (MLA's rope part from its own), else from the query's layout."""
    k, v = p["key"], p["value"]
    layout, b, kvn, d, dv = (info[x] for x in ("layout", "batch", "kv_heads", "d", "dv"))
    dev = k.device
    bt = p.get("block_table")
    if bt is not None:
        where = "npu_fused_infer_attention_score: block_table"

        def blocks(cache: torch.Tensor) -> torch.Tensor:  # → [NB, BS, KVN, D]
            if cache.dim() == 4:  # [NB, KVN, BS, D]
                return cache.permute(0, 2, 1, 3)
            return cache.reshape(cache.shape[0], cache.shape[1], kvn, -1)

        def gathered(cache: torch.Tensor) -> torch.Tensor:  # → [B, KVN, Lkv, D]
            return K.gather_paged(blocks(cache), bt, kv_per, lkv, int(p["block_size"]), where).permute(0, 2, 1, 3)

        kb, vb = gathered(k), gathered(v)
        if p.get("key_rope") is not None:  # MLA: each key's rope part, from its own cache
            kb = torch.cat([kb, gathered(p["key_rope"])], dim=-1)
        return kb, vb
    if layout == "TND":
        kstarts = torch.cumsum(kv_per, 0) - kv_per
        kidx = kstarts.unsqueeze(1) + torch.arange(lkv, device=dev).unsqueeze(0)
        kidx = torch.where(torch.arange(lkv, device=dev).unsqueeze(0) < kv_per.unsqueeze(1), kidx, 0)
        return k[kidx].permute(0, 2, 1, 3), v[kidx].permute(0, 2, 1, 3)
    if layout == "BSH":
        return (
            k.reshape(b, k.shape[1], kvn, d).permute(0, 2, 1, 3),
            v.reshape(b, v.shape[1], kvn, dv).permute(0, 2, 1, 3),
        )
    if layout == "BSND":
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    return k, v


def _write_out(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    info: dict[str, Any],
    out_layout: str,
    out_pair: Any,
    lse_flag: bool,
) -> None:
    """``o`` [B, N, Sq, Dv] and its log-sum-exp written into the call's outputs, in its layout."""
    out, lse_out = out_pair
    layout = info["layout"]
    if layout == "TND":
        dev = o.device
        t = q.shape[0]
        tok = torch.arange(t, device=dev)
        bidx = torch.searchsorted(torch.tensor([*info["starts"][1:], t + 1], device=dev), tok, right=True)
        sidx = tok - torch.tensor(info["starts"], device=dev)[bidx]
        rows = o[bidx, :, sidx]  # [T, N, Dv]
        out.copy_(rows.transpose(0, 1) if out_layout == "NTD" else rows)
        lse_rows = lse[bidx, :, sidx].unsqueeze(-1)
    elif out_layout == "NBSD":
        out.copy_(o.permute(1, 0, 2, 3))
        lse_rows = lse.unsqueeze(-1)
    elif layout == "BSH":
        out.copy_(o.permute(0, 2, 1, 3).reshape(out.shape))
        lse_rows = lse.unsqueeze(-1)
    elif layout == "BSND" or out_layout == "BSND":
        out.copy_(o.permute(0, 2, 1, 3))
        lse_rows = lse.unsqueeze(-1)
    else:
        out.copy_(o)
        lse_rows = lse.unsqueeze(-1)
    if lse_flag:
        lse_out.copy_(lse_rows.reshape(lse_out.shape))
    else:
        lse_out.zero_()


def fia_workspace(p: dict[str, Any], info: dict[str, Any]) -> int:
    # info comes from fia_check, which already folded any rope dims into the head size
    return K.fia_workspace_bytes(info["rows"], info["heads"], info["dv"], max(info["kv_per"], default=0))


def _fia_op(name: str, overload: str, host: tuple[str, ...]) -> SimOp:
    return SimOp(
        name,
        overload,
        host_args=host,
        output_args=("out",),
        check=fia_check,
        compute=fia_compute,
        workspace=fia_workspace,
        lengths=fia_lengths,
    )


_FIA_OUT = _fia_op("npu_fused_infer_attention_score", "out", ("actual_seq_lengths", "actual_seq_lengths_kv"))


FIA = _fia_op("npu_fused_infer_attention_score", "default", ("actual_seq_lengths", "actual_seq_lengths_kv"))


def _fia_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: Any = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Any = None,
    actual_seq_lengths_kv: Any = None,
    dequant_scale1: Any = None,
    quant_scale1: Any = None,
    dequant_scale2: Any = None,
    quant_scale2: Any = None,
    quant_offset2: Any = None,
    antiquant_scale: Any = None,
    antiquant_offset: Any = None,
    key_antiquant_scale: Any = None,
    key_antiquant_offset: Any = None,
    value_antiquant_scale: Any = None,
    value_antiquant_offset: Any = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: Any = None,
    kv_padding_size: Any = None,
    key_shared_prefix: Any = None,
    value_shared_prefix: Any = None,
    actual_shared_prefix_len: Any = None,
    query_rope: Any = None,
    key_rope: Any = None,
    key_rope_antiquant_scale: Any = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
    query_quant_mode: int = 0,
    workspace: torch.Tensor | None = None,
    out: Any = None,
) -> dict[str, Any]:
    return dict(locals())


def alloc_outputs(op: SimOp, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    info = op.check(p)
    out_shape, lse_shape = _fia_out_shapes(p, info)
    q = p["query"]
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.zeros(lse_shape, dtype=torch.float32, device=q.device)
    return out, lse


def _fia_default(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    if "out" in kwargs or "workspace" in kwargs:
        raise TypeError("npu_fused_infer_attention_score() got an unexpected keyword 'out'/'workspace' (use .out)")
    p = _fia_params(query, key, value, **kwargs)
    for name in FIA.host_args:
        p[name] = host_copy(name, p.get(name))
    p["out"] = list(alloc_outputs(FIA, p))
    launch(FIA, p)
    return p["out"][0], p["out"][1]


def out_pair(p: dict[str, Any]) -> list[Any]:
    """An FIA ``.out`` overload's ``out``: [attention_out, softmax_lse], as a list in ``p``."""
    outs = p.get("out")
    if not isinstance(outs, (list, tuple)) or len(outs) != 2:
        raise ValueError("out must have 2 tensors (attention_out, softmax_lse)")
    p["out"] = list(outs)
    return p["out"]


def fia_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _fia_params(query, key, value, **kwargs)
    outs = out_pair(p)
    if rt.get_state().current_stream._updating is None:  # an update compares with the captured outs
        _check_out_shapes(_FIA_OUT, p)
    launch(_FIA_OUT, p)
    return outs[0], outs[1]


def _check_out_shapes(op: SimOp, p: dict[str, Any]) -> None:
    for name in op.host_args:
        p[name] = host_copy(name, p.get(name))
    info = op.check(p)
    out_shape, lse_shape = _fia_out_shapes(p, info)
    out, lse = p["out"]
    if list(out.shape) != out_shape or out.dtype != p["query"].dtype:
        raise fail(
            op.name,
            "out[0]",
            f"must be {out_shape} {p['query'].dtype}, got {list(out.shape)} {out.dtype}",
        )
    if p["softmax_lse_flag"] and list(lse.shape) != lse_shape:
        raise fail(op.name, "out[1]", f"(softmax_lse) must be {lse_shape}, got {list(lse.shape)}")


npu_fused_infer_attention_score = OpPacket(
    _fia_default,
    fia_out,
    "npu_fused_infer_attention_score",
    schemas=(FIA_SCHEMA, FIA_OUT_SCHEMA),
    signatures=(_fia_params, _fia_params),
)


def _npu_fused_infer_attention_score_infer_output(
    query: torch.Tensor,
    value: torch.Tensor,
    *,
    input_layout: str = "BSH",
    quant_scale2: Any = None,
    block_table: torch.Tensor | None = None,
    num_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_lse_flag: bool = False,
    query_rope: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs ``.out`` would write, allocated (attention output, softmax LSE): what
    torch_npu's graph handler gives a ``.default`` call it turns into ``.out``."""
    if quant_scale2 is not None:
        raise NotImplementedError("_npu_fused_infer_attention_score_infer_output: quant_scale2 is not simulated")
    q = query
    if input_layout not in _LAYOUTS and input_layout not in _OUT_LAYOUTS:
        raise ValueError(
            f"_npu_fused_infer_attention_score_infer_output: input_layout {input_layout!r} is not simulated"
        )
    out_layout = _OUT_LAYOUTS.get(input_layout, input_layout)
    input_layout = input_layout.split("_")[0]
    kv_heads = num_key_value_heads or num_heads
    # a 3-dim value is [batch or blocks, tokens, kv_heads * dv] (BSH, and every paged cache)
    dv = (
        value.shape[-1] // kv_heads
        if value.dim() == 3 and (input_layout == "BSH" or block_table is not None)
        else value.shape[-1]
    )
    batch, sq = (q.shape[0], q.shape[2]) if input_layout == "BNSD" else (q.shape[0], q.shape[1] if q.dim() > 2 else 1)
    info = {"layout": input_layout, "out_layout": out_layout, "heads": num_heads, "dv": dv, "batch": batch, "sq": sq}
    out_shape, lse_shape = _fia_out_shapes({"query": q, "softmax_lse_flag": softmax_lse_flag}, info)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    return out, softmax_lse


def _npu_fused_infer_attention_score_get_max_workspace(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """Return a workspace large enough for every length these shapes allow."""
    return max_workspace(FIA, _fia_params(query, key, value, **kwargs))
