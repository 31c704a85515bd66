"""Make every Python process of this environment see the simulator, npusim, as ``torch_npu``.

With ``NPUSIM_TORCH_NPU=1`` (or its first name, ``NPUGRAPH_SIM_TORCH_NPU=1``) in the environment (inherited by child processes: vLLM's
workers, its model-inspection subprocess, ``multiprocessing`` spawn):

* ``import torch`` loads the simulator the way a real torch_npu loads: through torch's
  device-backend autoload (entry point group ``torch.backends``, :func:`torch_backend`).
  Then ``torch.npu``, the ``npu`` device, pinned memory and the ``hccl`` backend exist, and
  ``import torch_npu`` gives the simulator;
* ``import torch_npu`` before ``import torch`` works too: the ``npusim.pth`` file
  installs a finder (:func:`from_pth`) that imports torch first;
* ``import acl`` (CANN's pyACL, which Ray asks what a node has) gives the simulator's
  stand-in, :mod:`npusim.surfaces.acl`, without importing torch.

Without the variable nothing happens (this module imports nothing else); where a real
torch_npu is importable the simulator is refused with a warning, and the real one is used.
This is a top-level module, not part of the ``npusim`` package, so that the check costs
nothing in processes that never use the simulator.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

ENV = "NPUGRAPH_SIM_TORCH_NPU"  # its first name, which every script and doc of npugraph's sets
SHORT_ENV = "NPUSIM_TORCH_NPU"

__all__ = ["ENV", "SHORT_ENV", "after_import", "asked", "enabled", "from_pth", "install", "torch_backend"]


def asked() -> bool:
    """Whether this process's environment asks for the simulator as torch_npu."""
    return "1" in (os.environ.get(ENV, "").strip(), os.environ.get(SHORT_ENV, "").strip())


def enabled() -> bool:
    """Whether this process asked for the simulator as torch_npu, and may have it."""
    if not asked():
        return False
    real = importlib.machinery.PathFinder.find_spec("torch_npu")
    if real is not None:
        warnings.warn(
            f"{ENV}=1 or {SHORT_ENV}=1, but a real torch_npu is installed ({real.origin}); the simulator "
            f"(npusim) is not loaded. Unset both on an Ascend host.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def torch_backend() -> None:
    """torch's device-backend autoload (``torch.backends`` entry point): runs inside ``import torch``.

    Importing npusim installs it (:func:`install`, its last lines).  Where ``import npusim``
    came first, it is half-loaded here (it imports torch near its top): this import returns
    it as it is, and it installs itself once its names exist."""
    if not enabled():
        return
    import npusim  # noqa: F401


def install(sim: Any) -> None:
    """Install the simulator module ``sim`` as torch_npu with its device, Triton's stand-ins
    and the ``npugraph_ex`` backend: what ``NPUSIM_TORCH_NPU=1`` asks of every process."""
    sim.install_torch_npu(device=True)
    _install_triton()  # where no .pth ran (an editable install): before any Triton kernel is defined
    _install_npugraph_ex_backend()


def _register_npugraph_ex_backend(_: Any = None) -> None:
    from npusim.surfaces.npugraph_ex.npu_fx_compiler import register_dynamo_backend

    register_dynamo_backend()


def _install_npugraph_ex_backend() -> None:
    """``torch.compile(backend="npugraph_ex")``, as importing torch_npu registers it: once
    torch._dynamo is imported (importing it here would slow every process's start)."""
    if "torch._dynamo" in sys.modules:
        _register_npugraph_ex_backend()
    else:
        after_import("torch._dynamo", _register_npugraph_ex_backend)


class _TorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``import torch_npu`` to the simulator (importing torch, which installs it)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch_npu":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        import torch  # noqa: F401 - its autoload installs the simulator (torch_backend)

        import npusim as sim

        sim.install_torch_npu(device=True)  # also where torch's autoload is switched off
        return sys.modules["torch_npu"]

    def exec_module(self, module: Any) -> None:
        """The simulator is initialised already."""


class _AclFinder(importlib.abc.MetaPathFinder):
    """Resolves ``import acl`` (CANN's pyACL) to the simulator's stand-in, loaded from its file
    alone: Ray asks it what a node has, in processes that import no torch."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "acl":
            return None
        package = importlib.machinery.PathFinder.find_spec("npusim")
        if package is None or not package.submodule_search_locations:
            return None
        file = os.path.join(next(iter(package.submodule_search_locations)), "surfaces", "acl.py")
        return importlib.util.spec_from_file_location("acl", file)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each of ``thens`` on the module ``name`` once it has been executed, wherever it
    is imported from, in the order they were asked for (one finder per name: a second
    finder for the same name would never be asked, as the first answers)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.thens = name, [then]

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, thens = spec.loader.exec_module, self.thens

        def exec_module(module: Any) -> None:
            run(module)
            for then in thens:
                then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, then: Callable[[Any], None]) -> None:
    """Call ``then(module)`` when ``name`` is first imported (before whoever imported it goes
    on), after whatever was asked for ``name`` before."""
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and finder.name == name:
            finder.thens.append(then)
            return
    sys.meta_path.insert(0, _AfterImport(name, then))


class _TritonStandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import triton.language.extra.cann`` (triton-ascend's) gives the simulator's stand-ins of
    its ``extension`` and ``libdevice``, imported with the package as triton-ascend's are."""

    PACKAGE = "triton.language.extra.cann"
    NAMES = (PACKAGE, f"{PACKAGE}.extension", f"{PACKAGE}.libdevice")

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.NAMES:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=name == self.PACKAGE)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        from npusim.surfaces import triton_ascend

        if spec.name.endswith(".extension"):
            return triton_ascend.cann_extension()
        if spec.name.endswith(".libdevice"):
            return triton_ascend.cann_libdevice()
        return None

    def exec_module(self, module: Any) -> None:
        """The submodules are complete when made; the package imports them (code reads
        ``triton.language.extra.cann.libdevice`` off the package)."""
        if module.__name__ == self.PACKAGE:
            module.extension = importlib.import_module(f"{self.PACKAGE}.extension")
            module.libdevice = importlib.import_module(f"{self.PACKAGE}.libdevice")


