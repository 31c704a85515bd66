"""FIA v2: ``npu_fused_infer_attention_score_v2`` — v1's math under v2's argument names,
plus attention sinks (``learnable_sink``: one softmax logit per head, gpt-oss)."""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels.fia import (
    FIA,
    INT_MAX,
    _npu_fused_infer_attention_score_infer_output,
    alloc_outputs,
    fia_check,
    fia_compute,
    fia_workspace,
    out_pair,
)
from npusim.kernels.schemas import FIA_V2_OUT_SCHEMA, FIA_V2_SCHEMA
from npusim.runtime.launch import OpPacket, SimOp, host_copy, launch, max_workspace

__all__ = ["npu_fused_infer_attention_score_v2", "_npu_fused_infer_attention_score_v2_get_max_workspace"]


_V2_RENAMES = {
    "num_query_heads": "num_heads",
    "softmax_scale": "scale",
    "actual_seq_qlen": "actual_seq_lengths",
    "actual_seq_kvlen": "actual_seq_lengths_kv",
    "return_softmax_lse": "softmax_lse_flag",
}


def _v2_to_v1(kwargs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        out[_V2_RENAMES.get(k, k)] = v
    return out


class _V2Op(SimOp):
    """FIA v2: v1's math under v2's argument names."""

    def __init__(self, overload: str) -> None:
        super().__init__(
            "npu_fused_infer_attention_score_v2",
            overload,
            host_args=("actual_seq_qlen", "actual_seq_kvlen"),
            output_args=("out",),
            check=lambda p: fia_check(_v2_to_v1(p)),
            compute=lambda p, info: fia_compute(_v2_to_v1(p), info),
            workspace=lambda p, info: fia_workspace(_v2_to_v1(p), info),
        )


_V2_OUT = _V2Op("out")


_V2 = _V2Op("default")


def _v2_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: Any = None,
    key_rope: Any = None,
    pse_shift: Any = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen: Any = None,
    actual_seq_kvlen: Any = None,
    block_table: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    return_softmax_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    out: Any = None,
    **quant: Any,
) -> dict[str, Any]:
    p = dict(locals())
    extra = p.pop("quant")
    for k, v in extra.items():
        # quantisation switches default to None or 0; a tensor is never tested for truth
        if v is not None and (isinstance(v, torch.Tensor) or v != 0):
            raise NotImplementedError(f"npu_fused_infer_attention_score_v2: the simulator does not model {k!r}")
    return p


def _v2_default(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _v2_params(query, key, value, **kwargs)
    for name in _V2.host_args:
        p[name] = host_copy(name, p.get(name))
    v1 = _v2_to_v1(p)
    out, lse = alloc_outputs(FIA, v1)
    p["out"] = [out, lse]
    launch(_V2, p)
    return out, lse


def _v2_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _v2_params(query, key, value, **kwargs)
    outs = out_pair(p)
    launch(_V2_OUT, p)
    return outs[0], outs[1]


npu_fused_infer_attention_score_v2 = OpPacket(
    _v2_default,
    _v2_out,
    "npu_fused_infer_attention_score_v2",
    schemas=(FIA_V2_SCHEMA, FIA_V2_OUT_SCHEMA),
    signatures=(_v2_params, _v2_params),
)


def _npu_fused_infer_attention_score_v2_infer_output(
    query: torch.Tensor,
    value: torch.Tensor,
    *,
    query_dtype: Any = None,
    value_dtype: Any = None,
    input_layout: str = "BSH",
    quant_scale_out: Any = None,
    block_table: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    return_softmax_lse: bool = False,
    query_rope: Any = None,
    out_dtype: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """v1's rule under v2's names (the dtype switches are quantisation's: not simulated)."""
    for name, v in (("query_dtype", query_dtype), ("value_dtype", value_dtype), ("out_dtype", out_dtype)):
        if v is not None:
            raise NotImplementedError(f"_npu_fused_infer_attention_score_v2_infer_output: {name} is not simulated")
    return _npu_fused_infer_attention_score_infer_output(
        query,
        value,
        input_layout=input_layout,
        quant_scale2=quant_scale_out,
        block_table=block_table,
        num_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads,
        softmax_lse_flag=return_softmax_lse,
        query_rope=query_rope,
    )


def _npu_fused_infer_attention_score_v2_get_max_workspace(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """FIA v2's maximum workspace for these shapes."""
    return max_workspace(_V2, _v2_params(query, key, value, **kwargs))
