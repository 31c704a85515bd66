"""Injected device faults: the device going wrong on its own, for testing what a runtime and
an engine do then (``NPUGRAPH_SIM_FAULT``, or :func:`npusim.configure`'s ``faults``).

Two faults a device has and a CPU does not:

* ``kernel=NAME[@N]``: the ``N``-th execution (default the first) of kernel ``NAME`` (a
  torch_npu op name, e.g. ``npu_fused_infer_attention_score`` or ``_npu_paged_attention``)
  inside a graph replay fails, as an AI core exception does: the rest of that replay is
  cancelled and the next synchronize raises :class:`~npusim.errors.ReplayFault`
  (on hardware: error 507015 from the next ``aclrtSynchronize*``);
* ``lost-record[@N]``: the ``N``-th ExternalEvent record to land on the device (default the
  first) is lost: its flag is never set, and the replay waiting on it would wait forever
  (the simulator's synchronize raises :class:`~npusim.errors.DeadlockError` naming
  the wait; on hardware: event-wait timeout 507011 after about 30 minutes).

And one a benchmark needs, to show that a host-time figure leaves the device's out:

* ``slow-kernel=NAME:MS``: every replayed execution of kernel ``NAME`` takes ``MS``
  milliseconds (a float) longer, as a slower device would: the delay is the device's time,
  counted in :func:`npusim.device_seconds` as the kernel's own.  A host figure taken as
  wall time less the device's must not move with it (release/generate.py SLOWED, release/update_cost.py).

Several are separated by commas.  The two faults each fire once; the slowed kernel is slow
every time.  Counts start when the device is made (every process of an engine counts its own).
"""

from __future__ import annotations

import os
import time

import attrs

from npusim.errors import SimError

__all__ = ["ENV", "FaultPlan", "Faults", "InjectedFault"]

ENV = "NPUGRAPH_SIM_FAULT"


class InjectedFault(SimError):
    """A fault :data:`ENV` asked for (the cause of the :class:`ReplayFault` it becomes)."""


@attrs.frozen(kw_only=True)
class FaultPlan:
    """Which device faults to inject: ``kernel`` fails at its ``kernel_at``-th replayed
    execution; the ``lost_record_at``-th ExternalEvent record is lost; every replayed
    execution of ``slow_kernel`` takes ``slow_s`` seconds longer."""

    kernel: str | None = None
    kernel_at: int = 1
    lost_record_at: int | None = None
    slow_kernel: str | None = None
    slow_s: float = 0.0
    text: str = ""  # as given, for the messages

    @classmethod
    def parse(cls, text: str) -> FaultPlan | None:
        """The plan ``text`` (:data:`ENV`'s syntax) describes, or ``None`` for an empty one;
        ``ValueError`` naming :data:`ENV` for anything else."""
        fields: dict[str, object] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, _, slowed = part.partition("=")
            if name.strip() == "slow-kernel":
                kernel, _, ms = slowed.rpartition(":")
                try:
                    delay = float(ms)
                except ValueError:
                    delay = -1.0
                if not kernel.strip() or not delay >= 0:
                    raise ValueError(f"{ENV}={text!r}: {part!r} needs 'slow-kernel=NAME:MS' with MS >= 0 milliseconds")
                fields.update(slow_kernel=kernel.strip(), slow_s=delay / 1000)
                continue
            what, _, at = part.partition("@")
            try:
                n = int(at) if at else 1
            except ValueError:
                n = 0
            if n < 1:
                raise ValueError(f"{ENV}={text!r}: {part!r} needs a count >= 1 after '@'")
            name, _, kernel = what.partition("=")
            if name.strip() == "kernel" and kernel.strip():
                fields.update(kernel=kernel.strip(), kernel_at=n)
            elif what.strip() == "lost-record":
                fields["lost_record_at"] = n
            else:
                raise ValueError(
                    f"{ENV}={text!r}: {part!r} is not a fault the simulator injects; use "
                    "'kernel=NAME[@N]' (the N-th replayed execution of kernel NAME fails) or "
                    "'lost-record[@N]' (the N-th ExternalEvent record is lost) or 'slow-kernel=NAME:MS' "
                    "(every replayed execution of NAME takes MS milliseconds longer), comma-separated"
                )
        return cls(text=text, **fields) if fields else None  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        return cls.parse(os.environ.get(ENV, ""))


class Faults:
    """One device's injected faults and its counts toward them."""

    __slots__ = ("kernels", "plan", "records", "slowed")

    def __init__(self, plan: FaultPlan | None) -> None:
        self.plan = plan
        self.kernels = 0  # replayed executions of the planned kernel so far
        self.records = 0  # ExternalEvent records landed so far
        self.slowed = 0  # replayed executions of the slowed kernel so far

    def replayed_kernel(self, name: str, where: str) -> None:
        """Raise :class:`InjectedFault` if this replayed execution of ``name`` is the planned
        one; take the plan's delay first if ``name`` is its slowed kernel (the caller, a device
        work item, counts its time as the device's)."""
        plan = self.plan
        if plan is None:
            return
        if plan.slow_kernel == name:
            self.slowed += 1
            time.sleep(plan.slow_s)
        if plan.kernel != name:
            return
        self.kernels += 1
        if self.kernels == plan.kernel_at:
            raise InjectedFault(
                f"AI core exception in {where} (injected: {ENV}={plan.text!r}; on hardware error 507015, "
                "reported by the next synchronize)"
            )

    def record_lost(self) -> bool:
        """Whether this ExternalEvent record is the one the plan loses."""
        plan = self.plan
        if plan is None or plan.lost_record_at is None:
            return False
        self.records += 1
        return self.records == plan.lost_record_at
