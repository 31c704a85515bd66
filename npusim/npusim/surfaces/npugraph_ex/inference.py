"""``npugraph_ex.inference``: ``cache_compile`` (a module's method compiled with npugraph_ex on
its first call) and ``readable_cache``.

torchair saves the compiled graph under ``cache_dir`` and loads it in later processes; the
simulator compiles in every process (nothing is saved), which changes only start-up time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from npusim.surfaces.npugraph_ex.configs.compiler_config import CompilerConfig, _process_kwargs_options
from npusim.surfaces.npugraph_ex.npu_fx_compiler import get_npu_backend

__all__ = ["cache_compile", "readable_cache"]


def cache_compile(
    func: Callable[..., Any],
    *,
    config: CompilerConfig | None = None,
    dynamic: bool = True,
    cache_dir: str | None = None,
    global_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``func`` (a bound method of an ``nn.Module``) compiled with npugraph_ex on first call."""
    if not isinstance(getattr(func, "__self__", None), torch.nn.Module):
        raise ValueError("cache_compile: func must be a method of a torch.nn.Module instance (self.forward, ...)")
    if config is None:
        config = CompilerConfig()
        _process_kwargs_options(config, kwargs)
    return torch.compile(func, backend=get_npu_backend(compiler_config=config), dynamic=dynamic)


def readable_cache(cache_bin: str, print_output: bool = True, file: Any = None) -> str:
    raise RuntimeError("npugraph_ex.inference.readable_cache: the simulator saves no compile cache to read")
