"""FIA: ``torch_npu.npu_fused_infer_attention_score.out`` (TND, paged) — the kernel for larger batches."""

from __future__ import annotations

import functools
from typing import Any

import torch

from npugraph.ops.base import AttentionCall, OpSpec, StepLens

__all__ = ["FIA", "causal_mask"]


@functools.cache
def causal_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 compressed causal mask ``sparse_mode=3`` expects (1 = masked), on ``device``."""
    # A constant that is never written, so every graph on that device may share it.
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(diagonal=1)


def _arguments(call: AttentionCall, lens: StepLens, workspace: torch.Tensor | None) -> dict[str, Any]:
    nb, bs, kvn, d = call.key_cache.shape
    dv = call.value_cache.shape[-1]
    causal = call.tokens_per_request > 1
    # softmax_lse is not requested; FIA still wants a tensor for it in ``out``.
    lse = torch.empty(1, dtype=torch.float32, device=call.query.device)
    return {
        "query": call.query,
        "key": call.key_cache.view(nb, bs, kvn * d),
        "value": call.value_cache.view(nb, bs, kvn * dv),
        "atten_mask": causal_mask(call.query.device) if causal else None,
        "actual_seq_lengths": lens.q_ends,
        "actual_seq_lengths_kv": lens.kv_lens,
        "block_table": call.block_table,
        "num_heads": call.num_heads,
        "scale": call.scale,
        "input_layout": "TND",
        "num_key_value_heads": call.num_kv_heads,
        "sparse_mode": 3 if causal else 0,
        "block_size": bs,
        "softmax_lse_flag": False,
        "workspace": workspace,
        "out": [call.out, lse],
    }


def _host_values(lens: StepLens) -> dict[str, Any]:
    return {"actual_seq_lengths": lens.q_ends, "actual_seq_lengths_kv": lens.kv_lens}


def _workspace_bytes(device: Any, kwargs: dict[str, Any], max_model_len: int) -> int:
    """FIA's helper is a true maximum over lengths for the given shapes: one query."""
    base = {k: v for k, v in kwargs.items() if k not in ("workspace", "out")}
    base["actual_seq_lengths_kv"] = [max_model_len] * len(kwargs["actual_seq_lengths_kv"])
    ws = device.ops._npu_fused_infer_attention_score_get_max_workspace(
        base.pop("query"), base.pop("key"), base.pop("value"), **base
    )
    return int(ws.numel() * ws.element_size())


def _unsupported(call: AttentionCall) -> str | None:
    return None


FIA = OpSpec(
    name="fia",
    kernel="npu_fused_infer_attention_score",
    overload="out",
    host_args=("actual_seq_lengths", "actual_seq_lengths_kv"),
    refreshed_buffers=("block_table",),
    cache_arg="key",
    arguments=_arguments,
    host_values=_host_values,
    workspace_bytes=_workspace_bytes,
    unsupported=_unsupported,
    fused_update=True,
)
