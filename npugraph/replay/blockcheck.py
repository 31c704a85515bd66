"""Block-id checks of device-resident block tables, run on the device and read once.

The host must not read a table in device memory (a read would synchronize), so a step's
check is queued on the device (:class:`~npugraph.replay.lens.BlockIdCheck`) and its flag is
read at the next synchronize, when the device is idle and the read costs nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import torch

from npugraph.replay.lens import BadColumns, BlockIdCheck

__all__ = ["FLAG_SLOTS", "DeferredBlockChecks", "DeferredCheck"]

FLAG_SLOTS = 64  # deferred block-id checks remembered between two synchronizes


@attrs.frozen(kw_only=True)
class DeferredCheck:
    """A block-id check of a device-resident table, run on the device."""

    table: Any
    kv: tuple[int, ...]
    block_size: int
    num_blocks: int
    columns: int  # the graph's block-table buffer's: bounds the columns checked
    step: int  # the graph's step it checks
    where: str  # the graph and layer


class DeferredBlockChecks:
    """The queued checks of recent steps (the last :data:`FLAG_SLOTS`), and their constants."""

    def __init__(self) -> None:
        # (step, graph and layer, each request's first bad column, on the device) of the
        # recent deferred checks, oldest first (the message is made only if one fails)
        self._flags: deque[tuple[int, str, BadColumns]] = deque(maxlen=FLAG_SLOTS)
        # their constants, one per table memory and width, made on first use
        self._checks: dict[tuple[torch.device, int], BlockIdCheck] = {}

    def flag(self, check: DeferredCheck) -> None:
        """Queue the device-side block-id check of one table (no host read)."""
        memory = check.table.device  # the table's (a host table with defer_block_check=True)
        key = (memory, check.columns)
        found = self._checks.get(key)
        if found is None:
            found = self._checks[key] = BlockIdCheck.on(memory, check.columns)
        bad = found.flag(check.table, check.kv, check.block_size, check.num_blocks)
        self._flags.append((check.step, check.where, bad))

    def take_flagged(self) -> str:
        """Read (once) the deferred block-id checks: what the first that failed says, or ''."""
        if not self._flags:
            return ""
        checks = list(self._flags)
        self._flags.clear()
        found = BadColumns.locate([bad for _, _, bad in checks])  # one host read
        hits = [k for k, at in enumerate(found) if at is not None]
        if not hits:
            return ""
        more = f" (and {len(hits) - 1} later check(s))" if len(hits) > 1 else ""
        step, where, _ = checks[hits[0]]
        at = found[hits[0]]
        assert at is not None
        i, j = at
        return (
            f"step {step} of {where}: a block id in use in its device-resident block table is not a block of "
            f"the KV cache (block_table[{i}, {j}]: request {i}'s block {j}){more}"
        )
