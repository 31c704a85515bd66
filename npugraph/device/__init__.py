"""The one adapter over a torch_npu-shaped module pair.

``load_device("sim")`` (the default) uses :mod:`npugraph.sim`; ``load_device("npu")``
imports the real ``torch_npu`` lazily and uses ``torch.npu``.  Nothing else in npugraph
imports torch_npu or touches ``torch.npu``.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from npugraph.errors import DeviceUnavailable

__all__ = ["Device", "load_device"]


@attrs.frozen(kw_only=True)
class Device:
    """A torch_npu-shaped op module (``ops``) and its ``torch.npu``-shaped module (``npu``).

    ``deadlock_errors`` / ``race_errors`` are the exception types the device raises for
    hangs and races (the simulator's; empty on hardware, which just hangs).
    """

    name: str
    ops: Any
    npu: Any
    deadlock_errors: tuple[type[BaseException], ...] = ()
    race_errors: tuple[type[BaseException], ...] = ()

    @property
    def is_sim(self) -> bool:
        return self.name == "sim"

    @property
    def fused_fia_update(self) -> Any:
        """The GIL-free 4-in-1 FIA update (``_C._npu_fused_infer_attention_score_out_graph``), or None."""
        c = getattr(self.ops, "_C", None)
        return getattr(c, "_npu_fused_infer_attention_score_out_graph", None)


def load_device(kind: str | Device = "sim") -> Device:
    """Return the device adapter for ``kind``: ``"sim"`` or ``"npu"``."""
    if isinstance(kind, Device):
        return kind
    if kind == "sim":
        from npugraph import sim

        return Device(
            name="sim",
            ops=sim,
            npu=sim.npu,
            deadlock_errors=(sim.DeadlockError,),
            race_errors=(sim.RaceError,),
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
        import torch

        return Device(name="npu", ops=torch_npu, npu=torch.npu)  # type: ignore[attr-defined]
    raise ValueError(f"unknown device {kind!r}: expected 'sim' or 'npu'")
