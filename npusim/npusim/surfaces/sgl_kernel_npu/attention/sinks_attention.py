"""``sgl_kernel_npu.attention.sinks_attention``: attention with learned sinks (gpt-oss).
Not simulated: the names exist for SGLang's Ascend backend, which imports them."""

from __future__ import annotations

from npusim.surfaces.not_simulated import not_simulated

__all__ = ["attention_sinks_prefill_triton", "attention_sinks_triton"]

_WHY = "attention sinks (gpt-oss models)"
attention_sinks_prefill_triton = not_simulated(
    "sgl_kernel_npu.attention.sinks_attention.attention_sinks_prefill_triton", _WHY
)
attention_sinks_triton = not_simulated("sgl_kernel_npu.attention.sinks_attention.attention_sinks_triton", _WHY)
