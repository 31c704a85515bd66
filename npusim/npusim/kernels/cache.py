"""KV-cache writes, ``npu_scatter_pa_kv_cache`` and ``_npu_reshape_and_cache``, and the
read back into contiguous rows, ``npu_gather_pa_kv_cache``.

Both write token ``i``'s key and value at slot ``slot_mapping[i]`` of a paged cache
(``slot = block * block_size + offset``).  A negative slot is skipped: vLLM pads a step
with ``PAD_SLOT_ID = -1`` so that padding tokens write nowhere (vLLM's CUDA
``reshape_and_cache`` returns early for it; vllm-ascend pads ``slot_mapping`` with -1 for
these kernels).  A slot past the cache is the kernel's error (a device fault).

``npu_gather_pa_kv_cache`` (CANN's ``aclnnGatherPaKvCache``; vllm-ascend 0.30's MLA reads a
prefill's context with it) copies request ``i``'s ``seq_lens[i]`` tokens out of the paged
caches, from block ``seq_offset[i] // block_size`` of its row of ``block_tables`` on, into
consecutive rows of ``key``/``value``, request after request; rows past ``key``'s end are
not written (op-plugin's own reference stops there).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from npusim.kernels.dense import _kernel
from npusim.runtime.launch import SimOp, fail, launch, need_tensor

__all__ = ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache", "npu_gather_pa_kv_cache", "alloc_extend", "PAD_SLOT_ID"]

PAD_SLOT_ID = -1  # vLLM's padding slot: skipped


def _check(op: str, p: dict[str, Any]) -> dict[str, Any]:
    key = need_tensor(op, "key", p["key"], 3)
    value = need_tensor(op, "value", p["value"], 3)
    kc = need_tensor(op, "key_cache", p["key_cache"], 4)
    vc = need_tensor(op, "value_cache", p["value_cache"], 4)
    slots = need_tensor(op, "slot_mapping", p["slot_mapping"], 1)
    t, n, dk = key.shape
    if value.shape[0] != t or value.shape[1] != n:
        raise fail(op, "value", f"shape {list(value.shape)} does not match key {list(key.shape)} in tokens and heads")
    nb, bs, kn, kd = kc.shape
    if (kn, kd) != (n, dk):
        raise fail(op, "key_cache", f"shape {list(kc.shape)} does not hold [{n} heads, {dk}] per slot")
    if tuple(vc.shape) != (nb, bs, n, value.shape[2]):
        raise fail(op, "value_cache", f"shape {list(vc.shape)} does not match [{nb}, {bs}, {n}, {value.shape[2]}]")
    if kc.dtype != key.dtype or vc.dtype != value.dtype:
        raise fail(op, "key_cache", "caches must have their key's and value's dtype")
    if slots.dtype not in (torch.int32, torch.int64):
        raise fail(op, "slot_mapping", f"must be int32 or int64, got {slots.dtype}")
    if slots.shape[0] != t:
        raise fail(op, "slot_mapping", f"has {slots.shape[0]} entries for {t} tokens")
    return {"slots": nb * bs}


def _compute(op: str, p: dict[str, Any], info: dict[str, Any]) -> None:
    slots = p["slot_mapping"].long()
    bad = slots >= info["slots"]
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise fail(
            op,
            "slot_mapping",
            f"[{i}] = {int(slots[i])} is outside the cache's {info['slots']} slots (PAD_SLOT_ID -1 is skipped)",
        )
    keep = slots >= 0
    at = slots[keep]
    key, value, kc, vc = p["key"], p["value"], p["key_cache"], p["value_cache"]
    # by block and offset, through the caches' strides: vllm-ascend 0.30 interleaves each
    # block's keys and values in one allocation (key_cache = kv[0] strides over blocks by two)
    block, offset = at // kc.shape[1], at % kc.shape[1]
    kc[block, offset] = key[keep]
    vc[block, offset] = value[keep]


def _op(name: str, slot_arg: str) -> SimOp:
    def check(p: dict[str, Any]) -> dict[str, Any]:
        return _check(name, _canonical(p, slot_arg))

    def compute(p: dict[str, Any], info: dict[str, Any]) -> None:
        _compute(name, _canonical(p, slot_arg), info)

    return SimOp(
        name,
        "default",
        host_args=(),
        output_args=("key_cache", "value_cache"),
        check=check,
        compute=compute,
        workspace=lambda p, info: 0,
        anchor="key",  # no query: the caches and slots must be on the key's device
    )


def _canonical(p: dict[str, Any], slot_arg: str) -> dict[str, Any]:
    return p if slot_arg == "slot_mapping" else {**p, "slot_mapping": p[slot_arg]}


_SCATTER = _op("npu_scatter_pa_kv_cache", "slot_mapping")
_RESHAPE = _op("_npu_reshape_and_cache", "slot_indices")


def npu_scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    compress_lens: torch.Tensor | None = None,
    compress_seq_offsets: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cache_mode: str = "Norm",
    scatter_mode: str = "None",
    strides: Any = None,
    offsets: Any = None,
) -> None:
    """Write ``key``/``value`` ``[T, N, D]`` into paged caches ``[blocks, block_size, N, D]``
    at ``slot_mapping`` ``[T]`` (in place; ``cache_mode="Norm"``, negative slots skipped)."""
    op = "npu_scatter_pa_kv_cache"
    if cache_mode != "Norm" or scatter_mode not in ("None", None):
        raise NotImplementedError(f"{op}: the simulator models cache_mode='Norm', scatter_mode='None' only")
    for name, v in (
        ("compress_lens", compress_lens),
        ("compress_seq_offsets", compress_seq_offsets),
        ("seq_lens", seq_lens),
    ):
        if v is not None:
            raise NotImplementedError(f"{op}: the simulator does not model {name!r}")
    launch(
        _SCATTER,
        {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache, "slot_mapping": slot_mapping},
    )


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """vllm-ascend's GQA cache write (ATB ReshapeAndCache): the same as ``npu_scatter_pa_kv_cache``."""
    launch(
        _RESHAPE,
        {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache, "slot_indices": slot_indices},
    )


