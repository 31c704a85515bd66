"""A step's attention metadata, from the engine's form to the padded host lengths the kernels
take: :class:`AttentionMetadata` (what an engine gives per KV-cache group), :class:`StepLens`
(its lengths padded to a graph's size), the padding rule (:func:`pad_lens`, and
:func:`batch_refusal`, its limits; :func:`capture_lens` and :func:`eager_rows`, the shape one
call runs a step's metadata in) and :func:`convert`, which checks the one against a
captured graph and makes the other."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from npugraph.errors import BatchRefused, MetadataError

__all__ = [
    "AttentionMetadata",
    "StepLens",
    "batch_refusal",
    "capture_lens",
    "convert",
    "eager_rows",
    "pad_lens",
    "real_batch",
    "real_requests",
]


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
    width: int | None = None,
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
    exactly one.  ``width``: the graph's kernel reads that many keys of every request
    (update-free): a longer request is refused, validating or not (its mask would hide nothing
    past the width, and attention would silently drop its oldest keys), and the block ids of
    the whole width are checked.
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
        raise BatchRefused(f"{where}: {batch_refusal(batch, tokens, r, 0)}")
    table = _checked_table(meta.block_table, r, table_device, where)
    q_ends = _query_ends(meta, kv, given, tokens_per_request, where)
    refused = batch_refusal(batch, tokens, r, q_ends[-1] if q_ends else 0)
    if refused is not None:
        raise BatchRefused(f"{where}: {refused}")
    # batch_refusal's one-token rule, naming the request (without query_start_loc the graph's
    # own tokens per request apply: one, for a kernel that runs one)
    if one_query_token and meta.query_start_loc is not None and list(q_ends) != list(range(1, r + 1)):
        many, n = next((i, b - a) for i, (a, b) in enumerate(itertools.pairwise([0, *q_ends])) if b - a != 1)
        raise BatchRefused(
            f"{where}: request {many} has {n} query tokens, but "
            "the captured kernel runs one query token per request (PA, or FIA captured without a causal mask); "
            "run this batch on a graph captured for several tokens per request"
        )
    if width is not None and r and max(kv) > width:
        i = kv.index(max(kv))
        raise BatchRefused(
            f"{where}: request {i} has {kv[i]} keys, over the {width} this update-free graph reads; "
            "step it on a wider graph (Runtime.step picks the narrowest that holds the batch)"
        )
    if validate and r:
        _check_bounds(kv, table, max_model_len, block_size, capacity_blocks, where)
        if check_block_ids if check_block_ids is not None else table.device.type == "cpu":
            # update-free: the kernel reads the whole width of every row the step copies in
            rows = min(given, batch, int(table.shape[0]))
            _check_block_ids(table, kv if width is None else [width] * rows, block_size, num_blocks, where)
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
    for i, length in enumerate(kv):  # the first id a request reads that is not a block of the cache
        used = sub[i, : -(-length // block_size)]
        bad = ((used < 0) | (used >= num_blocks)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            _bad_block(where, i, j, int(used[j]), num_blocks)


def _bad_block(where: str, i: int, j: int, block: int, num_blocks: int) -> None:
    raise MetadataError(
        f"{where}: block_table[{i}, {j}] = {block} is not a block id of the KV cache (0 <= id < {num_blocks})"
    )


@attrs.frozen(kw_only=True)
class StepLens:
    """Host-side lengths of one KV-cache group for one step, padded to the graph's batch.

    ``kv_lens``: key length per request (padding requests: 0);
    ``q_ends``: cumulative query-token ends per request (last = tokens);
    ``num_reqs``: how many leading requests are real (the rest are padding).
    Each kernel's spec turns these into its own host form (``OpSpec.host_values``).
    """

    kv_lens: tuple[int, ...]
    q_ends: tuple[int, ...]
    num_reqs: int = 0


def pad_lens(
    kv_lens: tuple[int, ...] | list[int],
    q_ends: tuple[int, ...] | list[int] | None,
    batch: int,
    tokens: int,
) -> StepLens:
    """Pad ``R`` requests' lengths to ``batch`` requests and ``tokens`` query tokens.

    Padding requests get key length 0 (they produce zeros) and the spare query tokens,
    spread evenly (one each in plain decode), so a padded step has the same shapes
    however many requests are real.  A real request's lengths never change: with every
    row real, spare tokens have nowhere to go (giving them to the last request would
    shift its causal window), so the caller must refuse such a step.
    """
    r = len(kv_lens)
    kv = tuple(kv_lens) + (0,) * (batch - r)
    q = tuple(range(1, r + 1)) if q_ends is None else tuple(q_ends)
    last = q[-1] if q else 0
    pad = batch - r
    if pad:
        per, extra = divmod(tokens - last, pad)
        ends = []
        for i in range(pad):
            last += per + (1 if i >= pad - extra else 0)
            ends.append(last)
        q = q + tuple(ends)
    return StepLens(kv_lens=kv, q_ends=q, num_reqs=r)


def batch_refusal(
    rows: int, tokens: int, num_reqs: int, num_tokens: int, *, one_query_token: bool = False
) -> str | None:
    """Why a graph of ``rows`` request rows and ``tokens`` query tokens cannot run a step of
    ``num_reqs`` real requests with ``num_tokens`` real query tokens, or ``None`` if it can.

    The one statement of the padding rule's limits (:func:`pad_lens` pads what passes):
    the step's update refuses what this refuses, and ``Runtime.key_for`` picks the
    smallest graph this accepts.  Spare query tokens belong to padding rows, so a graph
    whose rows are all real must have no spare token.  ``one_query_token``: the graph's
    kernel takes one query token per request (:attr:`OpSpec.runs_one_query_token`).
    """
    if num_reqs > rows:
        return f"{num_reqs} requests do not fit the captured batch of {rows}; pick a key whose size covers the batch"
    if num_tokens > tokens:
        return f"{num_tokens} query tokens do not fit the captured {tokens}"
    if one_query_token and num_tokens != num_reqs:
        return (
            f"the captured kernel runs one query token per request (PA, or FIA captured without a causal "
            f"mask), but the step's {num_reqs} requests have {num_tokens} query tokens; run it on a graph "
            "captured for several tokens per request"
        )
    if num_reqs == rows and num_tokens < tokens:
        return (
            f"all {rows} captured request rows are real but the step has {num_tokens} of "
            f"{tokens} query tokens; the spare tokens need a padding row (giving them to the last "
            "request would shift its causal window). Use a graph with more request rows than requests."
        )
    return None


def _longest_request(starts: list[int]) -> int:
    """The most query tokens one request has, from cumulative query starts (1 without any)."""
    return max((b - a for a, b in itertools.pairwise(starts)), default=1)


def capture_lens(meta: AttentionMetadata, *, tokens: int, rows: int, tokens_per_request: int) -> tuple[int, StepLens]:
    """The query tokens per request a captured call runs, and the lengths it is captured with.

    A graph of ``rows`` request rows and ``tokens`` query tokens whose tokens exceed
    ``rows x tokens_per_request``, or whose metadata holds a longer request (vLLM's mixed
    FULL batches), runs requests of several tokens: it is captured causal, that wide.
    """
    q_ends: list[int] | None
    if meta.query_start_loc is not None:
        q_ends = meta.query_start_loc.tolist()[1:]
    else:
        q_ends = None if tokens_per_request == 1 else [tokens_per_request * (i + 1) for i in range(meta.num_reqs)]
    longest = _longest_request([0, *(q_ends or ())])
    if tokens > rows * tokens_per_request or longest > tokens_per_request:
        tokens_per_request = max(longest, -(-tokens // max(1, rows)))
    return tokens_per_request, pad_lens(meta.seq_lens.tolist(), q_ends, rows, tokens)


def eager_rows(meta: AttentionMetadata, *, tokens: int, rows: int, tokens_per_request: int) -> tuple[int, int]:
    """The request rows and query tokens per request an eager call runs ``meta`` in.

    Uniform metadata (no ``query_start_loc``) gives every request ``tokens_per_request``
    tokens, and spare tokens are padding requests.  Mixed prefill/decode metadata runs
    causal within each request, as wide as its longest; its spare tokens form one padding
    request, which needs a row of its own unless a trailing request of length 0 is one.
    """
    qsl = meta.query_start_loc
    if qsl is None:
        return max(rows, tokens // max(1, tokens_per_request)), tokens_per_request
    starts = qsl.tolist() if isinstance(qsl, torch.Tensor) else list(qsl)
    tokens_per_request = max(tokens_per_request, _longest_request(starts))
    lens_on_host = isinstance(meta.seq_lens, torch.Tensor) and meta.seq_lens.device.type == "cpu"
    real = real_requests(meta.seq_lens.tolist()) if lens_on_host and meta.seq_lens.dim() == 1 else 0
    if real < len(starts) and starts[real] < tokens and real >= rows:
        return rows + 1, tokens_per_request
    return rows, tokens_per_request
