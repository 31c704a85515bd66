"""``sgl_kernel_npu.norm.fused_split_qk_norm``: MLA's fused q/k split and norm (DeepSeek on
Ascend).  Not simulated: the name exists for SGLang's imports."""

from __future__ import annotations

from npusim.surfaces.not_simulated import not_simulated

__all__ = ["fused_split_qk_norm"]

fused_split_qk_norm = not_simulated("sgl_kernel_npu.norm.fused_split_qk_norm.fused_split_qk_norm", "MLA models")
