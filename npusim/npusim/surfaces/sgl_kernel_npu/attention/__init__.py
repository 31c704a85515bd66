"""``sgl_kernel_npu.attention``: SGLang's Triton attention kernels for Ascend."""
