"""``torch.npu``-shaped API of the simulated device (streams, events, graphs, task groups)."""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any

import attrs
import torch

from npusim.device import backend as _device
from npusim.runtime import state as rt
from npusim.runtime.external import ExternalEvent
from npusim.runtime.graph import graph_pool_handle
from npusim.runtime.state import Event, Stream
from npusim.runtime.taskgroups import (
    NPUTaskGroupHandle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)
from npusim.surfaces import npugraph_ex
from npusim.surfaces.acl import SOC_NAME
from npusim.surfaces.graphs import NPUGraph, graph
from npusim.surfaces.not_simulated import not_simulated
from npusim.surfaces.npugraph_handlers import NpuGraphOpHandler, register_npu_graph_handler
from npusim.surfaces.streams import StreamContext

__all__ = [
    "NPUGraph",
    "NpuGraphOpHandler",
    "register_npu_graph_handler",
    "npugraph_ex",
    "NPUTaskGroupHandle",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "Event",
    "ExternalEvent",
    "Stream",
    "current_stream",
    "default_stream",
    "stream",
    "StreamContext",
    "synchronize",
    "set_device",
    "current_device",
    "device_count",
    "is_available",
    "is_initialized",
    "is_current_stream_capturing",
    "empty_cache",
    "device",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
    "set_stream",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "memory_stats",
    "mem_get_info",
    "get_device_name",
    "get_soc_version",
    "get_device_properties",
    "get_device_capability",
    "set_compile_mode",
    "config",
    "memory",
]


def current_stream(device: Any = None) -> Stream:
    """Return the stream that work is issued on now."""
    return rt.get_state().current_stream


def default_stream(device: Any = None) -> Stream:
    """Return the device's default (legacy) stream."""
    return rt.get_state().default_stream


def stream(s: Stream | None) -> StreamContext:
    """Issue the body's work on ``s`` (``torch.npu.stream``: a reusable ``StreamContext``)."""
    return StreamContext(s)


@rt.locked
def synchronize(device: Any = None) -> None:
    """Wait for all queued work; raises :class:`~npusim.DeadlockError` if it cannot finish."""
    st = rt.get_state()
    st.charge("synchronize")
    st.drain("torch.npu.synchronize()")


