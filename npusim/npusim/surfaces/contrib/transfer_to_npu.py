"""``torch_npu.contrib.transfer_to_npu``: importing it points CUDA code at the NPU.

As torch_npu's module does on import (names and semantics, not code), for the whole process
and for good:

* ``torch.cuda`` takes ``torch.npu``'s public names (``synchronize``, ``Stream``,
  ``mem_get_info``, ...), ``torch.cuda.CUDAGraph`` is ``NPUGraph``, ``torch.cuda.is_available()``
  is true;
* the device arguments of torch's tensor factories, of ``Tensor.to`` / ``new_*`` /
  ``pin_memory``, of ``Module.to`` / ``to_empty`` and of a set of ``torch.cuda`` functions say
  ``npu`` where they said ``cuda`` (a string, a ``torch.device``, a bare index for ``to``);
  ``Tensor.cuda`` / ``Module.cuda`` are ``npu``, ``Tensor.is_cuda`` is ``is_npu``;
* ``torch.distributed.init_process_group`` takes ``hccl`` for ``nccl``;
  ``is_nccl_available`` is ``is_hccl_available``.

What torch_npu also patches and the simulator leaves: its inductor and dynamo hooks (Triton
off, the GPU type), ``torch.jit.script``, FSDP, pipelining and device meshes, the profiler,
generators and third-party libraries listed in its ``apis_config.json``.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__: list[str] = []

_TORCH_FNS = (
    "arange", "as_tensor", "empty", "empty_like", "empty_strided", "eye", "frombuffer", "full", "full_like",
    "linspace", "load", "logspace", "normal", "ones", "ones_like", "rand", "rand_like", "randint", "randint_like",
    "randn", "randn_like", "randperm", "range", "scalar_tensor", "tensor", "tril_indices", "triu_indices",
    "zeros", "zeros_like", "set_default_device", "get_device_module",
)  # fmt: skip
_TENSOR_FNS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros", "to", "pin_memory")
_MODULE_FNS = ("to", "to_empty")
_CUDA_FNS = (
    "get_device_properties", "get_device_name", "get_device_capability", "set_device", "synchronize",
    "mem_get_info", "memory_stats", "memory_allocated", "max_memory_allocated", "reset_max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "default_stream", "current_stream",
    "set_per_process_memory_fraction",
)  # fmt: skip
_DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")
_log = logging.getLogger("torch_npu.contrib.transfer_to_npu")


def _to_npu(value: Any, index_is_device: bool) -> Any:
    if isinstance(value, str) and "cuda" in value:
        return value.replace("cuda", "npu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("npu" if value.index is None else f"npu:{value.index}")
    if index_is_device and isinstance(value, int) and not isinstance(value, bool):
        return f"npu:{value}"
    if isinstance(value, dict):
        return {
            (k.replace("cuda", "npu") if isinstance(k, str) else k): (
                v.replace("cuda", "npu") if isinstance(v, str) else v
            )
            for k, v in value.items()
        }
    return value


def _npu_devices(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its device arguments said as ``npu`` where they said ``cuda``."""
    index_is_device = getattr(fn, "__name__", "") in ("to", "to_empty")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_to_npu(a, index_is_device) for a in args)
        for key in _DEVICE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = _to_npu(kwargs[key], True)
        if isinstance(kwargs.get("device_ids"), (list, tuple)):
            kwargs["device_ids"] = type(kwargs["device_ids"])(_to_npu(d, index_is_device) for d in kwargs["device_ids"])
        return fn(*args, **kwargs)

    wrapped._npugraph_transfer_to_npu = True  # type: ignore[attr-defined]
    return wrapped


def _wrap_all(owner: Any, names: tuple[str, ...]) -> None:
    for name in names:
        fn = getattr(owner, name, None)
        if fn is not None and not getattr(fn, "_npugraph_transfer_to_npu", False):
            setattr(owner, name, _npu_devices(fn))


def _hccl(fn: Callable[..., Any]) -> Callable[..., Any]:
    def say(v: Any) -> Any:
        return v.replace("nccl", "hccl").replace("cuda", "npu") if isinstance(v, str) else v

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args = tuple(say(a) for a in args)
        if "backend" in kwargs:
            kwargs["backend"] = say(kwargs["backend"])
        return fn(*args, **kwargs)

    return wrapped


def _init() -> None:
    # torch's DeviceContext (``with torch.device("npu"):``) knows its factories by identity, in
    # a set made on first use: made now, it holds torch's own functions, as the wrappers
    # below pass them on; made after, it would hold the wrappers and miss every call
    from torch.utils._device import _device_constructors

    _device_constructors()
    npu = torch.npu  # type: ignore[attr-defined]  # the simulator's torch.npu
    torch_npu = sys.modules["torch_npu"]
    _log.warning(
        "torch.cuda.* is torch.npu.* now; Tensor.cuda and Module.cuda are npu; device arguments saying cuda "
        "say npu; torch.distributed.init_process_group takes hccl for nccl"
    )
    for name in npu.__all__:  # torch_npu merges torch.npu's public names into torch.cuda
        setattr(torch.cuda, name, getattr(npu, name))
    torch.cuda.CUDAGraph = npu.NPUGraph  # type: ignore[attr-defined, misc]
    torch.cuda.is_available = lambda: True
    _wrap_all(torch.cuda, _CUDA_FNS)
    _wrap_all(torch, _TORCH_FNS)
    _wrap_all(torch.Tensor, _TENSOR_FNS)
    _wrap_all(torch.nn.Module, _MODULE_FNS)
    torch.Tensor.cuda = torch.Tensor.npu  # type: ignore[attr-defined, method-assign]
    torch.Tensor.is_cuda = torch.Tensor.is_npu  # type: ignore[attr-defined, method-assign]
    torch.nn.Module.cuda = torch.nn.Module.npu  # type: ignore[attr-defined, method-assign]
    dist = torch.distributed
    if not getattr(dist.init_process_group, "_npugraph_transfer_to_npu", False):
        hccl_init = _npu_devices(_hccl(dist.init_process_group))
        dist.init_process_group = hccl_init
    dist.is_nccl_available = getattr(dist, "is_hccl_available", lambda: True)
    c10d = getattr(torch_npu._C, "_distributed_c10d", None)
    if c10d is not None:
        dist.ProcessGroupNCCL = c10d.ProcessGroupHCCL  # type: ignore[attr-defined, misc]
    torch._utils._get_available_device_type = lambda: "npu" if npu.is_available() else None


_init()
