"""torchair's backend (``torchair.npu_fx_compiler``): on the simulator, the traced graph
run eagerly, with npugraph_ex's registered patterns replaced (see the package's docstring)."""

from __future__ import annotations

from typing import Any

from npusim.surfaces.npugraph_ex import npu_fx_compiler as _ex
from npusim.surfaces.npugraph_ex.configs.compiler_config import CompilerConfig as _ExConfig
from npusim.surfaces.torchair.configs.compiler_config import CompilerConfig

__all__ = ["get_compiler", "get_npu_backend"]


def _eager(config: CompilerConfig | None) -> _ExConfig:
    """npugraph_ex's options for ``config``: no capture (``force_eager``), its custom passes kept."""
    ex = _ExConfig()
    ex.force_eager = True
    if config is not None:
        ex.post_grad_custom_pre_pass = config.post_grad_custom_pre_pass.value
        ex.post_grad_custom_post_pass = config.post_grad_custom_post_pass.value
    return ex


def get_npu_backend(*, compiler_config: CompilerConfig | None = None, custom_decompositions: Any = None) -> Any:
    """A dynamo backend for ``compiler_config`` (any mode): the graph runs eagerly."""
    return _ex.get_npu_backend(compiler_config=_eager(compiler_config), custom_decompositions=custom_decompositions)


def get_compiler(compiler_config: CompilerConfig | None = None) -> Any:
    return _ex.get_compiler(_eager(compiler_config))
