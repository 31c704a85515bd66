"""What every kernel declaration provides; capture and update are both driven from it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from npugraph.errors import ConfigError
from npugraph.metadata import StepLens

__all__ = ["MIN_BLOCK", "AttentionCall", "DeviceLengths", "LensArena", "LensGroup", "OpSpec"]


@attrs.frozen(kw_only=True)
class AttentionCall:
    """One decode-attention call of one layer, as a client hands it to the runtime.

    ``query`` ``[T, N, D]``; caches ``[num_blocks, block_size, KVN, D]`` (``Dv`` for
    values); ``block_table`` ``[B, max_blocks]`` int32 on the device; ``out``
    ``[T, N, Dv]``.  ``tokens_per_request`` > 1 means speculative verification
    (``T = B * tokens_per_request``, causal within each request).

    ``window``: a sliding-window layer sees only the last ``window`` keys of each query.
    ``query_rope`` ``[T, N, Dr]`` and ``key_rope_cache`` ``[num_blocks, block_size, 1, Dr]``:
    absorbed MLA — scores add ``query_rope . key_rope``, the values are the latent
    ``value_cache`` (usually the same tensor as ``key_cache``), one KV head.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    out: torch.Tensor
    num_heads: int
    num_kv_heads: int
    scale: float
    tokens_per_request: int = 1
    window: int | None = None
    query_rope: torch.Tensor | None = None
    key_rope_cache: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        if (self.query_rope is None) != (self.key_rope_cache is None):
            # one without the other would silently run attention without the rope scores
            raise ConfigError("query_rope and key_rope_cache come together (absorbed MLA): pass both or neither")

    @property
    def is_mla(self) -> bool:
        return self.query_rope is not None

    @property
    def block_size(self) -> int:
        return int(self.key_cache.shape[1])


@attrs.frozen(kw_only=True, eq=False)
class LensGroup:
    """Device memory a tiling-sink kernel reads one KV-cache group's lengths and plan from.

    Made once per graph and group at capture (held by the graph's record: the graph reads
    it on every replay), written once per step before the replay: the lengths by one copy
    into ``lens``, the plan by the metadata op.  ``qlen`` / ``kvlen`` are ``lens``'s rows.
    """

    lens: torch.Tensor  # int32 [2, batch]: cumulative query ends, then key lengths
    qlen: torch.Tensor
    kvlen: torch.Tensor
    meta: torch.Tensor  # uint32 [1024]: the tiling plan
    plan_args: Mapping[str, Any]  # the metadata op's shape arguments (heads, head dim, block size, mask)
    slot: str
    batch: int
    # lengths frozen to a width (update-free decode): the graph reads ``width`` keys of every
    # request through its own ``table`` [batch, width / block_size], and ``mask``
    # [batch, 1, 1, width] (True = masked) hides the keys past each request's length;
    # ``positions`` is arange(width), what the mask is made from
    width: int | None = None
    table: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @classmethod
    def make(
        cls,
        memory: torch.device,
        batch: int,
        plan_args: Mapping[str, Any],
        slot: str,
        *,
        width: int | None = None,
        block_size: int = 1,
    ) -> LensGroup:
        arena = LensArena.make(memory, 1, batch, width=width)
        found = arena.take(batch, plan_args, slot, block_size=block_size)
        assert found is not None  # an arena of one group of this batch
        return found


