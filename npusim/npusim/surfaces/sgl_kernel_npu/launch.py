"""Triton-shaped launchers for the stand-in kernels: ``kernel[grid](*args)`` as SGLang calls
sgl_kernel_npu's ``@triton.jit`` kernels, computed by a torch function of the whole grid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GridKernel"]


class GridKernel:
    """A kernel launched as ``kernel[grid](*args, **kwargs)``; ``fn(grid, *args, **kwargs)``
    does the whole grid's work (the simulator has no programs to split it among)."""

    def __init__(self, name: str, fn: Callable[..., None]) -> None:
        self.__name__, self._fn = name, fn

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)

        def run(*args: Any, **kwargs: Any) -> None:
            self._fn(grid, *args, **kwargs)

        return run

    def __repr__(self) -> str:
        return f"<sgl_kernel_npu stand-in kernel {self.__name__}>"
