"""Packages the simulator stands in for under their own names (``sgl_kernel_npu``): an import
of ``<alias>.x.y`` gets ``<target>.x.y``, the module object itself, loaded on first use."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["PackageAlias"]


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """The target ran its own code when it was imported."""


class PackageAlias(importlib.abc.MetaPathFinder):
    """``import alias...`` resolves to ``target...`` (a real package of the simulator)."""

    def __init__(self, alias: str, target: str) -> None:
        self.alias, self.target = alias, target

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        real = self.target + fullname[len(self.alias) :]
        if importlib.util.find_spec(real) is None:
            return None  # a module the stand-in does not have: Python says "No module named"
        is_package = hasattr(importlib.import_module(real), "__path__")
        return importlib.machinery.ModuleSpec(fullname, _Loader(real), is_package=is_package)

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in [n for n in sys.modules if n == self.alias or n.startswith(self.alias + ".")]:
            del sys.modules[name]
