"""The torch_npu submodules vllm-ascend and vLLM's workers import at start-up, as the simulator's.

Each is a plain module made when the simulator is installed as ``torch_npu`` (nothing is
made at import).  Names that do work on a device work here (the ``hccl`` process group over
gloo); what the simulator cannot do raises a clear error naming itself when called, never
at import.
"""

from __future__ import annotations

import types
from typing import Any

from npugraph.sim._hccl import ProcessGroupHCCL

__all__ = ["submodules"]


def _register_atb_extensions() -> None:
    """torch_npu loads ATB's operator library here; the simulator's ops are built in."""


def _not_simulated(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{what} is not simulated by npugraph.sim (no device profiler); run it on an Ascend host")

    return refuse


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name, f"npugraph.sim's stand-in for {name}")
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def submodules(c: Any) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries for torch_npu's submodules; ``c`` is the simulator's ``_C``
    (it gains ``_distributed_c10d``)."""
    c10d = _module("torch_npu._C._distributed_c10d", ProcessGroupHCCL=ProcessGroupHCCL)
    c._distributed_c10d = c10d
    atb_ops = _module("torch_npu.op_plugin.atb._atb_ops", _register_atb_extensions=_register_atb_extensions)
    atb = _module("torch_npu.op_plugin.atb", _atb_ops=atb_ops)
    op_plugin = _module("torch_npu.op_plugin", atb=atb)
    # torch_npu.profiler.dynamic_profile: init() and step() are called by vllm-ascend's worker
    dynamic_profile = _module("torch_npu.profiler.dynamic_profile", init=lambda *a, **k: None, step=lambda: None)
    profiler = _module(
        "torch_npu.profiler",
        dynamic_profile=dynamic_profile,
        profile=_not_simulated("torch_npu.profiler.profile"),
        tensorboard_trace_handler=_not_simulated("torch_npu.profiler.tensorboard_trace_handler"),
    )
    return {
        "torch_npu._C._distributed_c10d": c10d,
        "torch_npu.op_plugin": op_plugin,
        "torch_npu.op_plugin.atb": atb,
        "torch_npu.op_plugin.atb._atb_ops": atb_ops,
        "torch_npu.profiler": profiler,
        "torch_npu.profiler.dynamic_profile": dynamic_profile,
    }