def _simulator_triton(then: str) -> Callable[[Any], None]:
    def run(module: Any) -> None:
        from npusim.surfaces import triton_ascend

        getattr(triton_ascend, then)(module)

    return run


def _install_triton() -> None:
    """Triton on the simulator (:mod:`npusim.surfaces.triton_ascend`), wired in as Triton's modules load:
    kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` unless set, the only way they
    run on a CPU), the simulator's backend joins ``triton.backends``, interpreted launches
    become simulator kernels, block shapes need not be powers of two (as triton-ascend's),
    bfloat16 arithmetic works on values, integer overflow checks that cannot assert are left
    out, and triton-ascend's language extension has a stand-in."""
    if any(isinstance(f, _TritonStandIns) for f in sys.meta_path):
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.meta_path.insert(0, _TritonStandIns())
    after_import("triton.backends", _simulator_triton("register_backend"))
    after_import("triton.language", _simulator_triton("relax_block_shapes"))
    after_import("triton.runtime.interpreter", _simulator_triton("launch_as_kernels"))
    after_import("triton.runtime.interpreter", _simulator_triton("bfloat16_arithmetic"))
    after_import("triton.runtime.interpreter", _simulator_triton("no_unasserted_overflow_checks"))
    after_import("triton.runtime.interpreter", _simulator_triton("cached_numpy_dtypes"))


def from_pth() -> None:
    """Called by ``npusim.pth`` at interpreter start: install the finders if asked."""
    if (
        asked()
        and not any(isinstance(f, _TorchNpuFinder) for f in sys.meta_path)
        and importlib.machinery.PathFinder.find_spec("torch_npu") is None  # a real one wins
    ):
        sys.meta_path.append(_TorchNpuFinder())
        _install_triton()
        if importlib.machinery.PathFinder.find_spec("acl") is None:  # CANN's pyACL wins
            sys.meta_path.append(_AclFinder())
