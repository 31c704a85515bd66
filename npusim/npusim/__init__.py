"""``npusim``: a CPU simulation of torch_npu's graph API with real PA/FIA kernels.

Shaped like ``torch_npu`` (the ops below, ``_C``) with ``npusim.npu`` shaped like
``torch.npu``, so code written for torch_npu runs on it with only the module swapped.
See docs/simulator.md for what it models and what it does not.

Simulator-only controls: :func:`configure` (adversarial scheduling, host-cost model),
:func:`counters` (device calls made so far), :func:`pool_bytes`.
"""

from __future__ import annotations

import collections
import importlib.machinery
import sys
import types
from typing import Any

import torch

import npusim_hook as _hook
from npusim import npu
from npusim.device import backend as _device
from npusim.errors import (
    CaptureError,
    ConcurrentUpdateError,
    DeadlockError,
    RaceError,
    ReplayFault,
    SimError,
    UpdateMismatchError,
    UseAfterFree,
    WorkspaceTooSmall,
)
from npusim.kernels.attention_update import npu_attention_update
from npusim.kernels.cache import PAD_SLOT_ID, _npu_reshape_and_cache, npu_gather_pa_kv_cache, npu_scatter_pa_kv_cache
from npusim.kernels.dense import (
    _npu_matmul_add_fp32,
    _npu_rotary_embedding,
    npu_add_rms_norm,
    npu_format_cast,
    npu_gemma_rms_norm,
    npu_mrope,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu,
)
from npusim.kernels.fia import (
    _npu_fused_infer_attention_score_get_max_workspace,
    _npu_fused_infer_attention_score_infer_output,
    npu_fused_infer_attention_score,
)
from npusim.kernels.fia_sink import (
    StaleTilingError,
    _npu_fused_infer_attention_score_v2_sink_metadata,
    npu_fused_infer_attention_score_v2_sink,
)
from npusim.kernels.fia_v2 import (
    _npu_fused_infer_attention_score_v2_get_max_workspace,
    _npu_fused_infer_attention_score_v2_infer_output,
    npu_fused_infer_attention_score_v2,
)
from npusim.kernels.fused import _npu_fused_infer_attention_score_out_graph
from npusim.kernels.mla import npu_interleave_rope, npu_kv_rmsnorm_rope_cache, npu_transpose_batchmatmul
from npusim.kernels.pa import _npu_paged_attention, _npu_paged_attention_get_workspace
from npusim.kernels.prefill import _npu_flash_attention_qlens, npu_fusion_attention
from npusim.runtime.capture import weak_ref_tensor as _weak_ref_tensor
from npusim.runtime.config import HostCostModel, SimConfig
from npusim.runtime.faults import FaultPlan, InjectedFault
from npusim.runtime.hbm import A2_HBM_BYTES_PER_S, HbmTimeModel
from npusim.runtime.state import get_state
from npusim.runtime.state import reset as _reset
from npusim.runtime.taskgroups import NPUTaskGroupHandle
from npusim.surfaces import hccl, profiler, torch_npu_modules, torch_npu_testing, torch_ops
from npusim.surfaces.aliases import PackageAlias
from npusim.surfaces.not_simulated import npu_mla_prolog, npu_mla_prolog_v2, npu_mla_prolog_v3
from npusim.surfaces.patches import _apply_patches
from npusim.surfaces.streams import accept_record_stream

__all__ = [
    "npu",
    "_C",
    "profiler",
    "_apply_patches",
    "_npu_paged_attention",
    "_npu_paged_attention_get_workspace",
    "npu_fused_infer_attention_score",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_infer_output",
    "npu_fused_infer_attention_score_v2",
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_fused_infer_attention_score_v2_infer_output",
    "npu_fused_infer_attention_score_v2_sink",
    "_npu_fused_infer_attention_score_v2_sink_metadata",
    "StaleTilingError",
    "npu_fusion_attention",
    "npu_attention_update",
    "npu_scatter_pa_kv_cache",
    "npu_gather_pa_kv_cache",
    "_npu_reshape_and_cache",
    "_npu_rotary_embedding",
    "_npu_matmul_add_fp32",
    "npu_add_rms_norm",
    "npu_rms_norm",
    "npu_gemma_rms_norm",
    "npu_format_cast",
    "npu_rotary_mul",
    "npu_mrope",
    "npu_interleave_rope",
    "npu_kv_rmsnorm_rope_cache",
    "npu_transpose_batchmatmul",
    "_npu_flash_attention_qlens",
    "npu_swiglu",
    "npu_mla_prolog",
    "npu_mla_prolog_v2",
    "npu_mla_prolog_v3",
    "PAD_SLOT_ID",
    "hifloat8",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "HostCostModel",
    "HbmTimeModel",
    "A2_HBM_BYTES_PER_S",
    "SimConfig",
    "configure",
    "counters",
    "pool_bytes",
    "device_seconds",
    "own_seconds",
    "is_device_memory",
    "pin_memory",
    "host_view",
    "is_pinned",
    "install_torch_npu",
    "install_npu_device",
    "uninstall_torch_npu",
    "SimError",
    "DeadlockError",
    "RaceError",
    "WorkspaceTooSmall",
    "CaptureError",
    "UpdateMismatchError",
    "UseAfterFree",
    "ReplayFault",
    "InjectedFault",
    "ConcurrentUpdateError",
]


