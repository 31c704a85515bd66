"""``sgl_kernel_npu.norm.split_qkv_rmsnorm_rope``: QKV split, per-head RMSNorm of q and k, and
rotary embedding in one kernel (SGLang's Llama and Qwen3 decode on Ascend)."""

from npusim.kernels.dense import split_qkv_rmsnorm_rope

__all__ = ["split_qkv_rmsnorm_rope"]
