"""The simulator's ``npu`` torch device: PrivateUse1 renamed ``npu``, over host memory.

:func:`install` builds (once, cached by torch's extension cache) and loads
``csrc/npu_device.cpp``, renames PrivateUse1 ``npu``, generates the ``Tensor.npu()`` family
and registers :mod:`npusim.npu` as ``torch.npu``.  Then ``torch.ones(4,
device="npu")``, ``.npu()``, ``.to("npu:1")``, ``.cpu()``, ``pin_memory()`` and every aten op
on npu tensors behave as with torch_npu: real storage, real data pointers (aliases share
them), the CPU kernels' math on that same memory, host versus device told by
``tensor.device``.

Why C++ and not torch's experimental Python backend
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``): that
backend's tensors are wrapper subclasses whose data lives beside, not in, their storage,
so ``data_ptr`` is not the memory and aliases do not share it — and the simulator's
pools, ``_weak_ref_tensor``, vLLM's input-address check and use-after-free detection all
rest on pointers.  A C++ PrivateUse1 backend over host memory (the shape of PyTorch's
OpenReg example) has them for free, and builds in about 15 s on two cores.

Installing is process-wide and cannot be undone (torch allows one PrivateUse1 name per
process); it is refused where PrivateUse1 already has another name (a real torch_npu).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BACKEND",
    "ENV_KEEP_HEAP",
    "ENV_MEMORY",
    "build",
    "card_size",
    "device_view",
    "host_available",
    "host_view",
    "install",
    "installed",
    "keep_host_heap",
    "memory_counters",
    "on_host",
]

BACKEND = "npu"
ENV_MEMORY = "NPUGRAPH_SIM_MEMORY_GB"
_CARD_MAX = 64 << 30  # an Atlas A2's HBM: the card never claims more than a real one has
_GIB = 1 << 30
_SOURCE = Path(__file__).parent / "csrc" / "npu_device.cpp"
_LIBRARY = "npugraph_sim_npu"


def host_available() -> int | None:
    """Bytes this host can back now: ``MemAvailable``, less where a cgroup (v2) limits the
    process further; ``None`` where it cannot tell."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


@functools.cache
def card_size() -> tuple[int, str]:
    """The simulated card's size in bytes, and how it was chosen (said at start-up).

    ``NPUGRAPH_SIM_MEMORY_GB`` when set; otherwise half of what the host can back when the
    process starts (the card is host memory, and the process's own work needs the rest),
    at most a real card's 64 GiB.  A malformed value raises ``ValueError`` naming it."""
    raw = os.environ.get(ENV_MEMORY, "").strip()
    if raw:
        try:
            gb = float(raw)
        except ValueError:
            gb = float("nan")
        if not gb > 0 or gb == float("inf"):
            raise ValueError(f"{ENV_MEMORY}={raw!r}: the simulated card's size must be a positive number of GiB")
        return int(gb * _GIB), f"{ENV_MEMORY}={raw}"
    available = host_available()
    if available is None:
        return _CARD_MAX, f"a real card's size: this host does not say what it has available; {ENV_MEMORY} sets it"
    size = min(_CARD_MAX, available // 2)
    return size, f"half of the {available / _GIB:.1f} GiB this host has available; {ENV_MEMORY} sets it"


def installed() -> bool:
    """Whether this process has the simulator's ``npu`` device."""
    return torch._C._get_privateuse1_backend_name() == BACKEND and _loaded()


def _loaded() -> bool:
    try:
        return hasattr(torch.ops.npugraph_sim, "host_view")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def build() -> None:
    """Compile (first time: about 15 s on two cores; then torch's cache) and load the backend."""
    from torch.utils.cpp_extension import load

    load(
        name=_LIBRARY,
        sources=[str(_SOURCE)],
        extra_cflags=["-O2"],
        is_python_module=False,
        verbose=os.environ.get("NPUGRAPH_SIM_BUILD_VERBOSE") == "1",
    )


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_FROM = 32 << 20  # glibc's largest mmap threshold on 64-bit hosts
_TRIM_FROM = 256 << 20


ENV_KEEP_HEAP = "NPUSIM_KEEP_HOST_HEAP"


def keep_host_heap() -> bool:
    """With ``NPUSIM_KEEP_HOST_HEAP=1``: serve the simulated device's allocations under 32 MiB
    from the host's heap, and keep up to 256 MiB of it free, instead of mapping and unmapping
    each one (glibc only; a process whose environment sets glibc's ``MALLOC_*`` knobs keeps its
    own).  Returns whether it did.

    Off by default: a ten-minute ``vllm serve`` soak under npugraph then saw its resident
    memory climb in 16 to 32 MB steps toward the heap's high-water mark (+2.3% over the second
    half, against the soak's 1% bar), where glibc's defaults return freed memory and the soak
    was flat (2026-12-07).  A bound that keeps both is to be found.

    The device's arithmetic runs on the host, in temporaries of megabytes each (a gathered
    key cache, float32 scores).  With glibc's defaults, once the heap was trimmed, each one
    was a fresh mapping whose pages the kernel faulted in and zeroed, and gave back when freed:
    ``npusim.bench``'s engine loop spent 16 of its 25 s in the kernel that way, and the
    re-issue after a layer's device work cost more for the caches and TLB that flushed (issue
    #78).  A device's memory is not mapped per allocation either: torch_npu caches it.
    Process-wide and for the life of the process, as the npu device is.
    """
    if os.environ.get(ENV_KEEP_HEAP) != "1":
        return False
    if sys.platform != "linux" or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_FROM))