def _gather_lengths(p: dict[str, Any]) -> list[int]:
    lens = [int(x) for x in p["seq_lens"].tolist()]
    if p["is_seq_lens_cumsum"]:
        return [b - a for a, b in itertools.pairwise(lens)]
    return lens


def _gather(p: dict[str, Any]) -> None:
    op = "npu_gather_pa_kv_cache"
    key_cache, value_cache, tables = p["key_cache"], p["value_cache"], p["block_tables"]
    blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    offsets = p["seq_offset"].tolist() if p["seq_offset"] is not None else None
    room, row = p["key"].shape[0], 0
    for i, n in enumerate(_gather_lengths(p)):
        if n < 0:
            raise fail(op, "seq_lens", f"request {i} has a negative length {n}")
        if row >= room:
            return
        first = int(offsets[i]) // block_size if offsets is not None else 0
        take = min(n, room - row)
        if take == 0:
            continue
        needed = first + -(-take // block_size)
        if needed > tables.shape[1]:
            raise fail(op, "block_tables", f"request {i} reads block {needed - 1} of a table {tables.shape[1]} wide")
        ids = tables[i, first:needed].long()
        if int(ids.min()) < 0 or int(ids.max()) >= blocks:
            raise fail(op, "block_tables", f"request {i} names a block outside the cache's {blocks}")
        for cache, out in ((key_cache, p["key"]), (value_cache, p["value"])):
            out[row : row + take] = cache[ids].flatten(0, 1)[:take].to(out.dtype)
        row += take


_GATHER = _kernel("npu_gather_pa_kv_cache", "key_cache", ("key", "value"), _gather)


def npu_gather_pa_kv_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_offset: torch.Tensor | None = None,
    is_seq_lens_cumsum: bool = False,
) -> None:
    """Each request's tokens out of paged ``key_cache``/``value_cache`` ``[blocks, block_size,
    N, D]`` into the rows of ``key``/``value`` ``[tokens, N, D]``, in place (``cache_mode``
    Norm, the ND cache vllm-ascend allocates)."""
    op = "npu_gather_pa_kv_cache"
    for name, cache, out in (("key", key_cache, key), ("value", value_cache, value)):
        need_tensor(op, f"{name}_cache", cache, 4)
        need_tensor(op, name, out, 3)
        if tuple(out.shape[1:]) != tuple(cache.shape[2:]):
            raise fail(op, name, f"rows are {list(out.shape[1:])}, the cache's tokens {list(cache.shape[2:])}")
        if out.dtype != cache.dtype:
            raise fail(op, name, f"is {out.dtype} but its cache is {cache.dtype}")
    if tuple(key_cache.shape[:2]) != tuple(value_cache.shape[:2]):
        raise fail(op, "value_cache", f"blocks {list(value_cache.shape[:2])} differ from key_cache's")
    if key.shape[0] != value.shape[0]:
        raise fail(op, "value", f"has {value.shape[0]} rows, key {key.shape[0]}")
    need_tensor(op, "block_tables", block_tables, 2)
    need_tensor(op, "seq_lens", seq_lens, 1)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("seq_offset", seq_offset)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise fail(op, name, f"must be int32 or int64, got {t.dtype}")
    requests = seq_lens.shape[0] - (1 if is_seq_lens_cumsum else 0)
    if block_tables.shape[0] < requests:
        raise fail(op, "block_tables", f"has {block_tables.shape[0]} rows for {requests} requests")
    if seq_offset is not None and seq_offset.shape[0] < requests:
        raise fail(op, "seq_offset", f"has {seq_offset.shape[0]} entries for {requests} requests")
    launch(
        _GATHER,
        {
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "seq_offset": seq_offset,
            "is_seq_lens_cumsum": is_seq_lens_cumsum,
            "key": key,
            "value": value,
        },
    )


