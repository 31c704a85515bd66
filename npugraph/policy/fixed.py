"""A policy that always picks one kernel (benchmarks and tests)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

from npugraph.ops import AttentionCall
from npugraph.policy.choice import KernelChoice

__all__ = ["FixedPolicy"]


@attrs.frozen
class FixedPolicy:
    """Always ``kernel`` (``"pa"``, ``"fia"``, ``"fia_v2"``, ``"fia_sink"`` or ``"mla"``), as it is:
    ``"fia"`` stays FIA with host lengths, updated per layer."""

    kernel: str = attrs.field(validator=attrs.validators.in_(("pa", "fia", "fia_v2", "fia_sink", "mla")))

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        return KernelChoice(kernel=self.kernel, reason=f"fixed: {self.kernel}", fixed=True)
