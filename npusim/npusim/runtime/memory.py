"""Simulated device memory: pools own blocks, graphs own memory (not objects), aliases own nothing.

The rules (contract §9) and how they are modelled on the CPU:

* **A pool is an allocator.**  Allocations made during capture are blocks of the
  graph's pool (private, or a shared ``graph_pool_handle()``).  The pool keeps every
  block's memory; a block is *free* once no Python tensor outside the simulator uses
  it, and a later capture into the same pool reuses it — so graphs sharing a pool
  alias each other's intermediates and outputs, as on hardware.
* **A graph keeps memory, not objects.**  Recorded nodes hold *internal aliases*: CPU
  tensors over the same bytes that do not count as users, so a Python ``weakref`` to a
  captured intermediate dies as soon as the capturing code drops it.
* **``_weak_ref_tensor``** returns such an alias to the caller: same data pointer,
  shape, stride and dtype; it keeps nothing alive.
* **Eager memory** (allocated outside capture) belongs to its Python owners.  The
  simulator holds one *keeper* per storage it has aliased, so that a dangling alias
  never reads freed CPU memory; but once only the keeper is left the memory counts as
  freed, and a kernel that would read or write it raises :class:`UseAfterFree`
  (hardware reads whatever the caching allocator put there since).
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from npusim.device import backend as _device
from npusim.errors import UseAfterFree

# Host memory: where the simulator's own bookkeeping tensors live (alias bases, the CPU
# views kernels compute on). Device memory is npu memory, always named on allocation: the
# simulator, like a device, ignores the process's default torch device.
MEMORY = torch.device("cpu")

__all__ = ["Memory", "Owner", "Pool", "ArgRef", "SCALARS", "check_refs", "hold_tree", "hold_params"]

_USE_COUNT = torch._C._storage_Use_Count


def _one_holder() -> int:
    t = torch.empty(1, device=MEMORY)
    return int(_USE_COUNT(t.untyped_storage()._cdata))


# What _storage_Use_Count reports for a storage with exactly one holder (the call itself
# may count as one): "used by somebody besides the simulator" is anything above it.
_ONE = _one_holder()
_BLOCK_ALIGN = 512  # bytes, as the device caching allocator rounds


class Owner:
    """One piece of device memory the simulator knows: an eager storage or a pool block."""

    __slots__ = (
        "_aliases",
        "_base",
        "_base_cdata",
        "cdata",
        "fresh",
        "keeper",
        "label",
        "nbytes",
        "pool",
        "ptr",
    )

    def __init__(self, keeper: torch.Tensor, pool: Pool | None, label: str) -> None:
        storage = keeper.untyped_storage()
        self.keeper = keeper  # the one reference the simulator holds on the real storage
        self.cdata = int(storage._cdata)
        self.ptr = int(storage.data_ptr())
        self.nbytes = int(storage.nbytes())
        self.pool = pool
        self.label = label
        self.fresh = True  # pool blocks: never handed out yet (poisoned on first use)
        self._base: torch.Tensor | None = None
        self._base_cdata = 0
        # (offset, shape, stride, dtype) -> alias: an update re-issues the same views every step
        self._aliases: dict[tuple[Any, ...], torch.Tensor] = {}

    def in_use(self) -> bool:
        """Whether a Python tensor outside the simulator still holds this memory."""
        return int(_USE_COUNT(self.cdata)) > _ONE

    def base(self, memory: Memory) -> torch.Tensor:
        """A uint8 alias over the whole memory that holds no reference to its owners."""
        if self._base is None:
            if self.nbytes:
                raw = (ctypes.c_char * self.nbytes).from_address(self.ptr)
                self._base = torch.frombuffer(raw, dtype=torch.uint8)
            else:
                self._base = torch.empty(0, dtype=torch.uint8, device=MEMORY)
            self._base_cdata = int(self._base.untyped_storage()._cdata)
            memory.owners[self._base_cdata] = self
        return self._base

    def aliased(self) -> bool:
        """Whether any alias of this memory (a graph node's, a weak reference) is alive.

        The cached aliases count only where somebody besides the cache holds them.
        """
        if self._base is None:
            return False
        if int(_USE_COUNT(self._base_cdata)) > _ONE + len(self._aliases):
            return True  # an alias made from a cached one (a view), or not cached
        # a reference from the dict, the loop variable and getrefcount's argument: 3
        return any(sys.getrefcount(a) > 3 for a in self._aliases.values())

    def __repr__(self) -> str:
        return f"<{self.label}: {self.nbytes} bytes at {self.ptr:#x}>"


class Pool:
    """A graph memory pool: blocks that live as long as the pool, reused once free."""

    def __init__(self, pool_id: tuple[int, int]) -> None:
        self.pool_id = pool_id
        self.blocks: list[Owner] = []

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def block(self, nbytes: int, memory: Memory, device: torch.device) -> Owner:
        """A free block of at least ``nbytes`` (best fit) on ``device``, or a new one."""
        best: Owner | None = None
        for b in self.blocks:
            if b.keeper.device != device:
                continue
            if b.nbytes >= nbytes and (best is None or b.nbytes < best.nbytes) and not b.in_use():
                best = b
                if b.nbytes == nbytes:
                    break
        if best is not None:
            best.fresh = False
            return best
        size = max(_BLOCK_ALIGN, -(-nbytes // _BLOCK_ALIGN) * _BLOCK_ALIGN)
        block = Owner(torch.empty(size, dtype=torch.uint8, device=device), self, f"block of pool {self.pool_id}")
        self.blocks.append(block)
        memory.owners[block.cdata] = block
        return block


class ArgRef:
    """A graph's hold on one tensor argument: the alias it computes with, and the memory's owner."""

    __slots__ = ("checked", "name", "owner")

    def __init__(self, name: str, owner: Owner, checked: bool) -> None:
        self.name, self.owner, self.checked = name, owner, checked


def check_refs(refs: tuple[ArgRef, ...], where: str) -> None:
    """Raise :class:`UseAfterFree` if an eager data argument's memory was freed by its owners."""
    for r in refs:
        if r.checked and not r.owner.in_use():
            raise UseAfterFree(
                f"{where}: argument {r.name!r} ({r.owner.label}, {r.owner.nbytes} bytes at "
                f"{r.owner.ptr:#x}) was freed by its owner after it was captured or updated; on "
                "hardware the kernel would read or write whatever the caching allocator has put "
                "there since (silent corruption). Keep the tensor alive as long as the graph may "
                "replay, or update the task with a live tensor before replaying.",
                argument=r.name,
            )


_PRUNE_BYTES = 1 << 30  # a prune by size: each GiB of newly registered eager memory


class Memory:
    """All memory of the simulated device that graphs or aliases refer to."""

    def __init__(self) -> None:
        # storage cdata (a real storage, or an alias base) -> its owner
        self.owners: dict[int, Owner] = {}
        self.pools: dict[tuple[int, int], Pool] = {}
        # Registering keeps the storage alive (so that an alias never points at memory the
        # host allocator reused); a prune lets go of what nobody uses.  It runs once the
        # registry doubles in entries or grows by a GiB, so that its cost stays amortised
        # (a GiB is allocated far more slowly than a prune runs) and a workload of a few
        # large tensors (an engine's KV caches, made anew per test) does not keep them
        # alive after their owners dropped them: hardware would have freed them.
        self._prune_at = 1024
        self._eager_bytes = 0
        self._prune_bytes_at = _PRUNE_BYTES
        # storage cdata -> the page-locked host tensor made there (by pin_memory)
        self.pinned: dict[int, weakref.ref[torch.Tensor]] = {}

    def pool(self, pool_id: tuple[int, int]) -> Pool:
        p = self.pools.get(pool_id)
        if p is None:
            p = self.pools[pool_id] = Pool(pool_id)
        return p

    def owner(self, t: torch.Tensor) -> Owner:
        """The owner of ``t``'s memory (registered on first sight as eager memory)."""
        storage = t.untyped_storage()
        cdata = int(storage._cdata)
        found = self.owners.get(cdata)
        if found is not None:
            return found
        keeper = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        owner = Owner(keeper, None, f"eager {t.dtype} tensor of shape {list(t.shape)}")
        self.owners[cdata] = owner
        self._eager_bytes += owner.nbytes
        if len(self.owners) > self._prune_at or self._eager_bytes > self._prune_bytes_at:
            self._prune()
        return owner

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of host tensor ``t`` (what ``Tensor.pin_memory()`` returns)."""
        pinned = t.clone(memory_format=torch.contiguous_format)
        cdata = int(pinned.untyped_storage()._cdata)
        pinned_map = self.pinned

        def forget(_: object) -> None:
            pinned_map.pop(cdata, None)

        self.pinned[cdata] = weakref.ref(pinned, forget)
        return pinned

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in page-locked host memory (:meth:`pin`, or the npu device's
        pinned allocator: ``Tensor.pin_memory()``)."""
        ref = self.pinned.get(int(t.untyped_storage()._cdata))
        if ref is not None and ref() is not None:
            return True
        return t.device.type == "cpu" and _device.installed() and t.is_pinned()

    def knows(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is device memory: an ``npu`` tensor."""
        return t.device.type == "npu"  # told by tensor.device, as on hardware: CPU memory is the host's

    def adopt(self, values: Any) -> None:
        """Register the npu memory of every tensor in ``values`` (nested lists and tuples):
        its owner is known from now on (for use-after-free checks and aliases).

        0-d tensors are host scalars, passed by value, as hardware treats them."""
        for t in tree_flatten(values)[0]:
            if isinstance(t, torch.Tensor) and t.dim() and t.device.type == "npu":
                self.owner(t)

    def alias(self, t: torch.Tensor, owner: Owner | None = None) -> torch.Tensor:
        """A tensor over ``t``'s bytes (same pointer, shape, stride, dtype) that owns nothing."""
        owner = owner or self.owner(t)
        base = owner.base(self)
        if t.numel() == 0 or not owner.nbytes:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        offset = t.data_ptr() - owner.ptr
        key = (offset, t.shape, t.stride(), t.dtype)
        alias = owner._aliases.get(key)
        if alias is None:
            alias = torch.empty(0, dtype=t.dtype, device=MEMORY).set_(
                base.untyped_storage(), offset // t.element_size(), t.shape, t.stride()
            )
            if t.device.type == "npu":  # the same alias, labelled as the device's memory it is
                alias = _device.device_view(alias, t.device.index or 0)
                # its storage is a view of the alias base: the same memory, the same owner
                self.owners[int(alias.untyped_storage()._cdata)] = owner
            owner._aliases[key] = alias
        return alias

    def hold(self, name: str, t: torch.Tensor, *, checked: bool = True) -> tuple[torch.Tensor, ArgRef]:
        """What a graph node keeps of a tensor argument: an alias, and a liveness check.

        Pool memory is the graph's own and is never checked; 0-d tensors are host
        scalars passed by value (kept as they are).  ``checked=False`` for scratch
        (workspaces), which hardware lets a kernel reuse serially.
        """
        owner = self.owner(t)
        return self.alias(t, owner), ArgRef(name, owner, checked and owner.pool is None)

    def allocate(
        self, pool_id: tuple[int, int], shape: Any, stride: Any, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Allocate a tensor from a graph pool (during capture); poisoned if the block is new."""
        size = [int(s) for s in shape]
        strides = [int(s) for s in stride]
        numel_span = 1 + sum((s - 1) * st for s, st in zip(size, strides)) if all(size) else 0
        nbytes = numel_span * torch.empty(0, dtype=dtype, device=MEMORY).element_size()
        if nbytes == 0:
            return torch.empty_strided(size, strides, dtype=dtype, device=device)
        block = self.pool(pool_id).block(nbytes, self, device)
        t = torch.empty(0, dtype=dtype, device=device).set_(block.keeper.untyped_storage(), 0, size, strides)
        if block.fresh and t.is_floating_point():
            t.fill_(float("nan"))  # a read before replay shows
        return t

    def _prune(self) -> None:
        """Forget eager memory that neither its owners nor any alias use any more."""
        dead = {id(o) for o in self.owners.values() if o.pool is None and not o.in_use() and not o.aliased()}
        self.owners = {c: o for c, o in self.owners.items() if id(o) not in dead}
        self._prune_at = max(1024, 2 * len(self.owners))
        self._eager_bytes = sum(o.nbytes for o in self.owners.values() if o.pool is None)
        self._prune_bytes_at = self._eager_bytes + _PRUNE_BYTES


# argument values that hold no memory (most of a kernel's keyword arguments): neither
# placed, nor compared as tensors, nor aliased
SCALARS = frozenset((bool, int, float, str))


def hold_tree(memory: Memory, name: str, v: Any, refs: list[ArgRef], *, checked: bool = True) -> Any:
    """Replace every tensor in ``v`` by a non-owning alias; note a liveness check for each.

    A graph keeps memory, not Python objects: what a node holds must not keep the
    capturing code's tensors alive.  0-d eager tensors are host scalars, passed by value.
    """
    if isinstance(v, torch.Tensor):
        if v.device.type not in ("cpu", "npu"):
            return v
        if v.dim() == 0:
            owner = memory.owners.get(int(v.untyped_storage()._cdata))
            if owner is None or owner.pool is None:
                return v
        alias, ref = memory.hold(name, v, checked=checked)
        refs.append(ref)
        return alias
    if isinstance(v, (list, tuple)) and any(isinstance(x, (torch.Tensor, list, tuple)) for x in v):
        held = [hold_tree(memory, f"{name}[{i}]", x, refs, checked=checked) for i, x in enumerate(v)]
        return held if isinstance(v, list) else tuple(held)
    return v


def hold_params(memory: Memory, op: Any, params: dict[str, Any]) -> tuple[dict[str, Any], tuple[ArgRef, ...]]:
    """A kernel's parameters as a graph keeps them: aliases, and checks for data arguments."""
    refs: list[ArgRef] = []
    # no mode may see the aliases made here (a capture's recorder would record them); torch's C
    # guards, not popping the stacks, as this runs at every re-issue (issue #78)
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        held = {
            k: v
            if v is None or k in op.host_args or type(v) in SCALARS
            else hold_tree(memory, k, v, refs, checked=k != "workspace")
            for k, v in params.items()
        }
    return held, tuple(refs)
