"""The default kernel policy: PA for small padded sizes, FIA otherwise."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import attrs

from npugraph.ops import PA, AttentionCall
from npugraph.policy.choice import KernelChoice

__all__ = ["DEFAULT_PA_SIZES", "StaticPolicy", "mla_choice", "pa_blocker"]

DEFAULT_PA_SIZES = frozenset({1, 2, 3, 4})


def pa_blocker(calls: Iterable[AttentionCall]) -> str | None:
    """Why PA cannot run one of ``calls`` (phrased as the reason FIA is used), or None."""
    for call in calls:
        why = PA.unsupported(call)
        if why is not None:
            return f"FIA: {why}"
    return None


def _size_set(sizes: Iterable[int]) -> frozenset[int]:
    return frozenset(int(s) for s in sizes)


def mla_choice(calls: Iterable[AttentionCall]) -> KernelChoice | None:
    """The MLA declaration for calls with rope arguments (no other kernel can run them)."""
    if any(c.is_mla for c in calls):
        return KernelChoice(kernel="mla", reason="MLA (query_rope): FIA with rope arguments; PA cannot run MLA")
    return None


@attrs.frozen
class StaticPolicy:
    """PA for padded token counts in ``pa_sizes``, FIA otherwise (unless PA cannot run).

    ``fia`` names the FIA declaration to use: ``"fia"`` (v1, the default) or ``"fia_v2"``.
    MLA calls always take the ``"mla"`` declaration.
    """

    pa_sizes: frozenset[int] = attrs.field(default=DEFAULT_PA_SIZES, converter=_size_set)
    fia: str = attrs.field(default="fia", validator=attrs.validators.in_(("fia", "fia_v2")))

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        """Pick the kernel for the graph of ``(namespace, key)`` with ``tokens`` tokens."""
        mla = mla_choice(calls)
        if mla is not None:
            return mla
        reason = pa_blocker(calls)
        if reason is not None:
            return KernelChoice(kernel=self.fia, reason=reason)
        if tokens in self.pa_sizes:
            return KernelChoice(kernel="pa", reason=f"static: size {tokens} in pa_sizes {sorted(self.pa_sizes)}")
        return KernelChoice(kernel=self.fia, reason=f"static: size {tokens} not in pa_sizes {sorted(self.pa_sizes)}")
