"""Capture of device graphs with their updatable attention tasks."""

from npugraph.capture.manager import CaptureManager, Phase
from npugraph.capture.records import CapturedGraph, TaskRecord

__all__ = ["CaptureManager", "CapturedGraph", "Phase", "TaskRecord"]
