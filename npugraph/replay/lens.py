"""Per-step attention metadata and its conversion to the host lengths kernels take."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from npugraph.errors import MetadataError
from npugraph.ops.base import StepLens, batch_refusal, pad_lens

__all__ = ["AttentionMetadata", "BadColumns", "BlockIdCheck", "pad_lens", "convert", "real_requests", "real_batch"]


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


def _host_ints(value: object, name: str, where: str, *, rows: int | None = None) -> list[int]:
    """A 1-D host integer tensor as a list; anything else is a MetadataError naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise MetadataError(f"{where}: {name} must be a CPU int32 tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise MetadataError(f"{where}: {name} must be on the host (CPU), got a tensor on {value.device}")
    if value.dtype not in (torch.int32, torch.int64):
        raise MetadataError(f"{where}: {name} must be an int32 tensor, got {value.dtype}")
    if value.dim() != 1:
        raise MetadataError(f"{where}: {name} must be 1-D, got shape {list(value.shape)}")
    return value.tolist()  # type: ignore[no-any-return]


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
    validate: bool,
    tokens_per_request: int,
    check_block_ids: bool | None = None,
    table_device: torch.device | None = None,
    one_query_token: bool = False,
) -> StepLens:
    """Validate ``meta`` against a captured graph and pad it to that graph's size.

    ``where`` names the graph and layer in error messages.  The checks of shapes,
    types and query/key lengths always run; ``validate`` adds the bounds of every
    length and, when ``check_block_ids`` (default: the table is on the host), of every
    block id in use — reading a device table here would synchronize, so the updater
    checks those on the device instead (the cost grows with the blocks in use).
    Without ``query_start_loc`` every request has ``tokens_per_request`` query tokens
    (1: decode; more: speculative verification).  ``table_device``: the device's memory;
    a block table must be there or on the host.  ``one_query_token``: the kernel takes one
    query token per request (PA, FIA without a causal mask), so every real request must have
    exactly one.
    """
    if not isinstance(meta, AttentionMetadata):
        raise MetadataError(
            f"{where}: metadata must be an npugraph.AttentionMetadata, got {type(meta).__name__}; "
            "convert the engine's metadata first (npugraph.integrations.vllm does it for vLLM)"
        )
    kv = _host_ints(meta.seq_lens, "seq_lens", where)
    given = len(kv)
    r = real_requests(kv)
    kv = kv[:r]
    if r > batch:  # before the table's rows are checked against r (batch_refusal says it)
        raise MetadataError(f"{where}: {batch_refusal(batch, tokens, r, 0)}")
    table = _checked_table(meta.block_table, r, table_device, where)
    q_ends = _query_ends(meta, kv, given, tokens_per_request, where)
    refused = batch_refusal(batch, tokens, r, q_ends[-1] if q_ends else 0)
    if refused is not None:
        raise MetadataError(f"{where}: {refused}")
    # batch_refusal's one-token rule, naming the request (without query_start_loc the graph's
    # own tokens per request apply: one, for a kernel that runs one)
    if one_query_token and meta.query_start_loc is not None and list(q_ends) != list(range(1, r + 1)):
        many, n = next((i, b - a) for i, (a, b) in enumerate(itertools.pairwise([0, *q_ends])) if b - a != 1)
        raise MetadataError(
            f"{where}: request {many} has {n} query tokens, but "
            "the captured kernel runs one query token per request (PA, or FIA captured without a causal mask); "
            "run this batch on a graph captured for several tokens per request"
        )
    if validate and r:
        _check_bounds(kv, table, max_model_len, block_size, capacity_blocks, where)
        if check_block_ids if check_block_ids is not None else table.device.type == "cpu":
            _check_block_ids(table, kv, block_size, num_blocks, where)
    return pad_lens(kv, q_ends, batch, tokens)