def install(module: Any) -> None:
    """Give this process the simulator's ``npu`` device (idempotent), with ``module`` (the
    simulated ``torch.npu``) as torch's ``npu`` device module.

    Raises ``RuntimeError`` where PrivateUse1 is another backend's already (a real
    torch_npu is loaded: two NPU backends cannot share one process).
    """
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", BACKEND):
        raise RuntimeError(
            f"npusim: PrivateUse1 is already the {name!r} backend in this process; the simulator's "
            "npu device cannot be installed beside it"
        )
    if installed():
        return
    if name == BACKEND and not _loaded():
        raise RuntimeError(
            "npusim: another backend already named PrivateUse1 'npu' (a real torch_npu?); the "
            "simulator's device cannot be installed beside it"
        )
    present = getattr(torch, BACKEND, None)
    if present is not None and present is not module:
        raise RuntimeError(
            f"npusim: torch.{BACKEND} is already {present!r}, not the simulator's; its npu device "
            "cannot be installed beside it"
        )
    build()
    keep_host_heap()
    # torch.accelerator.synchronize() reaches the device guard, which calls this op
    torch.library.impl("npugraph_sim::synchronize_device", "CompositeExplicitAutograd")(
        lambda index: module.synchronize()
    )
    torch.utils.rename_privateuse1_backend(BACKEND)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    if present is None:
        torch._register_device_module(BACKEND, module)
    else:  # install_torch_npu made it torch.npu already: what registering would do, less the refusal
        sys.modules[f"torch.{BACKEND}"] = module
    torch.ops.npugraph_sim.set_capacity(card_size()[0])  # past it, allocations are the card's OOM
    # The device's compute is the host's OpenMP pool, which does not survive a fork: a child
    # whose parent ran a parallel region hangs in libgomp at its first one (vLLM forks its
    # engine after the front end wrote a checkpoint or ran npu ops).  A forked child computes
    # on one thread, as torch's DataLoader workers do; the device's ops keep it so, whatever
    # raises the count later (npu_device.cpp: one_thread_if_forked).
    os.register_at_fork(after_in_child=_one_thread)


def _one_thread() -> None:
    torch.set_num_threads(1)


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor over an npu tensor's memory (simulated device memory is host memory):
    what the simulator's kernels compute on.  It keeps that memory alive."""
    return torch.ops.npugraph_sim.host_view(t)  # type: ignore[no-any-return]


def on_host(v: Any) -> Any:
    """``v`` with every npu tensor (also inside lists, tuples and dicts) replaced by a CPU
    tensor over the same memory, and an npu ``device`` by the CPU: how the simulator runs
    device work (kernels, a graph's aten ops) on the host without the backend's per-op
    fallback."""
    if isinstance(v, torch.Tensor):
        return host_view(v) if v.device.type == BACKEND else v
    if isinstance(v, torch.device):
        return _CPU if v.type == BACKEND else v
    if isinstance(v, list):
        return [on_host(x) for x in v]
    if isinstance(v, tuple):
        return tuple(on_host(x) for x in v)
    if isinstance(v, dict):
        return {k: on_host(x) for k, x in v.items()}
    return v


_CPU = torch.device("cpu")


def device_view(t: torch.Tensor, index: int = 0) -> torch.Tensor:
    """An ``npu:index`` tensor over a CPU tensor's memory (no copy); it keeps ``t`` alive."""
    return torch.ops.npugraph_sim.device_view(t, index)  # type: ignore[no-any-return]


def memory_counters(index: int) -> tuple[int, int, int, int]:
    """(allocated bytes, peak bytes, allocations, frees) of ``npu:index`` since the start."""
    allocated, peak, allocs, frees = torch.ops.npugraph_sim.memory_stats(index)
    return int(allocated), int(peak), int(allocs), int(frees)


def reset_peak(index: int) -> None:
    torch.ops.npugraph_sim.reset_peak(index)


def current_index() -> int:
    return int(torch.ops.npugraph_sim.current_device())


def set_index(index: int) -> None:
    torch.ops.npugraph_sim.set_device(index)


def device_count() -> int:
    return int(torch.ops.npugraph_sim.device_count())
