"""torch's stream surface over the simulator's streams: ``torch.npu.stream``'s context, and
``Tensor.record_stream`` taking a simulated stream."""

from __future__ import annotations

from typing import Any

from npusim.runtime.state import Stream, get_state

__all__ = ["StreamContext", "accept_record_stream"]


def accept_record_stream() -> None:
    """Let ``Tensor.record_stream`` take the simulator's streams, as torch_npu's NPU streams are
    torch streams (SGLang records its device-to-host copies on the current stream).

    On hardware the call keeps the caching allocator from reusing the tensor's block until
    the stream's work so far is done; on the simulator queued work holds its tensors until
    it runs, so there is nothing more to keep.  What this does not catch: a program that
    needs ``record_stream`` and lacks it (the simulator is kinder there)."""
    import torch

    original = torch.Tensor.record_stream
    if getattr(original, "_npugraph_sim", False):
        return

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, Stream):
            return None
        return original(self, stream)

    record_stream._npugraph_sim = True  # type: ignore[attr-defined]
    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign, assignment]


class StreamContext:
    """Make ``stream`` current for the block (``torch.npu.stream`` / ``torch.npu.StreamContext``;
    ``None``: no change); the stream before it is current again after.  Reusable: SGLang makes
    one and enters it every step."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = stream
        self._before: list[Stream] = []

    def __enter__(self) -> None:
        st = get_state()
        self._before.append(st.current_stream)
        if self.stream is not None:
            st.current_stream = self.stream

    def __exit__(self, *exc: object) -> None:
        get_state().current_stream = self._before.pop()
