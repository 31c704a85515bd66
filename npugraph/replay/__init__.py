"""Per-step update and replay of captured graphs."""

from npugraph.replay.lens import AttentionMetadata, convert, pad_lens
from npugraph.replay.updater import GraphState, ReplayUpdater, StepMetadata, UpdatePlan, describe_device_error

__all__ = [
    "AttentionMetadata",
    "GraphState",
    "ReplayUpdater",
    "StepMetadata",
    "UpdatePlan",
    "convert",
    "describe_device_error",
    "pad_lens",
]
