"""``sgl_kernel_npu.norm.add_rmsnorm_bias``: the residual add fused with an RMSNorm (with a bias:
``add_rmsnorm_bias``, modelslim's quantized layers; Gemma's, whose weight is offset by one:
``add_gemma_rms_norm``).  SGLang 0.5.22's ``layers/layernorm.py`` imports ``add_gemma_rms_norm``
at module level on Ascend.  Not simulated: the names exist for SGLang's imports."""

from __future__ import annotations

from npusim.surfaces.not_simulated import not_simulated

__all__ = ["add_gemma_rms_norm", "add_rmsnorm_bias"]

add_rmsnorm_bias = not_simulated(
    "sgl_kernel_npu.norm.add_rmsnorm_bias.add_rmsnorm_bias", "modelslim's quantized models"
)
add_gemma_rms_norm = not_simulated("sgl_kernel_npu.norm.add_rmsnorm_bias.add_gemma_rms_norm", "Gemma models")
