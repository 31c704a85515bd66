"""The one adapter over a torch_npu-shaped module pair.

``load_device("sim")`` (the default) uses :mod:`npusim`, the simulator (``npugraph[sim]``);
``load_device("npu")`` imports the real ``torch_npu`` (it breaks ``import torch`` where CANN is
missing) and uses ``torch.npu``.  Both are imported when asked for, never by ``import npugraph``:
an Ascend host loads no simulator module.  Nothing else in npugraph imports torch_npu or
touches ``torch.npu``.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs
import torch

from npugraph.errors import DeviceUnavailable

__all__ = ["SINK_OPS", "Device", "DeviceFault", "FaultSite", "load_device"]


@attrs.frozen(kw_only=True)
class FaultSite:
    """One place a device error names, in the device's own objects (``None`` where it names none):
    the device ``graph`` a replay ran in, the ``event`` a stream waited on or raced on, the
    ``task_group`` of the task, and the ExternalEvents whose waits a cancelled replay skipped."""

    graph: Any = None
    event: Any = None
    task_group: Any = None
    skipped_waits: tuple[Any, ...] = ()


@attrs.frozen(kw_only=True)
class DeviceFault:
    """What a device error says of where it happened, as :meth:`Device.fault_info` reads it.

    ``sites``: each stuck stream's wait (a hang), or the error's own place (a race, a fault);
    ``later``: the further replay faults the same synchronize found.  Empty on hardware,
    whose errors name no object (an error code and a text).
    """

    sites: tuple[FaultSite, ...] = ()
    later: tuple[FaultSite, ...] = ()


@attrs.frozen(kw_only=True)
class Device:
    """A torch_npu-shaped op module (``ops``) and its ``torch.npu``-shaped module (``npu``).

    ``memory`` is the torch device where this device's memory lives (``npu:<current device>`` on
    Ascend; ``npu:0``, the simulator's own device over host memory, on the simulator):
    npugraph allocates every device tensor there.
    ``deadlock_errors`` / ``race_errors`` / ``fault_errors`` are the exception types the
    device raises for hangs, races and faults inside a replay (reported by the next
    synchronize; the simulator's, empty on hardware, which hangs, corrupts silently or
    reports an error code that ends the process).
    """

    name: str
    ops: Any
    npu: Any
    memory: torch.device
    deadlock_errors: tuple[type[BaseException], ...] = ()
    race_errors: tuple[type[BaseException], ...] = ()
    fault_errors: tuple[type[BaseException], ...] = ()
    # the tiling-sink FIA and its metadata op (vllm-ascend's ``torch.ops._C_ascend`` where
    # built with them; the simulator's), or None: graphs then update FIA's lengths per layer
    device_length_ops: Any = None
    # read on every step's path: a field, not a property
    is_sim: bool = attrs.field(init=False)

    @is_sim.default
    def _is_sim(self) -> bool:
        return self.name == "sim"

    def device_seconds(self) -> float:
        """Host seconds spent executing simulated device work so far (0 on hardware, whose
        device runs beside the host): subtract to time the host's own work."""
        return float(self.ops.device_seconds()) if self.is_sim else 0.0

    @property
    def fused_fia_update(self) -> Any:
        """The GIL-free 4-in-1 FIA update (``_C._npu_fused_infer_attention_score_out_graph``), or None."""
        c = getattr(self.ops, "_C", None)
        return getattr(c, "_npu_fused_infer_attention_score_out_graph", None)

    def is_device_memory(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in this device's memory (the host must not read it: a read
        waits for the stream): told by ``tensor.device``, on Ascend and on the simulator."""
        return t.device.type == self.memory.type

    def staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ready for a non-blocking copy to the device: device memory as it is, host
        memory in page-locked memory (a copy if it is pageable).

        CANN's ``aclrtMemcpyAsync`` from pageable memory returns only once the copy has
        run, after everything queued before it on the stream: a host synchronize.
        """
        if self.is_device_memory(t):
            return t
        if self.is_sim:
            return t if self.ops.is_pinned(t) else self.ops.pin_memory(t)
        return t if t.is_pinned() else t.pin_memory()  # kept by the caching host allocator until the copy ran

    def mask_past(self, positions: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i, j] = positions[j] >= lengths[i]`` (True = masked: the keys past each request's
        length), one elementwise kernel on the current stream, into ``out`` (no allocation)."""
        torch.ge(positions, lengths.view(-1, 1), out=out)

    @property
    def fused_update_pays(self) -> bool:
        """Whether the 4-in-1 FIA update is worth taking by default: where it is C++ without the
        GIL (hardware); the simulator's is the same Python calls, taken there only on request."""
        return not self.is_sim

    def pool_bytes(self, pool: Any) -> int | None:
        """The bytes a graph memory pool holds, where the device can tell (the simulator), else None."""
        return int(self.ops.pool_bytes(pool)) if self.is_sim and pool is not None else None

    # The next two ask the object, not ``is_sim``: with the simulator installed as torch_npu
    # (NPUGRAPH_SIM_TORCH_NPU=1, how engines run here) the adapter is ``load_device("npu")``
    # over the simulator's objects, and its reports must still name npugraph's graphs.

    def task_group(self, handle: Any) -> Any:
        """The device task group behind a captured task's handle, as the device's errors carry it
        (the simulator's ``task_group``), or None where errors carry none (hardware)."""
        return getattr(handle, "_group", None)

    def name_in_reports(self, obj: Any, name: str) -> None:
        """Name a graph, event or task group in the device's own reports: the simulator's hang,
        race and fault messages say it.  Hardware's objects carry no name: nothing to do."""
        if hasattr(obj, "label"):
            obj.label = name

    def names_task(self, message: str, handle: Any) -> bool:
        """Whether a device error's text names the task group behind ``handle``: the simulator's
        kernel and memory errors say ``task group #N)``; hardware's name none."""
        group = self.task_group(handle)
        return group is not None and f"task group #{group.group_id})" in message

    def fault_info(self, exc: BaseException) -> DeviceFault:
        """Where a device error happened, as a record npugraph reads (the rest of npugraph
        knows no device's error fields): the simulator's hang lists each stuck stream
        (``blocked``), its race and replay fault carry their ``graph``, ``event``,
        ``task_group`` and skipped waits, a fault the ``others`` the same synchronize found.
        Hardware's errors carry none of them: an empty record."""
        blocked = getattr(exc, "blocked", None)
        if blocked:
            return DeviceFault(
                sites=tuple(
                    FaultSite(graph=b.get("graph"), event=b.get("event"), task_group=b.get("task_group"))
                    for b in blocked
                )
            )
        return DeviceFault(sites=(_fault_site(exc),), later=tuple(_fault_site(o) for o in getattr(exc, "others", ())))

    def weak_ref_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A non-owning alias of ``t`` (same data pointer, shape, stride, dtype).

        It keeps nothing alive: valid while the memory's owner (a graph's pool, the
        model) keeps it.  This is what "weak reference" means for a captured tensor.
        """
        return self.ops._C._weak_ref_tensor(t)  # type: ignore[no-any-return]


def _fault_site(exc: BaseException) -> FaultSite:
    """The place one device error carries itself (the simulator's race and replay fault)."""
    return FaultSite(
        graph=getattr(exc, "graph", None),
        event=getattr(exc, "event", None),
        task_group=getattr(exc, "task_group", None),
        skipped_waits=tuple(getattr(exc, "waits_skipped", ())),
    )


# The tiling-sink pair (vllm-ascend PRs #15215 / #15336): both or neither.
SINK_OPS = ("npu_fused_infer_attention_score_v2_sink", "_npu_fused_infer_attention_score_v2_sink_metadata")


def _c_ascend_sink_ops() -> Any:
    """vllm-ascend's custom-op namespace if it has the tiling-sink FIA and its metadata op
    (a build with PRs #15215 / #15336), else None."""
    ns = getattr(torch.ops, "_C_ascend", None)
    try:
        return ns if ns is not None and all(hasattr(ns, n) for n in SINK_OPS) else None
    except Exception:  # torch.ops raises when a namespace has no such op
        return None


def load_device(kind: str | Device = "sim") -> Device:
    """Return the device adapter for ``kind``: ``"sim"``, ``"npu"`` (the current NPU) or
    ``"npu:N"`` (NPU ``N``: made current with ``torch.npu.set_device``)."""
    if isinstance(kind, Device):
        return kind
    name, _, index = str(kind).strip().lower().partition(":")
    if index and not index.isdigit():
        raise DeviceUnavailable(f"device {kind!r}: the index after ':' must be a number, e.g. 'npu:0'")
    if name == "sim" and index in ("", "0"):
        kind = "sim"
    elif name == "sim":
        raise DeviceUnavailable(f"device {kind!r}: the simulator has one device, 'sim' (or 'sim:0')")
    elif name == "npu":
        kind = "npu"
    if kind == "sim":
        try:
            sim = importlib.import_module("npusim")
        except ImportError as exc:
            raise DeviceUnavailable(
                f"device='sim' needs npusim, npugraph's simulator, but importing it failed: {exc}. "
                "Install it with `pip install 'npugraph[sim]'` (in a checkout: `pip install -e ./npusim`), "
                "or use device='npu' on an Ascend host."
            ) from exc
        sim.install_npu_device()  # the simulator's npu device, for the life of the process
        return Device(
            name="sim",
            ops=sim,
            npu=sim.npu,
            memory=torch.device("npu", 0),
            deadlock_errors=(sim.DeadlockError,),
            race_errors=(sim.RaceError,),
            fault_errors=(sim.ReplayFault,),
            device_length_ops=sim,
        )
    if kind == "npu":
        try:
            torch_npu = importlib.import_module("torch_npu")
        except Exception as exc:  # ImportError, or OSError from missing CANN libraries
            raise DeviceUnavailable(
                f"device='npu' needs torch_npu and the CANN toolkit (libascendcl, libhccl), but "
                f"importing torch_npu failed: {type(exc).__name__}: {exc}. Install the "
                "torch_npu matching your torch and source CANN's set_env.sh, or use "
                "device='sim' (the built-in simulator) on machines without an NPU."
            ) from exc
        if index:
            torch.npu.set_device(int(index))  # type: ignore[attr-defined]
        return Device(
            name="npu",
            ops=torch_npu,
            npu=torch.npu,  # type: ignore[attr-defined]
            memory=torch.device("npu", torch.npu.current_device()),  # type: ignore[attr-defined]
            device_length_ops=_c_ascend_sink_ops(),
        )
    raise DeviceUnavailable(
        f"unknown device {kind!r}: expected 'sim' (the built-in simulator), 'npu' (the current Ascend NPU) "
        "or 'npu:N' (NPU number N)"
    )
