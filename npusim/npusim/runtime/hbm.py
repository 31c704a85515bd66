"""Device time of the attention kernels from the bytes they read (:class:`HbmTimeModel`).

A decode attention kernel is bound by memory: each request's keys and values stream from
HBM once.  So its time is the bytes it reads over the device's memory bandwidth, and a
kernel told to read ``W`` keys for every request (lengths frozen to a width, the real ones
masked) pays for ``W`` keys, masked or not, plus the mask.  Other kernels keep the
simulator's own measure (their CPU time).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

__all__ = ["A2_HBM_BYTES_PER_S", "HbmTimeModel"]

# Atlas A2 (Ascend 910B): about 1.6 TB/s of HBM2e bandwidth, the figure npugraph's bench
# uses for a layer's weights (npugraph/bench/modeled.py); published figures for the 910B
# range from 1.6 to 2.0 TB/s, so this errs towards the slower card.
A2_HBM_BYTES_PER_S = 1.6e12


def _lengths(v: Any, batch: int) -> list[int]:
    """A host length argument per request (one entry stands for every request)."""
    vals = v.tolist() if isinstance(v, torch.Tensor) else list(v or ())
    vals = [int(x) for x in vals]
    return vals * batch if len(vals) == 1 else vals[:batch]


def _token_bytes(cache: torch.Tensor, block_size: int) -> int:
    """Bytes a paged cache holds per token (every KV head)."""
    return cache.numel() // max(1, cache.shape[0] * block_size) * cache.element_size()


@attrs.frozen(kw_only=True)
class HbmTimeModel:
    """``npusim.configure(kernel_time_model=HbmTimeModel())``: PA's and paged FIA's device time
    is the bytes each reads (keys, values, block ids, the query, the mask, the output written)
    over ``bytes_per_s``, plus ``launch_s`` per kernel; ``None`` (the CPU's time) for the rest."""

    bytes_per_s: float = A2_HBM_BYTES_PER_S
    launch_s: float = 0.0

    def attention_bytes(self, op: str, p: dict[str, Any]) -> int | None:
        """The bytes a paged attention kernel moves, or ``None`` for another kernel."""
        if op == "_npu_paged_attention":
            cache, table, lens = p["key_cache"], p["block_table"], p["context_lens"]
            bs = int(cache.shape[1])
            per_token = _token_bytes(cache, bs) + _token_bytes(p["value_cache"], bs)
            q = p["query"]
            kv = _lengths(lens, int(q.shape[0]))
        elif op.startswith("npu_fused_infer_attention_score") and p.get("block_table") is not None:
            bs = int(p["block_size"])
            cache, table, q = p["key"], p["block_table"], p["query"]
            per_token = _token_bytes(cache, bs) + _token_bytes(p["value"], bs)
            lens = p.get("actual_seq_lengths_kv", p.get("actual_seq_kvlen"))
            kv = _lengths(lens, int(table.shape[0]))
        else:
            return None
        mask = p.get("atten_mask")
        # a mask of its own (sparse_mode 0) is read per key; the compressed causal one is a tile
        own = isinstance(mask, torch.Tensor) and int(p.get("sparse_mode", 0)) == 0
        mask_bytes = sum(kv) * mask.element_size() if isinstance(mask, torch.Tensor) and own else 0
        ids = sum(-(-k // bs) for k in kv) * table.element_size()
        return sum(kv) * per_token + mask_bytes + ids + 2 * q.numel() * q.element_size()

    def __call__(self, op: str, p: dict[str, Any]) -> float | None:
        moved = self.attention_bytes(op, p)
        return None if moved is None else self.launch_s + moved / self.bytes_per_s
