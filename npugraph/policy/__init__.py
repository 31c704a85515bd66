"""Which attention kernel each captured graph uses (PA for small batches, FIA above)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import attrs

from npugraph.capture.manager import KernelChoice
from npugraph.ops import PA, AttentionCall

__all__ = ["StaticPolicy", "DEFAULT_PA_SIZES"]

DEFAULT_PA_SIZES = frozenset({1, 2, 3, 4})


@attrs.frozen
class StaticPolicy:
    """PA for padded token counts in ``pa_sizes``, FIA otherwise.

    FIA always when a graph is not decode-only (more than one query token per request,
    e.g. speculative verification) or when PA cannot run the head size or dtype.
    The same rule as vllm-ascend's ``pa_shape_list`` (default ``[1, 2, 3, 4]``).
    """

    pa_sizes: frozenset[int] = attrs.field(default=DEFAULT_PA_SIZES, converter=frozenset)

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        """Pick the kernel for the graph of ``(namespace, key)`` with ``tokens`` tokens."""
        reason = _pa_blocker(calls)
        if reason is not None:
            return KernelChoice(kernel="fia", reason=reason)
        if tokens in self.pa_sizes:
            return KernelChoice(kernel="pa", reason=f"static: size {tokens} in pa_sizes {sorted(self.pa_sizes)}")
        return KernelChoice(kernel="fia", reason=f"static: size {tokens} not in pa_sizes {sorted(self.pa_sizes)}")


def _pa_blocker(calls: Iterable[AttentionCall]) -> str | None:
    for call in calls:
        why = PA.unsupported(call)
        if why is not None:
            return why
    return None
