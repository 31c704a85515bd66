"""``sgl_kernel_npu`` (sgl-project/sgl-kernel-npu: SGLang's Ascend kernels), on the simulator.

SGLang 0.5.23 imports it on its Ascend path; no package index has it (its wheel carries a
CANN library, ``libsgl_kernel_npu.so``, loaded at import).  What is here, modelled on its
Python sources (names, signatures and semantics, not code): the modules and names SGLang
touches on a dense model's path, each kernel computed with torch on the simulator's device
and checked against an independent float64 reference (tests/test_sgl_kernel_npu.py).
Triton kernels of the original (launched as ``kernel[grid](...)``) are launchers of the same
shape here (:class:`.launch.GridKernel`).  Names SGLang imports only on paths the simulator
does not serve (host KV offload, linear attention, MoE quantisation, sparse attention) raise
a clear error naming themselves when called, never at import.
"""
