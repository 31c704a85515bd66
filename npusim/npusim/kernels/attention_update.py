"""``npu_attention_update``: the merge of partial attention results by their log-sum-exp.

Each of ``sp`` sequence-parallel shards (or a chunked prefill's context and new tokens) has
attended over part of the keys and gives its output ``O_i [rows, head_dim]`` and its
log-sum-exp ``lse_i [rows]``.  The kernel (CANN's ``aclnnAttentionUpdate``) combines them
into the attention over all keys:

    lse_max = max_i lse_i;   lse_m = lse_max + log(sum_i exp(lse_i - lse_max))
    O = sum_i O_i * exp(lse_i - lse_m)

torch_npu's op (op-plugin's ``npu_attention_update``) returns ``(out, lse_out)``: ``out``
has ``local_out[0]``'s shape and dtype, ``lse_out`` (float32, ``lse[0]``'s shape) only
when ``update_type`` is 1, else ``None``.  CANN's limits: ``sp`` in [1, 16], ``head_dim``
in [8, 512] and a multiple of 8, ``lse`` float32, contiguous tensors.  Rows whose every
``lse_i`` is ``-inf`` (nothing attended) give 0, as the kernel's guard does.
"""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels.dense import _kernel
from npusim.runtime.launch import fail, launch

__all__ = ["npu_attention_update"]

MAX_SP = 16  # CANN: the shard count's range is [1, 16]
HEAD_DIM_RANGE = (8, 512)  # CANN: head_dim in [8, 512], a multiple of 8
_OUT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _merge(p: dict[str, Any]) -> None:
    lse = torch.stack([t.float() for t in p["lse"]])  # [sp, rows]
    outs = torch.stack([t.float() for t in p["local_out"]])  # [sp, rows, head_dim]
    top = lse.max(dim=0).values
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.exp(lse - safe).sum(dim=0)
    lse_m = safe + torch.log(total)
    weights = torch.exp(lse - lse_m)
    weights = torch.where(total > 0, weights, torch.zeros_like(weights))  # every shard empty: 0
    p["out"].copy_((weights.unsqueeze(-1) * outs).sum(dim=0))
    if p["lse_out"] is not None:
        p["lse_out"].copy_(lse_m)


_ATTENTION_UPDATE = _kernel("npu_attention_update", "out", ("out", "lse_out"), _merge)


def _check(lse: Any, local_out: Any, update_type: int) -> None:
    op = "npu_attention_update"
    if not isinstance(lse, (list, tuple)) or not isinstance(local_out, (list, tuple)):
        raise fail(op, "lse", "lse and local_out must be lists of tensors (one per shard)")
    sp = len(lse)
    if not 1 <= sp <= MAX_SP:
        raise fail(op, "lse", f"holds {sp} shards; the kernel takes 1 to {MAX_SP}")
    if len(local_out) != sp:
        raise fail(op, "local_out", f"holds {len(local_out)} tensors but lse holds {sp}")
    if update_type not in (0, 1):
        raise fail(op, "update_type", f"must be 0 (no lse_out) or 1 (with lse_out), got {update_type!r}")
    first = local_out[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 2:
        raise fail(op, "local_out[0]", "must be a 2-d tensor [rows, head_dim]")
    rows, head_dim = first.shape
    low, high = HEAD_DIM_RANGE
    if not low <= head_dim <= high or head_dim % 8:
        raise fail(op, "local_out", f"head_dim is {head_dim}; the kernel takes {low} to {high}, a multiple of 8")
    for i, (ls, o) in enumerate(zip(lse, local_out)):
        if not isinstance(ls, torch.Tensor) or ls.dtype != torch.float32 or tuple(ls.shape) != (rows,):
            raise fail(op, f"lse[{i}]", f"must be a float32 tensor [{rows}]")
        if not isinstance(o, torch.Tensor) or o.dtype != first.dtype or tuple(o.shape) != (rows, head_dim):
            raise fail(op, f"local_out[{i}]", f"must be a {first.dtype} tensor [{rows}, {head_dim}] like local_out[0]")
        if o.dtype not in _OUT_TYPES:
            raise fail(op, f"local_out[{i}]", f"must be float32, float16 or bfloat16, got {o.dtype}")
        for name, t in ((f"lse[{i}]", ls), (f"local_out[{i}]", o)):
            if not t.is_contiguous():
                raise fail(op, name, "must be contiguous (the kernel does not read strided tensors)")


def npu_attention_update(
    lse: list[torch.Tensor], local_out: list[torch.Tensor], update_type: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shards' outputs ``local_out`` merged by their log-sum-exps ``lse``: ``(out,
    lse_out)``, ``lse_out`` only for ``update_type`` 1 (else ``None``)."""
    _check(lse, local_out, update_type)
    first = local_out[0]
    out = torch.empty(first.shape, dtype=first.dtype, device=first.device)
    lse_out = torch.empty(lse[0].shape, dtype=torch.float32, device=lse[0].device) if update_type == 1 else None
    launch(
        _ATTENTION_UPDATE,
        {"lse": list(lse), "local_out": list(local_out), "update_type": update_type, "out": out, "lse_out": lse_out},
    )
    return out, lse_out