def _checked_table(table: Any, r: int, table_device: torch.device | None, where: str) -> torch.Tensor:
    """The step's block table, refused unless int32 [>= r, cols] on the host or the device."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or int(table.shape[0]) < r:
        shape = list(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise MetadataError(f"{where}: block_table must be an int32 tensor [R={r}, cols], got {shape}")
    if table.dtype != torch.int32:
        raise MetadataError(f"{where}: block_table must be int32, got {table.dtype}")
    if table.device.type != "cpu" and (table_device is None or table.device.type != table_device.type):
        raise MetadataError(
            f"{where}: block_table is on {table.device}; it must be on the host or on the device's memory "
            f"({table_device or 'cpu'}), where the runtime copies it into the captured buffer"
        )
    return table


def _query_ends(
    meta: AttentionMetadata, kv: list[int], given: int, tokens_per_request: int, where: str
) -> tuple[int, ...] | list[int]:
    """Where each real request's query tokens end: from ``query_start_loc``, checked against
    the key lengths, or ``tokens_per_request`` each."""
    r = len(kv)
    if meta.query_start_loc is not None:
        qsl = _host_ints(meta.query_start_loc, "query_start_loc", where)
        if len(qsl) != given + 1 or qsl[0] != 0:
            raise MetadataError(
                f"{where}: query_start_loc must have R+1={given + 1} entries starting at 0, got {qsl[:8]}"
            )
        for i in range(r, given):  # trailing padding requests: only their order is checked
            if qsl[i + 1] < qsl[i]:
                raise MetadataError(f"{where}: query_start_loc must be non-decreasing, got {qsl[:8]}")
        q_ends: tuple[int, ...] | list[int] = qsl[1 : r + 1]
        for i in range(r):
            q_len = qsl[i + 1] - qsl[i]
            if q_len < 0:
                raise MetadataError(f"{where}: query_start_loc must be non-decreasing, got {qsl[:8]}")
            if q_len > kv[i]:
                raise MetadataError(
                    f"{where}: request {i} has {q_len} query tokens but seq_lens[{i}] = {kv[i]}; the key "
                    "length counts this step's tokens too"
                )
    else:  # uniform: tokens_per_request each (1: decode; more: speculative verification)
        q_ends = tuple(range(tokens_per_request, tokens_per_request * r + 1, tokens_per_request))
        # a short request: 0 <= length < tokens_per_request (negative lengths are validate's)
        short = (
            next((i for i in range(r) if 0 <= kv[i] < tokens_per_request), None)
            if kv and min(kv) < tokens_per_request
            else None
        )
        if short is not None:
            raise MetadataError(
                f"{where}: request {short} has {tokens_per_request} query token(s) but seq_lens[{short}] = "
                f"{kv[short]}; the key length counts this step's tokens too (only trailing requests of "
                "length 0 are padding)"
            )
    return q_ends


def _check_bounds(
    kv: list[int], table: torch.Tensor, max_model_len: int, block_size: int, capacity_blocks: int, where: str
) -> None:
    """Every key length non-negative, within max_model_len and within the blocks the table holds."""
    longest = max(kv)
    shortest = min(kv)
    if shortest < 0:
        raise MetadataError(f"{where}: seq_lens has a negative entry ({shortest})")
    if longest > max_model_len:
        i = kv.index(longest)
        raise MetadataError(f"{where}: seq_lens[{i}] = {longest} exceeds max_model_len={max_model_len}")
    cols = int(table.shape[1])
    cap = min(cols, capacity_blocks) * block_size
    if longest > cap:
        i = kv.index(longest)
        raise MetadataError(
            f"{where}: seq_lens[{i}] = {longest} needs more than the {min(cols, capacity_blocks)} "
            f"blocks of {block_size} tokens the block table holds"
        )


def real_requests(kv_lens: list[int]) -> int:
    """How many leading requests are real: trailing requests of key length 0 are padding.

    vLLM pads a FULL batch with requests of ``seq_len`` 0 and no query tokens; vllm-ascend
    with requests of ``seq_len`` 0 and one query token.  Both are padding rows here (their
    query tokens are spare tokens, which padding rows take).
    """
    r = len(kv_lens)
    while r and kv_lens[r - 1] == 0:
        r -= 1
    return r


def real_batch(meta: AttentionMetadata, tokens_per_request: int) -> tuple[int, int] | None:
    """``(real requests, real query tokens)`` of a step's metadata, as :func:`convert`
    counts them (trailing requests of length 0 are padding; without ``query_start_loc``
    each request has ``tokens_per_request`` tokens), or ``None`` for metadata
    :func:`convert` would refuse for its form (it says why)."""
    lens, qsl = getattr(meta, "seq_lens", None), getattr(meta, "query_start_loc", None)
    if not isinstance(lens, torch.Tensor) or lens.dim() != 1 or lens.device.type != "cpu":
        return None
    r = real_requests(lens.tolist())
    if qsl is None:
        return r, r * tokens_per_request
    if not isinstance(qsl, torch.Tensor) or qsl.dim() != 1 or qsl.device.type != "cpu" or qsl.shape[0] <= r:
        return None
    return r, int(qsl[r])


def _check_block_ids(table: torch.Tensor, kv: list[int], block_size: int, num_blocks: int, where: str) -> None:
    """Every block a request uses (the first ceil(len / block_size) columns) must exist.

    Only the columns in use are read: the cost follows the blocks the step uses, not
    the table's width (max_model_len / block_size columns).
    """
    width = -(-max(kv) // block_size)  # the widest request's blocks
    if width == 0:
        return
    # whole rows when the widest request spans the table: a contiguous read, faster to reduce
    sub = table[: len(kv)] if width >= table.shape[1] else table[: len(kv), :width]
    lo, hi = torch.aminmax(sub)
    if int(lo) >= 0 and int(hi) < num_blocks:
        return  # the common case: every id in the columns in use (and beside them) is valid
    found = BlockIdCheck.on(table.device, width).flag(table, kv, block_size, num_blocks)
    hit = found.first_in_use(found.scores.tolist())
    if hit is not None:
        i, j = hit
        _bad_block(where, i, j, int(sub[i, j]), num_blocks)


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


def _bad_block(where: str, i: int, j: int, block: int, num_blocks: int) -> None:
    raise MetadataError(
        f"{where}: block_table[{i}, {j}] = {block} is not a block id of the KV cache (0 <= id < {num_blocks})"
    )
