"""``torch_npu.profiler``: the names SGLang and vllm-ascend touch, as torch_npu has them.

The simulator has no device profiler: ``profile`` and ``tensorboard_trace_handler`` refuse
when called, naming themselves (``dynamic_profile``'s hooks do nothing, as on a host where
no profiling is configured).  The option classes hold torch_npu's values, so code that builds
a profiler configuration at import (SGLang patches ``torch.profiler`` with these names at
start-up) runs.
"""

from __future__ import annotations

import enum
import types

from npusim.surfaces.not_simulated import not_simulated

__all__ = [
    "AiCMetrics",
    "ExportType",
    "ProfilerActivity",
    "ProfilerLevel",
    "_ExperimentalConfig",
    "dynamic_profile",
    "profile",
    "supported_activities",
    "tensorboard_trace_handler",
]


profile = not_simulated("torch_npu.profiler.profile", "no device profiler")
tensorboard_trace_handler = not_simulated("torch_npu.profiler.tensorboard_trace_handler", "no device profiler")
# torch_npu.profiler.dynamic_profile: init() and step() are called by vllm-ascend's worker
dynamic_profile = types.ModuleType("torch_npu.profiler.dynamic_profile", "npusim's stand-in")
dynamic_profile.init = lambda *a, **k: None  # type: ignore[attr-defined]
dynamic_profile.step = lambda: None  # type: ignore[attr-defined]


class ProfilerActivity(enum.Enum):
    """What a profile records (torch_npu's ``_C._profiler.ProfilerActivity``)."""

    CPU = 0
    NPU = 1


def supported_activities() -> set[ProfilerActivity]:
    return {ProfilerActivity.CPU, ProfilerActivity.NPU}


class ProfilerLevel:
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"
    Level_none = "Level_none"


class AiCMetrics:
    PipeUtilization = "ACL_AICORE_PIPE_UTILIZATION"
    ArithmeticUtilization = "ACL_AICORE_ARITHMETIC_UTILIZATION"
    Memory = "ACL_AICORE_MEMORY_BANDWIDTH"
    MemoryL0 = "ACL_AICORE_L0B_AND_WIDTH"
    MemoryUB = "ACL_AICORE_MEMORY_UB"
    ResourceConflictRatio = "ACL_AICORE_RESOURCE_CONFLICT_RATIO"
    L2Cache = "ACL_AICORE_L2_CACHE"
    MemoryAccess = "ACL_AICORE_MEMORY_ACCESS"
    AiCoreNone = "ACL_AICORE_NONE"


class ExportType:
    Db = "db"
    Text = "text"


class _ExperimentalConfig:
    """A profile's NPU options (torch_npu's ``_ExperimentalConfig``): kept, never used."""

    def __init__(
        self,
        profiler_level: str = ProfilerLevel.Level0,
        aic_metrics: str = AiCMetrics.PipeUtilization,
        l2_cache: bool = False,
        msprof_tx: bool = False,
        mstx: bool = False,
        data_simplification: bool = True,
        record_op_args: bool = False,
        op_attr: bool = False,
        gc_detect_threshold: float | None = None,
        export_type: str | list[str] = ExportType.Text,
        host_sys: list[str] | None = None,
        mstx_domain_include: list[str] | None = None,
        mstx_domain_exclude: list[str] | None = None,
        sys_io: bool = False,
        sys_interconnection: bool = False,
    ) -> None:
        self.options = dict(locals())
        del self.options["self"]
