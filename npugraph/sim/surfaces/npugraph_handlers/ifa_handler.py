"""FIA v1 and v2 (torch_npu's ``_npugraph_handlers/ifa_handler.py``).

Captured through ``.default``, the op becomes ``.out``: the maximum workspace over every
length the shapes allow and the outputs are allocated inside the capture (in the graph's
pool), and the caller gets ``out``.  The lengths are keyword-only in FIA's schema, so the
``("arg", ...)`` specs never match a record: an update rewrites them through the record's
kwargs, which hold them only if they were passed at capture (as on torch_npu).
"""

from __future__ import annotations

from typing import Any

from npugraph.sim.surfaces.npugraph_handlers.npugraph_handler import (
    NpuGraphOpHandler,
    register_npu_graph_handler,
    torch_npu,
)

__all__: list[str] = []

_V1 = "npu_fused_infer_attention_score"
_V2 = "npu_fused_infer_attention_score_v2"
_V1_OUTPUT_ARGS = (
    "input_layout",
    "quant_scale2",
    "block_table",
    "num_heads",
    "num_key_value_heads",
    "softmax_lse_flag",
    "query_rope",
)
_V2_OUTPUT_ARGS = (
    "query_dtype",
    "value_dtype",
    "input_layout",
    "quant_scale_out",
    "block_table",
    "num_query_heads",
    "num_key_value_heads",
    "return_softmax_lse",
    "query_rope",
    "out_dtype",
)


class _TensorListOutHandler(NpuGraphOpHandler):
    @classmethod
    def postprocess_result(cls, result: Any, kwargs: dict[str, Any]) -> Any:
        return kwargs["out"]


def _to_out(
    packet: Any, workspace: Any, infer_output: Any, keys: tuple[str, ...], args: Any, kwargs: dict[str, Any]
) -> tuple[Any, Any, dict[str, Any]]:
    kwargs["workspace"] = workspace(*args, **kwargs)
    sub = {k: kwargs[k] for k in keys if k in kwargs}
    kwargs["out"] = list(infer_output(args[0], args[2], **sub))
    return packet.out, args, kwargs


_V1_NAMES = [_V1, f"{_V1}.default", f"{_V1}.out"]


@register_npu_graph_handler(_V1_NAMES)
class _IFAv1DefaultHandler(_TensorListOutHandler):
    UPDATE_SPECS = {key: [("arg", 5, "actual_seq_lengths"), ("arg", 6, "actual_seq_lengths_kv")] for key in _V1_NAMES}

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        npu = torch_npu()
        if func is npu.npu_fused_infer_attention_score.out:
            return func, args, kwargs
        return _to_out(
            npu.npu_fused_infer_attention_score,
            npu._npu_fused_infer_attention_score_get_max_workspace,
            npu._npu_fused_infer_attention_score_infer_output,
            _V1_OUTPUT_ARGS,
            args,
            kwargs,
        )


_V2_NAMES = [_V2, f"{_V2}.default", f"{_V2}.out"]


@register_npu_graph_handler(_V2_NAMES)
class _IFAv2DefaultHandler(_TensorListOutHandler):
    UPDATE_SPECS = {key: [("arg", 7, "actual_seq_qlen"), ("arg", 8, "actual_seq_kvlen")] for key in _V2_NAMES}

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        npu = torch_npu()
        if func is npu.npu_fused_infer_attention_score_v2.out:
            return func, args, kwargs
        return _to_out(
            npu.npu_fused_infer_attention_score_v2,
            npu._npu_fused_infer_attention_score_v2_get_max_workspace,
            npu._npu_fused_infer_attention_score_v2_infer_output,
            _V2_OUTPUT_ARGS,
            args,
            kwargs,
        )
