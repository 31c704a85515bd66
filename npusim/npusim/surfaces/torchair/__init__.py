"""``torchair`` (Ascend's graph compiler for torch, shipped in torch_npu's wheel), on the simulator.

SGLang 0.5.23 builds its NPU compile backend from it at import time
(``get_compiler_backend``: ``torchair.get_npu_backend(compiler_config=CompilerConfig())`` with
``mode="max-autotune"``, or ``"reduce-overhead"`` with ``debug.run_eagerly`` for its
``npugraph_ex`` mode) and imports its HCOM all-reduce patch.  What is here, modelled on
Ascend/torchair's ``python/torchair`` (names and semantics, not code): ``CompilerConfig``
with torchair's option checks (:mod:`.configs.compiler_config`), ``get_npu_backend`` and
``get_compiler``, ``register_replacement`` (npugraph_ex's pattern pass, one per process).

What it does not model: torchair's conversion to a GE graph (``max-autotune``) and its
captured NPU graphs (``reduce-overhead``): the backend runs the traced graph eagerly, with
every registered pattern replaced, whatever the mode, so a compiled function computes what
its eager form computes; a graph compiled here is never faster.
"""

import logging

from npusim.surfaces.npugraph_ex.patterns.pattern_pass_manager import register_replacement
from npusim.surfaces.torchair.configs.compiler_config import CompilerConfig
from npusim.surfaces.torchair.npu_fx_compiler import get_compiler, get_npu_backend

__all__ = ["CompilerConfig", "get_compiler", "get_npu_backend", "logger", "register_replacement"]

logger = logging.getLogger("torchair")
