"""Per-step update and replay of captured graphs."""

from npugraph.replay.plan import Geometry, TaskPlan, UpdatePlan, build_plan
from npugraph.replay.updater import (
    ORDERS,
    GraphState,
    ReplayUpdater,
    StepMetadata,
    StepPhase,
    describe_device_error,
)

__all__ = [
    "ORDERS",
    "Geometry",
    "GraphState",
    "ReplayUpdater",
    "StepMetadata",
    "StepPhase",
    "TaskPlan",
    "UpdatePlan",
    "build_plan",
    "describe_device_error",
]
