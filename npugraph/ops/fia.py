"""FIA: ``torch_npu.npu_fused_infer_attention_score.out`` (TND, paged) — the kernel for larger batches.

Also runs sliding-window layers (``sparse_mode=4``: a band of ``window`` keys) and
speculative verification (``sparse_mode=3``: causal within each request).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, cast

import torch

from npugraph.metadata import StepLens
from npugraph.ops.base import AttentionCall, OpSpec

__all__ = ["FIA", "causal_mask", "fia_arguments", "fia_runs_one_query_token", "fia_workspace_bytes"]


@functools.cache
def causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 compressed causal mask ``sparse_mode=3`` expects (1 = masked), on ``device``."""
    # A constant that is never written, so every graph on that device may share it.
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(diagonal=1)


def _masking(call: AttentionCall) -> dict[str, Any]:
    """``sparse_mode`` and its mask: none, causal (speculative), or a band (sliding window)."""
    causal = call.tokens_per_request > 1
    if call.window is not None:
        # bottom-right band: each query sees the keys from `window - 1` before it up to itself
        return {
            "atten_mask": causal_mask(call.query.device),
            "sparse_mode": 4,
            "pre_tokens": call.window - 1,
            "next_tokens": 0,
        }
    return {"atten_mask": causal_mask(call.query.device) if causal else None, "sparse_mode": 3 if causal else 0}


def fia_arguments(call: AttentionCall, lens: StepLens, workspace: torch.Tensor | None) -> dict[str, Any]:
    """FIA v1's keyword arguments for ``call`` (TND, paged; rope arguments for MLA)."""
    nb, bs, kvn, d = call.key_cache.shape
    dv = call.value_cache.shape[-1]
    # softmax_lse is not requested; FIA still wants a tensor for it in ``out``.
    lse = torch.empty(1, dtype=torch.float32, device=call.query.device)
    kwargs = {
        "query": call.query,
        "key": call.key_cache.view(nb, bs, kvn * d),
        "value": call.value_cache.view(nb, bs, kvn * dv),
        "actual_seq_lengths": lens.q_ends,
        "actual_seq_lengths_kv": lens.kv_lens,
        "block_table": call.block_table,
        "num_heads": call.num_heads,
        "scale": call.scale,
        "input_layout": "TND",
        "num_key_value_heads": call.num_kv_heads,
        "block_size": bs,
        "softmax_lse_flag": False,
        "workspace": workspace,
        "out": [call.out, lse],
        **_masking(call),
    }
    if call.is_mla:
        kr = cast(torch.Tensor, call.key_rope_cache)  # AttentionCall: both rope arguments or neither
        kwargs["query_rope"] = call.query_rope
        kwargs["key_rope"] = kr.view(kr.shape[0], kr.shape[1], -1)
    return kwargs


def fia_runs_one_query_token(args: Mapping[str, Any]) -> bool:
    """Captured without a mask (``sparse_mode=0``), a request's query tokens all see all its
    keys: right for one token, not causal for several."""
    return bool(args.get("sparse_mode") == 0)


def _host_values(lens: StepLens) -> dict[str, Any]:
    return {"actual_seq_lengths": lens.q_ends, "actual_seq_lengths_kv": lens.kv_lens}


def fia_workspace_bytes(helper: str, kv_arg: str, device: Any, kwargs: dict[str, Any], max_model_len: int) -> int:
    """Workspace sizing through ``helper`` (a true maximum over lengths for these shapes).

    Declarations bind ``helper`` and ``kv_arg`` with :func:`functools.partial`.
    """
    base = {k: v for k, v in kwargs.items() if k not in ("workspace", "out")}
    base[kv_arg] = [max_model_len] * len(kwargs[kv_arg])
    ws = getattr(device.ops, helper)(base.pop("query"), base.pop("key"), base.pop("value"), **base)
    return int(ws.numel() * ws.element_size())


def _unsupported(call: AttentionCall) -> str | None:
    if call.is_mla:
        return "FIA without rope arguments cannot run MLA (the mla declaration does)"
    return None


FIA = OpSpec(
    name="fia",
    kernel="npu_fused_infer_attention_score",
    overload="out",
    host_args=("actual_seq_lengths", "actual_seq_lengths_kv"),
    refreshed_buffers=("block_table",),
    cache_arg="key",
    arguments=fia_arguments,
    host_values=_host_values,
    workspace_bytes=functools.partial(
        fia_workspace_bytes, "_npu_fused_infer_attention_score_get_max_workspace", "actual_seq_lengths_kv"
    ),
    unsupported=_unsupported,
    prepare=causal_mask,
    fused_update=True,
    runs_one_query_token=fia_runs_one_query_token,
)
