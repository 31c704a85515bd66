"""``acl``: pyACL, CANN's Python API, for what other people's code asks of it on an Ascend host.

CANN installs ``acl`` with its toolkit; no index has it, and no machine here has CANN.  Ray
asks it what a node has (``ray/_private/accelerators/npu.py``): ``acl.rt.get_device_count()``
for how many NPUs, ``acl.get_soc_name()`` for their type (the ``accelerator_type:Ascend910B1``
label it puts on the node).  Without it, every ``ray start`` on a simulated host logged
"Failed to detect NPU type" with a traceback, and the node carried no NPU type.

With ``NPUSIM_TORCH_NPU=1`` ``import acl`` gives this module (npusim_hook's finder; a real
pyACL wins), loaded from its file alone: it imports neither torch nor the rest of npusim,
because it is asked in processes that run no model (Ray's ``ray start`` and raylets).  Only
the calls listed in ``__all__`` exist; any other pyACL name raises ``AttributeError``.
"""

from __future__ import annotations

import os
import types

__all__ = ["SOC_NAME", "get_soc_name", "rt"]

SOC_NAME = "Ascend910B1"  # the simulated card: an Atlas A2 (npusim.npu reports the same)
SUCCESS = 0  # pyACL's ACL_SUCCESS


def get_soc_name() -> str:
    """The SoC's name, as ``torch_npu.npu.get_device_name()`` gives it."""
    return SOC_NAME


def _device_count() -> tuple[int, int]:
    """pyACL's ``(count, ret)``: the simulator's cards, as its ``npu`` device counts them
    (``NPUGRAPH_SIM_DEVICES``, 1 to 64, else 8: npusim/device/csrc/npu_device.cpp)."""
    try:
        n = int(os.environ.get("NPUGRAPH_SIM_DEVICES", "8"))
    except ValueError:
        n = 8
    return (n if 0 < n <= 64 else 8), SUCCESS


# pyACL's runtime namespace, ``acl.rt``
rt = types.SimpleNamespace(get_device_count=_device_count)
