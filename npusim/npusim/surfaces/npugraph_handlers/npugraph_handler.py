"""The handler base class and registry (torch_npu's ``_npugraph_handlers/npugraph_handler.py``).

Handlers are stateless: every hook is a classmethod and the registry holds the classes,
keyed by the op's ``__name__`` (``"npu_fused_infer_attention_score.out"``).  The capture and
update skeletons that call the hooks are :mod:`npusim.surfaces.graphs`'.
"""

from __future__ import annotations

import copy
import logging
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from npusim.runtime.capture import weak_ref_tensor

__all__ = ["NpuGraphOpHandler", "kept", "register_npu_graph_handler", "torch_npu"]

logger = logging.getLogger(__name__)

# op name -> handler class: the one registry graphs read at each capture and update (a
# process-wide table, as torch_npu's; tests save and restore it around themselves)
_NPU_GRAPH_OP_HANDLERS: dict[str, type[NpuGraphOpHandler]] = {}

H = TypeVar("H", bound="type[NpuGraphOpHandler]")


def torch_npu() -> types.ModuleType:
    """The ``torch_npu`` module as it is now: handlers call its names at call time, as
    torch_npu's do (SGLang replaces some of them with its batch-invariant kernels)."""
    module = sys.modules.get("torch_npu")
    return module if module is not None else sys.modules["npusim"]


def _is_npu(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and "npu" in str(t.device)


def kept(value: Any) -> Any:
    """A value as a dispatch record keeps it: a device tensor as a non-owning alias
    (``torch_npu._C._weak_ref_tensor``), anything else copied."""
    return weak_ref_tensor(value) if _is_npu(value) else copy.deepcopy(value)


class NpuGraphOpHandler:
    """What ``NPUGraph``'s auto-dispatch capture and ``update`` do for one kind of op."""

    # op name -> [(where, index or name, update key)]: where is "arg" (an index into the
    # record's args) or "kwarg" (a name in its kwargs); the key is what cpu_update_input says
    UPDATE_SPECS: dict[str, list[tuple[str, int | str, str]]] = {}

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """Before the op's task group: allocate what it needs, swap the overload; returns
        ``(func, args, kwargs)`` to capture.  By default, unchanged."""
        return func, args, kwargs

    @classmethod
    def postprocess_result(cls, result: Any, kwargs: dict[str, Any]) -> Any:
        """What the caller of the captured op gets back.  By default, the op's result."""
        return result

    @classmethod
    def get_update_specs(cls, op_name: str) -> list[tuple[str, int | str, str]]:
        return cls.UPDATE_SPECS.get(op_name, [])

    @classmethod
    def update_args(cls, dispatch_record: Any, update_input: dict[str, Any]) -> None:
        """Apply ``update_input`` to the record by this handler's specs (after the generic
        rewrite of the record's kwargs that ``update`` does first)."""
        for where, at, key in cls.get_update_specs(dispatch_record.op_cache_entry.__name__):
            if key not in update_input:
                continue
            if where == "arg":
                if isinstance(at, int) and len(dispatch_record.args) > at:
                    dispatch_record.args[at] = update_input[key]
            elif where == "kwarg":
                dispatch_record.kwargs[at] = update_input[key]

    @classmethod
    def record_wrap_kwarg(cls, key: str, value: Any, tensor_param_names: Iterable[str]) -> Any:
        """A keyword argument as the record keeps it: device tensors as non-owning aliases,
        anything else copied."""
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            return type(value)(kept(v) for v in value)
        if key in tensor_param_names and _is_npu(value):
            return weak_ref_tensor(value)
        return copy.deepcopy(value)


def register_npu_graph_handler(op_names: str | Iterable[str]) -> Callable[[H], H]:
    """Class decorator: ``cls`` handles each of ``op_names`` (an op's ``__name__``); a name
    registered before is overridden, with a warning."""
    names = [op_names] if isinstance(op_names, str) else list(op_names)

    def register(cls: H) -> H:
        for name in names:
            old = _NPU_GRAPH_OP_HANDLERS.get(name)
            if old is not None:
                logger.warning(
                    "NpuGraphOpHandler for '%s' is being overridden: %s -> %s", name, old.__name__, cls.__name__
                )
            _NPU_GRAPH_OP_HANDLERS[name] = cls
        return cls

    return register
