"""What the simulator needs to know about an aten op before it runs it: which ops read
device memory on the host, which only allocate, and the outputs an op will produce.

Shared by capture (an op becomes a graph node) and stream-ordered eager work (an op
becomes work queued on a stream): both shape an op's outputs on meta tensors and
allocate them before the op runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "ALLOC_PACKETS",
    "HOST_READ_OPS",
    "HOST_READ_METHODS",
    "HostReadMode",
    "is_host_read",
    "ShapeUnknown",
    "PlannedOp",
    "plan_outputs",
    "op_device",
    "run_planned",
]

_aten = torch.ops.aten

# ops that only allocate: nothing to run, on the device or at replay
ALLOC_PACKETS = frozenset(
    {
        _aten.empty,
        _aten.empty_strided,
        _aten.empty_like,
        _aten.new_empty,
        _aten.new_empty_strided,
    }
)

# ops that hand a device value to the host (``item()``, ``torch.equal``, ``bool(t)``)
HOST_READ_OPS = frozenset(
    {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default, _aten.allclose.default}
)

# Tensor methods that read memory on the host without an aten op the dispatcher sees
HOST_READ_METHODS = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
        torch.Tensor.__array__,
    }
)


def is_host_read(func: Any, args: Sequence[Any], on_read: Callable[[torch.Tensor, str], None]) -> bool:
    """Whether aten op ``func`` hands device values to the host; if so, ``on_read`` each tensor first."""
    if func not in HOST_READ_OPS:
        return False
    for a in args:
        if isinstance(a, torch.Tensor):
            on_read(a, f"{func.overloadpacket.__name__}()")
    return True


class HostReadMode(TorchFunctionMode):
    """Calls ``on_read(tensor, "tolist()")`` before a Tensor method reads memory on the host."""

    def __init__(self, on_read: Callable[[torch.Tensor, str], None]) -> None:
        super().__init__()
        self.on_read = on_read

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
            self.on_read(args[0], f"{func.__name__}()")
        return func(*args, **kwargs)


class ShapeUnknown(Exception):
    """An op's outputs cannot be known before it runs (data-dependent shapes, host values).

    ``host_value``: the op returns a host value (not a tensor); outside :data:`HOST_READ_OPS`
    such ops answer from metadata (``is_same_size``).
    """

    def __init__(self, message: str, *, host_value: bool = False) -> None:
        super().__init__(message)
        self.host_value = host_value


@attrs.define
class PlannedOp:
    """An aten op whose outputs exist before it runs.

    ``result``: what the op returns (fresh buffers, or the arguments it returns in place);
    ``fresh``: ``(return index, buffer or list of buffers)`` the op's results are copied
    into when it runs; ``written``: the tensors it mutates.
    """

    result: Any
    fresh: list[tuple[int, Any]]
    written: list[torch.Tensor]


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def plan_outputs(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    alloc: Callable[[Any, Any, torch.dtype, torch.device], torch.Tensor],
) -> PlannedOp:
    """Shape ``func``'s outputs on meta tensors and allocate them with
    ``alloc(shape, stride, dtype, device)``, on the op's device (:func:`op_device`).

    An allocation op (``empty``...) is planned as its buffer alone (no ``fresh``: nothing
    to run).  Raises :class:`ShapeUnknown` when the outputs depend on the data.
    """
    schema = func._schema
    try:
        meta_out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
    except Exception as exc:
        raise ShapeUnknown(
            f"its output shape could not be inferred without running it ({type(exc).__name__}: {exc})"
        ) from exc
    device = op_device(args, kwargs)
    if func.overloadpacket in ALLOC_PACKETS:
        return PlannedOp(alloc(meta_out.shape, meta_out.stride(), meta_out.dtype, device), [], [])
    returns = schema.returns
    metas = meta_out if len(returns) > 1 else (meta_out,)
    named = _bind_args(schema, args, kwargs)
    outs: list[Any] = []
    fresh: list[tuple[int, Any]] = []
    for i, (r, m) in enumerate(zip(returns, metas)):
        if r.alias_info is not None:
            outs.append(_aliased(schema, r.alias_info, named))
        elif isinstance(m, torch.Tensor):
            buf = alloc(m.shape, m.stride(), m.dtype, device)
            outs.append(buf)
            fresh.append((i, buf))
        elif isinstance(m, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in m):
            bufs = [alloc(x.shape, x.stride(), x.dtype, device) for x in m]
            outs.append(bufs)
            fresh.append((i, bufs))
        else:
            raise ShapeUnknown(
                f"it returns a host value ({type(m).__name__}) computed from device data", host_value=True
            )
    written: list[torch.Tensor] = []
    for arg in schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write:
            v = named.get(arg.name)
            written.extend(t for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor))
    # an op that returns nothing (``_foreach_copy_(...) -> ()``) returns None, as aten's does
    result = None if not returns else outs[0] if len(returns) == 1 else tuple(outs)
    return PlannedOp(result, fresh, written)


def op_device(args: Any, kwargs: dict[str, Any]) -> torch.device:
    """Where an op's outputs live: the ``npu`` device of an operand (or of its ``device=``),
    else the CPU (host work, which no graph records and no stream orders)."""
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "npu":
        return torch.device(dev)
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.device.type == "npu":
            return x.device
    return _CPU


_CPU = torch.device("cpu")


def run_planned(func: Any, args: Any, kwargs: Any, fresh: list[tuple[int, Any]]) -> None:
    """Run ``func`` and copy its results into the buffers planned for them."""
    res = func(*args, **kwargs)
    if not fresh:
        return
    outs = res if isinstance(res, (tuple, list)) else (res,)
    for i, buf in fresh:
        if isinstance(buf, list):
            for b, r in zip(buf, outs[i]):
                b.copy_(r)
        else:
            buf.copy_(outs[i])


def _bind_args(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    named: dict[str, Any] = {}
    for a, v in zip(schema.arguments, args):
        named[a.name] = v
    named.update(kwargs)
    return named


def _aliased(schema: Any, alias: Any, named: dict[str, Any]) -> Any:
    for arg in schema.arguments:
        if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
            return named[arg.name]
    raise ShapeUnknown(f"cannot resolve the aliased output of {schema.name}")
