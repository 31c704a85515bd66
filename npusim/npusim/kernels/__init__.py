"""The kernels: torch_npu's operators with real math, each with its bounds and workspace rules.

One module per kernel family: PA (:mod:`.pa`), FIA v1 (:mod:`.fia`), FIA v2 with sinks
(:mod:`.fia_v2`), the tiling-sink pair (:mod:`.fia_sink`), the 4-in-1 FIA update
(:mod:`.fused`), prefill attention (:mod:`.prefill`), the KV-cache writes (:mod:`.cache`),
MLA's rope, latent-cache write and up projection (:mod:`.mla`), and the dense ops a decoder layer calls (:mod:`.dense`: norms, rope, SwiGLU).  Each binds
its arguments as torch_npu names them, checks them, and hands a :class:`~npusim.runtime.launch.SimOp`
to the runtime, which decides whether it runs, is recorded or is an update.  The shared
attention math and workspace models are :mod:`.numerics` (re-exported here, the path
``npusim.kernels`` had as a module).  Kernels import the runtime and the device;
they never import a surface (how other code reaches them).
"""

from npusim.kernels.numerics import AI_CORES, attention, fia_workspace_bytes, gather_paged, pa_workspace_bytes

__all__ = ["AI_CORES", "attention", "fia_workspace_bytes", "gather_paged", "pa_workspace_bytes"]
