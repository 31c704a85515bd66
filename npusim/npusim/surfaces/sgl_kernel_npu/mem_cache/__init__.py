"""``sgl_kernel_npu.mem_cache``: KV-cache slot allocation and stores."""
