"""FIA v1 and v2 (torch_npu's ``_npugraph_handlers/ifa_handler.py``).

Captured through ``.default``, the op becomes ``.out``: the maximum workspace over every
length the shapes allow and the outputs are allocated inside the capture (in the graph's
pool), and the caller gets ``out``.  The lengths are keyword-only in FIA's schema, so the
``("arg", ...)`` specs never match a record: an update rewrites them through the record's
kwargs, which hold them only if they were passed at capture (as on torch_npu).
"""

from __future__ import annotations

from typing import Any

from npusim.surfaces.npugraph_handlers.npugraph_handler import (
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
    """Captured through ``.default``, the op becomes ``.out`` with torch_npu's maximum workspace
    and ``_infer_output``'s outputs (allocated inside the capture); the caller gets ``out``."""

    OP = ""  # the op's torch_npu name; its workspace and output helpers are named after it
    OUTPUT_ARGS: tuple[str, ...] = ()  # the keyword arguments _infer_output takes

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        npu = torch_npu()
        packet = getattr(npu, cls.OP)
        if func is packet.out:
            return func, args, kwargs
        kwargs["workspace"] = getattr(npu, f"_{cls.OP}_get_max_workspace")(*args, **kwargs)
        sub = {k: kwargs[k] for k in cls.OUTPUT_ARGS if k in kwargs}
        kwargs["out"] = list(getattr(npu, f"_{cls.OP}_infer_output")(args[0], args[2], **sub))
        return packet.out, args, kwargs

    @classmethod
    def postprocess_result(cls, result: Any, kwargs: dict[str, Any]) -> Any:
        return kwargs["out"]


_V1_NAMES = [_V1, f"{_V1}.default", f"{_V1}.out"]
_V2_NAMES = [_V2, f"{_V2}.default", f"{_V2}.out"]


@register_npu_graph_handler(_V1_NAMES)
class _IFAv1DefaultHandler(_TensorListOutHandler):
    OP = _V1
    OUTPUT_ARGS = _V1_OUTPUT_ARGS
    UPDATE_SPECS = {name: [("arg", 5, "actual_seq_lengths"), ("arg", 6, "actual_seq_lengths_kv")] for name in _V1_NAMES}


@register_npu_graph_handler(_V2_NAMES)
class _IFAv2DefaultHandler(_TensorListOutHandler):
    OP = _V2
    OUTPUT_ARGS = _V2_OUTPUT_ARGS
    UPDATE_SPECS = {name: [("arg", 7, "actual_seq_qlen"), ("arg", 8, "actual_seq_kvlen")] for name in _V2_NAMES}
