"""Real math for the simulated attention kernels, and their workspace models.

Numerics (both kernels): scores ``scale * q·k`` and the softmax in float32; the
probabilities are cast to the input dtype before the product with V, which is
accumulated in float32 and cast back.  Requests are vectorised (a paged cache gathered a
row per position, one batched matmul; a paged FIA in runs of requests sized to the host's
caches, each padded to the batch's longest context so the bits are one run's); no Python
loop runs per token.

Workspace models (bytes).  PA's depends on the *current* lengths and is not
monotonic: short sequences take a split-KV ("flash decoding") path that spreads each
request over the idle cores, so a batch of short sequences can need more scratch
than the same batch at 6144 tokens (the effect vllm-ascend hit in PR #3986).  FIA's
``get_max_workspace`` is a true maximum over lengths for the given shapes.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "AI_CORES",
    "attention",
    "gather_paged",
    "pa_workspace_bytes",
    "fia_workspace_bytes",
]

AI_CORES = 24  # Atlas A2/A3 vector cores used by the split-KV decision
_WS_BASE = 16 * 1024


def pa_workspace_bytes(tokens: int, heads: int, kv_heads: int, v_head_size: int, max_len: int) -> int:
    """Scratch PA needs for ``tokens`` requests whose longest context is ``max_len``."""
    if max_len <= 0:
        return _WS_BASE
    if max_len <= 1024:
        # split-KV: fill the idle cores with pieces of each (short) request
        splits = max(1, math.ceil(AI_CORES / max(1, tokens * kv_heads)))
    else:
        splits = math.ceil(max_len / 2048)
    return _WS_BASE + tokens * heads * splits * (v_head_size + 2) * 4


def fia_workspace_bytes(rows: int, heads: int, v_head_size: int, max_kv_len: int) -> int:
    """Scratch FIA needs for ``rows`` query rows attending to at most ``max_kv_len`` keys."""
    splits = min(16, max(1, math.ceil(max_kv_len / 1024)))
    return 4 * _WS_BASE + rows * heads * splits * (v_head_size + 2) * 4


def gather_paged(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    block_size: int,
    arg: str,
) -> torch.Tensor:
    """Gather positions ``[0, max_len)`` of every request from a paged cache.

    ``cache`` is ``[num_blocks, block_size, ...]``; returns ``[B, max_len, ...]``.
    Block ids of valid positions are range-checked (``arg`` names the table); positions
    past a request's length read block 0 (at the same offset) and are masked by the caller.

    Positions are gathered as rows of the cache seen as one row per position
    (``index_select``, a copy per row): torch's advanced indexing with a block and a position
    index cost most of a decode kernel's device time.  A cache whose blocks and positions are
    not one run of memory (FIA's ``[blocks, KV heads, block size, D]`` seen as
    ``[blocks, block size, KV heads, D]``) is gathered by whole blocks.
    """
    num_blocks = cache.shape[0]
    b = block_table.shape[0]
    cols = -(-max_len // block_size)
    blk = block_table[:, :cols].long()  # [B, cols]
    valid_col = (torch.arange(cols, device=cache.device) * block_size).unsqueeze(0) < lens.unsqueeze(1)
    bad = valid_col & ((blk < 0) | (blk >= num_blocks))
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{arg}: request {r} position {c * block_size} maps to block id {int(blk[r, c])}, outside "
            f"[0, {num_blocks}) (the cache has {num_blocks} blocks)"
        )
    pos = torch.arange(max_len, device=cache.device)
    offset = pos % block_size
    past = pos.unsqueeze(0) >= lens.unsqueeze(1)  # [B, max_len]
    rest = cache.shape[2:]
    try:
        rows = cache.view(num_blocks * block_size, -1)  # one row per position of the cache
    except RuntimeError:  # blocks and positions not one run of memory (a permuted cache)
        rows = None
    if rows is not None:
        at = torch.where(past, offset.unsqueeze(0), blk[:, pos // block_size] * block_size + offset)
        return rows.index_select(0, at.view(-1)).view(b, max_len, *rest)
    blk = torch.where(valid_col, blk, torch.zeros_like(blk))
    out = cache.index_select(0, blk.view(-1)).view(b, cols * block_size, *rest)[:, :max_len]
    return torch.where(past.view(b, max_len, *([1] * len(rest))), cache[0][offset], out)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    band: tuple[int, int] | None = None,
    sink: torch.Tensor | None = None,
    mask_fill: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked multi-head attention with GQA.

    ``q`` ``[B, N, Sq, D]``, ``k`` ``[B, KVN, Sk, D]``, ``v`` ``[B, KVN, Sk, Dv]``;
    ``q_lens``/``kv_lens`` ``[B]`` valid lengths.  ``causal`` anchors the diagonal
    bottom-right (query i of Lq sees key j iff ``j <= i + Lk - Lq``); ``band`` ``(pre, next)``
    keeps keys with ``-pre <= j - (i + Lk - Lq) <= next``; ``mask``
    (True = masked) broadcasts to ``[B, 1, Sq, Sk]``.  ``sink`` ``[N]``: a learnable
    attention-sink logit per head, one more term of the softmax's denominator that adds
    nothing to the output (gpt-oss).  Rows with no visible key give zeros.  ``mask_fill``: the
    score ``mask`` sets instead of removing the key (CANN's decode kernel adds -1e12: a row whose
    keys are all masked then weighs them alike, where removing them would give zeros).  Returns ``(out [B, N, Sq, Dv] in q.dtype, lse [B, N, Sq] float32)``.
    """
    b, n, sq, d = q.shape
    kvn, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if sk == 0:  # no request has a key (an empty step): every row is zeros
        return q.new_zeros(b, n, sq, dv), torch.full((b, n, sq), float("-inf"), device=q.device)
    g = n // kvn
    qf = q.float().reshape(b, kvn, g * sq, d)
    s = torch.matmul(qf, _float(k).transpose(-1, -2)).reshape(b, kvn, g, sq, sk) * scale
    qi = torch.arange(sq, device=q.device).view(1, sq, 1)
    kj = torch.arange(sk, device=q.device).view(1, 1, sk)
    ql = q_lens.view(b, 1, 1).long()
    kl = kv_lens.view(b, 1, 1).long()
    allowed = (kj < kl) & (qi < ql)
    if causal:
        allowed = allowed & (kj <= qi + (kl - ql))
    if band is not None:  # (pre, next) around the bottom-right diagonal
        off = kj - (qi + (kl - ql))
        allowed = allowed & (off >= -band[0]) & (off <= band[1])
    allowed = allowed.view(b, 1, 1, sq, sk)
    masked = None
    if mask is not None:
        m = mask.bool()
        while m.dim() < 4:
            m = m.unsqueeze(0)
        masked = m.reshape(m.shape[0], 1, 1, m.shape[-2], m.shape[-1])
        if mask_fill is None:
            allowed = allowed & ~masked
    s = s.masked_fill(~allowed, float("-inf"))
    if masked is not None and mask_fill is not None:
        s = s.masked_fill(masked & allowed, mask_fill)
    mx = s.amax(dim=-1, keepdim=True)
    sinks = None
    if sink is not None:
        sinks = sink.float().reshape(1, kvn, g, 1, 1)
        mx = torch.maximum(mx, sinks)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks - mx)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = torch.where(denom > 0, mx + torch.log(denom), torch.full_like(denom, float("-inf")))
    pv = p.to(q.dtype).float().reshape(b, kvn, g * sq, sk)
    o = torch.matmul(pv, _float(v)).reshape(b, kvn, g, sq, dv)
    return o.reshape(b, n, sq, dv).to(q.dtype), lse.reshape(b, n, sq)


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous float32, whatever its layout: a permuted view's ``float()`` keeps its
    strides and the matmul then copies it once more.  Contiguous always, because the layout
    picks BLAS's kernel and so the order of its sums: a cache's layout must not change the
    bits.  (``to`` returns a float32 view as it is, hence the ``contiguous``.)"""
    return x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()
