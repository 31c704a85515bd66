"""``fla_npu.ops.ascendc``: the names vllm-ascend 0.30 imports from it, none simulated.

``chunk_gated_delta_rule_fwd`` is left out: vllm-ascend imports it inside a ``try`` and falls
back to its own Triton kernels without it, which run here (in Triton's interpreter)."""

from __future__ import annotations

from npusim.surfaces.not_simulated import not_simulated

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule_fwd_h",
    "chunk_kda_fwd",
    "recurrent_kda",
]

_WHY = "an Ascend C linear-attention kernel of flash-linear-attention-npu"
causal_conv1d_fn = not_simulated("fla_npu.ops.ascendc.causal_conv1d_fn", _WHY)
causal_conv1d_update = not_simulated("fla_npu.ops.ascendc.causal_conv1d_update", _WHY)
recurrent_gated_delta_rule = not_simulated("fla_npu.ops.ascendc.recurrent_gated_delta_rule", _WHY)
chunk_gated_delta_rule_fwd_h = not_simulated("fla_npu.ops.ascendc.chunk_gated_delta_rule_fwd_h", _WHY)
chunk_kda_fwd = not_simulated("fla_npu.ops.ascendc.chunk_kda_fwd", _WHY)
recurrent_kda = not_simulated("fla_npu.ops.ascendc.recurrent_kda", _WHY)