def _index(device: Any) -> int:
    """The device index of ``device``: an int, ``"npu:1"``, a ``torch.device``, or None (current)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    text = str(device)
    if not text.startswith("npu"):
        raise ValueError(f"expected an npu device, got {device!r}")
    return int(text.rpartition(":")[2]) if ":" in text else current_device()


def set_device(device: Any) -> None:
    """Select the current device (``npu:N``; without the ``npu`` device installed there is one)."""
    idx = _index(device)
    if _device.installed():
        _device.set_index(idx)
    elif idx != 0:
        raise RuntimeError(f"invalid device ordinal {idx}: the simulator has one device (0)")
    rt.get_state().device_index = idx


def current_device() -> int:
    return _device.current_index() if _device.installed() else rt.get_state().device_index


def device_count() -> int:
    """The simulated cards (``NPUGRAPH_SIM_DEVICES``, default 8, with the ``npu`` device; else 1)."""
    return _device.device_count() if _device.installed() else 1


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    """torch_npu initialises the device lazily; the simulator is always ready."""


class device:  # torch.npu.device is a class
    """Context manager that makes ``idx`` the current device (``torch.npu.device``)."""

    def __init__(self, idx: Any) -> None:
        self.idx = _index(idx) if idx is not None and idx != -1 else current_device()
        self.prev = self.idx

    def __enter__(self) -> None:
        self.prev = current_device()
        if self.idx != self.prev:
            set_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        if self.prev != current_device():
            set_device(self.prev)


def manual_seed(seed: int) -> None:
    """Random ops on npu run the CPU kernels with the CPU generator: seed that one."""
    torch.random.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    torch.random.default_generator.seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return int(torch.random.default_generator.initial_seed())


def set_stream(s: Stream) -> None:
    """Make ``s`` the current stream (``torch.npu.set_stream``)."""
    rt.get_state().current_stream = s


# --- memory: real figures of the simulated device -------------------------------------
@functools.cache
def _total_bytes() -> int:
    """The simulated card's size (what mem_get_info reports as total), said once per process
    when it was chosen for the user: an engine sizes its caches from it."""
    size, how = _device.card_size()
    if not os.environ.get(_device.ENV_MEMORY, "").strip():
        sys.stderr.write(f"npusim: each simulated npu card has {size / (1 << 30):.1f} GiB ({how})\n")
    return size


def _counters(device: Any) -> tuple[int, int, int, int]:
    if not _device.installed():
        return (0, 0, 0, 0)
    return _device.memory_counters(_index(device))


def memory_allocated(device: Any = None) -> int:
    """Bytes of npu tensors alive on ``device`` (graph pools' blocks included)."""
    return _counters(device)[0]


def max_memory_allocated(device: Any = None) -> int:
    return _counters(device)[1]


def memory_reserved(device: Any = None) -> int:
    """The simulator caches nothing: reserved is what is allocated."""
    return _counters(device)[0]


def max_memory_reserved(device: Any = None) -> int:
    return _counters(device)[1]


def reset_peak_memory_stats(device: Any = None) -> None:
    if _device.installed():
        _device.reset_peak(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def memory_stats(device: Any = None) -> dict[str, int]:
    """torch_npu's (and torch.cuda's) memory statistics, from the simulated device's counters."""
    allocated, peak, allocs, frees = _counters(device)
    stats: dict[str, int] = {"num_alloc_retries": 0, "num_ooms": 0}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        stats[f"{kind}.all.current"] = allocated
        stats[f"{kind}.all.peak"] = peak
    stats["allocation.all.allocated"] = allocs
    stats["allocation.all.freed"] = frees
    stats["allocation.all.current"] = allocs - frees
    return stats


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the simulated card: its size (``NPUGRAPH_SIM_MEMORY_GB``, by
    default half of what the host can back) less what is allocated."""
    return max(0, _total_bytes() - memory_allocated(device)), _total_bytes()


# --- what the card is --------------------------------------------------------------------
_SOC_NAME = SOC_NAME  # pyACL's stand-in holds it (npusim.surfaces.acl)
_SOC_VERSION = 220  # torch_npu's number for Ascend910B1 (A2: 220-225)


def get_device_name(device: Any = None) -> str:
    return _SOC_NAME


def get_soc_version() -> int:
    """torch_npu's SoC number: the simulator is an Atlas A2 (Ascend910B1)."""
    return _SOC_VERSION


@attrs.frozen
class _DeviceProperties:
    name: str
    total_memory: int
    major: int = 2
    minor: int = 0
    multi_processor_count: int = 24  # AI cores of an Ascend910B1
    cube_core_num: int = 24
    vector_core_num: int = 48


def get_device_properties(device: Any = None) -> _DeviceProperties:
    _index(device)
    return _DeviceProperties(name=_SOC_NAME, total_memory=_total_bytes())


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (2, 0)


def set_compile_mode(jit_compile: bool = False) -> None:
    """torch_npu's operator compile mode: no effect on the simulator."""


# torch.npu.config: allow_internal_format is read and set by vllm-ascend's runner
config = types.SimpleNamespace(allow_internal_format=False)


# what vllm-ascend's sleep mode needs and the simulator does not have
_NO_POOLS = "it has no pluggable device allocators or memory pools, which vllm-ascend's sleep mode needs"


# torch.npu.memory: the names vllm-ascend's camem allocator imports (refused when called)
memory = types.SimpleNamespace(
    NPUPluggableAllocator=not_simulated("torch.npu.memory.NPUPluggableAllocator", _NO_POOLS),
    MemPool=not_simulated("torch.npu.memory.MemPool", _NO_POOLS),
    use_mem_pool=not_simulated("torch.npu.memory.use_mem_pool", _NO_POOLS),
    memory_snapshot=lambda: [],
    mem_get_info=lambda device=None: mem_get_info(device),
    memory_stats=lambda device=None: memory_stats(device),
)


def is_current_stream_capturing() -> bool:
    """True while the current stream is capturing a graph."""
    st = rt.get_state()
    return st.capture is not None and st.capture.stream is st.current_stream


def empty_cache() -> None:
    """Release cached free memory (the simulator caches none: a no-op).

    Graph pools are not affected, as on hardware.
    """