def _npu_setStream(stream: Any) -> None:
    """``torch_npu._C._npu_setStream``: make ``stream`` current."""
    npu.set_stream(stream)


_C = types.SimpleNamespace(
    _npu_fused_infer_attention_score_out_graph=_npu_fused_infer_attention_score_out_graph,
    _weak_ref_tensor=_weak_ref_tensor,
    _NPUTaskGroupHandle=NPUTaskGroupHandle,
    _npu_setStream=_npu_setStream,
)


def configure(
    *,
    adversarial_seed: int | None = None,
    cost_model: HostCostModel | None = None,
    kernel_time_model: object = None,
    faults: str | None = None,
) -> None:
    """Reset the simulated device with a new configuration.

    ``adversarial_seed``: defer work and interleave streams in a seeded random order.
    ``cost_model``: charge modelled host time per device call (benchmarks).
    ``kernel_time_model``: ``f(op_name, params) -> seconds`` of modelled device time (``None``
    from it: that kernel's CPU time), e.g. :class:`HbmTimeModel` (attention from the bytes it reads).
    ``faults``: device faults to inject, in ``NPUGRAPH_SIM_FAULT``'s syntax
    (:mod:`npusim.runtime.faults`); ``None``: that variable's.
    All queues, counters and streams of the previous device are dropped.
    """
    _reset(
        SimConfig(
            adversarial_seed=adversarial_seed,
            cost_model=cost_model,
            kernel_time_model=kernel_time_model,
            faults=FaultPlan.from_env() if faults is None else FaultPlan.parse(faults),
        )
    )


def counters() -> collections.Counter[str]:
    """Device calls made since the last :func:`configure` (a live Counter)."""
    return get_state().counters


def pool_bytes(pool: tuple[int, int]) -> int:
    """Bytes that graphs captured into ``pool`` currently hold."""
    p = get_state().memory.pools.get(pool)
    return p.nbytes if p is not None else 0


def is_device_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is in the simulated device's memory: an ``npu`` tensor (told by
    ``tensor.device``, as on hardware; a host read of it waits for the stream)."""
    return get_state().memory.knows(tensor)


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over an ``npu`` tensor's memory (the simulator's device memory is host
    memory): what a benchmark uses to read a device buffer as an engine reads its host
    table.  Simulator-only; it keeps the memory alive."""
    return _device.host_view(tensor)


def pin_memory(tensor: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of host ``tensor``: what ``tensor.pin_memory()`` gives on Ascend.

    A CPU-only torch cannot pin, so the simulator keeps the mark itself.  It matters to a
    copy into device memory: from page-locked memory a non-blocking copy is queued on the
    stream; from pageable memory (or blocking) it returns only once it has run, after the
    stream's earlier work — a host synchronize (CANN's ``aclrtMemcpyAsync``).
    """
    return get_state().memory.pin(tensor)


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in memory :func:`pin_memory` made (``tensor.is_pinned()``)."""
    return get_state().memory.is_pinned(tensor)


def device_seconds() -> float:
    """Host seconds the simulator has spent executing device work since :func:`configure`.

    The simulated device runs on the CPU inside whichever host call unblocks its work (a
    replay, an update, a synchronize); subtract this to get the host's own time.
    """
    return get_state().busy_s


def own_seconds() -> float:
    """Host seconds the simulator has spent in its own code since :func:`configure`: its entry
    points (a kernel's launch or re-issue with its argument binding, a replay, an update's
    begin and end, an event's record, a synchronize; the eager ordering's deferral of an op),
    less the device work run inside them (:func:`device_seconds`) and the modelled host cost
    of the real call (``configure(costs=...)``), which is the caller's.

    A step's wall time is then the program's own host time, this, and the device's.  Not
    counted: the eager ordering's pass-through of an op it lets run (a fraction of a
    microsecond per torch call while a replay is pending).
    """
    return get_state().own_s


