"""A capture's tiling-sink path: where FIA reads its lengths and plan from device memory.

What the capture manager asks of it, each once: whether a call's FIA becomes the sink kernel
(:func:`upgrade`), the :class:`~npugraph.ops.LensGroup` and event a sink task is captured with
(:meth:`SinkCapture.buffers`, :meth:`SinkCapture.wait_event`), and, once the graph is
captured, whether it must be captured again (more room for its lengths, :meth:`SinkCapture.room`;
the path refused, :func:`refusal`) or stands, its last sink task recording the shared event
(:func:`mark_recorder`).  The kernel's own launch, metadata op and plan arguments are its
declaration's (``npugraph/ops/fia_sink.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from npugraph.capture.events import EventSchedule
from npugraph.capture.records import TaskRecord
from npugraph.device import Device
from npugraph.errors import CaptureFailed
from npugraph.ops import FIA_FROZEN, FIA_SINK, MIN_BLOCK, AttentionCall, LensArena, LensGroup, OpSpec
from npugraph.policy import KernelChoice

__all__ = ["SINK_MIN_LAYERS", "SinkCapture", "check_width", "frozen", "mark_recorder", "refusal", "upgrade"]

# Below this many attention layers a graph keeps FIA's per-layer update: one FIA layer's
# update costs ~184 us of host time (begin + re-issue + end + record, vllm-ascend #13058),
# the tiling-sink step ~150-190 us of launches for the metadata op and the length copy
# (#15336) plus one event record, so the sink path saves host time from the second layer.
SINK_MIN_LAYERS = 2


@attrs.define
class SinkCapture:
    """One capture's tiling-sink state: whether FIA may take the path (``refused``: why not),
    the lengths' groups and their one ExternalEvent, the arena they come from, and the room
    the arena lacked (``short``: capture again with more)."""

    refused: str = ""
    groups: dict[tuple[Any, ...], LensGroup] = attrs.field(factory=dict)
    event: Any = None
    arena: LensArena | None = None
    short: tuple[int, int] | None = None

    @classmethod
    def start(
        cls, device: Device, enabled: bool, refused: str, room: tuple[int, int], tokens: int, width: int | None = None
    ) -> SinkCapture:
        """The state a capture starts with; where the path may be taken (or the lengths are
        frozen to ``width``), an arena of ``room`` (groups, rows) made outside the graph's
        pool (a step writes it from outside the graph)."""
        sink = cls(refused=refused)
        if width is not None or (enabled and device.device_length_ops is not None and not refused):
            groups, rows = room
            sink.arena = LensArena.make(device.memory, groups, max(rows, tokens), width=width)
        return sink

    def buffers(self, spec: OpSpec, call: AttentionCall, group: str, ubatch: int) -> LensGroup:
        """The lengths' group of ``call``'s KV-cache group (one per group, micro-batch, batch
        and plan): from the arena, or made apart where the arena is short (the capture is
        then discarded and run again with the room :meth:`room` says)."""
        assert spec.sink is not None  # the caller's test
        slot = group if ubatch == 0 else f"{group}#ubatch{ubatch}"
        plan_args = spec.sink.plan_args(call)
        batch = int(call.block_table.shape[0])
        gkey = (slot, batch, tuple(sorted(plan_args.items())))
        found = self.groups.get(gkey)
        if found is None:
            bs = call.block_size
            found = self.arena.take(batch, plan_args, slot, block_size=bs) if self.arena is not None else None
            if found is None:
                groups, rows = self.short or (0, 0)
                self.short = (max(groups, len(self.groups) + 1), max(rows, batch))
                width = self.arena.width if self.arena is not None else None
                found = LensGroup.make(call.query.device, batch, plan_args, slot, width=width, block_size=bs)
            self.groups[gkey] = found
        return found

    def wait_event(self, device: Device, stream: Any, name: str) -> tuple[Any, bool]:
        """The graph's one event of its sink tasks, and whether this task is the first (the
        graph waits for it there, once)."""
        first = self.event is None
        if first:
            self.event = device.npu.ExternalEvent()
            self.event.wait(stream)
            device.name_in_reports(self.event, f"{name}/device lengths")
        return self.event, first

    def room(self) -> tuple[int, int] | None:
        """The (groups, rows) the arena lacked, or None where it held every group."""
        return self.short


def upgrade(
    device: Device, enabled: bool, sink: SinkCapture, where: str, choice: KernelChoice, call: AttentionCall
) -> KernelChoice:
    """FIA with host lengths becomes the tiling-sink kernel where that is possible; a
    tiling-sink kernel chosen as it is must be possible; the update-free one is no policy's."""
    if choice.kernel == "fia_frozen":  # its width is the capture's (Runtime.capture(width=W))
        raise CaptureFailed(f"capture of {where}: fia_frozen is captured with width=W, not chosen by a policy")
    if choice.kernel != "fia_sink" and (choice.fixed or choice.kernel not in ("fia", "fia_v2")):
        return choice
    why: str | None
    if device.device_length_ops is None:
        why = "the device has no tiling-sink FIA (torch.ops._C_ascend without PRs #15215/#15336)"
    else:
        why = FIA_SINK.unsupported(call)
    if choice.kernel == "fia_sink":
        if why is not None:
            raise CaptureFailed(
                f"capture of {where}: the kernel policy chose fia_sink, but {why}; "
                "choose fia (lengths updated per layer) for this graph"
            )
        return choice
    if not enabled:
        return choice
    if why is None and sink.refused:
        why = sink.refused
    if why is None:
        return KernelChoice(kernel="fia_sink", reason=f"{choice.reason}; lengths on the device, no per-layer update")
    return KernelChoice(kernel=choice.kernel, reason=f"{choice.reason}; per-layer update: {why}")


