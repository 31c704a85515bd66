"""MLA: FIA with rope arguments (absorbed multi-head latent attention, DeepSeek-style).

``query`` is the latent-space query (``q_nope`` after absorbing W_UK), ``query_rope`` its
rope part; the cache holds one latent vector per token (``key`` and ``value`` are the same
latent cache) and a separate rope cache (``key_rope``); one KV head.  The same kernel,
arguments and host-side lengths as :mod:`npugraph.ops.fia` — only the declaration's name,
what it can run, and the rope arguments differ.
"""

from __future__ import annotations

import attrs

from npugraph.ops.base import AttentionCall
from npugraph.ops.fia import FIA

__all__ = ["MLA"]


def _unsupported(call: AttentionCall) -> str | None:
    if not call.is_mla or call.key_rope_cache is None:
        return "mla needs query_rope and key_rope_cache (absorbed MLA)"
    if call.num_kv_heads != 1:
        return f"MLA has one latent KV head, got {call.num_kv_heads}"
    return None


# FIA's declaration with another name and what it can run: the rope arguments come from
# the call (fia_arguments), and the 4-in-1 update forwards every keyword, rope included.
MLA = attrs.evolve(FIA, name="mla", unsupported=_unsupported)
