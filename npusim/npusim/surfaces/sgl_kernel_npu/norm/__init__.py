"""``sgl_kernel_npu.norm``: SGLang's fused normalisation kernels for Ascend."""
