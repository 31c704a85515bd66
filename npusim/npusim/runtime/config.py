"""How the simulated device is configured: its scheduling, its faults and the host time each
device call costs (:class:`HostCostModel`, off by default, on in benchmarks)."""

from __future__ import annotations

from typing import Any

import attrs

from npusim.runtime.faults import FaultPlan

__all__ = ["HostCostModel", "SimConfig"]


@attrs.frozen(kw_only=True)
class HostCostModel:
    """Host-side microseconds that each device API call costs (busy-waited).

    Off by default.  :meth:`atlas_a2` reproduces the cost structure measured on
    Atlas A2 by the vllm-ascend project:

    * issue #13058 (20 layers): 3.68 ms of update per step, ~184 us per updated
      layer, against 1.21 ms of replay;
    * PR #15579: reusing one PA workspace instead of querying it per layer cut the
      update from 2.4-2.95 ms to 1.65 ms (20 layers), i.e. ~40-65 us per query;
    * PR #4233: ~85 us per host synchronize.
    """

    op_launch_us: float = 0.0
    update_begin_us: float = 0.0
    update_end_us: float = 0.0
    event_record_us: float = 0.0
    workspace_query_us: float = 0.0
    synchronize_us: float = 0.0
    replay_us: float = 0.0

    @classmethod
    def atlas_a2(cls) -> HostCostModel:
        """Return the model calibrated on the Atlas A2 measurements cited above."""
        # 184 us per updated layer = begin 22 + op launch (tiling) 120 + end 30 + record 12.
        return cls(
            op_launch_us=120.0,
            update_begin_us=22.0,
            update_end_us=30.0,
            event_record_us=12.0,
            workspace_query_us=50.0,
            synchronize_us=85.0,
            replay_us=40.0,
        )


@attrs.frozen(kw_only=True)
class SimConfig:
    """How the simulated device schedules work and charges host time.

    ``adversarial_seed`` turns on adversarial scheduling: work is deferred and
    streams are interleaved in a seeded random order consistent with their
    dependencies, so missing ordering shows up as wrong results or typed errors.
    ``cost_model`` charges host time per device call (benchmarks only).
    ``faults``: device faults to inject (:mod:`.faults`); by default ``NPUGRAPH_SIM_FAULT``'s.
    """

    adversarial_seed: int | None = None
    cost_model: HostCostModel | None = None
    # f(op_name, params) -> seconds of device time per kernel; None: the kernel's wall time
    kernel_time_model: Any = None
    faults: FaultPlan | None = attrs.field(factory=FaultPlan.from_env)
