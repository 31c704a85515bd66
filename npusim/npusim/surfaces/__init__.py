"""The surfaces: what other people's code imports, made from the kernels and the runtime below.

torch_npu's submodules that engines import at start-up (:mod:`.torch_npu_modules`), the
kernels as ``torch.ops.npu`` ops for ``torch.compile`` (:mod:`.torch_ops`), triton-ascend in
Triton's interpreter (:mod:`.triton_ascend`), and ``hccl`` over gloo (:mod:`.hccl`).  The two
faces that define the package stay at its top, where torch_npu has them:
``npusim`` is ``torch_npu`` and ``npusim.npu`` is ``torch.npu``.  A new outside
name (another torch_npu module, torchair, ``sgl_kernel_npu``) is a module here, built from
kernels and the runtime; no layer below imports a surface.
"""
