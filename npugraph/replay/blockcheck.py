"""Block-id checks of device-resident block tables, run on the device and read once.

The host must not read a table in device memory (a read would synchronize), so a step's
check is queued on the device (:class:`BlockIdCheck`) and its flag is
read at the next synchronize, when the device is idle and the read costs nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import torch

__all__ = ["FLAG_SLOTS", "BadColumns", "BlockIdCheck", "DeferredBlockChecks", "DeferredCheck"]


@attrs.frozen(kw_only=True, eq=False)
class BlockIdCheck:
    """The device-side check of the block ids a step uses in a device-resident table.

    Reading a device table on the host would synchronize, so the check is device work
    whose result the host reads later, once the device is idle.  It sends nothing from the
    host: per request it finds the first column of the table's row that holds an id
    outside the cache (four ops: ``clamp``, ``ne``, ``where`` of a descending weight per
    column, ``amax`` over the row), and the host, when it reads that column, compares it
    with the blocks the request uses.  Nothing is cached between steps; ``weights``
    (``columns - j`` at column ``j``) and ``zeros`` are made once per table width, so that
    every operand is device memory (a Python 0 would be made a scalar tensor per step).
    """

    weights: torch.Tensor
    zeros: torch.Tensor

    @classmethod
    def on(cls, memory: torch.device, cols: int) -> BlockIdCheck:
        """A check of tables of up to ``cols`` columns on ``memory``."""
        return cls(
            weights=torch.arange(cols, 0, -1, dtype=torch.int32, device=memory),
            zeros=torch.zeros(cols, dtype=torch.int32, device=memory),
        )

    def flag(self, table: torch.Tensor, kv: Sequence[int], block_size: int, num_blocks: int) -> BadColumns:
        """Where the first ``len(kv)`` rows of ``table`` first hold an id outside
        ``[0, num_blocks)``, on the device (read it later with :meth:`BadColumns.locate`).

        ``kv``: the key lengths of at least one request, each within the table's columns
        (kept until the result is read, not copied: pass a tuple).  Device work only: no
        host read, no copy.
        """
        width = -(-max(kv) // block_size)
        ids = table[: len(kv), :width]
        outside = ids.clamp(0, num_blocks - 1).ne(ids)
        scores = torch.where(outside, self.weights[:width], self.zeros[:width]).amax(dim=1)
        return BadColumns(scores=scores, kv=kv, block_size=block_size, columns=int(self.weights.shape[0]))


@attrs.frozen(kw_only=True, eq=False)
class BadColumns:
    """Per request of one step, the first column of its table row that holds an id outside
    the cache, on the device until the host reads it: ``scores[i]`` is ``columns - j`` for
    that column ``j``, 0 where the row has none.  A column counts only if the request reads
    it (``j * block_size < kv[i]``): what lies beside the blocks in use is never read."""

    scores: torch.Tensor
    kv: Sequence[int]
    block_size: int
    columns: int

    def first_in_use(self, scores: list[int]) -> tuple[int, int] | None:
        """The first ``(request, column)`` that reads an id outside the cache, from the
        read ``scores`` (a row's first bad column is its only candidate: any earlier
        column of the row is good)."""
        for i, score in enumerate(scores):
            if score and (self.columns - score) * self.block_size < self.kv[i]:
                return i, self.columns - score
        return None

    @staticmethod
    def locate(checks: list[BadColumns]) -> list[tuple[int, int] | None]:
        """For each check, its first ``(request, column)`` in use holding an id outside
        the cache, or None.  One host read per memory they lie in (call it once the device
        is idle: it would synchronize otherwise; host tables checked with
        ``defer_block_check=True`` leave theirs in host memory)."""
        by_memory: dict[torch.device, list[int]] = {}
        for k, check in enumerate(checks):
            by_memory.setdefault(check.scores.device, []).append(k)
        found: list[tuple[int, int] | None] = [None] * len(checks)
        for ks in by_memory.values():
            read = torch.cat([checks[k].scores for k in ks]).tolist()
            at = 0
            for k in ks:
                n = int(checks[k].scores.shape[0])
                scores = read[at : at + n]
                at += n
                if any(scores):
                    found[k] = checks[k].first_in_use(scores)
        return found


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
