"""``vllm_ascend.vllm_ascend_C``: vllm-ascend's own C++ custom ops, the ``torch.ops._C_ascend``
namespace its extension registers (``csrc/torch_binding.cpp``), for the kernels the models
served here reach.

vllm-ascend builds that extension from its sdist against CANN, which no machine here has.
Up to 0.23 each use of it had a fallback (``enable_custom_op()`` false: torch_npu's op),
and the release environment ran without it.  From 0.30 its RMSNorm with a residual imports
the extension unconditionally (``ops/layernorm.py``: ``npu_add_rms_norm_bias``), so every
decoder layer needs it.  Importing this module registers, under the extension's schemas:

* ``npu_add_rms_norm_bias``: the residual add and RMSNorm with an optional bias
  (:func:`npusim.kernels.dense.npu_add_rms_norm_bias`, checked against a float64 reference);
* ``device_print`` / ``device_print_tensor``: the extension's printing from a kernel (here
  from the host, when the op runs); vllm-ascend registers them as effectful ops at start-up;
* LoRA's ``bgmv_shrink``, ``bgmv_expand``, ``sgmv_shrink``, ``sgmv_expand``, which refuse when
  called (LoRA is not simulated): vllm-ascend 0.29's ``meta_registration`` gives the two
  expands a meta kernel at start-up, which needs the ops defined, as every build defines them.

Any other ``_C_ascend`` op is absent, as on a build for a SoC without it: vllm-ascend's
``getattr(torch.ops._C_ascend, name, None)`` checks fall back, and a direct call fails
naming the op.  :func:`install` makes ``import vllm_ascend.vllm_ascend_C`` load this module.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from npusim.kernels import dense
from npusim.surfaces import torch_ops
from npusim.surfaces.aliases import PackageAlias
from npusim.surfaces.not_simulated import not_simulated

__all__ = ["NAMESPACE", "SCHEMAS", "install", "uninstall"]

NAMESPACE = "_C_ascend"
# vllm-ascend 0.30.0rc2's csrc/torch_binding.cpp, for the ops below
SCHEMAS = {
    "npu_add_rms_norm_bias": (
        "(Tensor x1, Tensor x2, Tensor gamma, Tensor? beta=None, float epsilon=1e-6) -> (Tensor y, Tensor rstd, Tensor x)"
    ),
    "device_print": "(str msg) -> ()",
    "device_print_tensor": "(Tensor tensor) -> ()",
    "bgmv_shrink": "(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, float scale) -> ()",
    "bgmv_expand": (
        "(Tensor! x, Tensor! weight, Tensor! indices, Tensor! y, int slice_offset, int slice_size) -> Tensor"
    ),
    "sgmv_shrink": "(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, float scale) -> ()",
    "sgmv_expand": (
        "(Tensor! x, Tensor! weight, Tensor! lora_indices, Tensor! seq_len, Tensor! y, int slice_offset, "
        "int slice_size) -> Tensor"
    ),
}
# defined with a kernel that refuses and no fake of its own: vllm-ascend registers their meta kernels
_NOT_SIMULATED = ("bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand")
_ALIAS = PackageAlias("vllm_ascend.vllm_ascend_C", __name__)


def _device_print(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


def _device_print_tensor(tensor: torch.Tensor) -> None:
    print(tensor.cpu(), file=sys.stdout, flush=True)


def _register() -> None:
    """Define each op once per process (a second import, or a re-import after :func:`uninstall`,
    finds them defined)."""
    namespace = getattr(torch.ops, NAMESPACE)
    kernels: dict[str, tuple[Any, str]] = {
        "npu_add_rms_norm_bias": (dense.npu_add_rms_norm_bias, "PrivateUse1"),
        "device_print": (_device_print, "CompositeExplicitAutograd"),
        "device_print_tensor": (_device_print_tensor, "CompositeExplicitAutograd"),
    }
    for name, (fn, key) in kernels.items():
        if not hasattr(namespace, name):
            torch_ops.define(f"{NAMESPACE}::{name}", SCHEMAS[name], fn, key)
    for name in _NOT_SIMULATED:
        if not hasattr(namespace, name):
            qualname = f"{NAMESPACE}::{name}"
            torch.library.define(qualname, SCHEMAS[name])
            torch.library.impl(qualname, "PrivateUse1")(not_simulated(f"torch.ops.{NAMESPACE}.{name}", "LoRA"))


def install() -> None:
    """``import vllm_ascend.vllm_ascend_C`` gets this module (the ops registered on import)."""
    _ALIAS.install()


def uninstall() -> None:
    _ALIAS.uninstall()


_register()
