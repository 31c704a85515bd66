"""``fla_npu.ops``: the kernels, under ``fla_npu.ops.ascendc``."""