# torch_npu's dtypes beyond torch's own: not torch.dtype objects but the ints of torch_npu's
# dtype enum, passed where an op takes a dtype (npu_quant_matmul's x1_dtype, ...); the values
# torch_npu has (vllm-ascend 0.30's test set-up records them as the real ones).  Kernels that
# take them are not simulated; code that only names them (vllm-ascend's QUANT_DTYPES) imports.
hifloat8 = 290
float8_e8m0fnu = 293
float4_e2m1fn_x2 = 296

# what code that records torch_npu's version reads (vllm-ascend's compile cache key)
__version__ = f"{torch.__version__.split('+')[0]}+npusim"

_MISSING = object()
# what install_torch_npu replaced, to restore: module name (or "torch.npu") -> the old value
_INSTALLED: dict[str, Any] = {}
# SGLang's Ascend kernels, which no package index has: ``import sgl_kernel_npu...`` gets the stand-in
_SGL_KERNEL_NPU = PackageAlias("sgl_kernel_npu", "npusim.surfaces.sgl_kernel_npu")
# vllm-ascend 0.30's linear-attention kernels, a wheel on GitHub only: the stand-in, unless installed
_FLA_NPU = PackageAlias("fla_npu", "npusim.surfaces.fla_npu")
# torch_npu.contrib: imported on demand (transfer_to_npu patches torch when it is imported)
_CONTRIB = PackageAlias("torch_npu.contrib", "npusim.surfaces.contrib")


def install_torch_npu(*, device: bool = False) -> None:
    """Make ``import torch_npu`` (with ``torch_npu.npu`` and ``torch_npu._C``) and ``torch.npu``
    resolve to the simulator, for code that imports torch_npu at module level (vllm-ascend):
    its graph code then runs on a CPU with real kernel math instead of mocks.

    ``device``: also give the process the ``npu`` torch device (:mod:`npusim.device.backend`:
    ``torch.ones(4, device="npu")``, ``.npu()``, pinned memory) and the ``hccl``
    distributed backend.  That part is process-wide and stays (torch allows one
    PrivateUse1 backend per process); what ``NPUGRAPH_SIM_TORCH_NPU=1`` does in every process.

    Idempotent; :func:`uninstall_torch_npu` restores the modules.  Refused where a real
    torch_npu is already imported (two NPU backends in one process would mix).
    """
    me = sys.modules[__name__]
    real = sys.modules.get("torch_npu")
    if real is not None and real is not me:
        raise RuntimeError(
            "install_torch_npu: a real torch_npu is already imported in this process; the simulator "
            "cannot stand in for it"
        )
    if device:
        install_npu_device()
    if _INSTALLED:
        return
    stand_ins = {
        "torch_npu": me,
        "torch_npu.npu": npu,
        "torch_npu._C": _C,
        **torch_npu_modules.submodules(_C),
        **torch_npu_testing.submodules(),
    }
    for name, module in stand_ins.items():
        _INSTALLED[name] = sys.modules.get(name, _MISSING)
        sys.modules[name] = module  # type: ignore[assignment]
    _INSTALLED["torch.npu"] = getattr(torch, "npu", _MISSING)
    torch.npu = npu  # type: ignore[attr-defined]
    if importlib.machinery.PathFinder.find_spec("sgl_kernel_npu") is None:  # a real one, where installed, wins
        _SGL_KERNEL_NPU.install()
    if importlib.machinery.PathFinder.find_spec("fla_npu") is None:
        _FLA_NPU.install()
    _CONTRIB.install()


def install_npu_device() -> None:
    """Give this process the ``npu`` torch device and the ``hccl`` backend (idempotent; for
    the life of the process), without swapping any module for ``torch_npu``."""
    _device.install(npu)
    accept_record_stream()
    hccl.register()
    # torch_npu's kernels are torch ops (torch.compile keeps a call as one node)
    torch_ops.register(sys.modules[__name__])


def uninstall_torch_npu() -> None:
    """Undo :func:`install_torch_npu` (a no-op when it is not installed)."""
    for name, old in _INSTALLED.items():
        if name == "torch.npu":
            if _device.installed():
                continue  # torch's npu device module: the npu device stays (see install_torch_npu)
            if old is _MISSING:
                if hasattr(torch, "npu"):
                    delattr(torch, "npu")
            else:
                torch.npu = old  # type: ignore[attr-defined]
        elif old is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old
    _INSTALLED.clear()
    _SGL_KERNEL_NPU.uninstall()
    _FLA_NPU.uninstall()
    _CONTRIB.uninstall()


# With the simulator asked for as torch_npu (NPUSIM_TORCH_NPU=1), importing it installs it,
# whichever came first: torch's device-backend autoload imports it inside `import torch`,
# and an `import npusim` that came first imports torch, whose autoload finds it half-loaded.
if _hook.enabled():
    _hook.install(sys.modules[__name__])