def _alloc_extend(p: dict[str, Any]) -> None:
    ps, n = int(p["page_size"]), int(p["requests"])
    pre = [int(x) for x in p["prefix_lens"][:n].tolist()]
    seq = [int(x) for x in p["seq_lens"][:n].tolist()]
    last = [int(x) for x in p["last_loc"][:n].tolist()]
    free = p["free_pages"]
    out: list[int] = []
    at = page = 0
    for r in range(n):
        pages_before, pages_after = -(-pre[r] // ps), -(-seq[r] // ps)
        # the rest of the request's last partial page, then whole new pages, then a partial one
        fill = min(seq[r], pages_before * ps) - pre[r]
        out.extend(range(last[r] + 1, last[r] + 1 + max(fill, 0)))
        for j in range(pages_after - pages_before):
            start = int(free[page + j]) * ps
            out.extend(range(start, start + min(ps, seq[r] - (pages_before + j) * ps)))
        page += pages_after - pages_before
        at += seq[r] - pre[r]
    if len(out) != at:  # the kernel's own arithmetic: a broken invariant of the caller's lengths
        raise fail("alloc_extend_kernel", "seq_lens", f"{len(out)} slots made for {at} new tokens")
    if out:
        p["out_indices"][: len(out)] = torch.tensor(out, dtype=p["out_indices"].dtype, device=p["out_indices"].device)


_ALLOC_EXTEND = SimOp(
    "alloc_extend_kernel",
    "default",
    host_args=(),
    output_args=("out_indices",),
    check=lambda p: {},
    compute=lambda p, info: _alloc_extend(p),
    workspace=lambda p, info: 0,
    anchor="seq_lens",
)


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
    requests: int,
) -> None:
    """The KV slots of each request's new tokens, in request order, into ``out_indices``:
    request ``r`` extends from ``prefix_lens[r]`` to ``seq_lens[r]`` tokens; its slots run on
    from ``last_loc[r] + 1`` to the end of its last partial page, then fill the pages it
    takes, in turn, from ``free_pages`` (page ``p`` holds slots ``p * page_size ..``)."""
    op = "alloc_extend_kernel"
    for name, t in (("prefix_lens", prefix_lens), ("seq_lens", seq_lens), ("last_loc", last_loc)):
        need_tensor(op, name, t, 1)
        if t.shape[0] < requests:
            raise fail(op, name, f"has {t.shape[0]} entries for {requests} requests")
    need_tensor(op, "free_pages", free_pages, 1)
    need_tensor(op, "out_indices", out_indices, 1)
    if page_size <= 0:
        raise fail(op, "page_size", f"{page_size} is not a positive page size")
    launch(
        _ALLOC_EXTEND,
        {
            "prefix_lens": prefix_lens,
            "seq_lens": seq_lens,
            "last_loc": last_loc,
            "free_pages": free_pages,
            "out_indices": out_indices,
            "page_size": page_size,
            "requests": requests,
        },
    )
