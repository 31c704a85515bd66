"""``npugraph_ex`` (torchair's graph backend, shipped in torch_npu's wheel), on the simulator.

vllm-ascend 0.23.0.post1 imports it at module level in its fusion passes (on by default) to
register each fusion pattern with it too, and, in ``FULL`` / ``FULL_DECODE_ONLY`` graph mode
(``enable_npugraph_ex=True``, the default), compiles the model's FX graph with its backend
(``force_eager=True``: the optimised FX graph runs eagerly; the ACL graph is captured by
vllm-ascend's own wrapper, or npugraph's).  What is here, modelled on torchair's
``npugraph_ex`` package (names and semantics, not code): ``CompilerConfig`` and
``configs.compiler_config._process_kwargs_options``; ``get_npu_backend`` (AOT autograd with
``npu_fx_compiler._NpuFxCompiler`` as the compiler: the FX graph with every registered
pattern replaced, run eagerly); ``compile_fx``, ``get_compiler``; ``register_replacement``
(one process-wide pattern pass, torch's pattern matcher); the ``npugraph_ex`` dynamo backend.
``inference.cache_compile``, ``scope.limit_core_num``.  The same module is ``torch.npu.npugraph_ex``.
What it does not model: torchair's graph conversion (``_NpuGraphConverter``, its concrete
graph), static kernels, core limits (the markers are removed) and its compile caches
(``get_code`` returns nothing, so vllm-ascend recompiles instead of loading).
"""

import logging

from npusim.surfaces.npugraph_ex import inference, scope
from npusim.surfaces.npugraph_ex.configs.compiler_config import CompilerConfig
from npusim.surfaces.npugraph_ex.npu_fx_compiler import compile_fx, get_compiler, get_npu_backend
from npusim.surfaces.npugraph_ex.patterns.pattern_pass_manager import register_replacement

__all__ = [
    "CompilerConfig",
    "compile_fx",
    "get_compiler",
    "get_npu_backend",
    "inference",
    "logger",
    "register_replacement",
    "scope",
]

logger = logging.getLogger("npugraph_ex")
