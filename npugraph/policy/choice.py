"""What a kernel policy returns, and what every policy provides."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import attrs

from npugraph.ops import AttentionCall

__all__ = ["KernelChoice", "KernelPolicy"]


@attrs.frozen(kw_only=True)
class KernelChoice:
    """The attention kernel of one graph (``"pa"``, ``"fia"``, ``"fia_sink"``, or ``"none"``), and why.

    ``fixed``: take it as it is.  Otherwise capture turns ``"fia"`` / ``"fia_v2"`` into
    ``"fia_sink"`` (lengths on the device) where the device and the call allow it.
    """

    kernel: str
    reason: str
    fixed: bool = False


class KernelPolicy(Protocol):
    """Picks PA or FIA for the calls of one graph; consulted at capture only."""

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice: ...
