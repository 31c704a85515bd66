"""FIA with tiling sink: ``npu_fused_infer_attention_score_v2_sink`` reads its lengths and
its tiling plan from device memory (vllm-ascend PRs #15215 / #15336; on Ascend in
``torch.ops._C_ascend`` where built with them).

A graph holds the kernel alone: no task group, no per-layer update, no event per layer.
Each step writes one KV-cache group's lengths into a :class:`~npugraph.ops.LensGroup` and
issues ``_npu_fused_infer_attention_score_v2_sink_metadata`` once for the group, outside
the graph (an AI-CPU node captured in a graph is not re-run on replay).  Eligible: GQA
decode and speculative verification in TND with a paged cache, head size other than 256;
not sliding windows (``sparse_mode=4``) nor MLA, which keep FIA's per-layer update.
"""

from __future__ import annotations

from typing import Any

import torch

from npugraph.metadata import StepLens
from npugraph.ops.base import AttentionCall, DeviceLengths, LensGroup, OpSpec
from npugraph.ops.fia import causal_mask, fia_arguments, fia_runs_one_query_token

__all__ = ["FIA_SINK"]


def _arguments(
    call: AttentionCall, lens: StepLens, workspace: torch.Tensor | None, buffers: LensGroup | None = None
) -> dict[str, Any]:
    v1 = fia_arguments(call, lens, None)
    return {
        "query": v1["query"],
        "key": v1["key"],
        "value": v1["value"],
        # host tuples only where no buffers exist yet (sizing at capture, never launched)
        "actual_seq_qlen": buffers.qlen if buffers is not None else lens.q_ends,
        "actual_seq_kvlen": buffers.kvlen if buffers is not None else lens.kv_lens,
        "block_table": call.block_table,
        "meta_data": buffers.meta if buffers is not None else None,
        "num_query_heads": call.num_heads,
        "num_key_value_heads": call.num_kv_heads,
        "softmax_scale": call.scale,
        "input_layout": "TND",
        "block_size": v1["block_size"],
        "sparse_mode": v1["sparse_mode"],
        "atten_mask": v1["atten_mask"],
        "out": v1["out"],
    }


def _plan_args(call: AttentionCall) -> dict[str, Any]:
    return {
        "num_query_heads": call.num_heads,
        "num_key_value_heads": call.num_kv_heads,
        "head_dim": int(call.query.shape[-1]),
        "block_size": call.block_size,
        "input_layout": "TND",
        "sparse_mode": 3 if call.tokens_per_request > 1 else 0,
    }


def _host_values(lens: StepLens) -> dict[str, Any]:
    return {"actual_seq_qlen": lens.q_ends, "actual_seq_kvlen": lens.kv_lens}


def _unsupported(call: AttentionCall) -> str | None:
    if call.is_mla:
        return "MLA has rope arguments the tiling-sink kernel does not take"
    if call.window is not None:
        return "a sliding window (sparse_mode=4) is not a mode of the tiling-sink kernel"
    if int(call.query.shape[-1]) == 256:
        return "head size 256 is refused by the tiling-sink kernel (GQA)"
    if call.value_cache.shape[-1] != call.query.shape[-1]:
        return "the tiling-sink kernel takes values of the query's head size"
    return None


FIA_SINK = OpSpec(
    name="fia_sink",
    kernel="npu_fused_infer_attention_score_v2_sink",
    overload="out",
    host_args=(),
    refreshed_buffers=("block_table",),
    cache_arg="key",
    arguments=_arguments,
    host_values=_host_values,
    workspace_bytes=lambda device, kwargs, max_model_len: 0,  # its plan is its tiling: no workspace
    unsupported=_unsupported,
    prepare=causal_mask,
    runs_one_query_token=fia_runs_one_query_token,
    sink=DeviceLengths(metadata_kernel="_npu_fused_infer_attention_score_v2_sink_metadata", plan_args=_plan_args),
)
