"""torch_npu's NPU-graph op-handler registry (``torch_npu.npu._npugraph_handlers``), on the simulator.

How torch_npu's ``NPUGraph.update`` knows each op it captured with ``auto_dispatch_capture``:
a handler class per op name (``register_npu_graph_handler``) prepares the capture (FIA's
``.default`` becomes ``.out`` with the maximum workspace and outputs allocated in the
graph), says which arguments an update may rewrite (``UPDATE_SPECS``) and rewrites them.
Names, hooks and the built-in handlers follow torch_npu v26.1 (Ascend/pytorch,
``torch_npu/npu/_npugraph_handlers``): FIA v1 and v2 (``.default`` and ``.out``), PA
(``_npu_paged_attention.default``) and MLA (``npu_multi_head_latent_attention.out``,
registered although the simulator has no MLA kernel).  Importing this package registers
the built-ins, as torch_npu's does.
"""

from npusim.surfaces.npugraph_handlers import ifa_handler, simple_handler
from npusim.surfaces.npugraph_handlers.npugraph_handler import NpuGraphOpHandler, register_npu_graph_handler

__all__ = ["NpuGraphOpHandler", "ifa_handler", "register_npu_graph_handler", "simple_handler"]
