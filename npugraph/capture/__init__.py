"""Capture of device graphs with their updatable attention tasks."""

from npugraph.capture.manager import (
    CaptureManager,
    GraphEntry,
    KernelChoice,
    Phase,
    TaskRecord,
    strong_tree,
)

__all__ = ["CaptureManager", "GraphEntry", "KernelChoice", "Phase", "TaskRecord", "strong_tree"]
