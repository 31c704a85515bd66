"""What a failed capture's error says beyond the error itself: where the callable went wrong,
and what a device's capture error means."""

from __future__ import annotations

import traceback
from collections.abc import Sequence

from npugraph.capture.records import TaskRecord
from npugraph.errors import CaptureFailed

__all__ = ["advice_for", "capture_failed", "raised_at"]

# What a device's capture error means, by the code or message torch_npu and CANN report
# (matched in lower case; vllm-ascend's issues #1168, #2182, the torch_npu builds without
# aclmdlRI*, and the stream-resource and old-HDK markers its ACLGraphWrapper diagnoses in
# compilation/acl_graph.py): the advice appended to CaptureFailed.
_DEVICE_ADVICE = (
    (
        ("207008", "insufficient_stream_resources", "stream resources are insufficient"),
        "The device ran out of stream resources (error 207008; about 1,920 graphs per device, vllm-ascend "
        "#1168): capture fewer sizes (vLLM: compilation_config.cudagraph_capture_sizes, or a lower "
        "max_cudagraph_capture_size) or fewer namespaces; FULL_DECODE_ONLY captures fewer graphs than "
        "PIECEWISE.",
    ),
    (
        ("alloc sq cq fail",),
        "This is the capture error of an old Ascend HDK/CANN stack (`Alloc sq cq fail`): upgrade the Ascend "
        "HDK to 25.5.1 or later with its matching CANN.",
    ),
    (
        ("aclmdlricapturebegin", "aclmdlricapture"),
        "This CANN/driver has no graph capture (aclmdlRICapture*): graph capture with task updates needs "
        "CANN >= 8.2.RC1 and Ascend HDK >= 25.0.RC1; upgrade them, or run without graphs.",
    ),
    (
        ("507011",),
        "An event wait timed out on the device (507011): a replay waited for an update that never came "
        "before this capture; synchronize (Runtime.synchronize names the graph) before capturing.",
    ),
)


def advice_for(message: str) -> str:
    """The advice for a device error's ``message`` (with a leading space), or empty."""
    lowered = message.lower()
    for needles, advice in _DEVICE_ADVICE:
        if any(n in lowered for n in needles):
            return " " + advice
    return ""


def raised_at(exc: BaseException, skip: tuple[str, ...]) -> str:
    """``file:line in function`` of the deepest frame of ``exc`` outside the ``skip``
    folders (torch's and the device's own code): where the callable went wrong.  Never
    empty: the traceback starts in :meth:`CaptureManager.capture`."""
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    f = mine[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def capture_failed(
    where: str, layer: str | None, tasks: Sequence[TaskRecord], cause: BaseException, library: tuple[str, ...]
) -> CaptureFailed:
    """The error of a capture of ``where`` the callable (or the device) failed, in ``layer``
    (None: between attention calls, after ``tasks``): where, and what to do."""
    last = tasks[-1].layer if tasks else None
    at = (
        f" in layer {layer!r}"
        if layer
        else (f" after layer {last!r} (the last attention call recorded)" if last else "")
    )
    return CaptureFailed(
        f"capture of {where} failed{at} at {raised_at(cause, library)}: "
        f"{type(cause).__name__}: {str(cause).rstrip('.')}. Nothing was registered for this key."
        + advice_for(str(cause))
    )
