"""Capture of device graphs with their updatable attention tasks."""

from npugraph.capture.events import AUTO_EVENT_GROUP, AUTO_EVENT_GROUP_MIN
from npugraph.capture.manager import SINK_MIN_LAYERS, CaptureManager
from npugraph.capture.records import CapturedGraph, TaskRecord, WidthKey

__all__ = [
    "WidthKey",
    "AUTO_EVENT_GROUP",
    "AUTO_EVENT_GROUP_MIN",
    "SINK_MIN_LAYERS",
    "CaptureManager",
    "CapturedGraph",
    "TaskRecord",
]
