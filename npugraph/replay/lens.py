"""Per-step attention metadata and its conversion to the host lengths kernels take."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from npugraph.errors import MetadataError
from npugraph.ops.base import StepLens, pad_lens

__all__ = ["AttentionMetadata", "BlockIdCheck", "IdRange", "pad_lens", "convert", "real_requests"]


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
) -> StepLens:
    """Validate ``meta`` against a captured graph and pad it to that graph's size.

    ``where`` names the graph and layer in error messages.  The checks of shapes,
    types and query/key lengths always run; ``validate`` adds the bounds of every
    length and, when ``check_block_ids`` (default: the table is on the host), of every
    block id in use — reading a device table here would synchronize, so the updater
    checks those on the device instead (the cost grows with the blocks in use).
    Without ``query_start_loc`` every request has ``tokens_per_request`` query tokens
    (1: decode; more: speculative verification).  ``table_device``: the device's memory;
    a block table must be there or on the host.
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
    if r > batch:
        raise MetadataError(
            f"{where}: {r} requests do not fit the captured batch of {batch}; pick a key whose size covers the batch"
        )
    table = meta.block_table
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
    if q_ends and q_ends[-1] > tokens:
        raise MetadataError(f"{where}: {q_ends[-1]} query tokens do not fit the captured {tokens}")
    real_tokens = q_ends[-1] if q_ends else 0
    if r == batch and real_tokens < tokens:
        raise MetadataError(
            f"{where}: all {batch} captured request rows are real but the step has {real_tokens} of "
            f"{tokens} query tokens; the spare tokens need a padding row (giving them to the last "
            "request would shift its causal window). Use a graph with more request rows than requests."
        )
    if validate and r:
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
        if check_block_ids if check_block_ids is not None else table.device.type == "cpu":
            _check_block_ids(table, kv, block_size, num_blocks, where)
    return pad_lens(kv, q_ends, batch, tokens)


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


def _check_block_ids(table: torch.Tensor, kv: list[int], block_size: int, num_blocks: int, where: str) -> None:
    """Every block a request uses (the first ceil(len / block_size) columns) must exist.

    Only the columns in use are read: the cost follows the blocks the step uses, not
    the table's width (max_model_len / block_size columns).
    """
    used_cols = [-(-length // block_size) for length in kv]
    width = max(used_cols)
    if width == 0:
        return
    sub = table[: len(kv), :width]
    lo, hi = torch.aminmax(sub)
    if int(lo) >= 0 and int(hi) < num_blocks:
        return  # the common case: every id in the columns in use (and beside them) is valid
    bad = BlockIdCheck.on(table.device, len(kv), width).bad_ids(table, kv, block_size, num_blocks)
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        _bad_block(where, i, j, int(sub[i, j]), num_blocks)


@attrs.define(eq=False)
class BlockIdCheck:
    """The device-side check of the block ids a step uses in a device-resident table.

    Reading a device table on the host would synchronize, so the check is device work:
    a few eager ops on the update stream whose result, the range of the ids in use, is
    read later, once the device is idle.  It owns two device tensors made once, ``limits``
    (the blocks each request uses, rewritten by a non-blocking copy when they change) and
    ``columns`` (``0 .. cols - 1``), and the mask of the columns in use of the last
    limits it copied.  In decode a request's block count changes once every
    ``block_size`` steps, so most steps reuse both: no copy, no mask, two ops.  Use one
    check from one stream (the updater's): its copies, masks and reads are then in order.
    """

    limits: torch.Tensor
    columns: torch.Tensor
    # the blocks in use that ``limits`` holds (once the copy issued last has run), and their mask
    _used: list[int] | None = None
    _mask: torch.Tensor | None = None

    @classmethod
    def on(cls, memory: torch.device, rows: int, cols: int) -> BlockIdCheck:
        """A check of tables of up to ``rows`` requests and ``cols`` columns on ``memory``."""
        return cls(
            limits=torch.zeros(rows, dtype=torch.int32, device=memory),
            columns=torch.arange(cols, dtype=torch.int32, device=memory),
        )

    def flag(
        self,
        table: torch.Tensor,
        kv: list[int] | tuple[int, ...],
        block_size: int,
        num_blocks: int,
        stage: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> IdRange:
        """The smallest and largest block id in use, as device tensors (read them later).

        ``kv``: the lengths of at least one request; ``stage`` puts the host tensor of the
        blocks in use where a non-blocking copy reads it (page-locked memory on hardware).
        Device work only: the ids in the columns in use (0 elsewhere, a valid id) and their
        range, after the copy and the mask when the blocks in use changed; no host read,
        no blocking copy.
        """
        in_use = self._in_use(kv, block_size, stage)
        low, high = torch.aminmax(torch.where(in_use, table[: len(kv), : in_use.shape[1]], 0))
        return IdRange(low=low, high=high, num_blocks=num_blocks)

    def bad_ids(
        self,
        table: torch.Tensor,
        kv: list[int] | tuple[int, ...],
        block_size: int,
        num_blocks: int,
        stage: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> torch.Tensor:
        """Where the first ``len(kv)`` rows of ``table``, in the columns the longest request
        uses, hold a block id in use that lies outside the cache (bool, on the device)."""
        in_use = self._in_use(kv, block_size, stage)
        sub = table[: len(kv), : in_use.shape[1]]
        return torch.ne(sub.clamp(0, num_blocks - 1), sub).logical_and_(in_use)

    def forget(self) -> None:
        """Copy the limits again at the next check (after an error, device work the
        mask relies on may not have run)."""
        self._used = self._mask = None

    def _in_use(
        self, kv: list[int] | tuple[int, ...], block_size: int, stage: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The mask of the columns each request uses ([requests, widest]); the limits are
        copied (non-blocking) and the mask made only when the blocks in use changed."""
        used = [-(-length // block_size) for length in kv]
        if used == self._used and self._mask is not None:
            return self._mask
        self.forget()  # a failure below leaves nothing half-cached
        limits = self.limits[: len(used)]
        limits.copy_(stage(torch.tensor(used, dtype=torch.int32, device="cpu")), non_blocking=True)
        mask = self.columns[: max(used)] < limits.unsqueeze(1)
        self._used, self._mask = used, mask
        return mask


@attrs.frozen(kw_only=True, eq=False)
class IdRange:
    """The range of the block ids one step uses, on the device until the host reads it."""

    low: torch.Tensor
    high: torch.Tensor
    num_blocks: int

    @staticmethod
    def outside(ranges: list[IdRange]) -> list[bool]:
        """For each range, does it leave the cache ``[0, num_blocks)``?  One host read per
        memory they lie in (call it once the device is idle: it would synchronize otherwise;
        host tables checked with ``defer_block_check=True`` leave theirs in host memory)."""
        by_memory: dict[torch.device, list[int]] = {}
        for k, r in enumerate(ranges):
            by_memory.setdefault(r.low.device, []).append(k)
        ends: dict[int, tuple[int, int]] = {}
        for ks in by_memory.values():
            read = torch.stack([t for k in ks for t in (ranges[k].low, ranges[k].high)]).tolist()
            ends.update((k, (read[2 * n], read[2 * n + 1])) for n, k in enumerate(ks))
        return [ends[k][0] < 0 or ends[k][1] >= r.num_blocks for k, r in enumerate(ranges)]


def _bad_block(where: str, i: int, j: int, block: int, num_blocks: int) -> None:
    raise MetadataError(
        f"{where}: block_table[{i}, {j}] = {block} is not a block id of the KV cache (0 <= id < {num_blocks})"
    )
