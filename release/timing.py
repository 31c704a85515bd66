"""Timing a per-step update inside a real engine, on the simulator (release/generate.py,
release/sglang/site.py): each call's host seconds less the simulated device's, and the
device calls it made."""

from __future__ import annotations

import collections
import cProfile
import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DEVICE_CALLS", "PROFILE_ENV", "timed"]

PROFILE_ENV = "NPUGRAPH_UPDATE_PROFILE"

# the device calls an update makes, as the simulator counts them (HostCostModel's)
DEVICE_CALLS = ("update_begin", "op_launch", "update_end", "event_record", "workspace_query")


def timed(
    owner: Any,
    name: str,
    samples: list[float],
    calls: collections.Counter[str],
    after: Callable[[], None] | None = None,
    walls: list[float] | None = None,
    own: list[float] | None = None,
) -> Any:
    """``owner.name`` recording each call's host seconds, less the simulated device's (the
    simulator runs device work inside whichever host call unblocks it), and counting the
    device calls it makes (update sessions, launches, event records, workspace queries);
    ``after()`` runs after each call; ``walls``, if given, also gets each call's whole wall time,
    and ``own`` the simulator's own host seconds in it (``npusim.own_seconds``): the host
    seconds less these are the framework's alone."""
    original = getattr(owner, name)
    # NPUGRAPH_UPDATE_PROFILE=DIR: every call also runs under cProfile, its stats rewritten to
    # DIR/NAME-PID.prof after each call (vLLM kills its engine process at shutdown): where an
    # update's host time goes, function by function (the timings then carry cProfile's cost)
    folder = os.environ.get(PROFILE_ENV)
    profile = cProfile.Profile() if folder else None
    profiling = [False]  # inside a call, the profile on
    if profile is not None:
        _pause_in_device_work(profile, profiling)

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        import npusim as sim  # at the call: the wrapped module may load inside the simulator's own import

        counters = sim.counters
        before = collections.Counter({k: counters()[k] for k in DEVICE_CALLS})
        t0, d0, o0 = time.perf_counter(), sim.device_seconds(), sim.own_seconds()
        if profile is not None:
            profile.enable()
            profiling[0] = True
        try:
            return original(*args, **kwargs)
        finally:
            if profile is not None:
                profiling[0] = False
                profile.disable()
            wall = time.perf_counter() - t0
            samples.append(wall - (sim.device_seconds() - d0))
            if walls is not None:
                walls.append(wall)
            if own is not None:
                own.append(sim.own_seconds() - o0)
            calls.update({k: counters()[k] - before[k] for k in DEVICE_CALLS})
            if profile is not None:
                profile.dump_stats(os.path.join(str(folder), f"{name}-{os.getpid()}.prof"))
            if after is not None:
                after()

    timed_call.__wrapped__ = original  # type: ignore[attr-defined]
    return timed_call


def _pause_in_device_work(profile: cProfile.Profile, profiling: list[bool]) -> None:
    """``profile`` off while the simulator runs device work (``SimState._pump``) inside a
    profiled call: its stats are the update's host functions alone, as its timing is."""
    from npusim.runtime.state import SimState

    pump = SimState._pump

    def _pump(self: Any, drain: bool) -> None:
        if not profiling[0]:
            return pump(self, drain)
        profile.disable()
        try:
            return pump(self, drain)
        finally:
            profile.enable()

    SimState._pump = _pump  # type: ignore[method-assign]
