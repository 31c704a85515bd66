"""A step's device writes for a tiling-sink group: the device I/O a plan's frozen records hold.

A tiling-sink FIA reads its lengths from device memory, so a step writes them once per
group (not per task) and issues the group's metadata op, on the update stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from npugraph.ops import LensGroup, OpSpec

__all__ = ["LensWrite"]


@attrs.define(kw_only=True, eq=False)
class _Staging:
    """Page-locked host memory one step's lengths are copied from, and the event of that copy."""

    host: torch.Tensor
    values: Any  # its numpy view: filled without a torch op or an allocation
    event: Any
    used: bool = False


@attrs.frozen(kw_only=True, eq=False)
class LensWrite:
    """A step's write of one tiling-sink group: its lengths by one copy from page-locked
    memory, then the metadata op for its plan, on the current (update) stream.

    ``task`` is the first task reading the group: its host values are the group's.  The
    page-locked buffers form a ring: one is refilled only once the copy that last read it
    has run (its event says so, without a wait); if none has, the ring grows by one.
    """

    group: LensGroup
    spec: OpSpec
    task: int
    device: Any
    ring: list[_Staging] = attrs.field(factory=list)

    def write(self, host_values: Mapping[str, Any]) -> None:
        staging = self._free()
        for row, values in enumerate(host_values.values()):  # the spec's host values: query ends, key lengths
            staging.values[row, :] = values
        self.group.lens.copy_(staging.host, non_blocking=True)
        staging.event.record()
        staging.used = True
        self.spec.issue_metadata(self.device, self.group)

    def _free(self) -> _Staging:
        for staging in self.ring:
            if not staging.used or staging.event.query():
                return staging
        host = self.device.staged(torch.zeros(2, self.group.batch, dtype=torch.int32, device="cpu"))
        staging = _Staging(host=host, values=host.numpy(), event=self.device.npu.Event())
        self.ring.append(staging)
        return staging
