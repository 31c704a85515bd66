"""Per-step attention metadata and its conversion to the host lengths kernels take."""

from __future__ import annotations

import attrs
import torch

from npugraph.errors import MetadataError
from npugraph.ops.base import StepLens

__all__ = ["AttentionMetadata", "pad_lens", "convert"]


@attrs.frozen(kw_only=True, eq=False)
class AttentionMetadata:
    """What an attention backend provides per step for one KV-cache group.

    * ``seq_lens``: CPU int32 ``[R]``, key length of each request *including* this
      step's tokens;
    * ``block_table``: int32 ``[R, cols]`` (host or device): the request's KV blocks;
    * ``query_start_loc``: CPU int32 ``[R + 1]`` cumulative query starts, or ``None``
      for plain decode (one token per request).

    The runtime pads all of it to the captured size itself (padding requests get
    length 0 and produce zeros).
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


def pad_lens(
    kv_lens: tuple[int, ...] | list[int],
    q_ends: tuple[int, ...] | list[int] | None,
    batch: int,
    tokens: int,
) -> StepLens:
    """Pad ``R`` requests' lengths to ``batch`` requests and ``tokens`` query tokens."""
    r = len(kv_lens)
    kv = tuple(kv_lens) + (0,) * (batch - r)
    q = tuple(range(1, r + 1)) if q_ends is None else tuple(q_ends)
    last = q[-1] if q else 0
    pad = batch - r
    if pad:
        # Spread the padding tokens evenly over the padding requests (one each in
        # plain decode), so a padded step has the same shapes however many are real.
        per, extra = divmod(tokens - last, pad)
        ends = []
        for i in range(pad):
            last += per + (1 if i >= pad - extra else 0)
            ends.append(last)
        q = q + tuple(ends)
    elif q and q[-1] != tokens:
        q = (*q[:-1], tokens)  # the last request absorbs padding tokens
    return StepLens(kv_lens=kv, q_ends=q, num_reqs=r)


def convert(
    meta: AttentionMetadata,
    *,
    batch: int,
    tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    capacity_blocks: int,
    where: str,
    validate: bool = True,
) -> StepLens:
    """Validate ``meta`` against a captured graph and pad it to that graph's size.

    ``where`` names the graph and layer in error messages.
    """
    kv = meta.seq_lens.tolist()
    r = len(kv)
    if r > batch:
        raise MetadataError(
            f"{where}: {r} requests do not fit the captured batch of {batch}; pick a key whose size covers the batch"
        )
    q_ends = None
    if meta.query_start_loc is not None:
        qsl = meta.query_start_loc.tolist()
        if len(qsl) != r + 1 or qsl[0] != 0:
            raise MetadataError(f"{where}: query_start_loc must have R+1={r + 1} entries starting at 0, got {qsl[:8]}")
        q_ends = qsl[1:]
        if q_ends and q_ends[-1] > tokens:
            raise MetadataError(f"{where}: {q_ends[-1]} query tokens do not fit the captured {tokens}")
    elif r > tokens:
        raise MetadataError(f"{where}: {r} decode tokens do not fit the captured {tokens}")
    if validate and r:
        longest = max(kv)
        shortest = min(kv)
        cols = int(meta.block_table.shape[1]) if meta.block_table.dim() == 2 else -1
        if meta.block_table.dim() != 2 or int(meta.block_table.shape[0]) < r:
            raise MetadataError(f"{where}: block_table must be [R={r}, cols], got {list(meta.block_table.shape)}")
        if meta.block_table.dtype != torch.int32:
            raise MetadataError(f"{where}: block_table must be int32, got {meta.block_table.dtype}")
        if shortest < 0:
            raise MetadataError(f"{where}: seq_lens has a negative entry ({shortest})")
        if longest > max_model_len:
            i = kv.index(longest)
            raise MetadataError(f"{where}: seq_lens[{i}] = {longest} exceeds max_model_len={max_model_len}")
        cap = min(cols, capacity_blocks) * block_size
        if longest > cap:
            i = kv.index(longest)
            raise MetadataError(
                f"{where}: seq_lens[{i}] = {longest} needs more than the {min(cols, capacity_blocks)} "
                f"blocks of {block_size} tokens the block table holds"
            )
        if meta.block_table.device.type == "cpu":
            _check_block_ids(meta.block_table, kv, block_size, num_blocks, where)
    return pad_lens(kv, q_ends, batch, tokens)


def _check_block_ids(table: torch.Tensor, kv: list[int], block_size: int, num_blocks: int, where: str) -> None:
    """Every block a request uses (the first ceil(len / block_size) columns) must exist."""
    # One host read and C-level min/max per row: cheaper than a chain of small tensor ops.
    rows = table[: len(kv)].tolist()
    for i, (row, length) in enumerate(zip(rows, kv)):
        used = row[: -(-length // block_size)]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            j = next(j for j, b in enumerate(used) if b < 0 or b >= num_blocks)
            raise MetadataError(
                f"{where}: block_table[{i}, {j}] = {used[j]} is not a block id of the KV cache (0 <= id < {num_blocks})"
            )
