"""The torch_npu submodules vllm-ascend and vLLM's workers import at start-up, as the simulator's.

Each is a plain module made when the simulator is installed as ``torch_npu`` (nothing is
made at import).  Names that do work on a device work here (the ``hccl`` process group over
gloo); what the simulator cannot do raises a clear error naming itself when called, never
at import.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import types
from typing import Any

from npusim.surfaces import graphs, npugraph_ex, npugraph_handlers, npugraph_utils, profiler, torchair
from npusim.surfaces.hccl import ProcessGroupHCCL
from npusim.surfaces.npugraph_ex import configs, inference, npu_fx_compiler, patterns, scope
from npusim.surfaces.npugraph_ex.configs import compiler_config
from npusim.surfaces.npugraph_ex.patterns import pattern_pass_manager
from npusim.surfaces.npugraph_handlers import ifa_handler, npugraph_handler, simple_handler
from npusim.surfaces.torchair import configs as torchair_configs
from npusim.surfaces.torchair import ge_concrete_graph
from npusim.surfaces.torchair import npu_fx_compiler as torchair_fx_compiler
from npusim.surfaces.torchair.configs import compiler_config as torchair_compiler_config
from npusim.surfaces.torchair.ge_concrete_graph import ge_converter
from npusim.surfaces.torchair.ge_concrete_graph.ge_converter import experimental as ge_experimental
from npusim.surfaces.torchair.ge_concrete_graph.ge_converter.experimental import patch_for_hcom_allreduce

__all__ = ["module", "submodules"]


def _register_atb_extensions() -> None:
    """torch_npu loads ATB's operator library here; the simulator's ops are built in."""


# pyACL's error code for a bad argument (ACL_ERROR_INVALID_PARAM)
_ACL_ERROR_INVALID_PARAM = 100000


def _acl_memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    """``acl.rt.memcpy``: pyACL's copy between raw addresses; returns pyACL's status code.

    The simulator's device memory is host memory, so every kind is one ``memmove``; a
    ``count`` over ``dest_max`` is refused as pyACL refuses it (status, not exception)."""
    if count < 0 or count > dest_max or kind not in (0, 1, 2, 3) or (count and not (dst and src)):
        return _ACL_ERROR_INVALID_PARAM
    ctypes.memmove(dst, src, count)
    return 0


def _rebuild_npu_tensor(*args: Any, **kwargs: Any) -> Any:
    """``torch_npu.multiprocessing.reductions.rebuild_npu_tensor``: an npu tensor shared with
    another process through the device's IPC handle; the simulated card has none."""
    raise RuntimeError(
        "torch_npu.multiprocessing.reductions.rebuild_npu_tensor: sharing an npu tensor between processes "
        "is not simulated by npusim (the simulated card has no IPC handles); pass host tensors"
    )


def _acl_get_device_info(device: int, attr: int) -> tuple[int, int]:
    """``acl.rt.get_device_info``: pyACL's ``(value, status)``.  The simulated card reports no
    device attribute (what each number means is CANN's, and the simulator models none):
    ``(0, ACL_ERROR_INVALID_PARAM)``, so no architecture check takes it for another card."""
    return 0, _ACL_ERROR_INVALID_PARAM


def module(name: str, **attrs: Any) -> types.ModuleType:
    """A stand-in module ``name`` holding ``attrs``."""
    m = types.ModuleType(name, f"npusim's stand-in for {name}")
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def submodules(c: Any) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries for torch_npu's submodules; ``c`` is the simulator's ``_C``
    (it gains ``_distributed_c10d``)."""
    c10d = module("torch_npu._C._distributed_c10d", ProcessGroupHCCL=ProcessGroupHCCL)
    c._distributed_c10d = c10d
    atb_ops = module("torch_npu.op_plugin.atb._atb_ops", _register_atb_extensions=_register_atb_extensions)
    atb = module("torch_npu.op_plugin.atb", _atb_ops=atb_ops)
    op_plugin = module("torch_npu.op_plugin", atb=atb)
    # torch_npu's inductor backend: vllm-ascend's worker imports it when Triton is on, for
    # what it registers with inductor; the simulator has none (vllm-ascend compiles without
    # inductor on the simulator, as its own backend does by default)
    inductor = module("torch_npu._inductor")
    scope.register_ops()
    dynamo = module("torch_npu.dynamo", npugraph_ex=npugraph_ex)
    reductions = module("torch_npu.multiprocessing.reductions", rebuild_npu_tensor=_rebuild_npu_tensor)
    multiprocessing = module("torch_npu.multiprocessing", reductions=reductions)
    modules = {
        # torchair: torch_npu's wheel carries it as a top-level package (SGLang imports it)
        "torchair": torchair,
        "torchair.configs": torchair_configs,
        "torchair.configs.compiler_config": torchair_compiler_config,
        "torchair.npu_fx_compiler": torchair_fx_compiler,
        "torchair.ge_concrete_graph": ge_concrete_graph,
        "torchair.ge_concrete_graph.ge_converter": ge_converter,
        "torchair.ge_concrete_graph.ge_converter.experimental": ge_experimental,
        "torchair.ge_concrete_graph.ge_converter.experimental.patch_for_hcom_allreduce": patch_for_hcom_allreduce,
        "torch_npu.multiprocessing": multiprocessing,
        "torch_npu.multiprocessing.reductions": reductions,
        # npugraph_ex: torch_npu's wheel carries it as torch_npu.dynamo.npugraph_ex and puts it
        # in sys.modules as npugraph_ex when torch_npu is imported (vllm-ascend imports it so)
        "npugraph_ex": npugraph_ex,
        "npugraph_ex.configs": configs,
        "npugraph_ex.configs.compiler_config": compiler_config,
        "npugraph_ex.npu_fx_compiler": npu_fx_compiler,
        "npugraph_ex.inference": inference,
        "npugraph_ex.scope": scope,
        "npugraph_ex.patterns": patterns,
        "npugraph_ex.patterns.pattern_pass_manager": pattern_pass_manager,
        "torch_npu.dynamo": dynamo,
        "torch_npu.dynamo.npugraph_ex": npugraph_ex,
        # torch_npu's graph-update machinery, at its module paths (its own tests import them)
        "torch_npu.npu.graphs": graphs,
        "torch_npu.npu._npugraph_utils": npugraph_utils,
        "torch_npu.npu._npugraph_handlers": npugraph_handlers,
        "torch_npu.npu._npugraph_handlers.npugraph_handler": npugraph_handler,
        "torch_npu.npu._npugraph_handlers.ifa_handler": ifa_handler,
        "torch_npu.npu._npugraph_handlers.simple_handler": simple_handler,
        "torch_npu._inductor": inductor,
        "torch_npu._C._distributed_c10d": c10d,
        "torch_npu.op_plugin": op_plugin,
        "torch_npu.op_plugin.atb": atb,
        "torch_npu.op_plugin.atb._atb_ops": atb_ops,
        "torch_npu.profiler": profiler,
        "torch_npu.profiler.dynamic_profile": profiler.dynamic_profile,
    }
    # pyACL (``acl``) ships with CANN beside torch_npu: vllm-ascend's worker imports
    # ``acl.rt.memcpy`` (its sleep-mode allocator).  A real one, where installed, wins.
    if importlib.machinery.PathFinder.find_spec("acl") is None:
        rt = module("acl.rt", memcpy=_acl_memcpy, get_device_info=_acl_get_device_info)
        modules["acl"] = module("acl", rt=rt)
        modules["acl.rt"] = rt
    return modules
