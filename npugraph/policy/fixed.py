"""A policy that always picks one kernel (benchmarks and tests)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

from npugraph.ops import AttentionCall
from npugraph.policy.choice import KernelChoice

__all__ = ["FixedPolicy"]


@attrs.frozen
class FixedPolicy:
    """Always ``kernel`` ("pa" or "fia")."""

    kernel: str = attrs.field(validator=attrs.validators.in_(("pa", "fia")))

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        return KernelChoice(kernel=self.kernel, reason=f"fixed: {self.kernel}")
