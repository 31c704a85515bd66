"""The simulator's kernels as torch ops (``torch.ops.npu.<name>``), as torch_npu's are.

torch_npu's kernels are registered torch ops, so ``torch.compile`` (vLLM's
``VLLM_COMPILE`` mode, which vllm-ascend's ACL graph mode needs) keeps a call to one as a
single opaque node of its graph and learns its outputs' shapes from the op's fake
implementation.  The simulator's kernels are Python functions: traced as they are, Dynamo
would walk into the simulator itself (its lock, its queues) and stop.  Registered here,
each becomes an op with a kernel for the ``npu`` device (the function) and a fake
implementation (the same function: it validates and allocates its outputs, and
:func:`npusim.runtime.launch.launch` does nothing for fake tensors).

Only the ops a compiled model region calls directly are registered: attention and the
KV-cache writes run inside engines' own custom ops (vLLM's ``unified_attention_with_output``),
which Dynamo never enters.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from npusim.kernels import dense, quant

__all__ = ["NAMESPACE", "TORCH_OPS", "define", "register"]

NAMESPACE = "npu"
# name -> (the kernel module, the arguments it writes in place: torch.library's ``mutates_args``)
TORCH_OPS: dict[str, tuple[types.ModuleType, tuple[str, ...]]] = {
    "npu_rms_norm": (dense, ()),
    "npu_add_rms_norm": (dense, ()),
    "npu_swiglu": (dense, ()),
    # vllm-ascend's default fusion pass traces them on npu tensors when it registers
    "npu_dynamic_quant": (quant, ()),
    "npu_add_rms_norm_dynamic_quant": (quant, ()),
    # and, with vllm-ascend 0.30's own custom ops, its static-quantisation patterns
    "npu_quantize": (quant, ()),
    "npu_add_rms_norm_quant": (quant, ()),
}


def _registered(name: str) -> Any:
    try:
        return getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return None


def define(qualname: str, schema: str, fn: Any, key: str = "PrivateUse1") -> None:
    """The op ``qualname`` (``namespace::name``) of ``schema`` (from its arguments on), whose
    kernel for dispatch key ``key`` is ``fn``.  A kernel for the ``npu`` device (PrivateUse1) is
    its own fake implementation: it validates, allocates its outputs and launches nothing for
    fake tensors (:func:`npusim.runtime.launch.launch`)."""
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, key)(fn)
    if key == "PrivateUse1":
        torch.library.register_fake(qualname)(fn)


def register(module: types.ModuleType) -> None:
    """Register each of :data:`TORCH_OPS` (once per process) and point ``module``'s name
    (the simulated ``torch_npu``) at the op, as ``torch_npu.npu_rms_norm`` is
    ``torch.ops.npu.npu_rms_norm``.  Needs the ``npu`` device installed."""
    for name, (kernels, mutates) in TORCH_OPS.items():
        packet = _registered(name)
        if packet is None:
            fn = getattr(kernels, name)
            qualname = f"{NAMESPACE}::{name}"
            schema = getattr(kernels, "SCHEMAS", {}).get(name)
            if schema is not None:  # declared as torch_npu declares it (custom_op cannot say it)
                define(qualname, schema.split(name, 1)[1], fn)
            else:
                op = torch.library.custom_op(qualname, fn, mutates_args=mutates, device_types="npu")
                op.register_fake(fn)
            packet = _registered(name)
        setattr(module, name, packet)
