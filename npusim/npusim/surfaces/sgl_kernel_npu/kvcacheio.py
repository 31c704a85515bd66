"""``sgl_kernel_npu.kvcacheio``: KV-cache copies between the device and host memory (SGLang's
hierarchical cache).  Not simulated: the names exist for SGLang's imports."""

from __future__ import annotations

from enum import Enum

from npusim.surfaces.not_simulated import not_simulated

__all__ = [
    "TransferDirection",
    "TransferFlag",
    "transfer_kv_dim_exchange",
    "transfer_state_all_layer_direct_lf_pf",
    "transfer_state_per_layer_direct_pf_lf",
    "transfer_mamba_state",
]


class TransferDirection(Enum):
    H2D = 1
    D2H = 2


class TransferFlag(Enum):
    FAST2D = 2


_WHY = "SGLang's hierarchical host KV cache"
transfer_kv_dim_exchange = not_simulated("sgl_kernel_npu.kvcacheio.transfer_kv_dim_exchange", _WHY)
transfer_state_per_layer_direct_pf_lf = not_simulated(
    "sgl_kernel_npu.kvcacheio.transfer_state_per_layer_direct_pf_lf", _WHY
)
transfer_state_all_layer_direct_lf_pf = not_simulated(
    "sgl_kernel_npu.kvcacheio.transfer_state_all_layer_direct_lf_pf", _WHY
)
transfer_mamba_state = not_simulated("sgl_kernel_npu.kvcacheio.transfer_mamba_state", _WHY)
