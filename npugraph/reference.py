"""An independent reference for paged decode attention, in float64.

It shares no code with npugraph's padding, conversion, op declarations or the
simulator's kernels: each real request's keys and values are gathered position by
position from the block table, and attention is computed with a plain float64
softmax.  Tests and ``npugraph selftest`` compare replayed outputs with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["paged_attention_reference"]


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    query_lens: Sequence[int] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of each real request's query tokens over its own cached keys (float64).

    ``query`` ``[T, N, D]`` holds the requests' tokens back to back (``query_lens``
    each, default 1); caches ``[num_blocks, block_size, KVN, D]``; ``block_table``
    ``[R, cols]``; ``seq_lens[r]`` counts this step's tokens.  A request's query token
    ``i`` of ``q`` sees key positions ``<= seq_len - q + i`` (causal, bottom-right), and
    with a sliding ``window`` only the last ``window`` of those.  For absorbed MLA pass the
    concatenated latent+rope query and keys, and the latent cache as values.
    Returns ``[sum(query_lens), N, Dv]`` float64.
    """
    n = query.shape[1]
    kvn = key_cache.shape[2]
    group = n // kvn
    block_size = key_cache.shape[1]
    qlens = list(query_lens) if query_lens is not None else [1] * len(seq_lens)
    table = block_table.to("cpu").tolist()
    q64 = query.to("cpu", torch.float64)
    kc, vc = key_cache.to("cpu", torch.float64), value_cache.to("cpu", torch.float64)
    outs = []
    start = 0
    for r, (length, ql) in enumerate(zip(seq_lens, qlens)):
        rows = []
        for p in range(length):
            b = table[r][p // block_size]
            rows.append((kc[b, p % block_size], vc[b, p % block_size]))
        for i in range(ql):
            visible = length - ql + i + 1
            first = max(0, visible - window) if window is not None else 0
            q = q64[start + i]  # [N, D]
            o = torch.zeros(n, vc.shape[-1], dtype=torch.float64)
            if visible > first:
                k = torch.stack([rows[p][0] for p in range(first, visible)])  # [L, KVN, D]
                v = torch.stack([rows[p][1] for p in range(first, visible)])
                for h in range(n):
                    s = (k[:, h // group] @ q[h]) * scale
                    w = torch.softmax(s, dim=0)
                    o[h] = w @ v[:, h // group]
            outs.append(o)
        start += ql
    return torch.stack(outs) if outs else torch.zeros(0, n, vc.shape[-1], dtype=torch.float64)