def check_width(where: str, width: int | None, max_model_len: int) -> None:
    """An update-free capture's width: keys, at most max_model_len (before any device call)."""
    if width is None:
        return
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise CaptureFailed(f"capture of {where}: width must be an int >= 1 (keys), got {width!r}")
    if width > max_model_len:
        raise CaptureFailed(f"capture of {where}: width {width} is over max_model_len={max_model_len}")


def frozen(where: str, layer: str | None, call: AttentionCall, width: int) -> KernelChoice:
    """The update-free kernel of a capture at ``width`` (lengths frozen, read from its
    :class:`~npugraph.ops.LensGroup` as the tiling sink's are), or why it cannot run ``call``."""
    why = FIA_FROZEN.unsupported(call)
    bs, cols = call.block_size, int(call.block_table.shape[1])
    if why is None and bs % MIN_BLOCK:
        why = f"the block size {bs} is not a multiple of {MIN_BLOCK} (CANN's FIA decode takes 16-aligned blocks)"
    if why is None and width % bs:
        why = f"the width {width} is not a whole number of blocks of {bs} (the mask covers whole blocks)"
    if why is None and width > cols * bs:
        why = f"the width {width} is more keys than the block table's {cols} columns of {bs} hold"
    if why is not None:
        raise CaptureFailed(
            f"capture of {where}: update-free at width {width} cannot run layer {layer!r}: {why}; "
            "capture this size without a width (lengths updated per step)"
        )
    return KernelChoice(
        kernel="fia_frozen",
        reason=f"update-free: lengths frozen to {width} keys, the real ones masked on the device",
        fixed=True,
    )


def refusal(
    tasks: Sequence[TaskRecord], choices: Iterable[KernelChoice], schedule: EventSchedule | None, where: str
) -> str:
    """Why a captured graph's sink tasks must read their lengths from the host after all
    (capture it again so), or "" where they stand: too few of them to save host time, or
    mixed with per-layer tasks under event grouping.  A policy that forced the sink kernel
    is taken as it is, and refused with per-layer tasks under event grouping."""
    on_device = sum(t.lens is not None for t in tasks)
    forced = any(c.fixed and c.kernel in ("fia_sink", "fia_frozen") for c in choices)
    mixed = on_device and schedule is not None and on_device < len(tasks)
    if forced and mixed:
        raise CaptureFailed(
            f"capture of {where}: the kernel policy chose fia_sink for some layers and "
            "another kernel, updated per layer, for others, with event grouping on; capture with "
            "event_group=1 or one kernel for every layer"
        )
    if forced:
        return ""
    if on_device and on_device < SINK_MIN_LAYERS:
        return (
            f"{on_device} attention layer(s): below the {SINK_MIN_LAYERS} from which the "
            "tiling-sink path saves host time"
        )
    if mixed:
        return "the graph mixes tiling-sink and per-layer tasks, and event grouping is on"
    return ""


def mark_recorder(tasks: list[TaskRecord]) -> None:
    """The graph's last tiling-sink task records the shared event (each was captured not recording)."""
    on_device = [t.index for t in tasks if t.lens is not None]
    if on_device:
        tasks[on_device[-1]] = attrs.evolve(tasks[on_device[-1]], records=True)
