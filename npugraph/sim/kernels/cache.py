"""KV-cache writes: ``npu_scatter_pa_kv_cache`` and ``_npu_reshape_and_cache``.

Both write token ``i``'s key and value at slot ``slot_mapping[i]`` of a paged cache
(``slot = block * block_size + offset``).  A negative slot is skipped: vLLM pads a step
with ``PAD_SLOT_ID = -1`` so that padding tokens write nowhere (vLLM's CUDA
``reshape_and_cache`` returns early for it; vllm-ascend pads ``slot_mapping`` with -1 for
these kernels).  A slot past the cache is the kernel's error (a device fault).
"""

from __future__ import annotations

from typing import Any

import torch

from npugraph.sim.runtime.launch import SimOp, fail, launch, need_tensor

__all__ = ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache", "PAD_SLOT_ID"]

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
    kc.view(-1, *kc.shape[2:])[at] = key[keep]
    vc.view(-1, *vc.shape[2:])[at] = value[keep]


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