@attrs.define(kw_only=True, eq=False)
class LensArena:
    """Device memory for a graph's :class:`LensGroup` s, allocated **before** its capture.

    Memory a step writes from outside the graph must not come from the graph's pool: a
    block freed earlier in the same capture is handed to the next allocation, so a node
    recorded before (a layer's intermediate) would overwrite it on every replay.
    ``groups`` groups of up to ``rows`` request rows; :meth:`take` returns ``None`` when
    it is full (the capture then runs again with a larger one).
    """

    lens: torch.Tensor  # int32 [groups, 2, rows]
    meta: torch.Tensor  # uint32 [groups, 1024]
    used: int = 0
    # with lengths frozen to ``width``: per group a block table and a mask of up to ``rows``
    # requests (flat: a group's table is contiguous whatever the block size), and arange(width)
    width: int | None = None
    tables: torch.Tensor | None = None  # int32 [groups, rows * width / MIN_BLOCK] (block ids: zeros, valid)
    masks: torch.Tensor | None = None  # bool [groups, rows * width]
    positions: torch.Tensor | None = None  # int32 [width]

    @classmethod
    def make(cls, memory: torch.device, groups: int, rows: int, *, width: int | None = None) -> LensArena:
        frozen: dict[str, Any] = {}
        if width is not None:
            frozen = {
                "width": width,
                # the block size is the capture's first call's: room for the smallest CANN takes
                "tables": torch.zeros(groups, rows * max(1, width // MIN_BLOCK), dtype=torch.int32, device=memory),
                "masks": torch.ones(groups, rows * width, dtype=torch.bool, device=memory),
                "positions": torch.arange(width, dtype=torch.int32, device=memory),
            }
        return cls(
            lens=torch.zeros(groups, 2, rows, dtype=torch.int32, device=memory),
            meta=torch.zeros(groups, 1024, dtype=torch.uint32, device=memory),
            **frozen,
        )

    def take(self, batch: int, plan_args: Mapping[str, Any], slot: str, *, block_size: int = 1) -> LensGroup | None:
        if self.used >= int(self.lens.shape[0]) or batch > int(self.lens.shape[2]):
            return None
        g = self.used
        self.used += 1
        lens = self.lens[g, :, :batch]
        frozen: dict[str, Any] = {}
        if self.width is not None and self.tables is not None and self.masks is not None:
            w = self.width
            frozen = {
                "width": w,
                "table": self.tables[g, : batch * (w // block_size)].view(batch, w // block_size),
                "mask": self.masks[g, : batch * w].view(batch, 1, 1, w),
                "positions": self.positions,
            }
        return LensGroup(
            lens=lens,
            qlen=lens[0],
            kvlen=lens[1],
            meta=self.meta[g],
            plan_args=plan_args,
            slot=slot,
            batch=batch,
            **frozen,
        )


# The least block size a lengths-frozen graph takes: CANN's FIA decode with a block table wants
# it 16-aligned (fp16/bf16; 32 for int8) (torch_npu's FIA documentation), so a graph's own block
# table needs at most width / 16 columns
MIN_BLOCK = 16


def _never(args: Mapping[str, Any]) -> bool:
    return False


def _no_constants(memory: torch.device) -> None:
    """Most kernels share no constant between graphs."""


@attrs.frozen(kw_only=True)
class DeviceLengths:
    """What a kernel whose lengths live in device memory declares beside its arguments: how
    a step turns the lengths it wrote into a :class:`LensGroup` into what the kernel reads,
    once per group, and the shape arguments that takes (``plan_args(call)``).

    Either ``metadata_kernel``, an op of the device's ``device_length_ops`` that plans from the
    lengths (the tiling sink; its kernel is there too), or ``plan(device, group)``, device work
    of the kernel's own (update-free FIA: the mask, from the lengths; its kernel is FIA's).
    ``width``: the lengths are frozen to the group's width (the graph reads that many keys).
    """

    plan_args: Callable[[AttentionCall], dict[str, Any]]
    metadata_kernel: str | None = None
    plan: Callable[[Any, LensGroup], None] | None = None
    width: bool = False

    @property
    def on_sink_ops(self) -> bool:
        """Whether the kernel is one of the device's ``device_length_ops`` (the tiling sink)."""
        return self.metadata_kernel is not None


@attrs.frozen(kw_only=True)
class OpSpec:
    """One attention kernel, declared once.

    * ``kernel`` / ``overload``: the torch_npu-shaped entry point (``ops.<kernel>.<overload>``);
    * ``host_args``: host-side arguments rewritten by a task update each step;
    * ``refreshed_buffers``: device arguments whose contents the runtime refreshes by copy
      (the block table, from each step's metadata);
    * ``cache_arg``: the argument holding the paged key cache (its block geometry
      bounds the lengths and block ids an update may write);
    * ``arguments(call, lens, workspace)``: the kernel's keyword arguments;
    * ``host_values(lens)``: the ``host_args`` for a step;
    * ``workspace_bytes(device, kwargs, max_model_len)``: one workspace for every length
      up to ``max_model_len`` (queried at capture only, never per step);
    * ``unsupported(call)``: why this kernel cannot run ``call`` (or ``None``);
    * ``fused_update``: the device's 4-in-1 update entry point may be used;
    * ``runs_one_query_token(args)``: whether the task, as captured with ``args``, runs one query
      token per request (PA, whose query rows are the requests; FIA captured without a
      causal mask); a step whose requests have more is refused, as the kernel would compute
      them wrongly;
    * ``prepare(memory)``: make the per-device constants its arguments share across
      graphs (FIA's causal mask) — called before every capture, since a tensor made
      inside one comes from that graph's pool and is written only by its replay;
    * ``sink``: set (a :class:`DeviceLengths`) where the kernel reads its lengths and a
      tiling plan from device memory (a :class:`LensGroup`, passed to ``arguments`` as
      ``buffers``): it is captured with no task group, and a step writes the group's lengths
      and issues the declared metadata op once, with no per-layer update.  ``None``: the
      lengths are host arguments, rewritten per layer.
    """

    name: str
    kernel: str
    overload: str | None
    host_args: tuple[str, ...]
    refreshed_buffers: tuple[str, ...]
    cache_arg: str
    # (call, lens, workspace) -> kwargs; a tiling-sink kernel also takes ``buffers=``
    arguments: Callable[..., dict[str, Any]]
    host_values: Callable[[StepLens], dict[str, Any]]
    workspace_bytes: Callable[[Any, dict[str, Any], int], int]
    unsupported: Callable[[AttentionCall], str | None]
    fused_update: bool = False
    prepare: Callable[[torch.device], object] = _no_constants
    runs_one_query_token: Callable[[Mapping[str, Any]], bool] = _never
    sink: DeviceLengths | None = None

    def kernel_fn(self, device: Any) -> Callable[..., Any]:
        """Resolve the entry point on ``device`` (once per capture, not per step)."""
        fn = getattr(
            device.device_length_ops if self.sink is not None and self.sink.on_sink_ops else device.ops, self.kernel
        )
        return getattr(fn, self.overload) if self.overload else fn

    def launch(self, device: Any, kwargs: dict[str, Any]) -> None:
        """Issue the kernel: run eagerly, record during capture, rewrite inside an update."""
        self.kernel_fn(device)(**kwargs)

    def issue_metadata(self, device: Any, group: LensGroup) -> None:
        """Issue the metadata op of a tiling-sink kernel on the current stream: the plan for
        the lengths in ``group`` (outside any graph: a captured one is not re-run)."""
        if self.sink is None:
            raise TypeError(f"{self.name} reads its lengths from the host: it has no metadata op")
        if self.sink.plan is not None:
            self.sink.plan(device, group)
            return
        fn = getattr(device.device_length_ops, str(self.sink.metadata_kernel))
        fn(group.qlen, group.kvlen, meta_data=group.meta, **group.plan_args)

    def run_eager(self, device: Any, call: AttentionCall, lens: StepLens, *, width: int | None = None) -> None:
        """Run the kernel outside a graph on ``lens`` (a tiling-sink kernel gets its lengths
        in fresh device memory, copied from page-locked memory, and its plan first; one with
        its lengths frozen reads ``width`` keys, by default the fewest whole blocks that hold
        every request)."""
        if self.sink is None:
            self.launch(device, self.arguments(call, lens, None))
            return
        if not self.sink.width:
            width = None
        elif width is None:
            bs = call.block_size
            width = max(bs, -(-max(lens.kv_lens, default=1) // bs) * bs)
        group = LensGroup.make(
            call.query.device,
            len(lens.kv_lens),
            self.sink.plan_args(call),
            "eager",
            width=width,
            block_size=call.block_size,
        )
        rows = list(self.host_values(lens).values())
        host = device.staged(torch.tensor(rows, dtype=torch.int32, device="cpu"))
        group.lens.copy_(host, non_blocking=True)
        if group.table is not None:
            cols = int(group.table.shape[1])
            group.table.copy_(call.block_table[: group.batch, :cols], non_blocking=True)
            call = attrs.evolve(call, block_table=group.table)
        self.issue_metadata(device, group)
        self.launch(device, self.arguments(call, lens, None, buffers=group))
